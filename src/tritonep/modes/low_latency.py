"""Low-latency mode: fixed per-expert receive slabs, online FP8, double buffering, no host sync.

Orchestrates :mod:`tritonep.kernels.ll_dispatch` and :mod:`tritonep.kernels.ll_combine` over
one symmetric heap. The heap of every rank holds, for each of two buffer sets (calls alternate
between them):

* dispatch receive slabs ``[E_local][R][max_tokens]`` of fixed-size messages
  (16-byte header, payload, scales), sized for BF16 messages so either format fits; a
  token's payload is stored once per rank, its other messages there being headers that
  refer to it;
* dispatch count flags ``[E_local][R]`` int64 (``call << 32 | count``);
* combine receive rows ``[max_tokens][max_topk][H]`` BF16;

plus ``[R]`` combine counters. Call counters live in a small device tensor, so calls need no
host synchronization (eager calls with ``check_ids`` read the ids' range on the host; capture
skips that read) and a captured CUDA graph can be replayed any number of times.

Across nodes (``gpus_per_node`` smaller than the group), peers on this rank's node are written
as above; for peers on other nodes, messages and rows are first built in a staging region of
this rank's heap (``[E][max_tokens]`` messages, also used for combine rows) and then moved with
NVSHMEM puts on heaps of the NVSHMEM backend, or copied from there where every heap is mapped
(emulated nodes on one host or on CPU ranks): :mod:`tritonep.kernels.transport`.

With ``enable_shrink`` a wait that times out masks its peer instead of raising, and masked
peers are skipped from then on (:mod:`tritonep.kernels.peer_mask`; :attr:`peer_mask`).

Outputs are allocated per call (``torch.empty``: rows past ``recv_count`` are undefined).
At most two dispatches (and two combines) may be in flight at once, and every rank must make
the same sequence of calls, as with DeepEP.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ..heap import allocate
from ..kernels import launcher, ll_combine, ll_dispatch, transport
from ..kernels.profiled import profiled
from ..kernels.sync import (
    DEFAULT_TIMEOUT_S,
    new_status,
    raise_on_timeout,
    timeout_us,
    use_clock,
)
from ..validation import (
    check_hidden,
    check_num_experts,
    check_ranks_agree,
    check_tensor,
    check_topk_idx,
)
from .outputs import empty_output
from .trace import SLOTS, TraceRecorder

MAX_TOPK = 16
#: The kernels as launched: compiled under the names profilers show
#: (``tritonep::low_latency::dispatch()``), by which DeepEP's benchmark finds them.
DISPATCH_KERNEL = profiled(ll_dispatch.ll_dispatch_kernel, "tritonep::low_latency::dispatch")
COMBINE_KERNEL = profiled(ll_combine.ll_combine_kernel, "tritonep::low_latency::combine")
PHASES = {
    ll_dispatch.PHASE_DISPATCH_RECV.value: "low-latency dispatch receive",
    ll_combine.PHASE_COMBINE_RECV.value: "low-latency combine receive",
}


def _align(n: int, a: int = 128) -> int:
    return (n + a - 1) // a * a


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _rows_in_flight(hidden: int, itemsize: int, budget: int = 32768) -> int:
    """Rows a program moves per iteration: about ``budget`` bytes of (padded) payload in
    flight."""
    row_bytes = _next_pow2(hidden // 128) * 128 * itemsize
    return max(1, min(8, budget // row_bytes))


def message_bytes(hidden: int, use_fp8: bool) -> int:
    """One dispatch message: 16-byte header, payload, then float32 scales with FP8."""
    payload = hidden if use_fp8 else 2 * hidden
    scales = hidden // 128 * 4 if use_fp8 else 0
    return _align(ll_dispatch.HEADER_BYTES.value + payload + scales, 16)


def combine_slot_bytes(hidden: int) -> int:
    """One row of the combine receive buffer: ``hidden`` BF16 values, then a float32
    ``(log_amin, step)`` pair per 128 channels for LogFMT combines."""
    return 2 * hidden + _align(hidden // 128 * 8, 16)


class LowLatencyLayout(NamedTuple):
    """Byte offsets of the regions of the heap (buffer set 0; set 1 follows at ``+ *_set``)."""

    recv: int
    recv_set: int
    flags: int
    flags_set: int
    combine: int
    combine_set: int
    done: int
    stage: int
    total: int

    @staticmethod
    def of(
        max_tokens: int,
        hidden: int,
        num_ranks: int,
        num_experts: int,
        max_topk: int,
        num_nodes: int = 1,
    ):
        e_local = num_experts // num_ranks
        recv_set = _align(e_local * num_ranks * max_tokens * message_bytes(hidden, False))
        flags_set = _align(e_local * num_ranks * 8)
        slot = combine_slot_bytes(hidden)
        combine_set = _align(max_tokens * max_topk * slot)
        recv = 0
        flags = recv + 2 * recv_set
        combine = flags + 2 * flags_set
        done = combine + 2 * combine_set
        stage = done + _align(num_ranks * 8)
        # Staging for peers on other nodes: dispatch messages [E][max_tokens], combine slots
        # [E_local * R * max_tokens].
        staging = max(recv_set, _align(e_local * num_ranks * max_tokens * slot))
        total = stage + (staging if num_nodes > 1 else 0)
        return LowLatencyLayout(
            recv, recv_set, flags, flags_set, combine, combine_set, done, stage, total
        )


class LowLatencyHandle(NamedTuple):
    """What combine needs from dispatch (the first five fields are DeepEP's handle).

    Attributes:
        recv_src_info: ``[E_local, R * max_tokens]`` int32 token index on the source rank.
        recv_layout_range: ``[E_local, R]`` int64 ``begin << 32 | count`` per source rank.
        num_max_dispatch_tokens_per_rank: as given to dispatch.
        hidden: hidden size.
        num_experts: experts in total.
        recv_topk_slot: ``[E_local, R * max_tokens]`` int32 top-k column of each row.
        num_tokens, topk: the shape of the dispatch's ``topk_idx``; combine takes ids of
            that shape, whose rows it reads back from the slots of those tokens.
    """

    recv_src_info: torch.Tensor
    recv_layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    recv_topk_slot: torch.Tensor
    num_tokens: int
    topk: int


class LowLatencyMode:
    """Low-latency dispatch and combine for one expert-parallel group.

    Args:
        group: the process group (default: the world); every rank constructs it together.
        num_max_dispatch_tokens_per_rank: most tokens one rank dispatches in a call.
        hidden: hidden size, a multiple of 128.
        num_experts: experts in total, a multiple of the number of ranks.
        max_topk: largest top-k a call may use (1 to 16).
        device: a CUDA device, or ``"cpu"`` for CPU ranks (kernels under the interpreter).
        timeout_s: limit of every wait inside the kernels.
        num_programs: programs per launch (default: up to 128 on GPUs, leaving some SMs
            free; 4 on CPU).
        check_ids: read the top-k ids on the host before each call and raise ``ValueError``
            for ids outside ``[-1, num_experts)``. That read waits for the GPU; without it
            (and always inside CUDA-graph capture) out-of-range ids are ignored by the
            kernels, which never write out of bounds.
        profile: record kernel traces of every launch (``self.trace``); a
            :class:`~tritonep.modes.trace.TraceRecorder` to share one with another mode.
        gpus_per_node: ranks per node (consecutive ranks share a node); None: the whole
            group is one node. Peers on other nodes are reached through staging and puts.
        enable_shrink: shrink mode (:mod:`tritonep.kernels.peer_mask`): a wait that times out
            masks its peer instead of raising, and masked peers (:attr:`peer_mask`) are
            neither sent to nor waited for; their experts' choices are dropped as if their
            ids were ``-1``. Every rank must pass the same value.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        num_max_dispatch_tokens_per_rank: int = 128,
        hidden: int = 7168,
        num_experts: int = 256,
        max_topk: int = MAX_TOPK,
        device: torch.device | str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        num_programs: int | None = None,
        check_ids: bool = True,
        profile: bool | TraceRecorder = False,
        gpus_per_node: int | None = None,
        enable_shrink: bool = False,
    ):
        self.group = group or dist.group.WORLD
        check_ranks_agree(
            self.group, "LowLatencyMode",
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank, hidden=hidden,
            num_experts=num_experts, max_topk=max_topk, num_programs=num_programs,
            device_type=torch.device(device).type if device is not None else None,
            gpus_per_node=gpus_per_node, enable_shrink=enable_shrink,
        )  # fmt: skip
        self.check_ids = check_ids
        self.enable_shrink = bool(enable_shrink)
        self.rank = dist.get_rank(self.group)
        self.num_ranks = dist.get_world_size(self.group)
        self.num_local_experts = check_num_experts(num_experts, self.num_ranks)
        check_hidden("hidden", hidden, 128)
        if not 1 <= max_topk <= MAX_TOPK:
            raise ValueError(f"max_topk: expected 1 to {MAX_TOPK}, got {max_topk}")
        if num_max_dispatch_tokens_per_rank < 1:
            raise ValueError(
                "num_max_dispatch_tokens_per_rank: expected a positive int, "
                f"got {num_max_dispatch_tokens_per_rank}"
            )
        self.max_tokens = num_max_dispatch_tokens_per_rank
        self.hidden, self.num_experts, self.max_topk = hidden, num_experts, max_topk
        self.timeout_s = timeout_s  # also sets the kernels' limit (property below)
        if gpus_per_node is None:
            gpus_per_node = self.num_ranks
        if gpus_per_node < 1 or self.num_ranks % gpus_per_node:
            raise ValueError(
                f"gpus_per_node: expected a divisor of the {self.num_ranks} ranks, "
                f"got {gpus_per_node}"
            )
        self.gpus_per_node = gpus_per_node
        self.num_nodes = self.num_ranks // gpus_per_node
        self.layout = LowLatencyLayout.of(
            self.max_tokens, hidden, self.num_ranks, num_experts, max_topk, self.num_nodes
        )
        self.heap = allocate(self.layout.total, self.group, device)
        self.device = self.heap.device
        #: How peers on other nodes are reached (:mod:`tritonep.kernels.transport`).
        self.transport = transport.PeerTransport(self.heap, self.num_nodes > 1, "gpus_per_node")
        if num_programs is None:
            if self.device.type == "cuda":
                # A few SMs stay free (as DeepEP leaves 4 of 132): a cooperative launch that
                # needs every SM waits on anything else resident. 128 also splits 256 experts
                # evenly.
                sms = torch.cuda.get_device_properties(self.device).multi_processor_count
                num_programs = min(sms - 4, 128, max(num_experts, self.max_tokens))
            else:
                num_programs = 4
        self.num_programs = num_programs
        # Call counters, one per program (every launch has this grid; ll_dispatch.STATE_ROWS).
        self.state = torch.zeros(ll_dispatch.STATE_ROWS * num_programs, dtype=torch.int64,
                                 device=self.device)  # fmt: skip
        self.status = new_status(self.device)
        # Dispatch senders: per-program slot counters and lists, and per-expert counts of
        # stored messages (the completing program zeroes each for the next call).
        # At least 2 bins: the scratch row (3 * bins + TOKEN_WORDS int32) stays even, so its
        # int64 words (the counting tally, the destination list) are 8-byte aligned in every
        # program's row.
        self._bins = _next_pow2(max(num_experts, 2))
        self.scratch = torch.empty(num_programs, 3 * self._bins + ll_dispatch.TOKEN_WORDS.value,
                                   dtype=torch.int32, device=self.device)  # fmt: skip
        self.expert_done = torch.zeros(self._bins, dtype=torch.int32, device=self.device)
        #: Dispatch senders count the batch's ids by atomic adds while (programs with tokens)
        #: x tokens x top-k stays within this, by histograms beyond; 0: always histograms.
        self.count_adds = ll_dispatch.COUNT_ADDS
        #: ``[R]`` int32, 1 where a peer is masked (shrink mode; change it in stream order).
        self.peer_mask = torch.zeros(self.num_ranks, dtype=torch.int32, device=self.device)
        # Per source rank: the verdicts of the last dispatch and combine receive (call
        # tagged), and the combines whose signal was not waited for.
        self._verdicts = tuple(torch.zeros(self.num_ranks, dtype=torch.int64, device=self.device)
                               for _ in range(2))  # fmt: skip
        self._skipped = torch.zeros(self.num_ranks, dtype=torch.int64, device=self.device)
        self._combine_input: torch.Tensor | None = None
        self._metas: dict[tuple, dict] = {}  # launch options per configuration (_run)
        on_gpu = use_clock(self.device)
        #: Kernel traces (``profile=True``): :meth:`TraceRecorder.dump` writes them.
        self.trace = TraceRecorder.of(profile, self.rank, self.device, on_gpu)
        # Readings of untraced launches: only the interpreter's logical clock (the last word)
        # is ever used, by wait statistics.
        self._untraced = torch.zeros(num_programs * SLOTS + 1, dtype=torch.int64,
                                     device=self.device)  # fmt: skip

    @property
    def timeout_s(self) -> float:
        """Limit of every wait inside the kernels, in seconds, at most ``MAX_TIMEOUT_S``. It
        may change between calls and a change compiles nothing (nor does a new batch size,
        but for one token: that dispatch has a variant of its own). With ``enable_shrink``, a
        limit shorter than a peer's first call of a kernel variant (which compiles it:
        seconds) masks a live peer, so warm up every variant (dtype, hook, top-k, one token)
        under a long limit, then shorten it."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._timeout_us = timeout_us(value)
        self._timeout_s = value

    # ------------------------------------------------------------------------------ sizes
    @staticmethod
    def size_hint(
        num_max_dispatch_tokens_per_rank: int,
        hidden: int,
        num_ranks: int,
        num_experts: int,
        max_topk: int = MAX_TOPK,
        num_nodes: int = 1,
    ) -> int:
        """Bytes of symmetric memory each rank needs (an int): ``num_max_dispatch_tokens_per_rank``
        rows per source rank in each expert's slab, rows of ``hidden``, ``num_ranks`` ranks,
        ``num_experts`` experts, top-k up to ``max_topk``, over ``num_nodes`` nodes."""
        return LowLatencyLayout.of(
            num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, max_topk, num_nodes
        ).total

    # ---------------------------------------------------------------------------- helpers
    def _run(self, kernel, name, args: tuple, key, build_meta, return_recv_hook, wait_stats,
             shrink_args: tuple):  # fmt: skip
        """Launch the send and receive phases of ``kernel``; returns the hook or None.

        On GPUs without a hook both phases run in one cooperative launch (receivers spin on
        senders of the same launch, so all programs must be resident). With a hook, or under
        the interpreter (which runs programs one after another), they are two launches.
        ``build_meta()`` gives the constexprs and options, built once per ``key`` (what they
        depend on besides the mode). ``wait_stats`` (``[R]`` int64 or None) accumulates the
        time waited per source rank; ``shrink_args`` are the kernel's shrink-mode tensors. A
        launch that only receives puts nothing, so it is not
        linked with NVSHMEM.
        """
        grid = (self.num_programs,)
        traced = self.trace is not None

        def launch(do_send, do_recv, cooperative=False):
            meta_key = (name, key, do_send, do_recv, cooperative, traced, wait_stats is not None)
            meta = self._metas.get(meta_key)
            if meta is None:
                meta = self._metas[meta_key] = dict(
                    build_meta(), DO_SEND=do_send, DO_RECV=do_recv, PROFILE=traced,
                    WAIT_STATS=wait_stats is not None, VIA=self.transport.via,
                    SHRINK=self.enable_shrink,
                    **(self.transport.options if do_send else {}),
                )  # fmt: skip
                if cooperative:
                    meta["launch_cooperative_grid"] = True
            readings = self._untraced
            if traced:
                readings = self.trace.buffer(name, self.num_programs, do_send, do_recv)
            stats = wait_stats if wait_stats is not None else self.state
            launcher.launch(kernel, grid, (*args, readings, stats, *shrink_args), meta)

        if not return_recv_hook and self.device.type == "cuda":
            launch(True, True, cooperative=True)
            return None
        launch(True, False)

        def receive():
            launch(False, True)

        if return_recv_hook:
            return receive
        receive()
        return None

    def check(self) -> None:
        """Wait for the device and raise :class:`WaitTimeoutError` if a wait gave up (never
        in shrink mode, where the peer is masked instead), or
        :class:`~tritonep.errors.HeapGuardError` if a kernel wrote past the heap's regions."""
        raise_on_timeout(self.status, self.rank, PHASES, "expert {}")
        self.heap.check_guard()

    # --------------------------------------------------------------------------- dispatch
    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        use_fp8: bool = True,
        use_ue8m0: bool = False,
        return_recv_hook: bool = False,
        wait_stats: torch.Tensor | None = None,
        pack_ue8m0: bool = False,
    ):
        """Send each token to each distinct expert of its top-k.

        Args:
            x: ``[N, H]`` BF16, ``N <= num_max_dispatch_tokens_per_rank``.
            topk_idx: ``[N, K]`` int64 global expert ids, ``-1`` for none, ``K <= max_topk``.
            use_fp8: quantize to e4m3 with float32 scales per 128 channels; else send BF16.
            use_ue8m0: round the scales up to powers of two.
            return_recv_hook: only send; the returned hook receives.
            wait_stats: optional ``[R]`` int64; the time this rank's receivers waited for
                each source rank is added to it (ns on GPUs; a slow rank stands out).
            pack_ue8m0: return the (power-of-two) scales packed as UE8M0 exponent bytes,
                four to an int32 (implies ``use_ue8m0``).
        Returns:
            ``(recv_x, recv_count, handle, hook)``: ``recv_x`` is ``[E_local, R * max, H]``
            BF16, or float8_e4m3fn with ``use_fp8`` (then a tuple with the scales: float32
            ``[E_local, R * max, H / 128]``, or with ``pack_ue8m0`` int32
            ``[E_local, R * max, ceil(H / 512)]`` whose byte ``g % 4`` of column ``g // 4`` is
            the biased exponent of group ``g``; rows past ``recv_count[e]`` are undefined, and
            so are the bytes of groups past ``H / 128``),
            ``recv_count`` ``[E_local]`` int32, a :class:`LowLatencyHandle`, and the hook
            (None unless ``return_recv_hook``). The scales are column-major within each
            expert (strides ``(columns * R * max, 1, R * max)``), the layout in which
            TMA-based grouped GEMMs read them (DeepEP's); ``.contiguous()`` gives row-major.
        """
        check_tensor("x", x, dtype=torch.bfloat16, shape=(None, self.hidden), device=self.device)
        num_tokens = x.shape[0]
        if num_tokens > self.max_tokens:
            raise ValueError(
                f"x: {num_tokens} tokens exceed num_max_dispatch_tokens_per_rank={self.max_tokens}"
            )
        check_topk_idx(
            "topk_idx", topk_idx, num_tokens, self.num_experts, self.device, self.check_ids
        )
        topk = topk_idx.shape[1]
        if topk > self.max_topk:
            raise ValueError(f"topk_idx: top-k {topk} exceeds max_topk={self.max_topk}")

        E_local, R, M, H = self.num_local_experts, self.num_ranks, self.max_tokens, self.hidden
        rows = R * M
        recv_x = empty_output(
            self.device, (E_local, rows, H), torch.float8_e4m3fn if use_fp8 else torch.bfloat16
        )
        use_ue8m0 = use_ue8m0 or pack_ue8m0
        recv_scales = scales_out = None
        if use_fp8:  # column-major per expert: allocated [E_local, columns, rows], transposed
            columns = -(-H // 512) if pack_ue8m0 else H // 128
            dtype = torch.int32 if pack_ue8m0 else torch.float32
            scales_out = empty_output(self.device, (E_local, columns, rows), dtype)
            # One column: the same memory either way, and a unit last stride lets callers
            # view it as bytes (torch calls a size-1 dimension contiguous whatever its stride).
            recv_scales = scales_out.transpose(1, 2) if columns > 1 else scales_out.view(
                E_local, rows, 1)  # fmt: skip
            if pack_ue8m0:
                scales_out = scales_out.view(torch.uint8)
        # One allocation for both [E_local, rows] int32 outputs (one allocator call fewer per
        # eager call).
        src_info, topk_slot = empty_output(self.device, (2, E_local, rows), torch.int32).unbind(0)
        recv_count = empty_output(self.device, (E_local,), torch.int32)
        layout_range = empty_output(self.device, (E_local, R), torch.int64)
        # How the senders count the ids: by atomic adds or histograms (ll_dispatch.COUNT_ADDS);
        # from the shapes alone, so a captured graph keeps its choice.
        per_program = -(-num_tokens // self.num_programs)
        senders = -(-num_tokens // per_program) if num_tokens else 1
        by_adds = senders * num_tokens * topk <= self.count_adds

        args = (
            x,
            topk_idx,
            num_tokens,
            self.heap.peer_ptrs,
            self.rank,
            self.layout.recv,
            self.layout.flags,
            self.layout.stage,
            self.gpus_per_node,
            self.transport.pes,
            self.state,
            self.scratch,
            self.expert_done,
            recv_x.view(torch.uint8) if use_fp8 else recv_x,
            scales_out if use_fp8 else recv_count,  # unused pointer without FP8
            src_info,
            topk_slot,
            recv_count,
            layout_range,
            self.status,
            self._timeout_us,
        )
        build_meta = lambda: dict(  # once per key below: _run
            H=H,
            K=topk,
            NUM_EXPERTS=self.num_experts,
            NUM_RANKS=R,
            M=M,
            MSG_BYTES=message_bytes(H, use_fp8),
            RECV_SET_BYTES=self.layout.recv_set,
            FLAG_SET_BYTES=self.layout.flags_set,
            USE_FP8=use_fp8,
            USE_UE8M0=use_ue8m0,
            PACK_UE8M0=pack_ue8m0,
            USE_CLOCK=use_clock(self.device),
            BLOCK_N=min(128, _next_pow2(max(M, 16))),
            COUNT_BY_ADDS=by_adds,
            ONE_TOKEN=num_tokens == 1,
            K_P2=_next_pow2(max(topk, 2)),
            G_P2=_next_pow2(H // 128),
            R_P2=_next_pow2(max(R, 2)),
            BINS=self._bins,
            # Messages copied together on receive: 64 KB of payload in flight, on 16 warps
            # (the pack's loads wait on the headers that locate the payloads).
            MSG_BLOCK=_rows_in_flight(H, 1 if use_fp8 else 2, 65536),
            # A receiving program moves its (expert, source) items together (one wait for
            # their counts, their messages in one list) where the batch is small and all
            # counts come at once; for larger batches, whose counts come spread out, one at
            # a time, so that it packs one while the next one's counts are still on the way
            # (4x H100: 2 together 14.6-14.7 against 15.1-15.5 us at 32 tokens, 26.0-26.9
            # against 24.6-24.7 at 128; BENCHMARKS.md).
            ITEMS=min(4, _next_pow2(-(-self.num_experts // self.num_programs))) if by_adds else 1,
            num_warps=16,
        )
        handle = LowLatencyHandle(
            src_info, layout_range, M, H, self.num_experts, topk_slot, num_tokens, topk
        )
        out_x = (recv_x, recv_scales) if use_fp8 else recv_x
        self._check_wait_stats(wait_stats)
        key = (use_fp8, use_ue8m0, pack_ue8m0, topk, by_adds, num_tokens == 1)
        hook = self._run(DISPATCH_KERNEL, "low-latency dispatch", args, key,
                         build_meta, return_recv_hook, wait_stats,
                         (self.peer_mask, self._verdicts[0]))  # fmt: skip
        return out_x, recv_count, handle, hook

    # ---------------------------------------------------------------------------- combine
    def get_next_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """A ``[E_local, R * max, H]`` BF16 tensor to write expert outputs into (``zero_copy``);
        ``handle`` is accepted (the tensor depends only on the mode's sizes)."""
        shape = (self.num_local_experts, self.num_ranks * self.max_tokens, self.hidden)
        if self._combine_input is None or self._combine_input.shape != shape:
            self._combine_input = torch.empty(shape, dtype=torch.bfloat16, device=self.device)
        return self._combine_input

    def combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        zero_copy: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        wait_stats: torch.Tensor | None = None,
        use_logfmt: bool = False,
    ):
        """Bring expert outputs back and reduce them with the routing weights.

        Args:
            x: ``[E_local, R * max, H]`` BF16 expert outputs, rows as dispatch packed them.
            topk_idx: ``[N, K]`` int64, the ids given to dispatch.
            topk_weights: ``[N, K]`` float32.
            handle: from :meth:`dispatch`.
            zero_copy: ``x`` is the tensor from :meth:`get_next_combine_buffer`. Rows go to
                their peers straight from wherever ``x`` lives, so both paths are the same.
            return_recv_hook: only send; the returned hook reduces.
            out: optional ``[N, H]`` BF16 output.
            wait_stats: optional ``[R]`` int64, as in :meth:`dispatch`.
            use_logfmt: rows travel as LogFMT-10 (:mod:`tritonep.reference.logfmt`): each
                128-channel group whose magnitudes are all below 1 in 10 bits a channel
                (relative error at most 2.2%, typically 0.3%), other groups unchanged.
                About 35% fewer bytes cross the links, but encoding costs more time than
                that saves on NVLink today (BENCHMARKS.md); results are not bit-exact.
        Returns:
            ``(combined [N, H] BF16, hook)``; the hook is None unless ``return_recv_hook``.
        """
        E_local, R, M, H = self.num_local_experts, self.num_ranks, self.max_tokens, self.hidden
        if handle.num_max_dispatch_tokens_per_rank != M or handle.hidden != H:
            raise ValueError("handle: it comes from a dispatch with other sizes")
        check_tensor("x", x, dtype=torch.bfloat16, shape=(E_local, R * M, H), device=self.device)
        check_topk_idx("topk_idx", topk_idx, None, self.num_experts, self.device, self.check_ids)
        # Token t's rows come back to slots [t][k] of this rank's receive set: ids of another
        # shape would read slots this call never filled, or past the set.
        num_tokens, topk = handle.num_tokens, handle.topk
        if tuple(topk_idx.shape) != (num_tokens, topk):
            raise ValueError(
                f"topk_idx: shape {list(topk_idx.shape)} differs from that of the dispatch "
                f"whose handle this is, [{num_tokens}, {topk}]"
            )
        check_tensor(
            "topk_weights",
            topk_weights,
            dtype=torch.float32,
            shape=(num_tokens, topk),
            device=self.device,
        )
        if out is None:
            out = empty_output(self.device, (num_tokens, H), torch.bfloat16)
        else:
            check_tensor(
                "out", out, dtype=torch.bfloat16, shape=(num_tokens, H), device=self.device
            )

        args = (
            x,
            handle.recv_src_info,
            handle.recv_topk_slot,
            handle.recv_layout_range,
            topk_idx,
            topk_weights,
            num_tokens,
            out,
            self.heap.peer_ptrs,
            self.rank,
            self.layout.combine,
            self.layout.done,
            self.layout.stage,
            self.gpus_per_node,
            self.transport.pes,
            self.state,
            self.status,
            self._timeout_us,
        )
        build_meta = lambda: dict(  # once per (top-k, LogFMT): _run
            H=H,
            K=topk,
            K_MAX=self.max_topk,
            NUM_EXPERTS=self.num_experts,
            NUM_RANKS=R,
            M=M,
            RECV_SET_BYTES=self.layout.combine_set,
            SLOT_BYTES=combine_slot_bytes(H),
            LOGFMT=bool(use_logfmt),
            USE_CLOCK=use_clock(self.device),
            G_P2=_next_pow2(H // 128),
            R_P2=_next_pow2(max(R, 2)),
            # 16 warps: a BF16 sender keeps 64 KB in flight, the reduce takes whole rows
            # (BENCHMARKS.md, "Low-latency combine on 16 warps"). LogFMT encodes ROW_BLOCK
            # rows x LOGFMT_GROUPS groups at a time: whole rows, 32 KB of BF16 a step (its
            # sender is bound by instructions; few, large steps hide the load latency).
            ROW_BLOCK=_rows_in_flight(H, 2, 32768 if use_logfmt else 65536),
            # A token's top-k rows reduced together: K x REDUCE_BW BF16 values are at most
            # 64 registers a thread (LogFMT: 4096 channels, the fastest measured).
            REDUCE_BW=min(_next_pow2(H), 65536 // _next_pow2(topk), 4096 if use_logfmt else 8192),
            LOGFMT_GROUPS=min(_next_pow2(H // 128), 64),
            num_warps=16,
            # No fused multiply-add: products round as in the reference, so the sum is
            # bit-exact with it.
            enable_fp_fusion=False,
        )
        self._check_wait_stats(wait_stats)
        hook = self._run(COMBINE_KERNEL, "low-latency combine", args,
                         (topk, bool(use_logfmt)), build_meta, return_recv_hook, wait_stats,
                         (self.peer_mask, self._verdicts[1], self._skipped))  # fmt: skip
        return out, hook

    def _check_wait_stats(self, wait_stats: torch.Tensor | None) -> None:
        if wait_stats is not None:
            check_tensor("wait_stats", wait_stats, dtype=torch.int64, shape=(self.num_ranks,),
                         device=self.device)  # fmt: skip

    def destroy(self) -> None:
        """Release the heap (collective: every rank calls it); raises if a wait had timed out
        (with the release's own failure, if a peer never arrived, as its cause)."""
        self.heap.close_checked(self.check)
