"""DeepEP V2's ``ElasticBuffer`` and ``EPHandle`` (``deep_ep/buffers/elastic.py``) on the
elastic mode (:class:`tritonep.modes.elastic.ElasticMode`): one ``dispatch``/``combine`` pair
for training, prefill and decode, with V2's names, argument order, defaults, return tuples,
shapes, dtypes and semantics. Every difference from DeepEP is listed in
``docs/deepep-compat.md``.
"""

from __future__ import annotations

import functools
import math
import re
import subprocess
from typing import TypeGuard

import torch
import torch.distributed as dist

from ..buffer import CallStreams, cuda_event, ranks_per_node
from ..modes.elastic import (
    DECODE_TOKENS,
    MAX_TOPK,
    CachedLayout,
    ElasticLayout,
    ElasticMode,
    region_bytes,
)
from ..validation import check_num_experts, check_tensor, plain_tensor
from .utils import EventHandle, EventOverlap

__all__ = ["EPHandle", "ElasticBuffer", "get_logical_domain_size", "get_physical_domain_size"]

#: Buffer sizes are multiples of this (DeepEP V2's alignment of its buffers).
BUFFER_ALIGNMENT = 2 << 20


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _value_or(value, default):
    return default if value is None else value


def get_physical_domain_size(group: dist.ProcessGroup) -> tuple[int, int]:
    """``(nodes, ranks per node)`` of ``group`` (world rank ``r`` on node
    ``r // LOCAL_WORLD_SIZE``, as torchrun numbers them; one node without that variable)."""
    size = dist.get_world_size(group)
    per_node = ranks_per_node(group) or size
    return size // per_node, per_node


def get_logical_domain_size(
    group: dist.ProcessGroup, allow_hybrid_mode: bool = True
) -> tuple[int, int]:
    """``(scale-out ranks, scale-up ranks)``: the physical domains with the hybrid mode, else
    every rank in one scale-up domain."""
    if allow_hybrid_mode:
        return get_physical_domain_size(group)
    return 1, dist.get_world_size(group)


