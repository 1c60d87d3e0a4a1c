"""Normal (high-throughput) mode within one node: notify, then channel-ring dispatch and combine.

Orchestrates :mod:`tritonep.kernels.normal_notify`, :mod:`~tritonep.kernels.normal_dispatch`
and :mod:`~tritonep.kernels.normal_combine` over one symmetric heap, which holds per rank:

* notify rows ``[2 sets][R sources][C + E_local]`` int32 (counts as ``-n - 1``);
* dispatch rings ``[C channels][R sources][ring][slot]`` with tails ``[C][R]`` int64 here
  and heads ``[C][R]`` int64 on the sender;
* combine rings ``[C][R expert ranks][ring][slot]`` with their tails and heads.

A dispatch runs notify (one small launch) unless a handle is given (cached mode), then the
dispatch launch (``C`` senders and ``C`` receivers, ``2 C`` programs: the SM budget). Output
sizes come two ways:

* exact (``num_worst_tokens=0``): the host reads the received count after notify (one
  device-to-host copy and wait, the only host synchronization of the mode);
* worst case (``num_worst_tokens > 0``): outputs have that many rows, the rows past the
  received ones carry top-k ids ``-1``; no wait for the count, so a CUDA graph can capture
  dispatch and combine and replay them with new inputs of the same shapes (eager calls with
  ``check_ids`` still read the ids' range on the host; capture skips that read).

Call counters live on the device (graph-safe). Every rank must make the same sequence of
calls. Under the Triton interpreter (CPU ranks) programs of a launch run one after another, so
there a channel's tokens must fit one ring (checked before launch).

With ``staged=True`` (the network leg of :class:`~tritonep.modes.internode.InternodeMode`)
nothing is stored into a peer directly: counts and rows are built in this rank's heap (a notify
row and a mirror ring per destination) and moved with the tails and heads by
:mod:`tritonep.kernels.transport`, NVSHMEM puts on NVSHMEM heaps, copies elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton

from ..heap import allocate, default_device
from ..kernels import launcher, normal_combine, normal_dispatch, normal_notify, transport
from ..kernels.layout import dispatch_layout
from ..kernels.sync import (
    DEFAULT_TIMEOUT_S,
    STATUS_OVERFLOW,
    STATUS_WORDS,
    check_status,
    new_status,
    timeout_us,
    use_clock,
)
from ..validation import (
    check_dispatch_x,
    check_num_experts,
    check_ranks_agree,
    check_tensor,
    check_topk_idx,
    check_topk_weights,
)
from .outputs import empty_output
from .trace import TraceRecorder

PHASES = {
    normal_notify.PHASE_NOTIFY.value: "notify",
    normal_dispatch.PHASE_DISPATCH_SEND.value: "dispatch send",
    normal_dispatch.PHASE_DISPATCH_RECV.value: "dispatch receive",
    normal_combine.PHASE_COMBINE_SEND.value: "combine send",
    normal_combine.PHASE_COMBINE_RECV.value: "combine receive",
    normal_dispatch.PHASE_DISPATCH_RELAY.value: "dispatch relay (rows from the network leg)",
    normal_combine.PHASE_COMBINE_RELAY.value: "combine relay (sums from the NVLink leg)",
}

#: SM budget of a call by default on GPUs (DeepEP's default is 20-24).
DEFAULT_NUM_SMS = 24

# Launch shape, measured on 2x H200 (BENCHMARKS.md). 16 warps with small tiles beat 8 warps
# with large ones (more warps hide more memory latency; larger tiles only cost registers), and
# a receiver that moves 32 rows per step, over all its sources, spends fewer of its steps on
# flag traffic than one that moves 16.
#: Rows a receiver moves per step, over all its source rings.
STEP_ROWS = 32
#: Words (4 bytes) of payload a dispatch sender holds per 16 warps, over its tokens of a step;
#: with it the send chunk is bounded (tokens per step at most ``SEND_TILE // SEND_BW``).
#: A step has a fixed cost whatever its size (the release of its tails, barriers, slot
#: arithmetic: about 1.5 us on one H100), so steps of 16 tokens dispatch 4096 tokens 16% faster
#: than steps of 8 there (BENCHMARKS.md).
SEND_TILE = 8192
#: Words per row a dispatch sender moves per tile (rows narrower than 512 words were slower).
SEND_BW = 512
#: Words of payload a dispatch receiver holds per step, over its ``STEP_ROWS`` rows (its own
#: lane's rows from the input included). 16 384 was slower on 2 H100s (BENCHMARKS.md).
RECV_TILE = 8192
#: Warps of a dispatch program on up to 4 ranks (half that on more: their registers are full).
#: 32 was slower on 2 H100s, with either receiver tile (BENCHMARKS.md).
DISPATCH_WARPS = 16
#: Words a combine program moves per row and step, and its warps. 16 warps with the receiver
#: tile below combined 4096 tokens on 2 H100s in 252 us, 8 warps (half the tile) in 370 us
#: (BENCHMARKS.md): a receiver's step is one round of loads, so its speed follows the bytes in
#: flight per SM, which 16 warps double at the same registers per thread.
COMBINE_BW = 512
COMBINE_WARPS = 16
#: Words a combine sender holds per step, over its ``R_P2`` rank lanes x ``ROWS`` rows. On 2x
#: H200 this shape (16 384 words, 512 per row, 8 warps) combines 4096 tokens in 343 us, a
#: narrower one (8192, 256, 16 warps) in 428 us. The bound matters: rows once came from the
#: rank count rounded up (1 for one rank) while the lanes were at least 2, so one rank held
#: 32 768 words and took 2660 us (BENCHMARKS.md). On 16 warps, 8192 words (fewer spilled
#: registers) was 7% slower on 2 H100s.
COMBINE_SEND_TILE = 16384
#: BF16 values a combine receiver loads per step, over its rank lanes (``[R_P2, tokens,
#: 2 * COMBINE_BW]``): its tokens per step are this over the lanes and the row chunk (16 on 2
#: ranks, 8 on 4, 4 on 8), so that its registers, and its bytes in flight, do not grow with
#: the rank count; at most the send chunk.
COMBINE_RECV_TILE = 32768
#: Sender steps (dispatch and combine) per release of the tails. A release at system scope
#: waits until every store before it has reached the peers. Rows held back are announced
#: before any wait for ring space. Timed on 2 H100s (BENCHMARKS.md): releasing every 2 or 4
#: steps helped dispatch while its senders set the pace and made combine 2-7% slower; with
#: own rows copied by the dispatch receivers, every 4 steps made both slower. So 1.
SEND_RELEASE_STEPS = 1
#: The launch constants above: what :func:`set_launch_constants` (and ``tritonep bench
#: --launch``) may change, to compare launch shapes on a GPU without editing the code.
LAUNCH_CONSTANTS = (
    "STEP_ROWS", "SEND_TILE", "SEND_BW", "RECV_TILE", "COMBINE_BW", "COMBINE_WARPS",
    "COMBINE_SEND_TILE", "COMBINE_RECV_TILE", "SEND_RELEASE_STEPS", "DISPATCH_WARPS",
)  # fmt: skip


_launch_version = 0


def check_launch_constants(values: dict[str, int]) -> None:
    """Raise ``ValueError`` naming the first of ``values`` that is not a launch constant or not
    a power of two (rows, words and warps of a Triton launch; warps at most 32)."""
    for name, value in values.items():
        if name not in LAUNCH_CONSTANTS:
            known = ", ".join(LAUNCH_CONSTANTS)
            raise ValueError(f"{name}: not a launch constant (one of {known})")
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"{name}: expected a power of two, got {value!r}")
        if name in ("COMBINE_WARPS", "DISPATCH_WARPS") and not 4 <= value <= 32:
            raise ValueError(f"{name}: expected 4, 8, 16 or 32, got {value}")


def set_launch_constants(**values: int) -> dict[str, int]:
    """Change launch constants of this process's normal (and internode) modes from the next
    launch on; returns their previous values. Results do not depend on them, only speed does."""
    global _launch_version
    check_launch_constants(values)
    old = {name: globals()[name] for name in values}
    globals().update(values)
    _launch_version += 1  # modes build their launch options anew
    return old


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _step_tokens(config: Config, tile_tokens: int) -> int:
    """Tokens a sender (or combine receiver) moves per step: the send chunk rounded up to a
    power of two, at most ``tile_tokens`` (what a step's tile holds) and at most the ring, so
    that a step never waits for slots that only its own later rows would free."""
    ring = config.nvl_recv_buffer_tokens
    chunk = _next_pow2(max(1, min(config.nvl_send_chunk, 32)))
    return max(1, min(chunk, tile_tokens, 1 << (ring.bit_length() - 1)))


@dataclass(frozen=True)
class Config:
    """Per-call tuning, as DeepEP's ``Config``.

    Attributes:
        num_sms: programs of a dispatch or combine launch, half senders and half receivers;
            channels = ``num_sms // 2``.
        nvl_send_chunk: tokens a sender moves per step, between two releases of its tails
            (rounded up to a power of two; fewer where a step's tile would not fit in
            registers, ``SEND_TILE`` and ``COMBINE_RECV_TILE``, or in a ring).
        nvl_recv_buffer_tokens: slots per ring (at most what the buffer was built with).
        rdma_send_chunk, rdma_recv_buffer_tokens: the same for the network leg of the
            internode mode (DeepEP's last two fields; unused within a node).
    """

    num_sms: int = DEFAULT_NUM_SMS
    nvl_send_chunk: int = 16
    nvl_recv_buffer_tokens: int = 128
    rdma_send_chunk: int = 8
    rdma_recv_buffer_tokens: int = 128

    @property
    def num_channels(self) -> int:
        """Channels of a call: ``num_sms // 2`` (a sender and a receiver program each)."""
        return self.num_sms // 2

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the dispatch and combine rings of one rank for rows of ``hidden_bytes``
        (row metadata, top-k ids and counters aside) in a group of ``num_ranks``."""
        rings = self.num_channels * num_ranks * self.nvl_recv_buffer_tokens
        return 2 * rings * _align(hidden_bytes, 16)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of network buffers: 0 within a node (``hidden_bytes`` and ``num_ranks`` are
        accepted for DeepEP's signature)."""
        return 0


@dataclass(frozen=True)
class NormalLayout:
    """Byte offsets of the heap regions and the fixed sizes they were built for."""

    notify: int
    notify_set: int
    notify_row: int  # int32 words
    dispatch_ring: int
    dispatch_tail: int
    dispatch_head: int
    dispatch_slot: int  # bytes
    combine_ring: int
    combine_tail: int
    combine_head: int
    combine_slot: int
    ring_tokens: int
    max_channels: int
    stage_notify: int  # staged notify rows [R destination][ROW] (staged transport)
    stage_rings: int  # mirror rings [C][R destination][ring][slot] (staged transport)
    total: int

    @staticmethod
    def of(hidden, num_ranks, num_local_experts, max_topk, max_channels, ring_tokens, staged=False,
           notify_extra=0):  # fmt: skip
        groups = -(-hidden // 128)  # a float32 scale per 128 channels, the last group partial
        record = _align(1 + 2 * max_topk, 4)
        dispatch_slot = 4 * (_align(hidden // 2 + groups, 4) + record)
        combine_slot = _align(2 * hidden + 4 * max_topk, 16)
        notify_row = _align(max_channels + num_local_experts + notify_extra, 4)
        notify_set = _align(num_ranks * notify_row * 4, 128)
        flags = _align(max_channels * num_ranks * 8, 128)
        offset = 0

        def take(nbytes):
            nonlocal offset
            at, offset = offset, offset + _align(nbytes, 128)
            return at

        notify = take(2 * notify_set)
        rings = max_channels * num_ranks * ring_tokens
        d_ring, d_tail, d_head = take(rings * dispatch_slot), take(flags), take(flags)
        c_ring, c_tail, c_head = take(rings * combine_slot), take(flags), take(flags)
        # Staged transport: what goes to peers is built here first (dispatch and combine
        # take turns on the mirror rings).
        stage_notify = take(num_ranks * notify_row * 4 if staged else 0)
        stage_rings = take(rings * max(dispatch_slot, combine_slot) if staged else 0)
        return NormalLayout(
            notify, notify_set, notify_row, d_ring, d_tail, d_head, dispatch_slot,
            c_ring, c_tail, c_head, combine_slot, ring_tokens, max_channels, stage_notify,
            stage_rings, offset,
        )  # fmt: skip


@dataclass
class NormalHandle:
    """What combine (and a cached dispatch) needs from a dispatch.

    Attributes:
        is_token_in_rank: ``[N, R]`` bool, where this rank's tokens went.
        recv_count: ``[R, C]`` int32, tokens each (source rank, channel) sent here.
        recv_start: ``[R, C]`` int32, the first received row of each (source rank, channel).
        host_info: ``[1 + E_local]`` int32 on the device: rows received, then tokens per local
            expert (aligned).
        recv_src_idx: ``[M]`` int32, each received row's token index on its source rank
            (``-1`` in padding rows).
        num_recv_tokens: rows received (exact mode), or ``-1`` (worst-case mode: read
            ``host_info[0]`` on the device).
        num_rows: rows of the outputs (``M``).
        num_tokens: ``N``, this rank's tokens.
        hidden: hidden size.
        num_experts: experts in total.
        config: the call's :class:`Config` (combine uses the same channels).
        num_recv_tokens_per_expert: set only on a handle from :meth:`NormalMode.notify`; None
            on the handles that :meth:`NormalMode.dispatch` returns (their counts are in the
            :class:`NormalDispatchOutput`).
        extra: ``[R, X]`` int32, the extra words each source's notify row carried, or None.
        bounds: ``[C + 1]`` int32, the first token of each channel when channels are given
            ranges (a relay's), else None (``C`` equal splits of the tokens).
        ranks_from_ids: whether the next dispatch with this handle computes
            ``is_token_in_rank`` from the ids it moves (a handle from :meth:`NormalMode.notify`
            with ``send_counts``).
    """

    is_token_in_rank: torch.Tensor
    recv_count: torch.Tensor
    recv_start: torch.Tensor
    host_info: torch.Tensor
    recv_src_idx: torch.Tensor
    num_recv_tokens: int
    num_rows: int
    num_tokens: int
    hidden: int
    num_experts: int
    config: Config
    num_recv_tokens_per_expert: list[int] | torch.Tensor | None = None
    extra: torch.Tensor | None = None
    bounds: torch.Tensor | None = None
    ranks_from_ids: bool = False


@dataclass
class Relay:
    """Per-row flags between two launches on this GPU: one writes rows, the other reads them
    as they come (the two legs of :class:`~tritonep.modes.internode.InternodeMode`).

    Attributes:
        flags: ``[rows]`` int32, one flag per row of the relayed tensor.
        publish_to: set by the writing side: a one-element int64 view of the reading launch's
            call counter; each written row's flag becomes its value + 1.
        await_rows: set by the reading side: wait for each row's flag (its own call + 1).
        limit: with ``await_rows`` in combine, ``[C + 1]`` int32 whose last value is the
            number of rows the writing side will flag (the rest are not awaited).
    """

    flags: torch.Tensor
    publish_to: torch.Tensor | None = None
    await_rows: bool = False
    limit: torch.Tensor | None = None


@dataclass
class NormalDispatchOutput:
    """What :meth:`NormalMode.dispatch` returns (DeepEP's tuple, less the event).

    Attributes:
        recv_x: ``[M, H]`` BF16, or ``(e4m3 [M, H], scales [M, S])`` in the scales' dtype.
        recv_topk_idx: ``[M, K]`` int64 local expert ids (``-1`` elsewhere and in padding
            rows), or None in cached mode.
        recv_topk_weights: ``[M, K]`` float32 (0 where the id is ``-1``), or None.
        num_recv_tokens_per_expert: tokens per local expert rounded up to the alignment: a
            list of int in exact mode, an ``[E_local]`` int32 device tensor in worst-case
            mode (no host read), None in cached mode.
        handle: for :meth:`NormalMode.combine` and cached dispatches.
    """

    recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    num_recv_tokens_per_expert: list[int] | torch.Tensor | None
    handle: NormalHandle


class NormalMode:
    """Normal-mode dispatch and combine for one expert-parallel group within a node.

    Args:
        group: the process group (default: the world); every rank constructs it together.
        hidden: hidden size; a multiple of 8 (BF16 rows of a multiple of 16 bytes), and of 16
            for FP8 inputs (e.g. 2880, whose last group of 128 channels holds 64).
        num_experts: experts in total, a multiple of the number of ranks.
        max_topk: largest top-k a call may use.
        device: a CUDA device, or ``"cpu"`` for CPU ranks (kernels under the interpreter).
        max_sms: the largest SM budget a call may use (sizes the rings).
        ring_tokens: slots per ring (the largest ``Config.nvl_recv_buffer_tokens``).
        timeout_s: limit of every wait inside the kernels (idle time, for the rings).
        check_ids: read the top-k ids on the host and reject ids outside ``[-1, E)``.
        profile: record kernel traces of every launch (``self.trace``); a
            :class:`~tritonep.modes.trace.TraceRecorder` to share one with another mode.
        label: what traces call this mode's kernels (``"{label} dispatch"``, ...); errors of a
            mode labelled other than ``"normal"`` name the label in the phase (``"rail
            dispatch send"``).
        staged: reach every peer through staging in this rank's heap and puts
            (:mod:`tritonep.kernels.transport`: NVSHMEM puts on NVSHMEM heaps, else copies),
            as a group whose peers are on other nodes needs; default: stores into peers.
        notify_extra: int32 words a notify row may carry besides the counts
            (:meth:`notify`'s ``extra``).
        rank_names: the number by which errors name each rank of ``group`` (default: its rank
            in ``group``); a leg of a larger mode passes the ranks' numbers in the group its
            caller knows.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        hidden: int = 7168,
        num_experts: int = 256,
        max_topk: int = 16,
        device: torch.device | str | None = None,
        max_sms: int | None = None,
        ring_tokens: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        check_ids: bool = True,
        profile: bool | TraceRecorder = False,
        label: str = "normal",
        staged: bool = False,
        notify_extra: int = 0,
        rank_names: list[int] | None = None,
    ):
        self.group = group or dist.group.WORLD
        self.label = label
        check_ranks_agree(
            self.group, "NormalMode", hidden=hidden, num_experts=num_experts, max_topk=max_topk,
            max_sms=max_sms, ring_tokens=ring_tokens, staged=staged, notify_extra=notify_extra,
            device_type=torch.device(device).type if device is not None else None,
        )  # fmt: skip
        self.rank = dist.get_rank(self.group)
        self.num_ranks = dist.get_world_size(self.group)
        self._rank_names = list(rank_names or range(self.num_ranks))
        if len(self._rank_names) != self.num_ranks:
            raise ValueError(f"rank_names: expected {self.num_ranks} names, got {rank_names}")
        prefix = "" if label == "normal" else f"{label} "
        self._phases = {code: prefix + name for code, name in PHASES.items()}
        self.num_local_experts = check_num_experts(num_experts, self.num_ranks)
        if hidden <= 0 or hidden % 8 != 0:
            raise ValueError(f"hidden: expected a positive multiple of 8, got {hidden}")
        if not 1 <= max_topk <= 64:
            raise ValueError(f"max_topk: expected 1 to 64, got {max_topk}")
        self.hidden, self.num_experts, self.max_topk = hidden, num_experts, max_topk
        self.timeout_s, self.check_ids = timeout_s, check_ids  # timeout_s: also the kernels'
        device = torch.device(device) if device is not None else default_device(self.group)
        on_gpu = device.type == "cuda"
        if max_sms is None:
            max_sms = 32 if on_gpu else 4
        if ring_tokens is None:
            ring_tokens = 128 if on_gpu else 64
        if max_sms < 2 or ring_tokens < 1:
            raise ValueError(f"max_sms, ring_tokens: expected >= 2 and >= 1, got {max_sms}, "
                             f"{ring_tokens}")  # fmt: skip
        self.default_config = Config(
            num_sms=min(DEFAULT_NUM_SMS, max_sms) if on_gpu else max_sms,
            nvl_recv_buffer_tokens=ring_tokens,
        )
        self.layout = NormalLayout.of(
            hidden, self.num_ranks, self.num_local_experts, max_topk, max_sms // 2, ring_tokens,
            staged, notify_extra,
        )  # fmt: skip
        self.notify_extra = notify_extra
        self.heap = allocate(self.layout.total, self.group, device)
        self.device = self.heap.device
        #: How peers are reached (:mod:`tritonep.kernels.transport`).
        self.transport = transport.PeerTransport(self.heap, staged, "staged")
        self.state = torch.zeros(8, dtype=torch.int64, device=self.device)
        self.status = new_status(self.device)
        self._decoded = torch.empty(
            self.num_ranks, self.num_local_experts, dtype=torch.int32, device=self.device
        )
        self._layout_arrivals = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._metas: dict[tuple, dict] = {}  # launch options per configuration (_launch)
        #: Kernel traces (``profile=True``): :meth:`TraceRecorder.dump` writes them.
        self.trace = TraceRecorder.of(profile, self.rank, self.device, on_gpu)

    # ---------------------------------------------------------------------------- helpers
    def _config(self, config: Config | None) -> Config:
        config = config or self.default_config
        channels = config.num_channels
        if not 1 <= channels <= self.layout.max_channels:
            raise ValueError(
                f"config: num_sms must lie in [2, {2 * self.layout.max_channels}] for this "
                f"buffer, got {config.num_sms}"
            )
        if not 1 <= config.nvl_recv_buffer_tokens <= self.layout.ring_tokens:
            raise ValueError(
                f"config: nvl_recv_buffer_tokens must lie in [1, {self.layout.ring_tokens}], "
                f"got {config.nvl_recv_buffer_tokens}"
            )
        if self.device.type == "cuda":
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            if 2 * channels > sms:
                raise ValueError(f"config: num_sms={config.num_sms} exceeds the {sms} SMs")
        return config

    def _check_fits_interpreter(self, config: Config, what: str, num_tokens: int,
                                bounds: torch.Tensor | None = None) -> None:  # fmt: skip
        """On CPU ranks every channel's tokens must fit its ring: the interpreter runs programs
        one by one. Channels are equal splits of ``num_tokens``, or the ranges ``bounds``."""
        if self.device.type == "cuda":
            return
        if bounds is None:
            widest = triton.cdiv(num_tokens, config.num_channels)
        else:
            widest = int((bounds[1:] - bounds[:-1]).max()) if bounds.numel() > 1 else 0
        if widest > config.nvl_recv_buffer_tokens:
            raise ValueError(
                f"{what}: a channel of {widest} tokens exceeds the ring of "
                f"{config.nvl_recv_buffer_tokens} slots; on CPU ranks a channel must fit its "
                "ring (the interpreter runs programs one by one)"
            )

    def _launch(self, kernel, name, num_programs, args, key, build_meta):
        """Launch ``kernel`` with ``args`` and the constexprs and options ``build_meta()``
        returns, built once per ``key`` (everything they depend on besides the mode): one
        dict per configuration, which also lets the launcher skip re-reading it."""
        traced = self.trace is not None
        meta = self._metas.get((name, key, traced, _launch_version))
        if meta is None:
            meta = build_meta()
            if self.device.type == "cuda":
                meta["launch_cooperative_grid"] = True
            meta.update(PROFILE=traced, VIA=self.transport.via, **self.transport.options)
            self._metas[(name, key, traced, _launch_version)] = meta
        readings = self.state  # placeholder pointer when nothing is recorded
        if traced:
            readings = self.trace.buffer(name, num_programs, True, True)
        launcher.launch(kernel, (num_programs,), (*args, readings), meta)

    @property
    def timeout_s(self) -> float:
        """Limit of every wait inside the kernels, in seconds (idle time, for the rings), at
        most ``MAX_TIMEOUT_S``; it may change between calls, and a change compiles nothing."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._timeout_us = timeout_us(value)
        self._timeout_s = value

    def check(self) -> None:
        """Wait for the device; raise if a kernel wait timed out or worst-case rows overflowed
        (:class:`~tritonep.kernels.sync.WaitTimeoutError`, ``ValueError``), or a kernel wrote
        past the heap's regions (:class:`~tritonep.errors.HeapGuardError`)."""
        self._check_status(self.status.tolist())
        self.heap.check_guard()

    def _check_status(self, words: list[int]) -> None:
        """:func:`check_status` of this mode's status words, its ranks named as the caller
        knows them. An overflow is raised once and then cleared: the receivers drained their
        rings, so the mode and its peers still agree and the next call may size its outputs
        better. A timeout stays (:mod:`tritonep.kernels.sync`)."""
        code, peer, *rest = words
        if peer >= 0:
            peer = self._rank_names[peer]
        if code == STATUS_OVERFLOW.value:
            self.status.zero_()  # in stream order: after the launches whose status was read
        check_status([code, peer, *rest], self._rank_names[self.rank], self._phases,
                     "channel {}")  # fmt: skip

    def get_dispatch_layout(self, topk_idx: torch.Tensor):
        """Routing statistics of ``topk_idx`` (``[N, K]`` int64 global expert ids, ``-1`` for
        none), from one kernel: ``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E]
        int32, is_token_in_rank [N, R] bool)``."""
        check_topk_idx("topk_idx", topk_idx, None, self.num_experts, self.device, self.check_ids)
        return dispatch_layout(topk_idx, self.num_experts, self.num_ranks, self._layout_arrivals)

    def notify(
        self,
        is_token_in_rank: torch.Tensor | None,
        num_tokens_per_expert: torch.Tensor,
        num_tokens: int,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        send_counts: torch.Tensor | None = None,
        bounds: torch.Tensor | None = None,
        extra: torch.Tensor | None = None,
        channel_major: bool = False,
    ) -> NormalHandle:
        """The count exchange alone: a handle with which :meth:`dispatch` then moves the
        tokens (given their ids: ``dispatch(x, topk_idx, ..., handle=handle)``).

        Args:
            is_token_in_rank: ``[N, R]`` bool, or None with ``send_counts``.
            num_tokens_per_expert: ``[E]`` int32, top-k entries per expert of this group.
            num_tokens: ``N``.
            expert_alignment, num_worst_tokens, config: as for :meth:`dispatch`.
            send_counts: ``[R, C]`` int32 tokens each channel will send to each rank, given
                instead of ``is_token_in_rank`` by a relay that learns its rows later; the
                next dispatch computes ``is_token_in_rank`` from the ids it moves.
            bounds: ``[C + 1]`` int32 first token of each channel, with ``send_counts``: the
                next dispatch's channels are these ranges instead of equal splits.
            extra: ``[R, X]`` int32 (``X <= notify_extra``) sent to each rank with the counts;
                the handle's ``extra`` holds what each source sent here.
            channel_major: order received rows by channel, then source (each channel's rows
                one range), instead of by source, then channel.
        Returns:
            a :class:`NormalHandle` (exact mode: after one host read of the received count).
        """
        config = self._config(config)
        R, E_local, C = self.num_ranks, self.num_local_experts, config.num_channels
        if send_counts is not None:
            check_tensor("send_counts", send_counts, dtype=torch.int32, shape=(R, C),
                         device=self.device)  # fmt: skip
            in_rank = torch.zeros(num_tokens, R, dtype=torch.bool, device=self.device)
            counted = send_counts
        else:
            in_rank = is_token_in_rank
            counted = in_rank.view(torch.int8)
        if bounds is not None:
            check_tensor("bounds", bounds, dtype=torch.int32, shape=(C + 1,), device=self.device)
        self._check_fits_interpreter(config, "x", num_tokens, bounds)
        X = 0
        if extra is not None:
            X = extra.shape[1]
            if not 1 <= X <= self.notify_extra:
                raise ValueError(
                    f"extra: expected 1 to {self.notify_extra} words per rank, got {X}"
                )
            check_tensor("extra", extra, dtype=torch.int32, shape=(R, X), device=self.device)
        recv_count = torch.empty(R, C, dtype=torch.int32, device=self.device)
        recv_start = torch.empty(R, C, dtype=torch.int32, device=self.device)
        host_info = torch.empty(1 + E_local, dtype=torch.int32, device=self.device)
        extra_out = torch.empty(R, X, dtype=torch.int32, device=self.device) if X else None
        self._launch(
            normal_notify.notify_kernel,
            f"{self.label} notify",
            R,
            (
                counted, num_tokens, num_tokens_per_expert,
                self.heap.peer_ptrs, self.rank, self.layout.notify,
                self.layout.stage_notify, self.transport.pes, self.state,
                self._decoded, recv_count, recv_start, host_info, num_worst_tokens,
                extra if X else recv_count, extra_out if X else recv_count,
                self.status, self._timeout_us,
            ),
            (C, expert_alignment, send_counts is not None, X, channel_major),
            lambda: dict(
                NUM_RANKS=R, NUM_CHANNELS=C, E_LOCAL=E_local, ALIGN=expert_alignment,
                ROW=self.layout.notify_row, SET_BYTES=self.layout.notify_set,
                USE_CLOCK=use_clock(self.device), BLOCK_N=256,
                C_P2=_next_pow2(C + 1), E_P2=_next_pow2(max(E_local, 2)),
                R_P2=_next_pow2(max(R, 2)), COUNTS_GIVEN=send_counts is not None, EXTRA=X,
                X_P2=_next_pow2(max(X, 2)), CHANNEL_MAJOR=channel_major,
            ),
        )  # fmt: skip
        if num_worst_tokens:
            num_recv, rows = -1, num_worst_tokens
            per_expert = host_info[1:]
        else:
            # The one host synchronization of exact mode: the received count.
            info = torch.cat([host_info, self.status]).tolist()
            self._check_status(info[-STATUS_WORDS:])
            num_recv = rows = info[0]
            per_expert = info[1 : 1 + E_local]
        return NormalHandle(
            in_rank, recv_count, recv_start, host_info, None, num_recv, rows, num_tokens,
            self.hidden, self.num_experts, config, per_expert,
            extra_out, bounds, send_counts is not None,
        )  # fmt: skip

    # --------------------------------------------------------------------------- dispatch
    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        handle: NormalHandle | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        src_tag: torch.Tensor | None = None,
        relay: Relay | None = None,
        row_map: torch.Tensor | None = None,
    ) -> NormalDispatchOutput:
        """Send each token once to every rank that holds one of its experts.

        Args:
            x: ``[N, H]`` BF16, or ``(e4m3 [N, H], scales [N, S])``: the scales are 4-byte
                words copied unchanged (float32, e.g. one per 128 channels, or int32, e.g.
                packed UE8M0), any strides, ``1 <= S <= ceil(H / 32)``.
            topk_idx: ``[N, K]`` int64 global expert ids, ``-1`` for none (not needed with
                ``handle``).
            topk_weights: ``[N, K]`` float32, or None.
            num_tokens_per_expert: ``[E]`` int32 from :meth:`get_dispatch_layout` (computed
                here when None).
            is_token_in_rank: ``[N, R]`` bool from :meth:`get_dispatch_layout` (likewise).
            handle: a handle of an earlier dispatch with the same routing: cached mode, only
                ``x`` moves (no notify, no host synchronization; ``topk_idx`` and
                ``topk_weights`` are ignored). A handle from :meth:`notify` with
                ``topk_idx`` (and weights): the ids move too.
            expert_alignment: round the per-expert counts up to a multiple of this.
            num_worst_tokens: if > 0, size the outputs to this many rows and skip the host
                synchronization (rows past the received ones get top-k ids ``-1``).
            config: SM budget and ring use of this call (default: :attr:`default_config`).
                With ``handle``, the handle's config, alignment and output size hold and
                ``config``, ``expert_alignment`` and ``num_worst_tokens`` are not used.
            src_tag: optional ``[N]`` int32 that receivers record as each row's source index
                (``handle.recv_src_idx``) instead of the token index: a relay passes on where
                its rows came from.
            relay: per-row flags shared with another launch on this GPU: the senders wait
                for each token's flag (``await_rows``), or the receivers flag each row they
                write (``publish_to``).
            row_map: optional ``[rows]`` int32, in cached mode only: where each received
                row's payload (and scales) goes in ``recv_x``, a permutation of the rows that
                keeps the rows past the received ones together (the internode mode's final
                order, written in place instead of gathered afterwards). The returned
                handle's ``recv_src_idx`` keeps the unmapped order.
        Returns:
            a :class:`NormalDispatchOutput`.
        """
        payload = check_dispatch_x("x", x)
        num_tokens, hidden = payload.shape
        if hidden != self.hidden:
            raise ValueError(f"x: expected hidden size {self.hidden}, got {hidden}")
        if payload.device != self.device:
            raise ValueError(f"x: expected a tensor on {self.device}, got {payload.device}")
        use_fp8 = isinstance(x, tuple)
        if use_fp8:  # the kernels read scales token-major (column-major ones are copied)
            x = (x[0], x[1].contiguous())
        if not isinstance(expert_alignment, int) or expert_alignment < 1:
            raise ValueError(f"expert_alignment: expected a positive int, got {expert_alignment}")
        if not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
            raise ValueError(f"num_worst_tokens: expected an int >= 0, got {num_worst_tokens}")
        R, E_local = self.num_ranks, self.num_local_experts
        if handle is not None:
            if not isinstance(handle, NormalHandle):
                raise TypeError(f"handle: expected a NormalHandle, got {type(handle).__name__}")
            if handle.num_tokens != num_tokens:
                raise ValueError(
                    f"x: the handle is for {handle.num_tokens} tokens, got {num_tokens}"
                )
            if handle.ranks_from_ids and topk_idx is None:
                raise ValueError("topk_idx: required with a handle from notify(send_counts=...)")
            if handle.recv_src_idx is not None:  # cached mode: the ids stay (as DeepEP's)
                topk_idx = topk_weights = None
        if row_map is not None:
            if handle is None or handle.recv_src_idx is None:
                raise ValueError("row_map: only in cached mode (the handle of a dispatch)")
            check_tensor("row_map", row_map, dtype=torch.int32, shape=(handle.num_rows,),
                         device=self.device)  # fmt: skip
        has_topk = topk_idx is not None
        if has_topk:
            topk_idx = check_topk_idx(
                "topk_idx", topk_idx, num_tokens, self.num_experts, self.device, self.check_ids
            )
            if topk_idx.shape[1] > self.max_topk:
                raise ValueError(
                    f"topk_idx: top-k {topk_idx.shape[1]} exceeds max_topk={self.max_topk}"
                )
            if topk_weights is not None:
                check_topk_weights("topk_weights", topk_weights, topk_idx)
        if handle is None:
            if not has_topk:
                raise ValueError("topk_idx: required without a handle")
            if (num_tokens_per_expert is None) != (is_token_in_rank is None):
                raise ValueError(
                    "num_tokens_per_expert, is_token_in_rank: give both (from "
                    "get_dispatch_layout) or neither"
                )
            if is_token_in_rank is None:
                _, num_tokens_per_expert, is_token_in_rank = dispatch_layout(
                    topk_idx, self.num_experts, R, self._layout_arrivals
                )
            check_tensor(
                "is_token_in_rank", is_token_in_rank, dtype=torch.bool,
                shape=(num_tokens, R), device=self.device,
            )  # fmt: skip
            check_tensor(
                "num_tokens_per_expert", num_tokens_per_expert, dtype=torch.int32,
                shape=(self.num_experts,), device=self.device,
            )  # fmt: skip
            handle = self.notify(is_token_in_rank, num_tokens_per_expert, num_tokens,
                                 expert_alignment, num_worst_tokens, config)  # fmt: skip
        if src_tag is not None:
            check_tensor("src_tag", src_tag, dtype=torch.int32, shape=(num_tokens,),
                         device=self.device)  # fmt: skip
        config, in_rank = handle.config, handle.is_token_in_rank
        C = config.num_channels
        topk = topk_idx.shape[1] if has_topk else 1
        num_recv, rows = handle.num_recv_tokens, handle.num_rows

        # Outputs.
        W = hidden // 4 if use_fp8 else hidden // 2
        G = x[1].shape[1] if use_fp8 else 0  # scale words per token
        if use_fp8:
            recv_x = (
                empty_output(self.device, (rows, hidden), torch.float8_e4m3fn),
                empty_output(self.device, (rows, G), x[1].dtype),
            )
            x_words, scale_words = x[0].view(torch.int32), x[1].view(torch.int32)
            out_words, out_scales = recv_x[0].view(torch.int32), recv_x[1].view(torch.int32)
        else:
            recv_x = empty_output(self.device, (rows, hidden), torch.bfloat16)
            x_words, out_words = x.view(torch.int32), recv_x.view(torch.int32)
            scale_words = out_scales = out_words
        has_weights = has_topk and topk_weights is not None
        recv_topk_idx = empty_output(self.device, (rows, topk), torch.int64) if has_topk else None
        recv_weights = (
            empty_output(self.device, (rows, topk), torch.float32) if has_weights else None
        )
        recv_src_idx = empty_output(self.device, (rows,), torch.int32)
        dummy = out_words
        ranks_from_ids = handle.ranks_from_ids and has_topk
        bounds = handle.bounds
        awaits = relay is not None and relay.await_rows
        publish = relay is not None and relay.publish_to is not None

        def build_meta():  # once per configuration: _launch
            r_p2 = _next_pow2(max(R, 2))
            warps = DISPATCH_WARPS if r_p2 <= 4 else max(4, DISPATCH_WARPS // 2)
            bw = min(SEND_BW, _next_pow2(W))
            rows_per_source = max(1, STEP_ROWS // r_p2)
            return dict(
                W=W, G=G, E_LOCAL=E_local, NUM_RANKS=R, NUM_CHANNELS=C,
                MAX_CHANNELS=self.layout.max_channels, RING=config.nvl_recv_buffer_tokens,
                RING_STRIDE=self.layout.ring_tokens, SLOT_BYTES=self.layout.dispatch_slot,
                META_OFF=_align(W + G, 4), HAS_SCALES=use_fp8, HAS_TOPK=has_topk,
                HAS_WEIGHTS=has_weights, HAS_TAG=src_tag is not None, PAD_ROWS=num_recv < 0,
                USE_CLOCK=use_clock(self.device),
                TOK=_step_tokens(config, SEND_TILE * warps // 16 // bw), ROWS=rows_per_source,
                BW=bw, RBW=min(RECV_TILE // (r_p2 * rows_per_source), _next_pow2(W)),
                R_P2=r_p2, K_P2=_next_pow2(max(topk, 2)), G_P2=_next_pow2(max(G, 2)),
                BOUNDS=bounds is not None, AWAIT=awaits, RANKS_FROM_IDS=ranks_from_ids,
                PUBLISH=publish, RELEASE_STEPS=SEND_RELEASE_STEPS, num_warps=warps,
                # Own rows straight from the input, where it is complete before the launch
                # (not in a relay leg that awaits its rows or learns their destinations).
                LOCAL=not (awaits or ranks_from_ids), ROW_MAP=row_map is not None,
            )  # fmt: skip

        self._launch(
            normal_dispatch.normal_dispatch_kernel,
            f"{self.label} dispatch",
            2 * C,
            (
                x_words, scale_words, topk_idx if has_topk else dummy,
                topk_weights if has_weights else dummy, in_rank.view(torch.int8),
                src_tag if src_tag is not None else dummy, num_tokens,
                self.heap.peer_ptrs, self.rank, self.layout.dispatch_ring,
                self.layout.dispatch_tail, self.layout.dispatch_head, self.layout.stage_rings,
                self.transport.pes, self.state, handle.recv_count,
                handle.recv_start, handle.host_info, out_words, out_scales,
                recv_topk_idx if has_topk else dummy, recv_weights if has_weights else dummy,
                recv_src_idx, rows, self.status, self._timeout_us,
                bounds if bounds is not None else handle.recv_count,
                relay.flags if relay is not None else handle.recv_count,
                relay.publish_to if publish else self.state,
                row_map if row_map is not None else handle.recv_count, topk,
            ),
            (config, G, _next_pow2(max(topk, 2)), has_topk, has_weights, src_tag is not None,
             num_recv < 0, bounds is not None, awaits, ranks_from_ids, publish,
             row_map is not None),
            build_meta,
        )  # fmt: skip
        new_handle = NormalHandle(
            in_rank, handle.recv_count, handle.recv_start, handle.host_info, recv_src_idx,
            num_recv, rows, num_tokens, hidden, self.num_experts, config,
            bounds=bounds, extra=handle.extra,
        )  # fmt: skip
        # Set on a handle from notify (a first dispatch, with or without top-k); None on a
        # dispatch's handle (cached mode).
        per_expert = handle.num_recv_tokens_per_expert
        return NormalDispatchOutput(recv_x, recv_topk_idx, recv_weights, per_expert, new_handle)

    # ---------------------------------------------------------------------------- combine
    def combine(
        self,
        x: torch.Tensor,
        handle: NormalHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        relay: Relay | None = None,
        row_map: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hand every received row back and sum, per source token, the rows of all ranks.

        Args:
            x: ``[M, H]`` BF16, one row per row of the dispatch outputs (each rank has already
                reduced its own experts' outputs for the token into it).
            handle: from :meth:`dispatch`.
            topk_weights: ``[M, K]`` float32 summed along with the rows, or None.
            bias: ``[N, H]`` BF16, or a tuple of up to two, added to the sum.
            relay: per-row flags shared with another launch on this GPU: the senders wait
                for each row's flag (``await_rows``), or the receivers flag each token they
                sum (``publish_to``).
            row_map: optional ``[M]`` int32, with a ``relay`` only: the row of ``x`` (and of
                ``topk_weights``) that holds each received row, ``x`` being in the caller's
                order (the internode mode's; read in place instead of scattered first).
        Returns:
            ``(combined_x [N, H] BF16, combined_topk_weights [N, K] float32 or None)``.
        """
        if not isinstance(handle, NormalHandle):
            raise TypeError(f"handle: expected a NormalHandle, got {type(handle).__name__}")
        H, N, M = handle.hidden, handle.num_tokens, handle.num_rows
        check_tensor("x", x, dtype=torch.bfloat16, shape=(M, H), device=self.device)
        K = 1
        if topk_weights is not None:
            check_tensor(
                "topk_weights", topk_weights, dtype=torch.float32, shape=(M, None),
                device=self.device,
            )  # fmt: skip
            K = topk_weights.shape[1]
            if not 1 <= K <= self.max_topk:
                raise ValueError(f"topk_weights: top-k {K} outside [1, {self.max_topk}]")
        if row_map is not None:
            if relay is None:  # own rows are read by the receivers, in the received order
                raise ValueError("row_map: only with a relay (the legs of the internode mode)")
            check_tensor("row_map", row_map, dtype=torch.int32, shape=(M,), device=self.device)
        terms = () if bias is None else bias if isinstance(bias, tuple) else (bias,)
        if len(terms) > 2:
            raise ValueError(f"bias: at most two tensors, got {len(terms)}")
        for i, term in enumerate(terms):
            check_tensor(
                f"bias[{i}]" if isinstance(bias, tuple) else "bias", term, dtype=torch.bfloat16,
                shape=(N, H), device=self.device,
            )  # fmt: skip
        config = handle.config
        self._check_fits_interpreter(config, "handle", N, handle.bounds)
        C, R = config.num_channels, self.num_ranks
        awaits = relay is not None and relay.await_rows
        publish = relay is not None and relay.publish_to is not None
        if awaits and relay.limit is None:
            raise ValueError("relay: a combine that awaits rows needs the relay's limit")
        out = empty_output(self.device, (N, H), torch.bfloat16)
        out_weights = (
            empty_output(self.device, (N, K), torch.float32) if topk_weights is not None else None
        )
        dummy = out

        def build_meta():  # once per configuration: _launch
            # A sender step holds [ranks x ROWS, BW] words: bounded, fewer rows rather than
            # narrower ones (a step's rows are contiguous).
            r_p2, bw = _next_pow2(max(R, 2)), min(COMBINE_BW, _next_pow2(H // 2))
            rows = max(1, min(STEP_ROWS // r_p2, COMBINE_SEND_TILE // (r_p2 * bw)))
            if awaits:  # reading a relay's rows (no tile in flight): half the rows, no spill
                rows = max(1, rows // 2)
            return dict(
                H=H, NUM_RANKS=R, NUM_CHANNELS=C, MAX_CHANNELS=self.layout.max_channels,
                RING=config.nvl_recv_buffer_tokens,
                RING_STRIDE=self.layout.ring_tokens, SLOT_BYTES=self.layout.combine_slot,
                HAS_WEIGHTS=topk_weights is not None, NUM_BIAS=len(terms),
                USE_CLOCK=use_clock(self.device),
                TOK=_step_tokens(config, COMBINE_RECV_TILE // (r_p2 * 2 * bw)),
                ROWS=rows, BW=bw, R_P2=r_p2, K_P2=_next_pow2(max(K, 2)), num_warps=COMBINE_WARPS,
                BOUNDS=handle.bounds is not None, AWAIT=awaits, PUBLISH=publish,
                # A relay's own rows go through the ring (not timed on GPUs without it).
                LOCAL=relay is None, RELEASE_STEPS=SEND_RELEASE_STEPS,
                ROW_MAP=row_map is not None,
                # Sums round as in the reference (no fused multiply-add).
                enable_fp_fusion=False,
            )  # fmt: skip

        self._launch(
            normal_combine.normal_combine_kernel,
            f"{self.label} combine",
            2 * C,
            (
                x, topk_weights if topk_weights is not None else dummy,
                handle.is_token_in_rank.view(torch.int8), N, M,
                terms[0] if len(terms) > 0 else dummy, terms[1] if len(terms) > 1 else dummy,
                handle.recv_count, handle.recv_start, self.heap.peer_ptrs, self.rank,
                self.layout.combine_ring, self.layout.combine_tail, self.layout.combine_head,
                self.layout.stage_rings, self.transport.pes,
                self.state, out, out_weights if out_weights is not None else dummy,
                self.status, self._timeout_us,
                relay.limit if awaits else handle.bounds if handle.bounds is not None
                else handle.recv_count,
                relay.flags if relay is not None else handle.recv_count,
                relay.publish_to if publish else self.state,
                row_map if row_map is not None else handle.recv_count, K,
            ),
            (config, H, _next_pow2(max(K, 2)), topk_weights is not None, len(terms),
             handle.bounds is not None, awaits, publish, row_map is not None),
            build_meta,
        )  # fmt: skip
        return out, out_weights

    def destroy(self) -> None:
        """Release the heap (collective: every rank calls it); raises if a wait had timed out
        (with the release's own failure, if a peer never arrived, as its cause)."""
        self.heap.close_checked(self.check)
