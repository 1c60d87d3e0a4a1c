"""Elastic mode: DeepEP V2's one dispatch/combine for training, prefill and decode.

Orchestrates :mod:`tritonep.kernels.elastic_dispatch` and :mod:`tritonep.kernels.elastic_combine`
over one symmetric heap, sized once when the mode is built (:func:`region_bytes` for the
largest call; :mod:`tritonep.kernels.elastic_exchange` describes the regions). A dispatch is
two launches:

* the push (``dispatch_impl``): each token's record goes once to every rank it has an expert
  on, into the slot ``[source][token's rank among this source's tokens for that destination]``;
  the last program exchanges headers (counts) and decodes them;
* the copy epilogue (``dispatch_copy_epilogue_impl``): the caller's layout, plain (one row per
  received token, in source order) or expanded (one row per token and local expert, each
  expert's rows contiguous and padded to the alignment).

Between the two, ``do_cpu_sync=True`` reads the counts on the host to size the outputs exactly;
``False`` sizes them for the worst case and never waits for the host, so CUDA graphs can
capture the calls. A combine is a push of one row per received token (reduced over its local
experts in the expanded layout) into the owner's slot for it, then a reduce epilogue that sums
each token's rows in a fixed order. Call counters live on the device. On sm_90 and later each
epilogue is a programmatic dependent launch of its push (launched while the push runs, it waits
for the push's grid before reading), so that a call costs about one launch. Tile sizes and
warps come from :data:`TUNING`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..heap import allocate, default_device
from ..kernels import elastic_combine as ec
from ..kernels import elastic_dispatch, elastic_exchange, phases
from ..kernels import elastic_dispatch as ed
from ..kernels.elastic_exchange import BarrierCall, BarrierVariant, ElasticShared
from ..kernels.launcher import KernelLaunch, Shared
from ..kernels.status import Status, host_words, wait_host_word
from ..kernels.sync import (
    DEFAULT_TIMEOUT_S,
    check_status,
    raise_on_timeout,
    timeout_us,
    use_clock,
)
from ..validation import check_num_experts, check_ranks_agree, default_group
from .outputs import empty_output
from .trace import TraceRecorder

#: Local experts per rank that the headers have room for.
MAX_LOCAL_EXPERTS = 1024
#: int32 words of a header: tag, tokens, then one count per local expert.
HEADER_WORDS = (2 + MAX_LOCAL_EXPERTS + 3) // 4 * 4
#: Largest top-k (the record's metadata is sized for it when no top-k is given).
MAX_TOPK = 32
#: Scale-factor packs per row are aligned to this in the TMA-aligned column-major layout.
TMA_SF_ALIGN = 4
#: Fields of the dispatch kernels' calls that the kernels read as int32 words (rows of any
#: dtype, 4-byte scale packs): Triton's path gets them viewed so, a launch from addresses
#: takes them as they are.
_PUSH_WORDS = ("x_ptr", "sf_ptr")
_COPY_WORDS = ("out_words_ptr", "out_sf_ptr")
_no_torch_function = torch._C.DisableTorchFunction


def _pow2(n: int) -> int:
    """The least power of two at least ``n`` (1 for ``n <= 1``): ``triton.next_power_of_2``,
    which is a constexpr function and costs microseconds per call on the host."""
    return 1 << max(0, n - 1).bit_length()


#: Calls of at most this many tokens on a rank are decode batches: the DeepEP V2 layer runs
#: their pushes on every SM unless the caller sets ``num_sms`` (at these sizes a push is
#: bound by latency, not bandwidth, and few programs would each walk many rows in turn).
DECODE_TOKENS = 256


@dataclass(frozen=True)
class Tuning:
    """Tile sizes and warps of the four launches (the largest a launch may take: smaller
    batches take smaller blocks so that they spread over the programs). Measured on H200 with
    ``scripts/elastic_decode_probe.py --tune``; part of every variant's key, so a probe may
    swap :data:`TUNING` between calls."""

    dispatch_tokens: int = 16  # tokens per block of the dispatch push
    small_scan_tokens: int = 32  # the fewest tokens a step of the scan of earlier ids reads
    dispatch_warps: int = 8
    copy_rows: int = 16  # received rows per block of the copy epilogue
    copy_warps: int = 8
    copy_programs_per_sm: int = 1  # programs of the copy epilogue per SM
    # SMs of the copy and reduce epilogues, 0: every SM (fewer measured worse beside a GEMM
    # on another stream as well as alone: BENCHMARKS.md, "Beside a GEMM")
    epilogue_sms: int = 0
    # the combine push: each program waits for a block's loads before it stores the block, so
    # wide blocks on many warps keep more rows in flight; expanded rows are summed K at a
    # time, whose loads take the registers of more rows (BENCHMARKS.md, ElasticBuffer prefill)
    combine_rows: int = 32  # received tokens per block of the combine push
    expanded_combine_rows: int = 8  # the same for rows in the expanded layout
    combine_channels: int = 1024  # channels per work item of the combine push
    combine_warps: int = 32
    # the same for decode batches (at most DECODE_TOKENS tokens on this rank): narrow blocks
    # of wide chunks keep every program's stores in flight (BENCHMARKS.md, ElasticBuffer decode)
    decode_combine_rows: int = 2
    decode_combine_channels: int = 2048
    decode_combine_warps: int = 8
    # combines of expanded rows with more tokens than this on a rank sum each token's rows on
    # every SM first (elastic_combine_sums), then push them as a plain layout; smaller ones sum
    # inside the push, one launch fewer (BENCHMARKS.md, ElasticBuffer prefill)
    sum_first_tokens: int = DECODE_TOKENS
    sums_rows: int = 8  # received tokens per block of those sums
    sums_channels: int = 1024  # channels per work item of those sums
    sums_warps: int = 16
    reduce_tokens: int = 8  # tokens per block of the reduce epilogue
    reduce_channels: int = 1024  # channels per work item of the reduce epilogue
    reduce_warps: int = 16

    @classmethod
    def of(cls, config: str) -> Tuning:
        """The tuning ``config`` names (``"combine_rows=16,combine_warps=8"``: each value an
        integer, converted to its field's type), the defaults elsewhere."""
        fields = dict(item.split("=") for item in filter(None, config.split(",")))
        default = cls()
        return cls(
            **{k.strip(): type(getattr(default, k.strip()))(int(v)) for k, v in fields.items()}
        )


TUNING = Tuning()


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def record_bytes(row_bytes: int, num_packs: int, topk: int) -> int:
    """Bytes of a dispatch record: the row, its 4-byte scale packs, its metadata."""
    meta = 4 * elastic_dispatch.meta_words(topk)
    return _align(row_bytes, 16) + _align(4 * num_packs, 16) + _align(meta, 16)


def record_layout(row_bytes: int, num_packs: int, topk: int) -> dict[str, int]:
    """The constexprs of a dispatch record's layout (:func:`record_bytes`), on which the push
    that stores records and the epilogue that reads them must agree."""
    return dict(
        ROW_WORDS=row_bytes // 4,
        G=num_packs,
        BLOCK_GROUPS=_pow2(max(num_packs, 2)),
        RECORD_BYTES=record_bytes(row_bytes, num_packs, topk),
        PAYLOAD_BYTES=_align(row_bytes, 16),
        SCALE_BYTES=_align(4 * num_packs, 16),
    )


def combine_record_bytes(hidden: int, topk: int) -> int:
    """Bytes of a combine record: ``hidden`` BF16 values, then ``topk`` float32 weights."""
    return _align(2 * hidden + 4 * topk, 16)


def combine_slots(num_ranks: int, topk: int, expand: bool, multiple_reduction: bool) -> int:
    """Rows a token may get back: one per rank it went to (at most ``min(R, K)``), or one per
    top-k choice when expanded rows go back unreduced."""
    return topk if expand and not multiple_reduction else min(num_ranks, topk)


def region_bytes(
    num_ranks: int,
    num_max_tokens_per_rank: int,
    hidden: int,
    topk: int,
    use_fp8: bool,
    multiple_reduction: bool = True,
) -> int:
    """Bytes of one region for calls of these sizes (the larger of a dispatch's records and a
    combine's rows; top-k 0 sizes for :data:`MAX_TOPK`)."""
    topk = topk or MAX_TOPK
    row = hidden if use_fp8 else 2 * hidden
    packs = -(-hidden // 32) if use_fp8 else 0  # at most one 4-byte pack per 32 channels
    dispatch = num_ranks * num_max_tokens_per_rank * record_bytes(row, packs, topk)
    slots = combine_slots(num_ranks, topk, True, multiple_reduction)
    combine = slots * num_max_tokens_per_rank * combine_record_bytes(hidden, topk)
    return _align(max(dispatch, combine), 128)


@dataclass(frozen=True)
class ElasticLayout:
    """Byte offsets of the heap: headers, barrier flags, two regions."""

    header: int
    barrier: int
    region: int
    region_bytes: int
    total: int

    @staticmethod
    def of(num_ranks: int, num_bytes: int) -> ElasticLayout:
        """The layout of a heap of about ``num_bytes``: the headers and flags first, the rest
        split into the two regions."""
        header = 0
        barrier = _align(2 * num_ranks * HEADER_WORDS * 4, 128)
        region = barrier + _align(4 * num_ranks, 128)
        each = max(128, (num_bytes - region) // 2 // 128 * 128)
        return ElasticLayout(header, barrier, region, each, region + 2 * each)

    @staticmethod
    def size_for(num_ranks: int, region: int) -> int:
        """Heap bytes whose regions hold ``region`` bytes each."""
        return ElasticLayout.of(num_ranks, 0).region + 2 * region


@dataclass
class ElasticDispatchOutput:
    """What :meth:`ElasticMode.dispatch` returns (DeepEP V2's outputs and handle fields).

    Attributes:
        recv_x: ``[rows, H]`` like ``x`` (BF16 or e4m3).
        recv_sf: ``[rows, G]`` scale packs in the dtype of the input's (FP8), else None.
        recv_topk_idx: ``[rows, K]`` int64 local expert ids (plain layout), else None.
        recv_topk_weights: ``[rows, K]`` (plain) or ``[rows]`` (expanded) float32, or None.
        num_recv_tokens, num_expanded_tokens: rows of each layout (worst case without a host
            read).
        num_recv_tokens_per_expert_list: per local expert, its aligned count (after a host
            read), else empty.
        psum_num_recv_tokens_per_scaleup_rank, psum_num_recv_tokens_per_expert,
            num_unaligned_recv_tokens_per_expert, recv_src_metadata, dst_buffer_slot_idx,
            reduction_slot, topk_idx: the handle's tensors (a cached dispatch returns None
            for those it reuses).
    """

    recv_x: torch.Tensor
    recv_sf: torch.Tensor | None
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    num_recv_tokens: int
    num_expanded_tokens: int
    num_recv_tokens_per_expert_list: list[int]
    psum_num_recv_tokens_per_scaleup_rank: torch.Tensor | None = None
    psum_num_recv_tokens_per_expert: torch.Tensor | None = None
    num_unaligned_recv_tokens_per_expert: torch.Tensor | None = None
    recv_src_metadata: torch.Tensor | None = None
    dst_buffer_slot_idx: torch.Tensor | None = None
    reduction_slot: torch.Tensor | None = None
    topk_idx: torch.Tensor | None = None


@dataclass
class CachedLayout:
    """What a cached dispatch reuses: the output sizes of the dispatch it repeats."""

    num_recv_tokens: int
    num_expanded_tokens: int
    num_recv_tokens_per_expert_list: list[int]


class ElasticMode:
    """Elastic dispatch and combine for one expert-parallel group whose heaps every rank maps
    (one node, or one NVLink domain; CPU ranks share memory).

    Args:
        group: the process group (default: the world); every rank constructs it together.
        num_bytes: heap bytes per rank (:func:`region_bytes` and :meth:`ElasticLayout.size_for`
            size it for a call shape); every rank passes the same.
        device: a CUDA device, or ``"cpu"`` for CPU ranks (kernels under the interpreter).
        timeout_s: limit of every wait inside the kernels, in seconds.
        profile: record kernel traces of every launch (:attr:`trace`); a
            :class:`~tritonep.modes.trace.TraceRecorder` to share one with another mode.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        num_bytes: int = 1 << 26,
        device: torch.device | str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        profile: bool | TraceRecorder = False,
    ):
        self.group = default_group(group)
        device = torch.device(device) if device is not None else default_device(self.group)
        check_ranks_agree(self.group, "ElasticMode", num_bytes=num_bytes, device_type=device.type)
        self.rank = dist.get_rank(self.group)
        self.num_ranks = dist.get_world_size(self.group)
        self.layout = ElasticLayout.of(self.num_ranks, num_bytes)
        self.heap = allocate(self.layout.total, self.group, device)
        if not self.heap.all_mapped:
            raise ValueError(
                "group: the elastic mode needs every rank's memory mapped here "
                "(one node or NVLink domain)"
            )
        self.device = self.heap.device
        self.timeout_s = timeout_s
        self.state = torch.zeros(8, dtype=torch.int64, device=self.device)
        # The kernels' status words; what they record is mirrored into host memory, which an
        # exact-size dispatch reads with its counts, without a copy.
        self._status = Status(self.device)
        self.status = self._status.words
        self._scratches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # [written flag, R x (1 + E_local) counts] int32 in host memory (page-locked on GPUs),
        # written by an exact-size push (elastic_exchange.HOST_COUNTS), grown to the most
        # experts seen.
        self._host_counts, self._host_view = host_words(1, self.device)
        self._f32 = torch.zeros(4, dtype=torch.float32, device=self.device)  # unused pointers
        #: Per call shape (sizes, and the block sizes they give): the launches, their programs,
        #: the checks done (each plan keeps the TUNING it was made with; a probe that swaps
        #: TUNING gets new plans). The launches themselves are kept per variant.
        self._dispatch_plans: dict[tuple, tuple] = {}
        self._epilogue_plans: dict[tuple, tuple] = {}
        self._combine_plans: dict[tuple, tuple] = {}
        self._sums_plans: dict[tuple, tuple] = {}
        self._launches: dict[tuple, KernelLaunch] = {}
        self._barrier: KernelLaunch | None = None
        on_gpu = self.device.type == "cuda"
        self.num_device_sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count if on_gpu else 4
        )
        # Each epilogue is a programmatic dependent launch of its push (sm_90 and later): the
        # push lets it launch at the push's start, so that its launch and its programs' start
        # overlap the push, and it waits for the push's grid to complete before reading.
        # Never under the interpreter (no inline assembly there).
        self._pdl = on_gpu and torch.cuda.get_device_capability(self.device)[0] >= 9
        #: Kernel traces (``profile``; may be set later, for the launches after):
        #: :meth:`TraceRecorder.dump` writes them. Each launch then gets a readings buffer of
        #: its own and is compiled with ``PROFILE``; without, the kernels read no clock.
        self.trace = TraceRecorder.of(profile, self.rank, self.device, on_gpu)
        self._share()

    @property
    def timeout_s(self) -> float:
        """Limit of every wait inside the kernels, in seconds (may change between calls)."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._timeout_us = timeout_us(value)
        self._timeout_s = value
        if hasattr(self, "_shared"):
            self._share()

    # ---------------------------------------------------------------------------- helpers
    def _share(self) -> None:
        """The kernels' trailing arguments (:class:`ElasticShared`), again after a change."""
        layout = self.layout
        self._shared = Shared.of(
            ElasticShared(
                peer_ptrs=self.heap.peer_ptrs,
                rank=self.rank,
                header_offset=layout.header,
                barrier_offset=layout.barrier,
                region_offset=layout.region,
                region_bytes=layout.region_bytes,
                state_ptr=self.state,
                status_ptr=self.status,
                timeout_us=self._timeout_us,
            )
        )

    def _kernel_launch(self, kernel, call_type, variant, options: dict) -> KernelLaunch:
        """One variant of ``kernel`` (``variant``: its constexprs; ``options``: warps and
        launch options), launched from ``call_type`` bundles; one per variant, so that plans
        of other sizes with the same variant launch its compiled kernel."""
        key = (kernel, variant, tuple(options.items()))
        launch = self._launches.get(key)
        if launch is None:
            meta = {**variant._asdict(), **options}
            pointers = tuple(i for i, f in enumerate(call_type._fields) if f.endswith("_ptr"))
            launch = KernelLaunch(kernel, (1,), meta, call_type._fields, pointers)
            self._launches[key] = launch
        return launch

    def _launch(
        self, launch: KernelLaunch, programs: int, call: Any, name: str, words: tuple = ()
    ) -> None:
        """Launch ``call`` (a call bundle of tensors and ints) on ``programs`` programs: from
        its addresses when the variant is compiled (:meth:`KernelLaunch.launch_values`), else
        through Triton, with the fields named in ``words`` viewed as int32. Traced (``name``
        in the trace), the call gets a readings buffer of its own."""
        grid = (programs,)
        if self.trace is not None:
            readings = self.trace.buffer(name, programs, True, True)
            call = call._replace(trace_ptr=readings)
        else:
            values = list(call)
            for i in launch.pointers:
                values[i] = values[i].data_ptr()
            if launch.launch_values(values, self._shared, None, grid):
                return
        views = {f: getattr(call, f).view(torch.int32) for f in words}
        launch(call._replace(**views), self._shared, grid)

    def _dependent(self) -> dict:
        """An epilogue's launch options: a programmatic dependent launch on sm_90 and later
        (the kernel waits for its push first), else none (the interpreter takes no
        ``launch_pdl``)."""
        return dict(launch_pdl=True) if self._pdl else {}

    def _epilogue_sms(self, tuning: Tuning) -> int:
        """The SMs of the copy and reduce epilogues under ``tuning``."""
        return tuning.epilogue_sms or self.num_device_sms

    def _programs(self, wanted: int, work: int, block: int) -> int:
        """Programs of a launch: ``wanted`` (an SM budget), no more than blocks of work, fewer
        on CPU ranks (the interpreter runs programs one after another)."""
        if self.device.type != "cuda":
            wanted = min(wanted, 2)
        return max(1, min(wanted, -(-work // block)))

    def _block(self, most: int, work: int, programs: int) -> int:
        """Rows per block: ``most``, or fewer (a power of two) when that leaves programs of the
        budget idle; decode batches then spread over every SM (one variant per power of two)."""
        if self.device.type != "cuda":
            return most
        return max(1, min(most, _pow2(-(-work // max(1, programs)))))

    def check(self) -> None:
        """Wait for the device and raise :class:`~tritonep.errors.WaitTimeoutError` if a wait
        gave up, or :class:`~tritonep.errors.HeapGuardError` if a kernel wrote past the heap."""
        raise_on_timeout(self.status, self.rank, phases.NAMES)
        self.heap.check_guard()

    def barrier(self) -> None:
        """Every rank's barrier kernel waits for every other's (on the current stream)."""
        launch = self._barrier
        if launch is None:
            R = self.num_ranks
            variant = BarrierVariant(
                NUM_RANKS=R, BLOCK_RANKS=_pow2(max(R, 2)), USE_CLOCK=use_clock(self.device)
            )
            launch = self._barrier = KernelLaunch(
                elastic_exchange.elastic_barrier, (1,), variant._asdict(), (), ()
            )
        with _no_torch_function():
            launch(BarrierCall(), self._shared)

    def capacity_error(
        self,
        num_max_tokens: int,
        hidden: int,
        topk: int,
        row_bytes: int,
        num_packs: int,
        slots: int,
    ) -> str | None:
        """Why calls of these sizes do not fit the regions, or None."""
        need = max(
            self.num_ranks * num_max_tokens * record_bytes(row_bytes, num_packs, topk),
            slots * num_max_tokens * combine_record_bytes(hidden, topk),
        )
        if need > self.layout.region_bytes:
            return (
                f"num_max_tokens_per_rank={num_max_tokens}, hidden={hidden}, top-k {topk} "
                f"need {ElasticLayout.size_for(self.num_ranks, need)} bytes of buffer, "
                f"more than the {self.layout.total} it has (get_buffer_size_hint)"
            )
        return None

    def _scratch(self, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The push's scratch for ``num_experts``: ``[R + E]`` int32 totals and ``[R, 1 +
        E_local]`` int32 received counts, which the epilogue of the same call reads (calls
        are ordered on the device, and a host read comes before the next call)."""
        scratch = self._scratches.get(num_experts)
        if scratch is None:
            R, device = self.num_ranks, self.device
            totals = torch.zeros(R + num_experts, dtype=torch.int32, device=device)
            counts = torch.zeros(R, 1 + num_experts // R, dtype=torch.int32, device=device)
            scratch = self._scratches[num_experts] = (totals, counts)
        return scratch

    # --------------------------------------------------------------------------- dispatch
    def dispatch(
        self,
        x: torch.Tensor,
        sf: torch.Tensor | None,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor | None,
        num_experts: int,
        num_max_tokens: int,
        expert_alignment: int = 1,
        num_sms: int = 16,
        cached: CachedLayout | None = None,
        do_cpu_sync: bool = True,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        tma_sf: bool = False,
        stats: torch.Tensor | None = None,
        copy_ids: bool = True,
        before_epilogue=None,
    ) -> ElasticDispatchOutput:
        """Dispatch ``x`` (checked by the caller) along ``topk_idx``.

        Args:
            x: ``[N, H]`` BF16 or e4m3, rows of a multiple of 16 bytes, contiguous.
            sf: ``[N, G]`` float32 or int32 scale packs of an e4m3 ``x`` (any strides), or None.
            topk_idx: ``[N, K]`` int64 global expert ids, ``-1`` for none (out-of-range ids
                count as ``-1``).
            topk_weights: ``[N, K]`` float32, or None.
            num_experts, num_max_tokens, expert_alignment: as DeepEP V2's.
            num_sms: programs of the push (the epilogue uses every SM).
            cached: the sizes of the dispatch whose handle this call reuses (no host read).
            do_cpu_sync: read the counts on the host and size the outputs exactly.
            do_expand, do_zero_padding, tma_sf: DeepEP V2's ``do_expand``,
                ``do_zero_padding``, ``use_tma_aligned_col_major_sf``.
            stats: ``[E_local]`` int32; received choices per local expert are added to it.
            copy_ids: return a copy of ``topk_idx`` for the handle (else the handle keeps it).
            before_epilogue: called before the epilogue is launched (stream waits).
        Returns:
            an :class:`ElasticDispatchOutput`.
        """
        with _no_torch_function():
            N, H = x.shape
            K = topk_idx.shape[1]
            G = sf.shape[1] if sf is not None else 0
            row_bytes = H * x.element_size()
            key = (N, H, row_bytes, G, K, num_experts, num_max_tokens, num_sms, self.trace)
            plan = self._dispatch_plans.get(key)
            if plan is None or plan[0] is not TUNING:
                plan = self._dispatch_plans[key] = self._dispatch_plan(*key[:-1])
            _, push, programs, E_local, totals, recv_counts = plan
            R, device = self.num_ranks, self.device
            first_call = cached is None
            host_read = first_call and do_cpu_sync  # the counts read on the host: exact sizes
            if host_read and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise ValueError(
                    "do_cpu_sync: an exact-size dispatch reads its counts on the host, "
                    "which a CUDA graph capture cannot; pass do_cpu_sync=False (worst-case "
                    "sizes) or a handle"
                )
            ids_copy = torch.empty_like(topk_idx) if first_call and copy_ids else None
            dst_slots = empty_output(device, (N, K), torch.int32) if first_call else None
            # The handle's count-sized tensors, allocated now: an exact-size call's host waits
            # for the push next, and what it allocates after the read delays the epilogue.
            handle_counts = None
            if first_call:
                handle_counts = (
                    empty_output(device, (R,), torch.int32),
                    empty_output(device, (E_local,), torch.int32),
                    empty_output(device, (E_local,), torch.int32),
                )
            int32_dummy = self.status
            flags = (
                (ed.FLAG_WEIGHTS.value if topk_weights is not None else 0)
                | (ed.FLAG_STATS.value if stats is not None else 0)
                | (ed.FLAG_COPY_IDS.value if ids_copy is not None else 0)
                | (ed.FLAG_SLOTS.value if first_call else 0)
            )
            count_words = R * (1 + E_local)
            if host_read:
                host_view = self._host_words(count_words)
                host_view[0] = 0  # (set by the push once the counts are written)
                flags |= ed.FLAG_HOST_COUNTS.value
            call = ed.DispatchCall(
                x_ptr=x,
                sf_ptr=sf if sf is not None else int32_dummy,
                sf_token_stride=sf.stride(0) if sf is not None else 0,
                sf_group_stride=sf.stride(1) if sf is not None else 0,
                topk_ptr=topk_idx,
                weights_ptr=topk_weights if topk_weights is not None else self._f32,
                num_tokens=N,
                max_tokens=num_max_tokens,
                totals_ptr=totals,
                recv_counts_ptr=recv_counts,
                stats_ptr=stats if stats is not None else int32_dummy,
                ids_copy_ptr=ids_copy if ids_copy is not None else self.state,
                slots_ptr=dst_slots if dst_slots is not None else int32_dummy,
                flags=flags,
                trace_ptr=self.state,
            )
            self._launch(push, programs, call, "elastic dispatch", _PUSH_WORDS)
            if cached is not None:
                num_recv, num_expanded = cached.num_recv_tokens, cached.num_expanded_tokens
                per_expert = cached.num_recv_tokens_per_expert_list
            elif do_cpu_sync:
                # The one host read of a dispatch: the counts every source sent here.
                info = self._read_counts(host_view, count_words)
                # [rows, rows per local expert] summed over the sources, element-wise in C:
                # the device idles until the epilogue's launch.
                words = 1 + E_local
                sums = info[:words]
                for s in range(1, R):
                    sums = list(map(operator.add, sums, info[s * words : (s + 1) * words]))
                num_recv = sums[0]
                per_expert = sums[1:]
                if expert_alignment > 1:
                    per_expert = [_align(n, expert_alignment) for n in per_expert]
                num_expanded = sum(per_expert)
            else:
                num_recv = R * num_max_tokens
                num_expanded = num_recv * min(K, E_local) + (expert_alignment - 1) * E_local
                num_expanded = _align(num_expanded, expert_alignment)
                per_expert = []
            if before_epilogue is not None:
                before_epilogue()
            out = self._dispatch_outputs(
                x,
                sf,
                topk_weights,
                K,
                E_local,
                num_recv,
                num_expanded,
                do_expand,
                tma_sf,
                handle_counts,
            )
            out.num_recv_tokens_per_expert_list = per_expert
            out.dst_buffer_slot_idx = dst_slots
            out.topk_idx = ids_copy if ids_copy is not None else (topk_idx if first_call else None)
            expected = (
                num_recv if do_cpu_sync or cached is not None else min(num_recv, R * max(N, 1))
            )
            self._epilogue(
                out,
                recv_counts,
                num_max_tokens,
                expert_alignment,
                row_bytes,
                G,
                K,
                E_local,
                do_expand,
                do_zero_padding,
                expected,
            )
            return out

    def _dispatch_plan(self, N, H, row_bytes, G, K, num_experts, num_max_tokens, num_sms):
        """``(TUNING, the push's launch, its programs, E_local, totals, recv_counts)`` for
        dispatches of these sizes (:meth:`_scratch`); ``ValueError`` for sizes the mode cannot
        take."""
        R = self.num_ranks
        E_local = check_num_experts(num_experts, R)
        if E_local > MAX_LOCAL_EXPERTS:
            raise ValueError(
                f"num_experts: at most {MAX_LOCAL_EXPERTS} experts per rank, got {E_local}"
            )
        error = self.capacity_error(num_max_tokens, H, K, row_bytes, G, min(R, K))
        if error:
            raise ValueError(error)
        tuning = TUNING
        ROW_WORDS, BLOCK_K = row_bytes // 4, _pow2(max(K, 2))
        BLOCK_TOKENS = self._block(max(1, min(tuning.dispatch_tokens, 128 // BLOCK_K)), N, num_sms)
        # The scan of the earlier tokens' ids reads 1024 of them a step; a small batch no more
        # than it has, in powers of two from small_scan_tokens (its histogram costs per id
        # read, masked or not).
        scan = max(tuning.small_scan_tokens, _pow2(max(N, 1)))
        variant = ed.DispatchVariant(
            K=K,
            BLOCK_K=BLOCK_K,
            NUM_EXPERTS=num_experts,
            BLOCK_EXPERTS=_pow2(max(num_experts, 2)),
            E_LOCAL=E_local,
            BLOCK_COUNTS=_pow2(E_local + 1),
            NUM_RANKS=R,
            BLOCK_RANKS=_pow2(max(R, 2)),
            BLOCK_WORDS=min(_pow2(ROW_WORDS), 8192 // BLOCK_TOKENS),
            **record_layout(row_bytes, G, K),
            HEADER_WORDS=HEADER_WORDS,
            BLOCK_TOKENS=BLOCK_TOKENS,
            SCAN_BLOCK_TOKENS=max(BLOCK_TOKENS, min(1024 // BLOCK_K, scan)),
            HAS_SF=G > 0,
            USE_CLOCK=use_clock(self.device),
            PDL=self._pdl,
            PROFILE=self.trace is not None,
        )
        options = {"num_warps": tuning.dispatch_warps}
        push = self._kernel_launch(ed.elastic_dispatch, ed.DispatchCall, variant, options)
        programs = self._programs(num_sms, N, BLOCK_TOKENS)
        return tuning, push, programs, E_local, *self._scratch(num_experts)

    def _host_words(self, count_words: int):
        """The host words of an exact-size push's counts (``[flag, counts...]``, a ctypes
        array), holding at least ``count_words`` counts."""
        if len(self._host_view) < 1 + count_words:
            self._host_counts, self._host_view = host_words(1 + count_words, self.device)
            # (in stream order, before the push that writes there; the push of any earlier
            # exact-size call has written its words: that call waited for them)
            self.state[elastic_exchange.HOST_COUNTS.value] = self._host_counts.data_ptr()
        return self._host_view

    def _read_counts(self, view, count_words: int) -> list[int]:
        """What each source sent here, ``[R x (1 + E_local)]``, once the push just launched has
        written it to host memory (its flag, ``view[0]``); raises what a wait of that push
        recorded (its status is mirrored into host memory too)."""

        def stuck():
            check_status(self._status.record(), self.rank, phases.NAMES)
            raise RuntimeError(
                f"rank {self.rank}: the elastic dispatch ended without writing the counts it "
                "received"
            )

        wait_host_word(view, self.device, stuck)
        check_status(self._status.record(), self.rank, phases.NAMES)
        return view[1 : 1 + count_words]

    def _dispatch_outputs(
        self,
        x,
        sf,
        topk_weights,
        K,
        E_local,
        num_recv,
        num_expanded,
        do_expand,
        tma_sf,
        handle_counts,
    ) -> ElasticDispatchOutput:
        """The outputs of a dispatch of ``num_recv`` tokens (``num_expanded`` rows expanded);
        ``handle_counts``: the handle's ``[R]``, ``[E_local]``, ``[E_local]`` int32 prefix sums and
        counts of a first dispatch (None: a cached one, which makes no handle)."""
        device = self.device
        rows = num_expanded if do_expand else num_recv
        recv_x = empty_output(device, (rows, x.shape[1]), x.dtype)
        recv_sf = None
        if sf is not None:
            G = sf.shape[1]
            if tma_sf:  # column-major, each column's rows padded to a 16-byte multiple
                stride = _align(max(rows, 1), TMA_SF_ALIGN)
                recv_sf = empty_output(device, (G, stride), sf.dtype).T[:rows]
            else:
                recv_sf = empty_output(device, (rows, G), sf.dtype)
        recv_idx = None if do_expand else empty_output(device, (rows, K), torch.int64)
        recv_w = None
        if topk_weights is not None:
            shape = (rows,) if do_expand else (rows, K)
            recv_w = empty_output(device, shape, torch.float32)
        out = ElasticDispatchOutput(recv_x, recv_sf, recv_idx, recv_w, num_recv, num_expanded, [])
        if handle_counts is not None:
            out.psum_num_recv_tokens_per_scaleup_rank = handle_counts[0]
            out.psum_num_recv_tokens_per_expert = handle_counts[1]
            out.num_unaligned_recv_tokens_per_expert = handle_counts[2]
            out.recv_src_metadata = empty_output(device, (num_recv, K + 2), torch.int32)
            out.reduction_slot = empty_output(device, (num_recv,), torch.int32)
        return out

    def _epilogue(
        self,
        out: ElasticDispatchOutput,
        recv_counts,
        num_max_tokens,
        expert_alignment,
        row_bytes,
        G,
        K,
        E_local,
        do_expand,
        do_zero_padding,
        expected_rows,
    ) -> None:
        """Launch the copy epilogue. ``expected_rows``: the received rows it plans for (the
        exact count, or without a host read this rank's tokens times the ranks, as when the
        ranks decode equal batches); only the block size follows it, the loops run over the
        rows received."""
        recv_sf = out.recv_sf
        has_sf = recv_sf is not None
        rows = out.recv_x.shape[0]
        num_recv = out.num_recv_tokens
        tuning = TUNING
        copy_programs = self._epilogue_sms(tuning) * tuning.copy_programs_per_sm
        BLOCK_ROWS = self._block(tuning.copy_rows, expected_rows, copy_programs)
        key = (row_bytes, G, K, E_local, BLOCK_ROWS, do_expand, has_sf, self.trace)
        plan = self._epilogue_plans.get(key)
        if plan is None or plan[0] is not tuning:
            plan = self._epilogue_plans[key] = self._epilogue_plan(*key[:-1])
        copy = plan[1]
        programs = self._programs(copy_programs, max(num_recv, E_local), BLOCK_ROWS)
        write_meta = out.recv_src_metadata is not None
        has_w = out.recv_topk_weights is not None
        int32_dummy = self.status
        flags = (
            (ed.FLAG_WEIGHTS.value if has_w else 0)
            | (ed.FLAG_ZERO_PAD.value if do_zero_padding else 0)
            | (ed.FLAG_META.value if write_meta else 0)
        )
        call = ed.EpilogueCall(
            recv_counts_ptr=recv_counts,
            max_tokens=num_max_tokens,
            alignment=expert_alignment,
            num_rows=num_recv,
            num_out_rows=rows,
            out_words_ptr=out.recv_x,
            out_sf_ptr=recv_sf if has_sf else int32_dummy,
            out_sf_token_stride=recv_sf.stride(0) if recv_sf is not None else 0,
            out_sf_group_stride=recv_sf.stride(1) if recv_sf is not None else 0,
            out_ids_ptr=out.recv_topk_idx if out.recv_topk_idx is not None else self.state,
            out_weights_ptr=out.recv_topk_weights if has_w else self._f32,
            out_meta_ptr=out.recv_src_metadata if write_meta else int32_dummy,
            out_slots_ptr=out.reduction_slot if write_meta else int32_dummy,
            psum_rank_ptr=out.psum_num_recv_tokens_per_scaleup_rank if write_meta else int32_dummy,
            psum_expert_ptr=out.psum_num_recv_tokens_per_expert if write_meta else int32_dummy,
            unaligned_ptr=out.num_unaligned_recv_tokens_per_expert if write_meta else int32_dummy,
            flags=flags,
            trace_ptr=self.state,
        )
        self._launch(copy, programs, call, "elastic dispatch epilogue", _COPY_WORDS)

    def _epilogue_plan(self, row_bytes, G, K, E_local, BLOCK_ROWS, do_expand, has_sf):
        """``(TUNING, the copy epilogue's launch)`` for these sizes."""
        R, tuning = self.num_ranks, TUNING
        ROW_WORDS = row_bytes // 4
        variant = ed.EpilogueVariant(
            K=K,
            BLOCK_K=_pow2(max(K, 2)),
            NUM_RANKS=R,
            BLOCK_RANKS=_pow2(max(R, 2)),
            E_LOCAL=E_local,
            BLOCK_LOCAL_EXPERTS=_pow2(max(E_local, 2)),
            # Tiles of 8192 words: a decode block of a row or two copies it in one step (each
            # step waits for its load).
            BLOCK_WORDS=min(_pow2(ROW_WORDS), 8192 // BLOCK_ROWS),
            **record_layout(row_bytes, G, K),
            BLOCK_ROWS=BLOCK_ROWS,
            BLOCK_FILL=128,
            EXPAND=do_expand,
            HAS_SF=has_sf,
            PDL=self._pdl,
            PROFILE=self.trace is not None,
            USE_CLOCK=self.trace is not None and use_clock(self.device),
        )
        options = {"num_warps": tuning.copy_warps, **self._dependent()}
        copy = self._kernel_launch(ed.elastic_dispatch_epilogue, ed.EpilogueCall, variant, options)
        return tuning, copy

    # ---------------------------------------------------------------------------- combine
    def combine(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor, ...],
        recv_src_metadata: torch.Tensor,
        reduction_slot: torch.Tensor,
        psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
        topk_idx: torch.Tensor,
        num_experts: int,
        num_max_tokens: int,
        do_expand: bool,
        multiple_reduction: bool = True,
        num_sms: int = 16,
        before_epilogue=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hand every received token's row back and sum each token's rows in DeepEP V2's order.

        Args:
            x: ``[rows, H]`` BF16: one row per received token (plain), or per expanded row.
            topk_weights: ``[rows, K]`` (plain) or ``[rows]`` (expanded) float32, or None.
            bias: up to two ``[N, H]`` BF16 tensors added first.
            recv_src_metadata, reduction_slot, psum_num_recv_tokens_per_scaleup_rank,
                topk_idx: the dispatch handle's.
            num_experts, num_max_tokens: the dispatch's.
            do_expand: ``x`` is in the expanded layout.
            multiple_reduction: expanded rows are summed here per token before they go back
                (else each goes back alone, and ``topk_weights`` must be None).
            num_sms: programs of the push (the epilogue uses every SM).
            before_epilogue: called before the epilogue is launched (stream waits).
        Returns:
            ``(combined_x [N, H] BF16, combined_topk_weights [N, K] float32 or None)``.
        """
        with _no_torch_function():
            N, K = topk_idx.shape
            H = x.shape[1]
            multi = multiple_reduction or not do_expand
            tokens = recv_src_metadata.shape[0]
            decode = N <= DECODE_TOKENS
            has_w = topk_weights is not None
            if do_expand and multi and TUNING.sum_first_tokens < N:
                # Each token's rows summed on every SM; the push sends the sums as plain rows.
                x, topk_weights = self._sum_expanded(
                    x, topk_weights, recv_src_metadata, psum_num_recv_tokens_per_scaleup_rank, K
                )
                do_expand = False
            blocks = self._combine_blocks(N, H, tokens, decode, do_expand, num_sms)
            channels, rows_block, reduce_channels, tokens_block, _ = blocks
            key = (H, K, num_experts, num_max_tokens, do_expand, multi, *blocks, self.trace)
            plan = self._combine_plans.get(key)
            if plan is None or plan[0] is not TUNING:
                plan = self._combine_plans[key] = self._combine_plan(*key[:-1])
            _, push, reduce = plan
            chunks, reduce_chunks = -(-H // channels), -(-H // reduce_channels)
            push_programs = self._programs(num_sms, -(-tokens // rows_block) * chunks, 1)
            reduce_programs = self._programs(
                self._epilogue_sms(TUNING), -(-N // tokens_block) * reduce_chunks, 1
            )
            call = ec.CombineCall(
                x_ptr=x,
                weights_ptr=topk_weights if has_w else self._f32,
                meta_ptr=recv_src_metadata,
                slots_ptr=reduction_slot,
                psum_rank_ptr=psum_num_recv_tokens_per_scaleup_rank,
                max_tokens=num_max_tokens,
                has_weights=int(has_w),
                trace_ptr=self.state,
            )
            self._launch(push, push_programs, call, "elastic combine")
            if before_epilogue is not None:
                before_epilogue()
            device = self.device
            out = empty_output(device, (N, H), torch.bfloat16)
            out_w = empty_output(device, (N, K), torch.float32) if has_w else None
            terms = tuple(bias) + (out,) * (2 - len(bias))  # unused pointers when fewer
            reduce_call = ec.ReduceCall(
                topk_ptr=topk_idx,
                bias0_ptr=terms[0],
                bias1_ptr=terms[1],
                out_ptr=out,
                out_weights_ptr=out_w if out_w is not None else self._f32,
                num_tokens=N,
                max_tokens=num_max_tokens,
                num_bias=len(bias),
                has_weights=int(has_w),
                trace_ptr=self.state,
            )
            self._launch(reduce, reduce_programs, reduce_call, "elastic combine epilogue")
            return out, out_w

    def _sum_expanded(self, x, weights, meta, psum_rank, K):
        """``(sums [tokens, H] BF16, weights [tokens, K] float32 or None)``: each received
        token's expanded rows ``x`` summed in top-k order on every SM, with its weights (0 for
        choices elsewhere), for a plain push; ``tokens`` as in ``meta``."""
        tokens, H = meta.shape[0], x.shape[1]
        device = self.device
        plan = self._sums_plans.get((H, K, self.trace))
        if plan is None or plan[0] is not TUNING:
            plan = self._sums_plans[H, K, self.trace] = self._sums_plan(H, K)
        _, launch, rows_block, channels = plan
        sums = empty_output(device, (tokens, H), torch.bfloat16)
        sum_weights = (
            empty_output(device, (tokens, K), torch.float32) if weights is not None else None
        )
        call = ec.SumsCall(
            x_ptr=x,
            weights_ptr=weights if weights is not None else self._f32,
            meta_ptr=meta,
            psum_rank_ptr=psum_rank,
            sums_ptr=sums,
            sum_weights_ptr=sum_weights if sum_weights is not None else self._f32,
            has_weights=int(weights is not None),
            trace_ptr=self.state,
        )
        work = -(-tokens // rows_block) * -(-H // channels)
        self._launch(
            launch, self._programs(self.num_device_sms, work, 1), call, "elastic combine sums"
        )
        return sums, sum_weights

    def _sums_plan(self, H, K):
        """``(TUNING, the launch of elastic_combine_sums, its rows and channels per block)``."""
        tuning, device = TUNING, self.device
        widest = _pow2(H) if device.type == "cuda" else 64
        variant = ec.SumsVariant(
            H=H,
            K=K,
            BLOCK_K=_pow2(max(K, 2)),
            NUM_RANKS=self.num_ranks,
            BLOCK_ROWS=tuning.sums_rows,
            BLOCK_CHANNELS=min(widest, tuning.sums_channels),
            USE_CLOCK=use_clock(device),
            PROFILE=self.trace is not None,
        )
        options = {"num_warps": tuning.sums_warps, "enable_fp_fusion": False}
        launch = self._kernel_launch(ec.elastic_combine_sums, ec.SumsCall, variant, options)
        return tuning, launch, variant.BLOCK_ROWS, variant.BLOCK_CHANNELS

    def _combine_blocks(
        self, N, H, tokens, decode, expand, num_sms
    ) -> tuple[int, int, int, int, int]:
        """The tiles of a combine of ``N`` tokens here and ``tokens`` received ones:
        ``(channels and received tokens per block of the push, channels and tokens per block
        of the reduce, warps of the push)``."""
        tuning = TUNING
        # CPU ranks take narrow chunks, so that the tests cross chunk boundaries.
        widest = _pow2(H) if self.device.type == "cuda" else 64
        channels = min(
            widest, tuning.decode_combine_channels if decode else tuning.combine_channels
        )
        # Received tokens: the handle's worst case, planned for as this rank's tokens times the
        # ranks (equal decode batches); only the block size follows the guess.
        rows = min(tokens, self.num_ranks * max(N, 1)) * -(-H // channels)
        most_rows = (
            tuning.decode_combine_rows
            if decode
            else tuning.expanded_combine_rows
            if expand
            else tuning.combine_rows
        )
        reduce_channels = min(widest, tuning.reduce_channels)
        reduce_work = N * -(-H // reduce_channels)
        return (
            channels,
            self._block(most_rows, rows, num_sms),
            reduce_channels,
            self._block(tuning.reduce_tokens, reduce_work, self._epilogue_sms(tuning)),
            tuning.decode_combine_warps if decode else tuning.combine_warps,
        )

    def _combine_plan(
        self,
        H,
        K,
        num_experts,
        num_max_tokens,
        do_expand,
        multi,
        BLOCK_CHANNELS,
        BLOCK_ROWS,
        REDUCE_CHANNELS,
        BLOCK_TOKENS,
        PUSH_WARPS,
    ):
        """``(TUNING, the push's launch, the reduce's launch)`` for combines of these sizes and
        tiles (:meth:`_combine_blocks`); ``ValueError`` for sizes the mode cannot take."""
        R, device, tuning = self.num_ranks, self.device, TUNING
        slots = combine_slots(R, K, do_expand, multi)
        error = self.capacity_error(num_max_tokens, H, K, 0, 0, slots)
        if error:
            raise ValueError(error)
        crec, BLOCK_K = combine_record_bytes(H, K), _pow2(max(K, 2))
        profile = self.trace is not None
        variant = ec.CombineVariant(
            H=H,
            K=K,
            BLOCK_K=BLOCK_K,
            NUM_RANKS=R,
            BLOCK_RANKS=_pow2(max(R, 2)),
            COMBINE_RECORD_BYTES=crec,
            HEADER_WORDS=HEADER_WORDS,
            BLOCK_ROWS=BLOCK_ROWS,
            BLOCK_CHANNELS=BLOCK_CHANNELS,
            EXPAND=do_expand,
            MULTI=multi,
            USE_CLOCK=use_clock(device),
            PDL=self._pdl,
            PROFILE=profile,
        )
        options = {"num_warps": PUSH_WARPS, "enable_fp_fusion": False}
        push = self._kernel_launch(ec.elastic_combine, ec.CombineCall, variant, options)
        reduce_variant = ec.ReduceVariant(
            H=H,
            K=K,
            BLOCK_K=BLOCK_K,
            NUM_EXPERTS=num_experts,
            E_LOCAL=num_experts // R,
            SLOTS=slots,
            RANK_SLOTS=multi,
            COMBINE_RECORD_BYTES=crec,
            BLOCK_TOKENS=BLOCK_TOKENS,
            BLOCK_CHANNELS=REDUCE_CHANNELS,
            USE_CLOCK=use_clock(device),
            PDL=self._pdl,
            PROFILE=profile,
        )
        options = {
            "num_warps": tuning.reduce_warps,
            "enable_fp_fusion": False,
            **self._dependent(),
        }
        reduce = self._kernel_launch(
            ec.elastic_combine_epilogue, ec.ReduceCall, reduce_variant, options
        )
        return tuning, push, reduce

    def destroy(self) -> None:
        """Release the heap (collective); raises if a wait had timed out."""
        self.heap.close_checked(self.check)