@functools.cache
def _nvlink_gbs(device_index: int, factor: float = 0.9) -> float:
    """NVLink bandwidth of a GPU in GB/s: ``nvidia-smi``'s link speeds summed, times
    ``factor``; when they cannot be read, H100's and H200's (18 links of 26.5625 GB/s)."""
    try:
        text = subprocess.run(
            ["nvidia-smi", "nvlink", "-s", "-i", str(device_index)],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout
        speeds = [float(v) for v in re.findall(r"Link \d+:\s*([\d.]+) GB/s", text)]
        if speeds:
            return sum(speeds) * factor
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return 18 * 26.5625 * factor


_no_torch_function = torch._C.DisableTorchFunction


def _plain_torch(method):
    """``method`` with torch function modes off: ``torch.set_default_device`` sets one, which
    would see every tensor access of the call (the calls pass devices and dtypes)."""

    @functools.wraps(method)
    def call(*args, **kwargs):
        with _no_torch_function():
            return method(*args, **kwargs)

    return call


def _plain_rows(
    t: object, dtype: torch.dtype, rows: int | None, device_index: int
) -> TypeGuard[torch.Tensor]:
    """:func:`plain_tensor`, 2-D with ``rows`` rows (None: any)."""
    return (
        plain_tensor(t, dtype, device_index)
        and t.dim() == 2
        and (rows is None or t.shape[0] == rows)
    )


def _check(name: str, t: object, dtype: torch.dtype, shape: tuple, device: torch.device):
    """:func:`check_tensor` with every size given, plain comparisons first (every call
    checks its tensors)."""
    if plain_tensor(t, dtype, device.index if device.type == "cuda" else -1) and t.shape == shape:
        return t
    return check_tensor(name, t, dtype=dtype, shape=shape, device=device)


class EPHandle:
    """What a dispatch leaves for combine and for cached dispatches (DeepEP V2's ``EPHandle``).

    Attributes (``R`` ranks, ``E_local`` experts per rank, ``K`` top-k; int32 tensors unless
    said otherwise):
        do_expand: whether the dispatch used the expanded layout.
        num_experts, expert_alignment, num_max_tokens_per_rank, num_sms: the dispatch's.
        topk_idx: ``[N, K]`` int64 ids of the dispatch (a copy with ``do_handle_copy``).
        psum_num_recv_tokens_per_scaleup_rank: ``[R]`` inclusive prefix sum of the tokens
            received from each rank (its last value: all received tokens).
        psum_num_recv_tokens_per_expert: ``[E_local]``: plain layout, the inclusive prefix
            sum of each expert's count aligned up; expanded, expert ``i``'s first row plus its
            real count (``psum[i] - align(psum[i - 1])`` is the count, ``align(psum[i])`` the
            next expert's first row).
        num_recv_tokens_per_expert_list: each local expert's aligned count (a list; empty
            without a host read).
        num_unaligned_recv_tokens_per_expert: ``[E_local]`` real counts.
        recv_src_metadata: ``[rows, K + 2]``: the source token's global index
            (``source_rank * num_max_tokens_per_rank + token``), ``source_rank * K`` plus the
            first top-k column that names this rank, and (expanded layout) per top-k column
            the row that holds the token for that expert (``-1`` elsewhere; ``-1`` in every
            column of the plain layout). Rows past the received tokens (worst-case sizes): -1.
        dst_buffer_slot_idx: ``[N, K]``: each choice's slot on the rank that receives it
            (``-1`` for none).
        token_metadata_at_forward, channel_linked_list: None (no hybrid mode here).
        num_recv_tokens, num_expanded_tokens: rows of the plain and expanded layouts (the
            worst case without a host read).
        reduction_slot: ``[rows]`` (tritonep's): each received token's place in the order its
            owner sums the rows a combine sends back.
    """

    def __init__(
        self,
        do_expand: bool,
        num_experts: int,
        expert_alignment: int,
        num_max_tokens_per_rank: int,
        num_sms: int,
        topk_idx: torch.Tensor,
        num_recv_tokens: int,
        num_expanded_tokens: int,
        num_recv_tokens_per_expert_list: list,
        psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
        psum_num_recv_tokens_per_expert: torch.Tensor,
        num_unaligned_recv_tokens_per_expert: torch.Tensor,
        recv_src_metadata: torch.Tensor,
        dst_buffer_slot_idx: torch.Tensor,
        token_metadata_at_forward: torch.Tensor | None,
        channel_linked_list: torch.Tensor | None,
        reduction_slot: torch.Tensor | None = None,
    ):
        if topk_idx is None:
            raise ValueError("topk_idx: an EPHandle needs the dispatch's ids")
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.reduction_slot = reduction_slot
        self.cached_recv_src_metadata_before_sort = None

    def deterministic_sort(
        self,
        do_cpu_sync,
        is_cached_dispatch,
        recv_x,
        recv_sf,
        recv_topk_idx,
        recv_topk_weights,
        channel_linked_list,
    ) -> None:
        """Nothing to do: rows always come in (source rank, source token) order, the same on
        every call (DeepEP V2 sorts them here in deterministic mode)."""


class ElasticBuffer:
    """DeepEP V2's elastic buffer: expert-parallel dispatch and combine (the Engram, pipeline
    and all-gather calls raise ``NotImplementedError``).

    Args:
        group: the process group; every rank constructs the buffer together.
        num_bytes: buffer bytes per rank; None: :meth:`get_buffer_size_hint` of the sizes below.
        num_cpu_bytes: Engram's host storage: must be 0 (not implemented).
        num_max_tokens_per_rank: most tokens a rank dispatches in a call (the default of
            :meth:`dispatch`); with ``hidden``, ``num_topk`` and ``use_fp8_dispatch`` it sizes
            the buffer when ``num_bytes`` is None.
        hidden, num_topk, use_fp8_dispatch: the calls' sizes (top-k 0: up to 32; BF16 rows
            leave room for FP8 ones, not the other way round).
        deterministic: accepted; rows always come in the same order.
        allow_hybrid_mode: accepted (one NVLink domain here: no hybrid mode).
        allow_multiple_reduction: expanded rows are summed per token on their rank before a
            combine sends them back (else each goes back alone: more traffic, one rounding).
        prefer_overlap_with_compute: fewer SMs by default (:meth:`get_theoretical_num_sms`).
        sl_idx, num_allocated_qps: accepted (no RDMA).
        num_cpu_timeout_secs: accepted (host waits end with the kernels' waits).
        num_gpu_timeout_secs: limit of every wait inside the kernels; a wait that gives up
            raises :class:`~tritonep.errors.WaitTimeoutError` from :meth:`check` (or from a
            dispatch's host read) instead of trapping.
        explicitly_destroy: accepted; :meth:`destroy` releases the memory either way.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_bytes: int | None = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
    ):
        if num_cpu_bytes:
            raise NotImplementedError("num_cpu_bytes: Engram's host storage is not implemented")
        self.group = group
        self.rank_idx = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        if ranks_per_node(group) is not None:
            raise NotImplementedError(
                "ElasticBuffer: groups that span nodes (V2's hybrid and "
                "RDMA modes) are not implemented; deep_ep.Buffer "
                "runs across nodes"
            )
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = deterministic
        self.explicitly_destroy = explicitly_destroy
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        if num_bytes is None:
            num_bytes = self.get_buffer_size_hint(
                group,
                num_max_tokens_per_rank,
                hidden,
                num_topk,
                use_fp8_dispatch,
                allow_hybrid_mode,
                allow_multiple_reduction,
            )
        if not isinstance(num_bytes, int) or num_bytes <= 0:
            raise ValueError(f"num_bytes: expected a positive int, got {num_bytes!r}")
        self.num_bytes = num_bytes
        self.num_allocated_qps = num_allocated_qps or (129 if allow_hybrid_mode else 17)
        self.runtime: ElasticMode | None = ElasticMode(
            group, num_bytes, timeout_s=float(num_gpu_timeout_secs)
        )
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = self.get_physical_domain_size()
        self._streams = CallStreams()  # where the calls run, in what order
        #: get_theoretical_num_sms by (num_experts, top-k): the default of every dispatch.
        self._default_sms: dict[tuple[int, int], int] = {}
        device = self.runtime.device
        #: The CUDA device index of the calls (-1 on CPU ranks).
        self._device = -1 if device.type != "cuda" else device.index
        if self._device is None:
            self._device = torch.cuda.current_device()
        dist.barrier(group)

    # ------------------------------------------------------------------------ the buffer
    def destroy(self) -> None:
        """Release the buffer's memory (collective); raises if a kernel wait had timed out."""
        if self.runtime is not None:
            self._streams.join()
            runtime, self.runtime = self.runtime, None
            runtime.destroy()

    def check(self) -> None:
        """Wait for the device; raise :class:`~tritonep.errors.WaitTimeoutError` if a kernel
        wait gave up (tritonep's; DeepEP V2 traps the GPU instead)."""
        self._streams.join()
        self._require_runtime().check()

    @staticmethod
    def get_buffer_size_hint(
        group: dist.ProcessGroup,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
    ) -> int:
        """Bytes of buffer per rank for calls of these sizes (a multiple of 2 MiB)."""
        if num_max_tokens_per_rank <= 0 or hidden <= 0:
            raise ValueError(
                f"num_max_tokens_per_rank, hidden: expected positive ints, got "
                f"{num_max_tokens_per_rank}, {hidden}"
            )
        if not 0 <= num_topk <= MAX_TOPK:
            raise ValueError(f"num_topk: expected 0 to {MAX_TOPK}, got {num_topk}")
        num_ranks = dist.get_world_size(group)
        region = region_bytes(
            num_ranks,
            num_max_tokens_per_rank,
            hidden,
            num_topk,
            use_fp8_dispatch,
            allow_multiple_reduction,
        )
        return _align(ElasticLayout.size_for(num_ranks, region), BUFFER_ALIGNMENT)

    def barrier(
        self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True
    ) -> None:
        """A barrier of every rank's device work (one small kernel), on the communication
        stream or the current one; ``with_cpu_sync`` also waits for the device before and
        after. ``sequential`` is accepted (one kernel either way)."""
        runtime = self._require_runtime()
        on_gpu = runtime.device.type == "cuda"
        if with_cpu_sync and on_gpu:
            torch.cuda.synchronize(runtime.device)
        if use_comm_stream and on_gpu:
            _, compute = self._streams.on_comm(self._device, None, (), runtime.barrier)
            self._streams.finish(compute, False, ())
        else:
            if on_gpu:
                self._streams.on_current(self._device, None)
            runtime.barrier()
        if with_cpu_sync and on_gpu:
            torch.cuda.synchronize(runtime.device)

    @staticmethod
    def capture() -> EventHandle:
        """An event recorded on the current stream, to pass as ``previous_event``."""
        return EventHandle()

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        """The stream the calls with ``async_with_compute_stream`` or
        ``allocate_on_comm_stream`` run on (None on CPU ranks)."""
        if self._require_runtime().device.type != "cuda":
            return None
        return self._streams.comm_stream(self._device)

    def get_physical_domain_size(self) -> tuple[int, int]:
        """``(RDMA ranks, NVLink ranks)``: ``(1, group size)`` here."""
        return get_physical_domain_size(self.group)

    def get_logical_domain_size(self) -> tuple[int, int]:
        """``(scale-out ranks, scale-up ranks)``: ``(1, group size)`` here."""
        return get_logical_domain_size(self.group, self.allow_hybrid_mode)

    def get_theoretical_num_sms(
        self,
        num_experts: int,
        num_topk: int,
        num_scaleout_topk: int = 0,
        rdma_gbs: float = 0,
        nvlink_gbs: float = 0,
        sm_read_gbs: float = 200,
        sm_write_gbs: float = 50,
    ) -> int:
        """SMs a dispatch (and its combine) needs to keep NVLink busy with balanced routing:
        DeepEP V2's model (each token read once per expected destination rank, written once per
        rank it goes to; ``sm_read_gbs`` and ``sm_write_gbs`` per SM), with 25% headroom, even,
        at least 4 (64 without ``prefer_overlap_with_compute``), at most the GPU's SMs."""
        if num_scaleout_topk:
            raise ValueError("num_scaleout_topk: must be 0 (one NVLink domain)")
        check_num_experts(num_experts, self.num_ranks)
        runtime = self._require_runtime()
        device_sms = runtime.num_device_sms
        if not nvlink_gbs:
            on_gpu = runtime.device.type == "cuda"
            nvlink_gbs = _nvlink_gbs(runtime.device.index or 0) if on_gpu else 450.0
        return _theoretical_num_sms(
            self.num_ranks,
            num_experts,
            num_topk,
            nvlink_gbs,
            sm_read_gbs,
            sm_write_gbs,
            device_sms,
            self.prefer_overlap_with_compute,
        )

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """DeepEP V2's queue-pair count for ``num_sms`` (accepted and unused: no RDMA)."""
        num_qps = num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 9)
        return min(num_qps, self.num_allocated_qps)

    def _check_qps(self, num_qps: int) -> None:
        """``ValueError`` for more queue pairs than allocated (0, the default, takes
        :meth:`get_theoretical_num_qps`, which never asks for more)."""
        if num_qps > self.num_allocated_qps:
            raise ValueError(
                f"num_qps: at most num_allocated_qps={self.num_allocated_qps}, got {num_qps}"
            )

    def _push_sms(self, num_sms: int, num_tokens: int) -> int:
        """Programs of a push the caller left to us (``num_sms`` 0) for a decode batch: every
        SM, as the low-latency mode takes; at these sizes a push is bound by latency, not by
        bandwidth, and is short. 0 otherwise (the caller's or the theoretical count)."""
        if num_sms or num_tokens > DECODE_TOKENS:
            return 0
        return self._require_runtime().num_device_sms

    def _require_runtime(self) -> ElasticMode:
        if self.runtime is None:
            raise RuntimeError("ElasticBuffer: destroyed")
        return self.runtime

    # ------------------------------------------------------------------------ streams
    def _run(self, previous_event, before_epilogue, on_comm: bool, inputs: tuple, fn):
        """``fn(wait)`` on the current stream, or with ``on_comm`` on the communication stream
        (:class:`~tritonep.buffer.CallStreams`), after ``previous_event``; ``wait`` is None, or
        makes the stream the call runs on wait for ``before_epilogue`` (an event, or an
        object holding one) when called. Returns ``(fn's result, the caller's stream when the
        call ran on the communication stream, else None)``."""
        device = self._device
        if device < 0:
            return fn(None), None
        event = cuda_event(before_epilogue)
        if not on_comm:
            self._streams.on_current(device, previous_event)
            wait = None
            if event is not None:
                wait = functools.partial(torch.cuda.current_stream(device).wait_event, event)
            return fn(wait), None
        comm = self._streams.comm_stream(device)
        wait = None if event is None else functools.partial(comm.wait_event, event)
        return self._streams.on_comm(device, previous_event, inputs, lambda: fn(wait))

    def _finish(self, compute, async_with_compute_stream: bool, outputs: tuple) -> EventOverlap:
        """Hand the outputs of a call on the communication stream to the caller's stream
        ``compute``: an event to wait on, or a wait now."""
        if not async_with_compute_stream:
            return self._streams.finish(compute, False, outputs)
        # (V2's event type: an EventHandle recorded on the communication stream.)
        tensors = tuple(t for t in outputs if isinstance(t, torch.Tensor))
        for t in tensors:
            t.record_stream(compute)
        with torch.cuda.stream(self._streams.comm):
            event = EventHandle()
        return EventOverlap(event, tensors)

    # ----------------------------------------------------------------------- dispatch
    @_plain_torch
    def dispatch(
        self,
        x,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event=None,
        previous_event_before_epilogue=None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: EPHandle | None = None,
        do_handle_copy: bool = True,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
    ):
        """Send each token once to every rank holding one of its experts.

        Args:
            x: ``[N, H]`` BF16, or ``(e4m3 [N, H], scale packs [N, G])`` with float32 or packed
                UE8M0 (int32) packs, any strides; rows of a multiple of 16 bytes (any hidden
                size: 2880 works), ``N <= num_max_tokens_per_rank``.
            topk_idx: ``[N, K]`` int64 global expert ids, ``-1`` for none (``K <= 32``); None
                with ``handle``.
            topk_weights: ``[N, K]`` float32, or None (also allowed with ``handle``).
            cumulative_local_expert_recv_stats: ``[E_local]`` int32: each local expert's
                received choices are added to it.
            num_experts: experts in total (from ``handle`` if given).
            num_max_tokens_per_rank: default: the constructor's (or the handle's); every rank
                passes the same.
            expert_alignment: pad each local expert's row count to a multiple of this
                (default 1).
            num_sms: programs of the push; 0: :meth:`get_theoretical_num_sms`, or every SM
                for a decode batch (at most ``DECODE_TOKENS`` tokens, 256). The copy
                epilogue uses every SM.
            num_qps: accepted (no RDMA); at most ``num_allocated_qps``.
            previous_event: an event (:meth:`capture`) the kernels wait for (instead of the
                current stream's work on the communication stream; besides it on the current
                stream).
            previous_event_before_epilogue: an event the copy epilogue also waits for.
            async_with_compute_stream: run on the communication stream and return an event to
                wait on; otherwise (and without ``allocate_on_comm_stream``) the call runs on the
                current stream, its outputs ready in that stream's order.
            allocate_on_comm_stream: run on the communication stream, outputs allocated there
                and handed to the current stream.
            handle: an :class:`EPHandle` of an earlier dispatch: the same routing again, only
                ``x`` (and ``topk_weights``) moves, no host read.
            do_handle_copy: keep a copy of ``topk_idx`` in the handle (else the tensor itself).
            do_cpu_sync: read the counts on the host and size the outputs exactly (default:
                True without ``handle``); False: worst-case sizes, no host read (CUDA graphs).
            do_expand: one row per (token, local expert), each expert's rows contiguous from
                ``align(psum_num_recv_tokens_per_expert[e - 1])`` and padded to the alignment:
                a grouped GEMM's input.
            do_zero_padding: zero the padding rows (and their scales and weights); expanded
                layout only.
            use_tma_aligned_col_major_sf: scale packs column-major, each column's rows padded
                to a multiple of 4 (strides ``(1, align(rows, 4))``).
        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``: ``recv_x`` like
            ``x`` with one row per received token (plain, in source rank then source token
            order) or per (token, local expert) (expanded); ``recv_topk_idx`` ``[rows, K]``
            int64 local expert ids (``-1`` elsewhere; None when expanded);
            ``recv_topk_weights`` ``[rows, K]`` float32 as sent, or ``[rows]`` when expanded
            (None without ``topk_weights``); the :class:`EPHandle` (the given one in cached
            mode); an :class:`EventOverlap`.
        """
        runtime = self._require_runtime()
        payload, sf = x if isinstance(x, tuple) else (x, None)
        num_tokens = _check_x(payload, sf, runtime.device)
        first_call = handle is None
        if handle is not None:
            if not isinstance(handle, EPHandle):
                raise TypeError(f"handle: expected an EPHandle, got {type(handle).__name__}")
            if topk_idx is not None:
                raise ValueError("topk_idx: must be None with a handle (its ids are reused)")
            if do_cpu_sync:
                raise ValueError("do_cpu_sync: a cached dispatch does not read counts")
            given = (num_experts, expert_alignment, num_max_tokens_per_rank)
            known = (handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank)
            if any(g is not None and g != k for g, k in zip(given, known, strict=True)):
                raise ValueError(
                    f"num_experts, expert_alignment, num_max_tokens_per_rank: the "
                    f"handle's are {known}, got {given}"
                )
            topk_idx = handle.topk_idx
            num_experts, expert_alignment, num_max_tokens_per_rank = known
        num_max = _value_or(num_max_tokens_per_rank, self.num_max_tokens_per_rank)
        expert_alignment = _value_or(expert_alignment, 1)
        do_cpu_sync = _value_or(do_cpu_sync, first_call)
        if num_experts is None:
            raise ValueError("num_experts: required without a handle")
        e_local = check_num_experts(num_experts, self.num_ranks)
        if not _plain_rows(topk_idx, torch.int64, num_tokens, self._device):
            topk_idx = check_tensor(
                "topk_idx",
                topk_idx,
                dtype=torch.int64,
                shape=(num_tokens, None),
                device=runtime.device,
            )
        topk = topk_idx.shape[1]
        if not 1 <= topk <= MAX_TOPK:
            raise ValueError(f"topk_idx: top-k must lie in [1, {MAX_TOPK}], got {topk}")
        if not isinstance(num_max, int) or num_max < max(1, num_tokens):
            raise ValueError(
                f"num_max_tokens_per_rank: expected at least the {num_tokens} "
                f"tokens (and 1), got {num_max!r}"
            )
        if not isinstance(expert_alignment, int) or expert_alignment < 1:
            raise ValueError(f"expert_alignment: expected a positive int, got {expert_alignment}")
        if do_zero_padding and not do_expand:
            raise ValueError("do_zero_padding: only with do_expand=True")
        if topk_weights is not None:
            _check("topk_weights", topk_weights, torch.float32, (num_tokens, topk), runtime.device)
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            name = "cumulative_local_expert_recv_stats"
            _check(name, stats, torch.int32, (e_local,), runtime.device)
        push_sms = self._push_sms(num_sms, num_tokens)
        if not num_sms:
            sms = self._default_sms.get((num_experts, topk))
            if sms is None:
                sms = self._default_sms[num_experts, topk] = self.get_theoretical_num_sms(
                    num_experts, topk
                )
            num_sms = sms
        self._check_qps(num_qps)
        cached = None
        if handle is not None:
            cached = CachedLayout(
                handle.num_recv_tokens,
                handle.num_expanded_tokens,
                handle.num_recv_tokens_per_expert_list,
            )

        def run(before_epilogue):
            return runtime.dispatch(
                payload,
                sf,
                topk_idx,
                topk_weights,
                num_experts,
                num_max,
                expert_alignment,
                push_sms or num_sms,
                cached,
                do_cpu_sync,
                do_expand,
                do_zero_padding,
                use_tma_aligned_col_major_sf,
                stats,
                do_handle_copy,
                before_epilogue,
            )

        out, compute = self._run(
            previous_event,
            previous_event_before_epilogue,
            async_with_compute_stream or allocate_on_comm_stream,
            (payload, sf, topk_idx, topk_weights, stats),
            run,
        )
        if handle is None:
            handle = EPHandle(
                do_expand,
                num_experts,
                expert_alignment,
                num_max,
                num_sms,
                _made(out.topk_idx),
                out.num_recv_tokens,
                out.num_expanded_tokens,
                out.num_recv_tokens_per_expert_list,
                _made(out.psum_num_recv_tokens_per_scaleup_rank),
                _made(out.psum_num_recv_tokens_per_expert),
                _made(out.num_unaligned_recv_tokens_per_expert),
                _made(out.recv_src_metadata),
                _made(out.dst_buffer_slot_idx),
                None,
                None,
                reduction_slot=out.reduction_slot,
            )
        event = EventOverlap(None)  # (a new one: V2's callers may register hooks on it)
        if compute is not None:
            outputs = (
                out.recv_x,
                out.recv_sf,
                out.recv_topk_idx,
                out.recv_topk_weights,
                out.recv_src_metadata,
                out.reduction_slot,
                out.topk_idx,
                out.psum_num_recv_tokens_per_scaleup_rank,
                out.psum_num_recv_tokens_per_expert,
                out.num_unaligned_recv_tokens_per_expert,
                out.dst_buffer_slot_idx,
            )
            event = self._finish(compute, async_with_compute_stream, outputs)
        recv_x = (out.recv_x, out.recv_sf) if sf is not None else out.recv_x
        return recv_x, out.recv_topk_idx, out.recv_topk_weights, handle, event

    # ------------------------------------------------------------------------ combine
    @_plain_torch
    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights: torch.Tensor | None = None,
        bias=None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event=None,
        previous_event_before_epilogue=None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Send every received row back and sum each token's rows (unweighted).

        Each token gets float32 ``bias_0 + bias_1``, then the rows of the ranks it went to in
        the order of the top-k column of each rank's last choice (expanded rows are first
        summed per token and rank in top-k order and rounded to BF16, unless the buffer was
        built with ``allow_multiple_reduction=False``, where every expanded row is added in
        top-k order), rounded to BF16 once: DeepEP V2's reference order, bit for bit.

        Args:
            x: ``[rows, H]`` BF16 in the layout of the handle's dispatch (rows as received).
            handle: the dispatch's :class:`EPHandle`.
            topk_weights: ``[rows, K]`` (plain) or ``[rows]`` (expanded) float32, handed back:
                weight ``k`` of a token comes from the rank that holds expert ``k``.
            bias: ``[N, H]`` BF16, or a tuple of two.
            num_sms: programs of the push; 0: the dispatch's, or every SM for a decode
                batch (at most ``DECODE_TOKENS`` tokens, 256).
            num_qps, previous_event, previous_event_before_epilogue,
                async_with_compute_stream, allocate_on_comm_stream: as in :meth:`dispatch`.
        Returns:
            ``(combined_x [N, H] BF16, combined_topk_weights [N, K] float32 or None, event)``.
        """
        runtime = self._require_runtime()
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle: expected an EPHandle, got {type(handle).__name__}")
        if handle.reduction_slot is None:
            raise ValueError("handle: it has no reduction_slot; pass a handle a dispatch returned")
        reduction_slot = handle.reduction_slot
        device = runtime.device
        rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
        num_tokens, topk = handle.topk_idx.shape
        if not _plain_rows(x, torch.bfloat16, rows, self._device):
            check_tensor("x", x, dtype=torch.bfloat16, shape=(rows, None), device=device)
        if topk_weights is not None:
            shape = (rows,) if handle.do_expand else (rows, topk)
            _check("topk_weights", topk_weights, torch.float32, shape, device)
            if handle.do_expand and not self.allow_multiple_reduction:
                raise ValueError(
                    "topk_weights: an expanded combine takes weights only with "
                    "allow_multiple_reduction=True (as in DeepEP V2)"
                )
        terms = () if bias is None else bias if isinstance(bias, tuple) else (bias,)
        if len(terms) > 2:
            raise ValueError(f"bias: at most two tensors, got {len(terms)}")
        for i, term in enumerate(terms):
            check_tensor(
                f"bias[{i}]" if isinstance(bias, tuple) else "bias",
                term,
                dtype=torch.bfloat16,
                shape=(num_tokens, x.shape[1]),
                device=device,
            )
        push_sms = self._push_sms(num_sms, num_tokens)
        num_sms = num_sms or handle.num_sms
        self._check_qps(num_qps)

        def run(before_epilogue):
            return runtime.combine(
                x,
                topk_weights,
                terms,
                handle.recv_src_metadata,
                reduction_slot,
                handle.psum_num_recv_tokens_per_scaleup_rank,
                handle.topk_idx,
                handle.num_experts,
                handle.num_max_tokens_per_rank,
                handle.do_expand,
                self.allow_multiple_reduction,
                push_sms or num_sms,
                before_epilogue,
            )

        inputs = (
            x,
            topk_weights,
            *terms,
            handle.recv_src_metadata,
            reduction_slot,
            handle.psum_num_recv_tokens_per_scaleup_rank,
            handle.topk_idx,
        )
        (out, out_w), compute = self._run(
            previous_event,
            previous_event_before_epilogue,
            async_with_compute_stream or allocate_on_comm_stream,
            inputs,
            run,
        )
        event = EventOverlap(None)  # (a new one: V2's callers may register hooks on it)
        if compute is not None:
            event = self._finish(compute, async_with_compute_stream, (out, out_w))
        return out, out_w, event

    # ------------------------------------------------------- experimental V2 features
    # DeepEP V2's signatures, so that a caller gets NotImplementedError naming the feature.
    @staticmethod
    def get_engram_storage_size_hint(
        num_entries: int,
        hidden: int,
        num_max_tokens_per_rank: int,
        dtype: torch.dtype = torch.bfloat16,
    ):
        raise NotImplementedError(_ENGRAM)

    def engram_write(self, storage: torch.Tensor, sf: torch.Tensor | None = None):
        raise NotImplementedError(_ENGRAM)

    def engram_fetch(
        self, indices: torch.Tensor, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = False
    ):
        raise NotImplementedError(_ENGRAM)

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int):
        raise NotImplementedError(_PP)

    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int):
        raise NotImplementedError(_PP)

    def pp_send(self, t: torch.Tensor, dst_rank_idx: int, num_sms: int = 0):
        raise NotImplementedError(_PP)

    def pp_recv(self, t: torch.Tensor, src_rank_idx: int, num_sms: int = 0):
        raise NotImplementedError(_PP)

    @staticmethod
    def get_agrs_num_max_session_bytes(group: dist.ProcessGroup, shapes, dtype: torch.dtype):
        raise NotImplementedError(_AGRS)

    @staticmethod
    def get_agrs_buffer_size_hint(group: dist.ProcessGroup, num_max_session_bytes: int):
        raise NotImplementedError(_AGRS)

    def create_agrs_session(self):
        raise NotImplementedError(_AGRS)

    def destroy_agrs_session(self):
        raise NotImplementedError(_AGRS)

    def agrs_new_session(self, enabled: bool = True):
        raise NotImplementedError(_AGRS)

    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int):
        raise NotImplementedError(_AGRS)

    def agrs_get_inplace_tensor(self, shapes, dtype: torch.dtype):
        raise NotImplementedError(_AGRS)

    def all_gather(self, t):
        raise NotImplementedError(_AGRS)


_ENGRAM = "Engram (remote KV-cache fetch) is not implemented in tritonep"
_PP = "pipeline-parallel send/recv (PP) is not implemented in tritonep"
_AGRS = "all-gather reduce-scatter (AGRS, all_gather) is not implemented in tritonep"


def _made(t: torch.Tensor | None) -> torch.Tensor:
    """A handle tensor of a first (not cached) dispatch, which makes every one."""
    assert t is not None
    return t


def _check_x(payload: object, sf: object, device: torch.device) -> int:
    """Check a dispatch's ``x``; returns its token count."""
    index = device.index if device.type == "cuda" else -1
    if not _plain_rows(payload, torch.bfloat16, None, index):
        payload = check_tensor(
            "x",
            payload,
            dtype=(torch.bfloat16, torch.float8_e4m3fn),
            shape=(None, None),
            device=device,
        )
    num_tokens, hidden = payload.shape
    if hidden < 1 or hidden * payload.element_size() % 16:
        raise ValueError(
            f"x: rows must be a positive multiple of 16 bytes, got hidden {hidden} "
            f"of {payload.dtype}"
        )
    fp8 = payload.dtype == torch.float8_e4m3fn
    if fp8 != (sf is not None):
        raise TypeError("x: FP8 rows come as a tuple (x, scale packs), BF16 rows alone")
    if sf is not None:
        sf = check_tensor(
            "x[1]",
            sf,
            dtype=(torch.float32, torch.int32),
            shape=(num_tokens, None),
            device=device,
            contiguous=False,
        )
        if not 1 <= sf.shape[1] <= -(-hidden // 32):
            raise ValueError(
                f"x[1]: expected 1 to {-(-hidden // 32)} scale packs per token, got {sf.shape[1]}"
            )
    return num_tokens


@functools.cache
def _theoretical_num_sms(
    num_ranks: int,
    num_experts: int,
    num_topk: int,
    nvlink_gbs: float,
    sm_read_gbs: float,
    sm_write_gbs: float,
    device_sms: int,
    prefer_overlap_with_compute: bool,
) -> int:
    """DeepEP V2's SM model for one NVLink domain (see :meth:`ElasticBuffer.
    get_theoretical_num_sms`)."""
    if num_ranks == 1 or num_topk == 0:
        return device_sms
    # Expected distinct ranks per token with uniformly random experts.
    miss = math.comb(num_experts - num_experts // num_ranks, num_topk) / math.comb(
        num_experts, num_topk
    )
    expected_ranks = num_ranks * (1 - miss)
    read = 1 / expected_ranks  # a token row read per destination it goes to
    write = 1.0  # every received row is written once
    traffic = 1 - 1 / num_ranks  # the share of rows that cross NVLink
    sms = max(
        nvlink_gbs / traffic * read / sm_read_gbs, nvlink_gbs / traffic * write / sm_write_gbs
    )
    sms = _align(max(4, math.ceil(sms * 1.25)), 2)
    if not prefer_overlap_with_compute:
        sms = max(sms, 64)
    return min(sms, device_sms)
