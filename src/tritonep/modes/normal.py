"""Normal (high-throughput) mode within one node: notify, then channel-ring dispatch and combine.

Orchestrates :mod:`tritonep.kernels.normal_notify`, :mod:`~tritonep.kernels.normal_dispatch`
and :mod:`~tritonep.kernels.normal_combine` over one symmetric heap, which holds per rank:

* notify rows ``[2 sets][R sources][C + E_local]`` int32 (counts as ``-n - 1``);
* dispatch rings ``[C channels][R sources][ring][slot]`` with tails ``[C][R]`` int64 here
  and heads ``[C][R]`` int64 on the sender;
* combine rings ``[C][R expert ranks][ring][slot]`` with their tails and heads.

A dispatch exchanges the counts (notify) unless a handle is given (cached mode), then moves
the rows in the dispatch launch (``C`` senders and ``C`` receivers, ``2 C`` programs: the SM
budget). Output sizes come two ways:

* exact (``num_worst_tokens=0``): notify is a small launch of its own, after which the host
  reads the received count (one device-to-host copy and wait, the only host synchronization
  of the mode), then the dispatch launch;
* worst case (``num_worst_tokens > 0``): outputs have that many rows, the rows past the
  received ones carry top-k ids ``-1``; no wait for the count, so one launch does both: its
  senders exchange the counts first, and its receivers wait (bounded) for the layout (host
  time: a launch costs the host 5 to 7 us). A CUDA graph can capture dispatch and combine and
  replay them with new inputs of the same shapes.

Call counters live on the device (graph-safe). Every rank must make the same sequence of
calls. Under the Triton interpreter (CPU ranks) programs of a launch run one after another, so
there a channel's tokens must fit one ring (checked before launch).

Errors without a host synchronization. Ids outside ``[-1, num_experts)`` are dropped by the
layout and dispatch kernels, which record the first one (rank, token, column, id), as a wait
that gave up or worst-case outputs that overflowed are recorded, in the mode's status
(:mod:`tritonep.kernels.status`), whose host copy each dispatch and combine reads before it
launches: the call then launches as usual (its peers get what they wait for) and raises the
recorded error, a ``ValueError`` or a :class:`~tritonep.errors.WaitTimeoutError` naming the
rank, the peer and the phase (an exact-size dispatch, which reads the host anyway, raises
what its own layout and count exchange recorded). :meth:`NormalMode.check` waits for the device
and raises the same. A timed-out call leaves outputs that say so: a dispatch receiver that
finds a timeout recorded fills its channel's rows with 0xFF bytes (NaN payload, scales and
weights, sources and ids ``-1``), and a combined token one of whose rows never came is NaN. A
timeout stays (later calls raise it and give up their waits at once); the others are raised
once. ``check_ids=True`` also checks the ids on the host before launching (a synchronization).

The call path. Each configuration (config, dtypes, top-k rounded up to a power of two,
relay options) gets a plan on its first call: its kernel's variant (``NotifyVariant``,
``DispatchVariant``, ``CombineVariant``), whose compiled kernel later calls launch with
addresses (:class:`~tritonep.kernels.launcher.KernelLaunch`). A call then checks its tensors
(plain comparisons), allocates its outputs, sets its own arguments on a template of its launch
and launches, all under ``torch._C.DisableTorchFunction`` (a ``torch`` function mode, such as
``torch.set_default_device``'s, would otherwise intercept every tensor access). The templates
are argument bundles made by name, tensors as addresses: per shape class for a first dispatch
(:class:`_RouteCall`), per handle for a cached dispatch and a combine (:class:`_HandleCall`,
kept on the handle); a launch that needs tensors (the first of a variant, one under a launch
hook, relays and traces) gets its bundle by name. Token and row counts, top-k and the
alignment are run-time values: a new batch compiles nothing.

With ``staged=True`` (the network leg of :class:`~tritonep.modes.internode.InternodeMode`)
nothing is stored into a peer directly: counts and rows are built in this rank's heap (a notify
row and a mirror ring per destination) and moved with the tails and heads by
:mod:`tritonep.kernels.transport`, NVSHMEM puts on NVSHMEM heaps, copies elsewhere.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

import torch
import torch.distributed as dist
import triton

from ..heap import allocate, default_device
from ..kernels import normal_combine, normal_dispatch, normal_notify, phases, transport
from ..kernels.launcher import KernelLaunch, Shared
from ..kernels.layout import DispatchLayout
from ..kernels.normal_combine import CombineCall, CombineVariant
from ..kernels.normal_dispatch import DispatchCall, DispatchVariant, NormalShared
from ..kernels.normal_notify import NOTIFY_WARPS, NotifyCall, NotifyVariant
from ..kernels.status import (
    STATUS_BAD_ID,
    STATUS_TIMEOUT,
    Status,
    bad_id_error,
    check_status,
    host_words,
    wait_host_word,
)
from ..kernels.sync import DEFAULT_TIMEOUT_S, timeout_us, use_clock
from ..validation import (
    check_dispatch_x,
    check_num_experts,
    check_ranks_agree,
    check_tensor,
    check_topk_idx,
    check_topk_weights,
    default_group,
)
from ..validation import (
    plain_tensor as _plain,
)
from . import copy_combine
from .copy_combine import CopyCombine
from .outputs import empty_output
from .trace import TraceRecorder

PHASES = {
    code.value: phases.NAMES[code.value]
    for code in (
        phases.NOTIFY,
        phases.DISPATCH_SEND,
        phases.DISPATCH_RECV,
        phases.COMBINE_SEND,
        phases.COMBINE_RECV,
        phases.DISPATCH_RELAY,
        phases.COMBINE_RELAY,
        phases.LAYOUT_IDS,
        phases.DISPATCH_IDS,
        phases.DISPATCH_COUNTS,
        phases.COPY_COMBINE_DONE,
        phases.COPY_COMBINE_RECV,
    )
}

_no_torch_function = torch._C.DisableTorchFunction

T = TypeVar("T")


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
#: Words a combine sender holds per step, over its ``BLOCK_RANKS`` rank lanes x ``ROWS`` rows. On 2x
#: H200 this shape (16 384 words, 512 per row, 8 warps) combines 4096 tokens in 343 us, a
#: narrower one (8192, 256, 16 warps) in 428 us. The bound matters: rows once came from the
#: rank count rounded up (1 for one rank) while the lanes were at least 2, so one rank held
#: 32 768 words and took 2660 us (BENCHMARKS.md). On 16 warps, 8192 words (fewer spilled
#: registers) was 7% slower on 2 H100s.
COMBINE_SEND_TILE = 16384
#: BF16 values a combine receiver loads per step, over its rank lanes (``[BLOCK_RANKS, tokens,
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
#: Tokens the count exchange reads at a time (notify, or the dispatch launch that runs it).
COUNT_TOKENS = 256
#: The launch constants above: what :func:`set_launch_constants` (and ``tritonep bench
#: --launch``) may change, to compare launch shapes on a GPU without editing the code.
LAUNCH_CONSTANTS = (
    "STEP_ROWS",
    "SEND_TILE",
    "SEND_BW",
    "RECV_TILE",
    "COMBINE_BW",
    "COMBINE_WARPS",
    "COMBINE_SEND_TILE",
    "COMBINE_RECV_TILE",
    "SEND_RELEASE_STEPS",
    "DISPATCH_WARPS",
)


_launch_version = 0


def _block_k(topk: int) -> int:
    """The kernels' top-k block: ``topk`` as a power of two, at least 2."""
    return max(2, 1 << (topk - 1).bit_length())


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


def raise_after(
    recorded: Callable[[], object],
    raise_recorded: Callable[[], None],
    call: Callable[[], T],
    synced: bool = False,
) -> T:
    """Run ``call()`` and return what it returns, unless the kernels recorded an error before
    it (``recorded()``, read first), or (``synced``: a call that read the host, an exact-size
    dispatch without a handle) during it: then ``raise_recorded()`` raises it, after the
    launches, deterministically on every rank."""
    earlier = recorded()
    out = call()
    if earlier or (synced and recorded()):
        raise_recorded()
    return out


def _step_tokens(config: Config, tile_tokens: int) -> int:
    """Tokens a sender (or combine receiver) moves per step: the send chunk rounded up to a
    power of two, at most ``tile_tokens`` (what a step's tile holds) and at most the ring, so
    that a step never waits for slots that only its own later rows would free."""
    ring = config.nvl_recv_buffer_tokens
    chunk = triton.next_power_of_2(max(1, min(config.nvl_send_chunk, 32)))
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
    def of(
        hidden,
        num_ranks,
        num_local_experts,
        max_topk,
        max_channels,
        ring_tokens,
        staged=False,
        notify_extra=0,
    ):
        groups = -(-hidden // 128)  # a float32 scale per 128 channels, the last group partial
        record = _align(1 + 2 * max_topk, 4)
        dispatch_slot = 4 * (_align(hidden // 2 + groups, 4) + record)
        combine_slot = _align(2 * hidden + 4 * max_topk, 16)
        # (The row's last word: its source's token count.)
        notify_row = _align(max_channels + num_local_experts + notify_extra + 1, 4)
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
            notify,
            notify_set,
            notify_row,
            d_ring,
            d_tail,
            d_head,
            dispatch_slot,
            c_ring,
            c_tail,
            c_head,
            combine_slot,
            ring_tokens,
            max_channels,
            stage_notify,
            stage_rings,
            offset,
        )


@dataclass
class NormalHandle:
    """What combine (and a cached dispatch) needs from a dispatch.

    Attributes:
        is_token_in_rank: ``[N, R]`` bool, where this rank's tokens went.
        counts: int32 on the device, all that the count exchange writes, in one allocation
            (each allocation costs host time on every dispatch): ``host_info``,
            ``recv_count`` and ``recv_start`` below are views of it, made when first read,
            each starting at a 16-byte boundary (:func:`count_offsets`).
        recv_count: ``[R, C]`` int32, tokens each (source rank, channel) sent here.
        recv_start: ``[R, C]`` int32, the first received row of each (source rank, channel).
        host_info: ``[1 + E_local]`` int32 on the device: rows received, then tokens per local
            expert (aligned).
        recv_src_idx: ``[M]`` int32, each received row's token index on its source rank
            (``-1`` in padding rows); None on a handle from :meth:`NormalMode.notify`, whose
            rows no dispatch has moved yet.
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
        source_rows: ``R`` ints, the rows received from each source, on the host (exact
            mode: its count exchange wrote them where the host reads them), else None. Rows
            from one source are contiguous, in source order: what the copy-engine combine
            (:mod:`tritonep.modes.copy_combine`) copies back, one range per peer.
        most_tokens: the most tokens any rank dispatched in the call that made the handle
            (exact mode: every row of the count exchange carries its source's), else ``-1``;
            the same on every rank, so all ranks choose the same combine by it.
    """

    is_token_in_rank: torch.Tensor
    counts: torch.Tensor
    recv_src_idx: torch.Tensor | None
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
    source_rows: list[int] | None = None
    most_tokens: int = -1

    # Views of ``counts``, made when first read: a call's launches take its addresses.
    @functools.cached_property
    def host_info(self) -> torch.Tensor:
        return self._count_view(0)

    @functools.cached_property
    def recv_count(self) -> torch.Tensor:
        return self._count_view(1)

    @functools.cached_property
    def recv_start(self) -> torch.Tensor:
        return self._count_view(2)

    def _count_view(self, part: int) -> torch.Tensor:
        R = self.is_token_in_rank.shape[1]
        views = count_views(self.counts, self.num_experts // R, R, self.config.num_channels)
        self.__dict__.update(zip(("host_info", "recv_count", "recv_start"), views, strict=True))
        return views[part]


def count_offsets(num_local_experts: int, num_ranks: int, num_channels: int) -> tuple[int, ...]:
    """Where a handle's ``counts`` (int32 words) holds ``recv_count`` and ``recv_start``, and
    its length: ``host_info`` first, each part starting at a multiple of 4 words (16 bytes:
    the kernels are compiled for aligned pointers, whatever the rank and channel counts)."""
    info, rows = _align(1 + num_local_experts, 4), _align(num_ranks * num_channels, 4)
    return info, info + rows, info + 2 * rows


def count_views(counts: torch.Tensor, num_local_experts: int, num_ranks: int, num_channels: int):
    """``(host_info [1 + E_local], recv_count [R, C], recv_start [R, C])``, views of a
    handle's ``counts`` (:func:`count_offsets`)."""
    at_count, at_start, _ = count_offsets(num_local_experts, num_ranks, num_channels)
    n = num_ranks * num_channels
    return (
        counts[: 1 + num_local_experts],
        counts[at_count : at_count + n].view(num_ranks, num_channels),
        counts[at_start : at_start + n].view(num_ranks, num_channels),
    )


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


#: The handle type of a dispatch output: a :class:`NormalHandle`, or the internode mode's.
HandleT = TypeVar("HandleT")


@dataclass
class NormalDispatchOutput(Generic[HandleT]):
    """What :meth:`NormalMode.dispatch` returns (DeepEP's tuple, less the event).

    Attributes:
        recv_x: ``[M, H]`` BF16, or ``(e4m3 [M, H], scales [M, S])`` in the scales' dtype.
        recv_topk_idx: ``[M, K]`` int64 local expert ids (``-1`` elsewhere and in padding
            rows), or None in cached mode.
        recv_topk_weights: ``[M, K]`` float32 (0 where the id is ``-1``), or None.
        num_recv_tokens_per_expert: tokens per local expert rounded up to the alignment: a
            list of int in exact mode, an ``[E_local]`` int32 device tensor in worst-case
            mode (no host read), None in cached mode.
        handle: for :meth:`NormalMode.combine` and cached dispatches (a
            :class:`~tritonep.modes.internode.InternodeHandle` from the internode mode).
    """

    recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    num_recv_tokens_per_expert: list[int] | torch.Tensor | None
    handle: HandleT


class DispatchOptions(NamedTuple):
    """What a dispatch's kernel variant depends on besides the mode: its plan's key (the
    variant is built from these alone, :meth:`NormalMode._dispatch_plan`)."""

    config: Config
    scale_words: int  # 0: a BF16 payload
    block_k: int
    has_topk: bool
    has_weights: bool
    has_tag: bool
    pad_rows: bool
    bounds: bool
    awaits: bool
    ranks_from_ids: bool
    publish: bool
    row_map: bool
    exchange: bool = False  # the count exchange runs in the dispatch launch


class CombineOptions(NamedTuple):
    """What a combine's kernel variant depends on besides the mode (its plan's key)."""

    config: Config
    block_k: int
    has_weights: bool
    num_bias: int
    bounds: bool
    relay: bool
    awaits: bool
    publish: bool
    row_map: bool
    x_aligned: bool = True  # x's rows start at 16-byte boundaries (all rows load as vectors)


class NotifyOptions(NamedTuple):
    """What a notify's kernel variant depends on besides the mode (its plan's key)."""

    config: Config
    counts_given: bool
    extra: int
    channel_major: bool
    host_copy: bool = False  # exact size: the count also goes to host memory


class _HandleCall(NamedTuple):
    """The launch of a cached dispatch or a combine with one handle, its arguments known but
    for those of the call (:meth:`NormalMode._cached_dispatch`, :meth:`NormalMode._fast_combine`).

    Made on the first such call of the handle and kept on it: the call bundle's fields in
    order, tensors as addresses (``values``: the handle's, the defaults' placeholder; those of
    the call left 0), and the bitwise or of those addresses (``aligned``). It stands while the
    mode, its launch constants and the handle's tensors are those it was made from."""

    launch: KernelLaunch
    values: list
    aligned: int
    mode: weakref.ref  # (a handle kept longer than its mode does not keep the mode)
    version: int
    tensors: tuple  # the handle's tensors it read, compared by identity

    def stands(self, mode, handle: NormalHandle) -> bool:
        held = self.tensors
        return (
            self.mode() is mode
            and self.version == _launch_version
            and held[0] is handle.is_token_in_rank
            and held[1] is handle.counts
            and held[2] is handle.recv_src_idx
            and held[3] is handle.bounds
        )


def _handle_call(
    mode, handle: NormalHandle, launch: KernelLaunch, call: tuple, given
) -> _HandleCall:
    """A :class:`_HandleCall` from ``call`` (a bundle of the first such call, by name), whose
    fields ``given`` (indices) each call sets; kept on ``handle`` by the caller."""
    null = launch.placeholder.data_ptr() if launch.placeholder is not None else 0
    values = [
        a.data_ptr()
        if isinstance(a, torch.Tensor)
        else null
        if a is None and i in launch.pointers
        else a
        for i, a in enumerate(call)
    ]
    aligned = 0
    for i in launch.pointers:
        if i in given and call[i] is not None:
            values[i] = 0
        else:
            aligned |= values[i]
    tensors = (handle.is_token_in_rank, handle.counts, handle.recv_src_idx, handle.bounds)
    return _HandleCall(launch, values, aligned, weakref.ref(mode), _launch_version, tensors)


def _keep_handle_call(
    mode, handle: NormalHandle, key: tuple, launch: KernelLaunch, call: tuple, given
) -> None:
    """Keep on ``handle``, under ``key``, the template of ``call`` (a bundle just launched by
    name), unless one made from the same mode and tensors stands there."""
    calls = _handle_calls(handle)
    entry = calls.get(key)
    if entry is None or not entry.stands(mode, handle):
        calls[key] = _handle_call(mode, handle, launch, call, given)


def _handle_calls(handle: NormalHandle) -> dict:
    """The :class:`_HandleCall` entries kept on ``handle`` (an attribute, not a field: a
    handle copied field by field starts without them)."""
    calls = handle.__dict__.get("_calls")
    if calls is None:
        calls = handle.__dict__["_calls"] = {}
    return calls


class _RouteCall(NamedTuple):
    """The launches of a first dispatch (no relay, source tags or traces) of one shape class:
    notify's (None where the dispatch launch exchanges the counts itself: worst-case outputs,
    no host read between the two) and the dispatch's, their call bundles as lists in their
    fields' order, tensors as addresses, the placeholder's where the variant reads nothing;
    each call sets the rest (:meth:`NormalMode._routed_dispatch`)."""

    notify: KernelLaunch | None
    notify_values: list
    dispatch: KernelLaunch
    dispatch_values: list
    null: int  # the placeholder's address (in every template)
    version: int
    count_words: int  # length of the handle's counts (count_offsets)
    count_bytes: int  # where in it recv_count starts
    start_bytes: int  # where recv_start starts


def _indices(fields: tuple, names: str) -> tuple[int, ...]:
    return tuple(fields.index(name) for name in names.split())


# The fields each call sets in place, by name.
(
    _N_COUNTS,
    _N_TOKENS,
    _N_PER_EXPERT,
    _N_ALIGNMENT,
    _N_MAX_ROWS,
    _N_RECV_COUNT,
    _N_RECV_START,
    _N_HOST_INFO,
) = _indices(
    NotifyCall._fields,
    "counts_ptr num_tokens per_expert_ptr alignment max_rows recv_count_ptr recv_start_ptr "
    "host_info_ptr",
)
(
    _D_X,
    _D_SCALES,
    _D_IDS,
    _D_WEIGHTS,
    _D_IN_RANK,
    _D_TOKENS,
    _D_RECV_COUNT,
    _D_RECV_START,
    _D_HOST_INFO,
    _D_PER_EXPERT,
    _D_ALIGNMENT,
    _D_OUT_X,
    _D_OUT_SCALES,
    _D_OUT_IDS,
    _D_OUT_WEIGHTS,
    _D_OUT_SRC,
    _D_MAX_ROWS,
) = _indices(
    DispatchCall._fields,
    "x_ptr scales_ptr topk_idx_ptr topk_weights_ptr in_rank_ptr num_tokens recv_count_ptr "
    "recv_start_ptr host_info_ptr per_expert_ptr alignment out_x_ptr out_scales_ptr "
    "out_topk_idx_ptr out_weights_ptr out_src_ptr max_rows",
)
_C_X, _C_WEIGHTS, _C_BIAS0, _C_BIAS1, _C_OUT, _C_OUT_WEIGHTS = _indices(
    CombineCall._fields, "x_ptr weights_ptr bias0_ptr bias1_ptr out_ptr out_weights_ptr"
)
# The fields a handle sets in a combine's and a cached dispatch's template.
_CH_IN_RANK, _CH_TOKENS, _CH_ROWS, _CH_RECV_COUNT, _CH_RECV_START, _CH_BOUNDS = _indices(
    CombineCall._fields,
    "in_rank_ptr num_tokens num_rows recv_count_ptr recv_start_ptr bounds_ptr",
)
_DH_SRC, _DH_BOUNDS = _indices(DispatchCall._fields, "out_src_ptr bounds_ptr")
#: The fields a cached dispatch's and a combine's templates leave to each call.
_D_GIVEN = (_D_X, _D_SCALES, _D_OUT_X, _D_OUT_SCALES)
_C_GIVEN = (_C_X, _C_WEIGHTS, _C_BIAS0, _C_BIAS1, _C_OUT, _C_OUT_WEIGHTS)


def _dispatch_key(payload: torch.Tensor, scales: torch.Tensor | None) -> tuple:
    """The key of a cached dispatch's template on its handle."""
    return ("dispatch", payload.dtype, None if scales is None else (scales.shape[1], scales.dtype))


def _combine_key(topk_weights: torch.Tensor | None, K: int, num_bias: int) -> tuple:
    """The key of a combine's template on its handle."""
    return ("combine", K if topk_weights is not None else 0, num_bias)


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
        check_ids: also read the top-k ids on the host and raise ``ValueError`` there for ids
            outside ``[-1, E)``, before anything is launched (a host synchronization per call
            with ids). Without it the kernels drop such ids and the next dispatch or combine
            raises (module docs).
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
        copy_combine_tokens: if > 0, combines of exact-size dispatches in which no rank
            dispatched more tokens than this, and some rank at least
            ``copy_combine_min_tokens``, hand the rows back by copy engines
            (:mod:`tritonep.modes.copy_combine`: no SM moves a row); the others take the rings.
            Reserves ``(R - 1) * copy_combine_tokens * (2 * hidden + 4 * max_topk)`` bytes of
            symmetric memory.
        copy_combine_min_tokens: the fewest tokens, on the rank with the most, for which that
            combine takes the copy engines (default:
            :func:`tritonep.modes.copy_combine.default_min_tokens` of the rank count; 0: every
            call within ``copy_combine_tokens``). Below it the rings are faster: the copies'
            fixed costs, host time above all, outweigh their bandwidth.
        copy_combine_chunks: copies per peer and call of that combine, each followed by a
            launch of its sums (default: :data:`tritonep.modes.copy_combine.CHUNKS`; the same
            on every rank).
        copy_combine_last_share: that combine's last chunk holds ``1 / this`` of each peer's
            rows, an int >= 2 (default:
            :func:`tritonep.modes.copy_combine.default_last_share` of the rank count, tuned on
            H200s; the same on every rank). The call ends with the sums of the last chunk,
            while the others' run beside its copies: the best share makes those end with the
            last copies.
    """

    #: The class of the handles dispatches return (a subclass's, such as DeepEP's tuple-like
    #: handle, made here rather than copied from a NormalHandle on every dispatch).
    handle_type: type[NormalHandle] = NormalHandle

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
        check_ids: bool = False,
        profile: bool | TraceRecorder = False,
        label: str = "normal",
        staged: bool = False,
        notify_extra: int = 0,
        rank_names: list[int] | None = None,
        copy_combine_tokens: int = 0,
        copy_combine_chunks: int | None = None,
        copy_combine_last_share: int | None = None,
        copy_combine_min_tokens: int | None = None,
    ):
        self.group = default_group(group)
        self.label = label
        # (Resolved here: the ranks must agree on the values.)
        if copy_combine_chunks is None:
            copy_combine_chunks = copy_combine.CHUNKS
        if copy_combine_last_share is None:
            copy_combine_last_share = copy_combine.default_last_share(
                dist.get_world_size(self.group)
            )
        if copy_combine_min_tokens is None:
            copy_combine_min_tokens = copy_combine.default_min_tokens(
                dist.get_world_size(self.group)
            )
        check_ranks_agree(
            self.group,
            "NormalMode",
            hidden=hidden,
            num_experts=num_experts,
            max_topk=max_topk,
            max_sms=max_sms,
            ring_tokens=ring_tokens,
            staged=staged,
            notify_extra=notify_extra,
            copy_combine_tokens=copy_combine_tokens,
            copy_combine_chunks=copy_combine_chunks,
            copy_combine_last_share=copy_combine_last_share,
            copy_combine_min_tokens=copy_combine_min_tokens,
            device_type=torch.device(device).type if device is not None else None,
        )
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
        self.check_ids = check_ids
        device = torch.device(device) if device is not None else default_device(self.group)
        on_gpu = device.type == "cuda"
        if max_sms is None:
            max_sms = 32 if on_gpu else 4
        if ring_tokens is None:
            ring_tokens = 128 if on_gpu else 64
        if max_sms < 2 or ring_tokens < 1:
            raise ValueError(
                f"max_sms, ring_tokens: expected >= 2 and >= 1, got {max_sms}, {ring_tokens}"
            )
        self.default_config = Config(
            num_sms=min(DEFAULT_NUM_SMS, max_sms) if on_gpu else max_sms,
            nvl_recv_buffer_tokens=ring_tokens,
        )
        self.layout = NormalLayout.of(
            hidden,
            self.num_ranks,
            self.num_local_experts,
            max_topk,
            max_sms // 2,
            ring_tokens,
            staged,
            notify_extra,
        )
        self.notify_extra = notify_extra
        self.heap = allocate(self.layout.total, self.group, device)
        self.device = self.heap.device
        #: How peers are reached (:mod:`tritonep.kernels.transport`).
        self.transport = transport.PeerTransport(self.heap, staged, "staged")
        self.state = torch.zeros(8, dtype=torch.int64, device=self.device)
        # An exact-size notify writes the count where the host reads it without a copy:
        # [written flag, rows received, aligned tokens per local expert..., rows from each
        # source..., the most tokens any rank dispatched] (HOST_COUNTS).
        self._host_counts, self._host_view = host_words(
            3 + self.num_local_experts + self.num_ranks, self.device
        )
        self.state[normal_notify.HOST_COUNTS.value] = self._host_counts.data_ptr()
        #: What went wrong, on the device and in host memory (:mod:`tritonep.kernels.status`).
        self.status = Status(self.device)
        # The count exchange's workspace: expert entries, then tokens, of each source.
        self._decoded = torch.empty(
            self.num_ranks * (self.num_local_experts + 1), dtype=torch.int32, device=self.device
        )
        # get_dispatch_layout's kernel: bad ids go to this mode's status (under this rank's
        # number in the group, as the dispatch kernel's; errors name it by rank_names).
        self._layout = DispatchLayout(
            self.device, num_experts, self.num_ranks, self.status, self.rank
        )
        # A dispatch that computes its layout reads only is_token_in_rank past its launches:
        # the tokens per rank and per expert go here (fewer allocations per call), read by the
        # notify launch that follows in stream order, as the heap's rings are.
        self._layout_scratch = (
            torch.empty(self.num_ranks, dtype=torch.int32, device=self.device),
            torch.empty(num_experts, dtype=torch.int32, device=self.device),
        )
        # Passed for the pointers a variant does not read.
        self._unused = torch.zeros(4, dtype=torch.int64, device=self.device)
        self._plans: dict[tuple, KernelLaunch] = {}
        self._routes: dict[tuple, _RouteCall] = {}  # _routed_dispatch's templates
        self._count_at: dict[int, tuple[int, int]] = {}  # channels -> count_offsets in bytes
        # Templates of combines and cached dispatches, whose handle fields each handle sets
        # (_combine_template, _dispatch_template).
        self._templates: dict[tuple, tuple] = {}
        self._plans_version = _launch_version
        self._configs: set[Config] = set()  # configs found valid (_config)
        self._scale_shapes: set[tuple] = set()  # (words, dtype) of scales found valid
        self._device_index = self.device.index if on_gpu else -1
        if type(copy_combine_tokens) is not int or copy_combine_tokens < 0:
            raise ValueError(
                f"copy_combine_tokens: expected an int >= 0, got {copy_combine_tokens!r}"
            )
        if type(copy_combine_chunks) is not int or copy_combine_chunks < 1:
            raise ValueError(
                f"copy_combine_chunks: expected an int >= 1, got {copy_combine_chunks!r}"
            )
        if type(copy_combine_last_share) is not int or copy_combine_last_share < 2:
            raise ValueError(
                f"copy_combine_last_share: expected an int >= 2, got {copy_combine_last_share!r}"
            )
        if type(copy_combine_min_tokens) is not int or copy_combine_min_tokens < 0:
            raise ValueError(
                f"copy_combine_min_tokens: expected an int >= 0, got {copy_combine_min_tokens!r}"
            )
        #: The copy-engine combine (``copy_combine_tokens``), or None.
        self.copy_combine: CopyCombine | None = None
        self.timeout_s = timeout_s  # also sets the kernels' limit (property below)
        if copy_combine_tokens:
            self.copy_combine = CopyCombine(
                self.group,
                hidden,
                max_topk,
                copy_combine_tokens,
                self.device,
                self.status,
                self._timeout_us,
                copy_combine_chunks,
                copy_combine_last_share,
                copy_combine_min_tokens,
            )
        #: Kernel traces (``profile=True``): :meth:`TraceRecorder.dump` writes them.
        self.trace = TraceRecorder.of(profile, self.rank, self.device, on_gpu)

    # ---------------------------------------------------------------------------- helpers
    def _config(self, config: Config | None) -> Config:
        config = config or self.default_config
        if config in self._configs:
            return config
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
        self._configs.add(config)
        return config

    def _check_fits_interpreter(
        self, config: Config, what: str, num_tokens: int, bounds: torch.Tensor | None = None
    ) -> None:
        """On CPU ranks every channel's tokens must fit its ring: the interpreter runs programs
        one by one. Channels are equal splits of ``num_tokens``, or the ranges ``bounds``."""
        if self.device.type == "cuda":
            return
        if bounds is None:
            widest = -(-num_tokens // config.num_channels)
        else:
            widest = int((bounds[1:] - bounds[:-1]).max()) if bounds.numel() > 1 else 0
        if widest > config.nvl_recv_buffer_tokens:
            raise ValueError(
                f"{what}: a channel of {widest} tokens exceeds the ring of "
                f"{config.nvl_recv_buffer_tokens} slots; on CPU ranks a channel must fit its "
                "ring (the interpreter runs programs one by one)"
            )

    def _plan(self, key: tuple, build) -> KernelLaunch:
        """The launch of one configuration (``key``: its options), built by ``build(key)`` on
        first use; plans built before a change of the launch constants are dropped."""
        if self._plans_version != _launch_version:
            self._plans.clear()
            self._plans_version = _launch_version
        plan = self._plans.get(key)
        if plan is None:
            kernel, grid, variant, call_type, options = build(key)
            meta = {**variant._asdict(), **options, **self.transport.options}
            if self.device.type == "cuda":
                meta["launch_cooperative_grid"] = True
            pointers = tuple(i for i, f in enumerate(call_type._fields) if f.endswith("_ptr"))
            plan = KernelLaunch(kernel, (grid,), meta, call_type._fields, pointers, self._unused)
            self._plans[key] = plan
        return plan

    def _launch(self, plan: KernelLaunch, name: str, call) -> None:
        if self.trace is not None:
            readings = self.trace.buffer(f"{self.label} {name}", plan.grid[0], True, True)
            call = call._replace(trace_ptr=readings)
        plan(call, self._shared)

    @property
    def timeout_s(self) -> float:
        """Limit of every wait inside the kernels, in seconds (idle time, for the rings), at
        most ``MAX_TIMEOUT_S``; it may change between calls, and a change compiles nothing."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._timeout_us = timeout_us(value)
        self._timeout_s = value
        # The kernels' trailing arguments (NormalShared), tensors and addresses.
        self._shared = Shared.of(
            NormalShared(
                peer_ptrs=self.heap.peer_ptrs,
                pe_ptr=self.transport.pes,
                rank=self.rank,
                state_ptr=self.state,
                status_ptr=self.status.words,
                timeout_us=self._timeout_us,
                decoded_ptr=self._decoded,
            )
        )
        if self.copy_combine is not None:
            self.copy_combine.timeout_us = self._timeout_us

    # ----------------------------------------------------------------------------- errors
    def check(self) -> None:
        """Wait for the device; raise what a kernel recorded: a wait that timed out
        (:class:`~tritonep.errors.WaitTimeoutError`), worst-case rows that overflowed or ids
        outside ``[-1, num_experts)`` (``ValueError``); or
        :class:`~tritonep.errors.HeapGuardError` if a kernel wrote past the heap's regions."""
        self.status.raise_recorded(self.status.synced_record(), self._raise)
        self.heap.check_guard()

    def _raise(self, words: list[int]) -> None:
        """Raise a record (:mod:`tritonep.kernels.status`), its ranks named as the caller knows
        them. Bad ids and an overflow were cleared first: the ranks stayed in step (the
        receivers drained their rings), so the next call may size its outputs better. A
        timeout stays."""
        code, peer, phase = words[:3]
        name = self._phases.get(phase, f"phase {phase}")
        if peer >= 0:
            peer = self._rank_names[peer]
        if code == STATUS_BAD_ID.value:
            raise bad_id_error([code, peer, *words[2:]], name, self.num_experts)
        check_status(
            [code, peer, *words[2:]], self._rank_names[self.rank], self._phases, "channel {}"
        )

    def raise_recorded(self) -> None:
        """Raise what this mode's kernels recorded so far (the host copy: no synchronization);
        nothing if nothing was recorded."""
        self.status.raise_recorded(self.status.record(), self._raise)

    # ----------------------------------------------------------------------------- layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor):
        """Routing statistics of ``topk_idx`` (``[N, K]`` int64 global expert ids, ``-1`` for
        none), from one kernel: ``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E]
        int32, is_token_in_rank [N, R] bool)``. Ids outside ``[-1, E)`` count as none and are
        recorded: the next dispatch or combine raises them (with ``check_ids``, this call
        does, before launching)."""
        with _no_torch_function():
            if self.check_ids or not self._ids_look_right(topk_idx, None):
                check_topk_idx(
                    "topk_idx", topk_idx, None, self.num_experts, self.device, self.check_ids
                )
            return self._layout(topk_idx)

    def _ids_look_right(self, topk_idx, num_tokens: int | None) -> bool:
        """Plain comparisons: ``topk_idx`` is a contiguous ``[num_tokens, K]`` int64 tensor on
        this mode's device with ``1 <= K <= max_topk`` (``num_tokens`` None: any)."""
        if not _plain(topk_idx, torch.int64, self._device_index) or topk_idx.dim() != 2:
            return False
        n, k = topk_idx.shape
        return (num_tokens is None or n == num_tokens) and 1 <= k <= self.max_topk

    # ----------------------------------------------------------------------------- notify
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
        Raises:
            :class:`~tritonep.errors.WaitTimeoutError` in exact mode, when the count exchange
            gave up (the count is unknown); what earlier calls recorded is left to the
            dispatch that follows (which raises it after its launches).
        """
        with _no_torch_function():
            return self._notify(
                is_token_in_rank,
                num_tokens_per_expert,
                num_tokens,
                expert_alignment,
                num_worst_tokens,
                self._config(config),
                send_counts,
                bounds,
                extra,
                channel_major,
            )

    def _notify(
        self,
        is_token_in_rank,
        num_tokens_per_expert,
        num_tokens,
        expert_alignment,
        num_worst_tokens,
        config,
        send_counts,
        bounds,
        extra,
        channel_major,
    ) -> NormalHandle:
        R, E_local, C = self.num_ranks, self.num_local_experts, config.num_channels
        device = self.device
        if send_counts is not None:
            check_tensor("send_counts", send_counts, dtype=torch.int32, shape=(R, C), device=device)
            in_rank = torch.zeros((num_tokens, R), dtype=torch.bool, device=device)
            counted = send_counts
        else:
            in_rank = counted = is_token_in_rank
        if bounds is not None:
            check_tensor("bounds", bounds, dtype=torch.int32, shape=(C + 1,), device=device)
        if device.type != "cuda":
            self._check_fits_interpreter(config, "x", num_tokens, bounds)
        X = 0
        if extra is not None:
            X = extra.shape[1]
            if not 1 <= X <= self.notify_extra:
                raise ValueError(
                    f"extra: expected 1 to {self.notify_extra} words per rank, got {X}"
                )
            check_tensor("extra", extra, dtype=torch.int32, shape=(R, X), device=device)
        counts = torch.empty(count_offsets(E_local, R, C)[2], dtype=torch.int32, device=device)
        host_info, recv_count, recv_start = count_views(counts, E_local, R, C)
        extra_out = torch.empty((R, X), dtype=torch.int32, device=device) if X else None
        exact = not num_worst_tokens
        options = NotifyOptions(config, send_counts is not None, X, channel_major, exact)
        plan = self._plans.get(options)
        if plan is None or self._plans_version != _launch_version:
            plan = self._plan(options, self._notify_plan)
        if exact:
            self._host_view[0] = 0  # (written by the launch)
        self._launch(
            plan,
            "notify",
            NotifyCall(
                counts_ptr=counted,
                num_tokens=num_tokens,
                per_expert_ptr=num_tokens_per_expert,
                extra_ptr=extra,
                alignment=expert_alignment,
                max_rows=num_worst_tokens,
                recv_count_ptr=recv_count,
                recv_start_ptr=recv_start,
                host_info_ptr=host_info,
                extra_out_ptr=extra_out,
                trace_ptr=None,
            ),
        )
        per_expert: list[int] | torch.Tensor
        source_rows, most_tokens = None, -1
        if num_worst_tokens:
            num_recv, rows = -1, num_worst_tokens
            per_expert = host_info[1:]
        else:
            num_recv = rows = self._received_count()
            per_expert, source_rows, most_tokens = self._host_counts_read()
            if channel_major:  # (a source's rows are not one range: no copy-engine combine)
                source_rows = None
        handle = NormalHandle(
            in_rank,
            counts,
            None,
            num_recv,
            rows,
            num_tokens,
            self.hidden,
            self.num_experts,
            config,
            per_expert,
            extra_out,
            bounds,
            send_counts is not None,
            source_rows,
            most_tokens,
        )
        handle.__dict__.update(host_info=host_info, recv_count=recv_count, recv_start=recv_start)
        return handle

    def _notify_plan(self, options: NotifyOptions):
        config, R, E_local = options.config, self.num_ranks, self.num_local_experts
        C = config.num_channels
        variant = NotifyVariant(
            NUM_RANKS=R,
            NUM_CHANNELS=C,
            E_LOCAL=E_local,
            ROW_WORDS=self.layout.notify_row,
            SET_BYTES=self.layout.notify_set,
            NOTIFY_OFFSET=self.layout.notify,
            STAGE_OFFSET=self.layout.stage_notify,
            EXTRA=options.extra,
            COUNTS_GIVEN=options.counts_given,
            CHANNEL_MAJOR=options.channel_major,
            HOST_COPY=options.host_copy,
            USE_CLOCK=use_clock(self.device),
            BLOCK_TOKENS=COUNT_TOKENS,
            BLOCK_CHANNELS=triton.next_power_of_2(C + 1),
            BLOCK_EXPERTS=triton.next_power_of_2(max(E_local, 2)),
            BLOCK_RANKS=triton.next_power_of_2(max(R, 2)),
            BLOCK_EXTRA=triton.next_power_of_2(max(options.extra, 2)),
            BLOCK_ROW=normal_notify.row_block(C + E_local + options.extra + 1, NOTIFY_WARPS),
            PROFILE=self.trace is not None,
            VIA=self.transport.via,
        )
        return (
            normal_notify.notify_kernel,
            R,
            variant,
            NotifyCall,
            {"num_warps": NOTIFY_WARPS},
        )

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
    ) -> NormalDispatchOutput[NormalHandle]:
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
            a :class:`NormalDispatchOutput`; in cached mode its handle is ``handle`` itself
            (its ``recv_src_idx`` rewritten with the same values).
        Raises:
            ``ValueError``/``TypeError`` naming the argument, before anything is launched;
            after its launches, what an earlier call recorded (module docs).
        """
        with _no_torch_function():  # raise_after, inlined (host time)
            earlier = self.status.recorded()
            out = self._dispatch(
                x,
                topk_idx,
                topk_weights,
                num_tokens_per_expert,
                is_token_in_rank,
                handle,
                expert_alignment,
                num_worst_tokens,
                config,
                src_tag,
                relay,
                row_map,
            )
            if earlier or (handle is None and not num_worst_tokens and self.status.recorded()):
                self.raise_recorded()
            return out

    def _check_x(self, x) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(payload [N, H], scales [N, S] token-major or None)``, checked: plain comparisons
        for the shapes :func:`check_dispatch_x` accepted before (scale words and dtype), else
        that check, which names what is wrong."""
        at, H = self._device_index, self.hidden
        if type(x) is tuple and len(x) == 2:
            payload, scales = x
            if (
                _plain(payload, torch.float8_e4m3fn, at)
                and type(scales) is torch.Tensor
                and scales.get_device() == at
                and payload.dim() == 2
                and payload.shape[1] == H
                and scales.dim() == 2
                and scales.shape[0] == payload.shape[0]
                and (scales.shape[1], scales.dtype) in self._scale_shapes
            ):
                if not scales.is_contiguous():  # the kernels read scales token-major
                    scales = scales.contiguous()
                return payload, scales
        elif _plain(x, torch.bfloat16, at) and x.dim() == 2 and x.shape[1] == H:
            return x, None
        payload = check_dispatch_x("x", x)
        if payload.shape[1] != H:
            raise ValueError(f"x: expected hidden size {H}, got {payload.shape[1]}")
        if payload.device != self.device:
            raise ValueError(f"x: expected a tensor on {self.device}, got {payload.device}")
        if type(x) is not tuple:
            return payload, None
        self._scale_shapes.add((x[1].shape[1], x[1].dtype))
        return payload, x[1].contiguous()

    def _dispatch(
        self,
        x,
        topk_idx=None,
        topk_weights=None,
        num_tokens_per_expert=None,
        is_token_in_rank=None,
        handle=None,
        expert_alignment=1,
        num_worst_tokens=0,
        config=None,
        src_tag=None,
        relay=None,
        row_map=None,
    ) -> NormalDispatchOutput[NormalHandle]:
        payload, scales = self._check_x(x)
        num_tokens, device = payload.shape[0], self.device
        if type(expert_alignment) is not int or expert_alignment < 1:
            raise ValueError(f"expert_alignment: expected a positive int, got {expert_alignment}")
        if type(num_worst_tokens) is not int or num_worst_tokens < 0:
            raise ValueError(f"num_worst_tokens: expected an int >= 0, got {num_worst_tokens}")
        cached = False
        recv_x = recv_scales = None
        if handle is not None:
            if not isinstance(handle, NormalHandle):  # (or a subclass: deep_ep's LegacyHandle)
                raise TypeError(f"handle: expected a NormalHandle, got {type(handle).__name__}")
            if handle.num_tokens != num_tokens:
                raise ValueError(
                    f"x: the handle is for {handle.num_tokens} tokens, got {num_tokens}"
                )
            if handle.ranks_from_ids and topk_idx is None:
                raise ValueError("topk_idx: required with a handle from notify(send_counts=...)")
            cached = handle.recv_src_idx is not None
            if cached:  # the ids stay (as DeepEP's)
                if relay is None and row_map is None and src_tag is None and self.trace is None:
                    recv_x, recv_scales = self._dispatch_outputs(payload, scales, handle)
                    if self._cached_dispatch(payload, scales, handle, recv_x, recv_scales):
                        out_x = recv_x if recv_scales is None else (recv_x, recv_scales)
                        return NormalDispatchOutput(out_x, None, None, None, handle)
                topk_idx = topk_weights = None
        if row_map is not None:
            if not cached:
                raise ValueError("row_map: only in cached mode (the handle of a dispatch)")
            check_tensor(
                "row_map", row_map, dtype=torch.int32, shape=(handle.num_rows,), device=device
            )
        has_topk = topk_idx is not None
        if has_topk:
            if self.check_ids or not self._ids_look_right(topk_idx, num_tokens):
                check_topk_idx(
                    "topk_idx", topk_idx, num_tokens, self.num_experts, device, self.check_ids
                )
                if topk_idx.shape[1] > self.max_topk:
                    raise ValueError(
                        f"topk_idx: top-k {topk_idx.shape[1]} exceeds max_topk={self.max_topk}"
                    )
            if topk_weights is not None and (
                not _plain(topk_weights, torch.float32, self._device_index)
                or topk_weights.shape != topk_idx.shape
            ):
                check_topk_weights("topk_weights", topk_weights, topk_idx)
        if handle is None:
            if not has_topk:
                raise ValueError("topk_idx: required without a handle")
            if relay is None and src_tag is None and self.trace is None:
                return self._routed_dispatch(
                    payload,
                    scales,
                    topk_idx,
                    topk_weights,
                    num_tokens_per_expert,
                    is_token_in_rank,
                    expert_alignment,
                    num_worst_tokens,
                    config,
                )
            handle = self._route(
                topk_idx,
                num_tokens_per_expert,
                is_token_in_rank,
                num_tokens,
                expert_alignment,
                num_worst_tokens,
                config,
            )
        if src_tag is not None:
            check_tensor("src_tag", src_tag, dtype=torch.int32, shape=(num_tokens,), device=device)
        topk = topk_idx.shape[1] if has_topk else 1
        rows = handle.num_rows
        awaits = relay is not None and relay.await_rows
        publish = relay is not None and relay.publish_to is not None
        options = DispatchOptions(
            config=handle.config,
            scale_words=scales.shape[1] if scales is not None else 0,
            block_k=_block_k(topk),
            has_topk=has_topk,
            has_weights=topk_weights is not None,
            has_tag=src_tag is not None,
            pad_rows=handle.num_recv_tokens < 0,
            bounds=handle.bounds is not None,
            awaits=awaits,
            ranks_from_ids=handle.ranks_from_ids and has_topk,
            publish=publish,
            row_map=row_map is not None,
        )
        plan = self._plans.get(options)
        if plan is None or self._plans_version != _launch_version:
            plan = self._plan(options, self._dispatch_plan)
        # Outputs.
        if recv_x is None:  # (else made for the template launch, which declined)
            recv_x, recv_scales = self._dispatch_outputs(payload, scales, handle)
        recv_topk_idx = recv_weights = None
        if has_topk:
            recv_topk_idx = empty_output(device, (rows, topk), torch.int64)
            if topk_weights is not None:
                recv_weights = empty_output(device, (rows, topk), torch.float32)
        # Cached mode writes the handle's sources again (the same values): no new handle.
        recv_src_idx = handle.recv_src_idx if cached else empty_output(device, (rows,), torch.int32)
        call = DispatchCall(
            x_ptr=payload,
            scales_ptr=scales,
            topk_idx_ptr=topk_idx,
            topk_weights_ptr=topk_weights,
            in_rank_ptr=handle.is_token_in_rank,
            src_tag_ptr=src_tag,
            num_tokens=num_tokens,
            K=topk,
            recv_count_ptr=handle.recv_count,
            recv_start_ptr=handle.recv_start,
            host_info_ptr=handle.host_info,
            per_expert_ptr=None,
            alignment=1,
            out_x_ptr=recv_x,
            out_scales_ptr=recv_scales,
            out_topk_idx_ptr=recv_topk_idx,
            out_weights_ptr=recv_weights,
            out_src_ptr=recv_src_idx,
            max_rows=rows,
            bounds_ptr=handle.bounds,
            ready_ptr=relay.flags if relay is not None else None,
            relay_call_ptr=relay.publish_to if publish else None,
            row_map_ptr=row_map,
            trace_ptr=None,
        )
        self._launch(plan, "dispatch", call)
        out_x = recv_x if recv_scales is None else (recv_x, recv_scales)
        if cached:
            if relay is None and row_map is None and src_tag is None and self.trace is None:
                key = _dispatch_key(payload, scales)
                _keep_handle_call(self, handle, key, plan, call, _D_GIVEN)
            return NormalDispatchOutput(out_x, None, None, None, handle)
        new_handle = self.handle_type(
            handle.is_token_in_rank,
            handle.counts,
            recv_src_idx,
            handle.num_recv_tokens,
            rows,
            num_tokens,
            self.hidden,
            self.num_experts,
            handle.config,
            bounds=handle.bounds,
            extra=handle.extra,
            source_rows=handle.source_rows,
            most_tokens=handle.most_tokens,
        )
        # Set on a handle from notify (a first dispatch, with or without top-k).
        per_expert = handle.num_recv_tokens_per_expert
        return NormalDispatchOutput(out_x, recv_topk_idx, recv_weights, per_expert, new_handle)

    def _dispatch_outputs(self, payload, scales, handle: NormalHandle):
        """``(recv_x, recv_scales or None)``: a dispatch's outputs, ``handle.num_rows`` rows."""
        rows, device = handle.num_rows, self.device
        recv_x = empty_output(device, (rows, self.hidden), payload.dtype)
        if scales is None:
            return recv_x, None
        return recv_x, empty_output(device, (rows, scales.shape[1]), scales.dtype)

    def _cached_dispatch(self, payload, scales, handle: NormalHandle, recv_x, recv_scales) -> bool:
        """Launch a dispatch with the handle of an earlier one, no relay, row map or source
        tags (``payload`` and ``scales`` checked), into ``recv_x`` and ``recv_scales``, from
        the handle's :class:`_HandleCall`: only the payload's and the outputs' arguments are
        new. The first such call with a handle makes the template from its addresses
        (:meth:`_dispatch_template`). False where the launch must take Triton's path (the
        first of its variant, a launch hook): :meth:`_dispatch` then launches by name."""
        key = _dispatch_key(payload, scales)
        calls = handle.__dict__.get("_calls")
        entry = calls.get(key) if calls is not None else None
        if entry is None or not entry.stands(self, handle):
            entry = self._dispatch_template(handle, key, scales)
        values = entry.values.copy()
        x, out = payload.data_ptr(), recv_x.data_ptr()
        values[_D_X], values[_D_OUT_X] = x, out
        aligned = entry.aligned | x | out
        if recv_scales is not None:
            s, out = scales.data_ptr(), recv_scales.data_ptr()
            values[_D_SCALES], values[_D_OUT_SCALES] = s, out
            aligned |= s | out
        return entry.launch.launch_values(values, self._shared, aligned)

    def _dispatch_template(self, handle: NormalHandle, key: tuple, scales) -> _HandleCall:
        """The :class:`_HandleCall` of a cached dispatch without a relay, row map or source
        tags (``key``: :func:`_dispatch_key`) with ``handle``, made from the addresses of its
        tensors set on the mode's template of such dispatches (the bundle :meth:`_dispatch`
        would launch by name, as :func:`_handle_call` keeps it: a test compares the two),
        kept on the handle."""
        bounds = handle.bounds
        config = handle.config
        pad_rows = handle.num_recv_tokens < 0
        base = self._templates.get((key, config, pad_rows, bounds is not None))
        if base is None or base[3] != _launch_version:
            base = self._dispatch_base(key, config, scales, pad_rows, bounds is not None)
        plan, values, aligned, _ = base
        values = values.copy()
        info, at_count, at_start = self._count_addresses(handle)
        values[_D_IN_RANK] = in_rank = handle.is_token_in_rank.data_ptr()
        values[_D_TOKENS] = handle.num_tokens
        values[_D_RECV_COUNT] = at_count
        values[_D_RECV_START] = at_start
        values[_D_HOST_INFO] = info
        assert handle.recv_src_idx is not None  # a cached dispatch's handle came from a dispatch
        values[_DH_SRC] = src = handle.recv_src_idx.data_ptr()
        values[_D_MAX_ROWS] = handle.num_rows
        aligned |= in_rank | info | at_count | at_start | src
        if bounds is not None:
            values[_DH_BOUNDS] = at = bounds.data_ptr()
            aligned |= at
        return self._keep_template(handle, key, plan, values, aligned)

    def _dispatch_base(self, key: tuple, config: Config, scales, pad_rows: bool, bounds: bool):
        """The mode's template of a cached dispatch of ``key`` (:func:`_dispatch_key`),
        ``config``, worst-case rows or not and channel ``bounds`` or not: ``(launch, values,
        aligned, version)``, the values of the handle's fields and of each call's 0
        (:meth:`_dispatch_template` sets the first)."""
        options = DispatchOptions(
            config=config,
            scale_words=0 if scales is None else scales.shape[1],
            block_k=2,  # (top-k 1: no ids move)
            has_topk=False,
            has_weights=False,
            has_tag=False,
            pad_rows=pad_rows,
            bounds=bounds,
            awaits=False,
            ranks_from_ids=False,
            publish=False,
            row_map=False,
        )
        plan = self._plan(options, self._dispatch_plan)
        null = self._unused.data_ptr()
        given = 0 if scales is not None else null
        call = DispatchCall(
            x_ptr=0,
            scales_ptr=given,
            topk_idx_ptr=null,
            topk_weights_ptr=null,
            in_rank_ptr=0,
            src_tag_ptr=null,
            num_tokens=0,
            K=1,
            recv_count_ptr=0,
            recv_start_ptr=0,
            host_info_ptr=0,
            per_expert_ptr=null,
            alignment=1,
            out_x_ptr=0,
            out_scales_ptr=given,
            out_topk_idx_ptr=null,
            out_weights_ptr=null,
            out_src_ptr=0,
            max_rows=0,
            bounds_ptr=0 if bounds else null,
            ready_ptr=null,
            relay_call_ptr=null,
            row_map_ptr=null,
            trace_ptr=null,
        )
        return self._keep_base((key, config, pad_rows, bounds), plan, call)

    def _routed_dispatch(
        self,
        payload,
        scales,
        topk_idx,
        topk_weights,
        num_tokens_per_expert,
        is_token_in_rank,
        expert_alignment,
        num_worst_tokens,
        config,
    ) -> NormalDispatchOutput[NormalHandle]:
        """A first dispatch (no handle) without a relay, source tags or traces, its inputs
        checked but the layout: the count exchange, then the rows, each launch's arguments set
        in place on its :class:`_RouteCall` template (by name on a launch that needs tensors:
        the first of a shape class, or one under a launch hook)."""
        num_tokens, topk = topk_idx.shape
        per_expert_in, in_rank = self._layout_of(
            topk_idx, num_tokens_per_expert, is_token_in_rank, num_tokens
        )
        config = self._config(config)
        if self._device_index < 0:
            self._check_fits_interpreter(config, "x", num_tokens)
        has_weights = topk_weights is not None
        key = (
            config,
            0 if scales is None else scales.shape[1],
            topk,
            has_weights,
            num_worst_tokens > 0,
        )
        route = self._routes.get(key)
        if route is None or route.version != _launch_version:
            route = self._route_call(key)
        device, null = self.device, route.null
        # The count exchange, into one allocation (the handle's views of it come when read).
        counts = torch.empty(route.count_words, dtype=torch.int32, device=device)
        rank, info = in_rank.data_ptr(), counts.data_ptr()
        count, start = info + route.count_bytes, info + route.start_bytes
        per_expert_at = per_expert_in.data_ptr()
        handles = rank | count | start | info
        if route.notify is not None:  # (else the dispatch launch exchanges the counts)
            values = route.notify_values.copy()
            values[_N_COUNTS] = rank
            values[_N_TOKENS] = num_tokens
            values[_N_PER_EXPERT] = per_expert_at
            values[_N_ALIGNMENT] = expert_alignment
            values[_N_MAX_ROWS] = num_worst_tokens
            values[_N_RECV_COUNT] = count
            values[_N_RECV_START] = start
            values[_N_HOST_INFO] = info
            if not num_worst_tokens:
                self._host_view[0] = 0  # (written by the launch)
            self._launch_notify(
                route,
                values,
                handles | per_expert_at | null,
                counts,
                in_rank,
                per_expert_in,
                config,
            )
        # The rows: first what does not depend on their number (in exact mode, while the
        # count is on its way).
        values = route.dispatch_values.copy()
        values[_D_X] = a = payload.data_ptr()
        values[_D_IDS] = b = topk_idx.data_ptr()
        values[_D_IN_RANK] = rank
        values[_D_TOKENS] = num_tokens
        values[_D_RECV_COUNT] = count
        values[_D_RECV_START] = start
        values[_D_HOST_INFO] = info
        aligned = handles | a | b | null
        if route.notify is None:
            values[_D_PER_EXPERT] = per_expert_at
            values[_D_ALIGNMENT] = expert_alignment
            aligned |= per_expert_at
        if scales is not None:
            values[_D_SCALES] = a = scales.data_ptr()
            aligned |= a
        if has_weights:
            values[_D_WEIGHTS] = a = topk_weights.data_ptr()
            aligned |= a
        per_expert: list[int] | torch.Tensor
        source_rows, most_tokens = None, -1
        if num_worst_tokens:
            num_recv, rows = -1, num_worst_tokens
            per_expert = counts[1 : 1 + self.num_local_experts]
        else:
            num_recv = rows = self._received_count()
            per_expert, source_rows, most_tokens = self._host_counts_read()
        recv_x = empty_output(device, (rows, self.hidden), payload.dtype)
        recv_topk_idx = empty_output(device, (rows, topk), torch.int64)
        recv_src_idx = empty_output(device, (rows,), torch.int32)
        values[_D_OUT_X] = c = recv_x.data_ptr()
        values[_D_OUT_IDS] = d = recv_topk_idx.data_ptr()
        values[_D_OUT_SRC] = e = recv_src_idx.data_ptr()
        values[_D_MAX_ROWS] = rows
        aligned |= c | d | e
        recv_scales = recv_weights = None
        if scales is not None:
            recv_scales = empty_output(device, (rows, scales.shape[1]), scales.dtype)
            values[_D_OUT_SCALES] = b = recv_scales.data_ptr()
            aligned |= b
        if has_weights:
            recv_weights = empty_output(device, (rows, topk), torch.float32)
            values[_D_OUT_WEIGHTS] = b = recv_weights.data_ptr()
            aligned |= b
        if not route.dispatch.launch_values(values, self._shared, aligned):
            host_info, recv_count, recv_start = count_views(
                counts, self.num_local_experts, self.num_ranks, config.num_channels
            )
            bundle = DispatchCall._make(values)._replace(
                x_ptr=payload,
                scales_ptr=scales,
                topk_idx_ptr=topk_idx,
                topk_weights_ptr=topk_weights,
                in_rank_ptr=in_rank,
                src_tag_ptr=None,
                recv_count_ptr=recv_count,
                recv_start_ptr=recv_start,
                host_info_ptr=host_info,
                per_expert_ptr=per_expert_in if route.notify is None else None,
                out_x_ptr=recv_x,
                out_scales_ptr=recv_scales,
                out_topk_idx_ptr=recv_topk_idx,
                out_weights_ptr=recv_weights,
                out_src_ptr=recv_src_idx,
                bounds_ptr=None,
                ready_ptr=None,
                relay_call_ptr=None,
                row_map_ptr=None,
                trace_ptr=None,
            )
            self._launch(route.dispatch, "dispatch", bundle)
        handle = self.handle_type(
            in_rank,
            counts,
            recv_src_idx,
            num_recv,
            rows,
            num_tokens,
            self.hidden,
            self.num_experts,
            config,
            source_rows=source_rows,
            most_tokens=most_tokens,
        )
        out_x = recv_x if recv_scales is None else (recv_x, recv_scales)
        return NormalDispatchOutput(out_x, recv_topk_idx, recv_weights, per_expert, handle)

    def _host_counts_read(self) -> tuple[list[int], list[int], int]:
        """``(aligned tokens per local expert, rows from each source, the most tokens any rank
        dispatched)``: what the exact-size notify wrote into host memory besides the count
        (read after :meth:`_received_count`)."""
        E, R, words = self.num_local_experts, self.num_ranks, self._host_view
        return words[2 : 2 + E], words[2 + E : 2 + E + R], words[2 + E + R]

    def _received_count(self) -> int:
        """The rows this rank receives, once the exact-size notify just launched has written
        them into host memory (the one wait of exact mode; the words it wrote stay in
        ``self._host_view``). Raises what that notify recorded if one of its waits timed out
        (the count is unknown: nothing can follow)."""

        def stuck():
            if self.status.recorded() == STATUS_TIMEOUT.value:
                self.raise_recorded()  # a wait that gave up names its peer and phase
            raise RuntimeError(
                f"rank {self._rank_names[self.rank]}: the notify launch ended without "
                "writing the received count"
            )

        wait_host_word(self._host_view, self.device, stuck)
        if self.status.recorded() == STATUS_TIMEOUT.value:
            self.raise_recorded()
        return self._host_view[1]

    def _launch_notify(
        self, route: _RouteCall, values: list, aligned: int, counts, in_rank, per_expert, config
    ) -> None:
        """Launch a first dispatch's notify from its template ``values`` (addresses), or by
        name with the tensors where the template's launch declines."""
        assert route.notify is not None  # routes without one fold notify into the dispatch
        if route.notify.launch_values(values, self._shared, aligned):
            return
        host_info, recv_count, recv_start = count_views(
            counts, self.num_local_experts, self.num_ranks, config.num_channels
        )
        call = NotifyCall._make(values)._replace(
            counts_ptr=in_rank,
            per_expert_ptr=per_expert,
            extra_ptr=None,
            recv_count_ptr=recv_count,
            recv_start_ptr=recv_start,
            host_info_ptr=host_info,
            extra_out_ptr=None,
            trace_ptr=None,
        )
        self._launch(route.notify, "notify", call)

    def _route_call(self, key: tuple) -> _RouteCall:
        """The :class:`_RouteCall` of ``key`` (config, scale words, top-k, weights given,
        worst-case outputs), made and kept."""
        config, scale_words, topk, has_weights, pad_rows = key
        # Worst-case outputs need no host read between the count exchange and the rows: one
        # launch does both (where rows are stored into peers directly).
        exchange = pad_rows and self.transport.via == transport.VIA_STORE.value
        notify = None
        if not exchange:
            notify_options = NotifyOptions(config, False, 0, False, not pad_rows)
            notify = self._plan(notify_options, self._notify_plan)
        options = DispatchOptions(
            config=config,
            scale_words=scale_words,
            block_k=_block_k(topk),
            has_topk=True,
            has_weights=has_weights,
            has_tag=False,
            pad_rows=pad_rows,
            bounds=False,
            awaits=False,
            ranks_from_ids=False,
            publish=False,
            row_map=False,
            exchange=exchange,
        )
        dispatch = self._plan(options, self._dispatch_plan)
        null = self._unused.data_ptr()
        scales = 0 if scale_words else null  # 0: set by each call
        weights = 0 if has_weights else null
        notify_call = NotifyCall(
            counts_ptr=0,
            num_tokens=0,
            per_expert_ptr=0,
            extra_ptr=null,
            alignment=0,
            max_rows=0,
            recv_count_ptr=0,
            recv_start_ptr=0,
            host_info_ptr=0,
            extra_out_ptr=null,
            trace_ptr=null,
        )
        dispatch_call = DispatchCall(
            x_ptr=0,
            scales_ptr=scales,
            topk_idx_ptr=0,
            topk_weights_ptr=weights,
            in_rank_ptr=0,
            src_tag_ptr=null,
            num_tokens=0,
            K=topk,
            recv_count_ptr=0,
            recv_start_ptr=0,
            host_info_ptr=0,
            per_expert_ptr=0 if exchange else null,
            alignment=1,
            out_x_ptr=0,
            out_scales_ptr=scales,
            out_topk_idx_ptr=0,
            out_weights_ptr=weights,
            out_src_ptr=0,
            max_rows=0,
            bounds_ptr=null,
            ready_ptr=null,
            relay_call_ptr=null,
            row_map_ptr=null,
            trace_ptr=null,
        )
        at_count, at_start, words = count_offsets(
            self.num_local_experts, self.num_ranks, config.num_channels
        )
        route = _RouteCall(
            notify,
            list(notify_call),
            dispatch,
            list(dispatch_call),
            null,
            _launch_version,
            words,
            4 * at_count,
            4 * at_start,
        )
        self._routes[key] = route
        return route

    def _route(
        self,
        topk_idx,
        num_tokens_per_expert,
        is_token_in_rank,
        num_tokens,
        expert_alignment,
        num_worst_tokens,
        config,
    ) -> NormalHandle:
        """The layout (unless given) and the count exchange of a first dispatch."""
        num_tokens_per_expert, is_token_in_rank = self._layout_of(
            topk_idx, num_tokens_per_expert, is_token_in_rank, num_tokens
        )
        return self._notify(
            is_token_in_rank,
            num_tokens_per_expert,
            num_tokens,
            expert_alignment,
            num_worst_tokens,
            self._config(config),
            None,
            None,
            None,
            False,
        )

    def _layout_of(self, topk_idx, num_tokens_per_expert, is_token_in_rank, num_tokens):
        """``(num_tokens_per_expert, is_token_in_rank)`` of a first dispatch: checked where
        given, else from :meth:`get_dispatch_layout`'s kernel."""
        R, device = self.num_ranks, self.device
        if (num_tokens_per_expert is None) != (is_token_in_rank is None):
            raise ValueError(
                "num_tokens_per_expert, is_token_in_rank: give both (from "
                "get_dispatch_layout) or neither"
            )
        if is_token_in_rank is None:
            per_rank, per_expert = self._layout_scratch
            in_rank = torch.empty((num_tokens, R), dtype=torch.bool, device=device)
            _, num_tokens_per_expert, is_token_in_rank = self._layout(
                topk_idx, out=(per_rank, per_expert, in_rank)
            )
        else:
            at = self._device_index
            if not _plain(is_token_in_rank, torch.bool, at) or is_token_in_rank.shape != (
                num_tokens,
                R,
            ):
                check_tensor(
                    "is_token_in_rank",
                    is_token_in_rank,
                    dtype=torch.bool,
                    shape=(num_tokens, R),
                    device=device,
                )
            if not _plain(num_tokens_per_expert, torch.int32, at) or (
                num_tokens_per_expert.shape != (self.num_experts,)
            ):
                check_tensor(
                    "num_tokens_per_expert",
                    num_tokens_per_expert,
                    dtype=torch.int32,
                    shape=(self.num_experts,),
                    device=device,
                )
        return num_tokens_per_expert, is_token_in_rank

    def _dispatch_plan(self, options: DispatchOptions):
        config, R, layout = options.config, self.num_ranks, self.layout
        G = options.scale_words
        W = self.hidden // 4 if G else self.hidden // 2  # words of an e4m3 or BF16 row
        r_p2 = triton.next_power_of_2(max(R, 2))
        warps = DISPATCH_WARPS if r_p2 <= 4 else max(4, DISPATCH_WARPS // 2)
        send_words = min(SEND_BW, triton.next_power_of_2(W))
        rows_per_source = max(1, STEP_ROWS // r_p2)
        local = not (options.awaits or options.ranks_from_ids)
        variant = DispatchVariant(
            ROW_WORDS=W,
            SCALE_WORDS=G,
            E_LOCAL=self.num_local_experts,
            NUM_RANKS=R,
            NUM_CHANNELS=config.num_channels,
            MAX_CHANNELS=layout.max_channels,
            RING=config.nvl_recv_buffer_tokens,
            RING_STRIDE=layout.ring_tokens,
            SLOT_BYTES=layout.dispatch_slot,
            RECORD_WORD=_align(W + G, 4),
            RING_OFFSET=layout.dispatch_ring,
            TAIL_OFFSET=layout.dispatch_tail,
            HEAD_OFFSET=layout.dispatch_head,
            STAGE_OFFSET=layout.stage_rings,
            HAS_SCALES=G > 0,
            HAS_TOPK=options.has_topk,
            HAS_WEIGHTS=options.has_weights,
            HAS_TAG=options.has_tag,
            PAD_ROWS=options.pad_rows,
            BOUNDS=options.bounds,
            AWAIT=options.awaits,
            RANKS_FROM_IDS=options.ranks_from_ids,
            PUBLISH=options.publish,
            # Own rows straight from the input, where it is complete before the launch (not
            # in a relay leg that awaits its rows or learns their destinations).
            LOCAL=local,
            ROW_MAP=options.row_map,
            RELEASE_STEPS=SEND_RELEASE_STEPS,
            USE_CLOCK=use_clock(self.device),
            BLOCK_TOKENS=_step_tokens(config, SEND_TILE * warps // 16 // send_words),
            BLOCK_ROWS=rows_per_source,
            BLOCK_SEND_WORDS=send_words,
            BLOCK_RECV_WORDS=min(RECV_TILE // (r_p2 * rows_per_source), triton.next_power_of_2(W)),
            BLOCK_RANKS=r_p2,
            BLOCK_K=options.block_k,
            BLOCK_SCALES=triton.next_power_of_2(max(G, 2)),
            EXCHANGE=options.exchange,
            NOTIFY_ROW_WORDS=layout.notify_row,
            NOTIFY_SET_BYTES=layout.notify_set,
            NOTIFY_OFFSET=layout.notify,
            NOTIFY_STAGE_OFFSET=layout.stage_notify,
            BLOCK_COUNT_TOKENS=COUNT_TOKENS,
            BLOCK_CHANNELS=triton.next_power_of_2(config.num_channels + 1),
            BLOCK_EXPERTS=triton.next_power_of_2(max(self.num_local_experts, 2)),
            BLOCK_NOTIFY_ROW=normal_notify.row_block(
                config.num_channels + self.num_local_experts + 1, warps
            ),
            PROFILE=self.trace is not None,
            VIA=self.transport.via,
        )
        grid = 2 * config.num_channels
        return (
            normal_dispatch.normal_dispatch_kernel,
            grid,
            variant,
            DispatchCall,
            {"num_warps": warps},
        )

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
            ``(combined_x [N, H] BF16, combined_topk_weights [N, K] float32 or None)``; a
            token one of whose rows never came (a wait that gave up) sums to NaN.
        Raises:
            ``ValueError``/``TypeError`` naming the argument, before anything is launched;
            after its launches, what an earlier call recorded (module docs).
        """
        with _no_torch_function():  # raise_after, inlined (host time)
            earlier = self.status.recorded()
            out = self._combine(x, handle, topk_weights, bias, relay, row_map)
            if earlier:
                self.raise_recorded()
            return out

    def _combine(self, x, handle, topk_weights=None, bias=None, relay=None, row_map=None):
        if not isinstance(handle, NormalHandle):  # (or a subclass: deep_ep's LegacyHandle)
            raise TypeError(f"handle: expected a NormalHandle, got {type(handle).__name__}")
        H, N, M = handle.hidden, handle.num_tokens, handle.num_rows
        device, at = self.device, self._device_index
        if not _plain(x, torch.bfloat16, at) or x.shape != (M, H):
            check_tensor("x", x, dtype=torch.bfloat16, shape=(M, H), device=device)
        K = 1
        if topk_weights is not None:
            if not _plain(topk_weights, torch.float32, at) or topk_weights.dim() != 2:
                check_tensor(
                    "topk_weights",
                    topk_weights,
                    dtype=torch.float32,
                    shape=(M, None),
                    device=device,
                )
            K = topk_weights.shape[1]
            if topk_weights.shape[0] != M:
                check_tensor("topk_weights", topk_weights, shape=(M, None))
            if not 1 <= K <= self.max_topk:
                raise ValueError(f"topk_weights: top-k {K} outside [1, {self.max_topk}]")
        if row_map is not None:
            if relay is None:  # own rows are read by the receivers, in the received order
                raise ValueError("row_map: only with a relay (the legs of the internode mode)")
            check_tensor("row_map", row_map, dtype=torch.int32, shape=(M,), device=device)
        terms = () if bias is None else bias if type(bias) is tuple else (bias,)
        if len(terms) > 2:
            raise ValueError(f"bias: at most two tensors, got {len(terms)}")
        for i, term in enumerate(terms):
            if not _plain(term, torch.bfloat16, at) or term.shape != (N, H):
                check_tensor(
                    f"bias[{i}]" if type(bias) is tuple else "bias",
                    term,
                    dtype=torch.bfloat16,
                    shape=(N, H),
                    device=device,
                )
        out = empty_output(device, (N, H), torch.bfloat16)
        out_weights = None
        if topk_weights is not None:
            out_weights = empty_output(device, (N, K), torch.float32)
        plain = relay is None and row_map is None and self.trace is None
        copies = self.copy_combine
        if plain and copies is not None and copies.serves(handle):
            copies(x, handle, topk_weights, terms, K, _block_k(K), out, out_weights)
            return out, out_weights
        if plain and self._fast_combine(x, handle, topk_weights, terms, K, out, out_weights):
            return out, out_weights
        config = handle.config
        if device.type != "cuda":
            self._check_fits_interpreter(config, "handle", N, handle.bounds)
        awaits = relay is not None and relay.await_rows
        publish = relay is not None and relay.publish_to is not None
        if awaits and relay.limit is None:
            raise ValueError("relay: a combine that awaits rows needs the relay's limit")
        options = CombineOptions(
            config=config,
            block_k=_block_k(K),
            has_weights=topk_weights is not None,
            num_bias=len(terms),
            bounds=handle.bounds is not None,
            relay=relay is not None,
            awaits=awaits,
            publish=publish,
            row_map=row_map is not None,
            x_aligned=x.data_ptr() % 16 == 0 or relay is not None,  # (no own rows read)
        )
        plan = self._plans.get(options)
        if plan is None or self._plans_version != _launch_version:
            plan = self._plan(options, self._combine_plan)
        call = CombineCall(
            x_ptr=x,
            weights_ptr=topk_weights,
            in_rank_ptr=handle.is_token_in_rank,
            num_tokens=N,
            num_rows=M,
            K=K,
            bias0_ptr=terms[0] if terms else None,
            bias1_ptr=terms[1] if len(terms) > 1 else None,
            recv_count_ptr=handle.recv_count,
            recv_start_ptr=handle.recv_start,
            out_ptr=out,
            out_weights_ptr=out_weights,
            bounds_ptr=relay.limit if awaits else handle.bounds,
            ready_ptr=relay.flags if relay is not None else None,
            relay_call_ptr=relay.publish_to if publish else None,
            row_map_ptr=row_map,
            trace_ptr=None,
        )
        self._launch(plan, "combine", call)
        if plain and options.x_aligned:  # (the fast path launches aligned inputs only)
            key = _combine_key(topk_weights, K, len(terms))
            _keep_handle_call(self, handle, key, plan, call, _C_GIVEN)
        return out, out_weights

    def _fast_combine(
        self, x, handle: NormalHandle, topk_weights, terms: tuple, K: int, out, out_weights
    ) -> bool:
        """Launch a combine without a relay or a row map (its tensors checked) into ``out``
        and ``out_weights`` from the handle's :class:`_HandleCall`: only the arguments of its
        tensors and outputs are new. The first such combine of a handle makes the template
        from its addresses (:meth:`_combine_template`). False where the launch must take
        Triton's path (the first of its variant, a launch hook): :meth:`_combine` then
        launches by name."""
        key = _combine_key(topk_weights, K, len(terms))
        calls = handle.__dict__.get("_calls")
        entry = calls.get(key) if calls is not None else None
        if entry is None or not entry.stands(self, handle):
            entry = self._combine_template(handle, key, K, len(terms))
        values = entry.values.copy()
        a, o = x.data_ptr(), out.data_ptr()
        values[_C_X], values[_C_OUT] = a, o
        aligned = entry.aligned | a | o
        if out_weights is not None:
            a, o = topk_weights.data_ptr(), out_weights.data_ptr()
            values[_C_WEIGHTS], values[_C_OUT_WEIGHTS] = a, o
            aligned |= a | o
        if terms:
            a = values[_C_BIAS0] = terms[0].data_ptr()
            aligned |= a
            if len(terms) > 1:
                a = values[_C_BIAS1] = terms[1].data_ptr()
                aligned |= a
        return entry.launch.launch_values(values, self._shared, aligned)

    def _combine_template(self, handle: NormalHandle, key: tuple, K: int, num_bias: int):
        """The :class:`_HandleCall` of a combine without a relay or a row map (``key``:
        :func:`_combine_key`) with ``handle``, made from the addresses of its tensors set on
        the mode's template of such combines (the bundle :meth:`_combine` would launch by
        name, as :func:`_handle_call` keeps it: a test compares the two), kept on the
        handle."""
        bounds = handle.bounds
        config = handle.config
        base = self._templates.get((key, config, bounds is not None))
        if base is None or base[3] != _launch_version:
            base = self._combine_base(key, config, K, num_bias, bounds is not None)
        plan, values, aligned, _ = base
        values = values.copy()
        _, at_count, at_start = self._count_addresses(handle)
        values[_CH_IN_RANK] = in_rank = handle.is_token_in_rank.data_ptr()
        values[_CH_TOKENS] = handle.num_tokens
        values[_CH_ROWS] = handle.num_rows
        values[_CH_RECV_COUNT] = at_count
        values[_CH_RECV_START] = at_start
        aligned |= in_rank | at_count | at_start
        if bounds is not None:
            values[_CH_BOUNDS] = at = bounds.data_ptr()
            aligned |= at
        return self._keep_template(handle, key, plan, values, aligned)

    def _combine_base(self, key: tuple, config: Config, K: int, num_bias: int, bounds: bool):
        """The mode's template of a combine of ``key`` (:func:`_combine_key`), ``config`` and
        channel ``bounds`` or not: ``(launch, values, aligned, version)``, the values of the
        handle's fields and of each call's 0 (:meth:`_combine_template` sets the first)."""
        has_weights = key[1] > 0
        options = CombineOptions(
            config=config,
            block_k=_block_k(K),
            has_weights=has_weights,
            num_bias=num_bias,
            bounds=bounds,
            relay=False,
            awaits=False,
            publish=False,
            row_map=False,
        )
        plan = self._plan(options, self._combine_plan)
        null = self._unused.data_ptr()
        call = CombineCall(
            x_ptr=0,
            weights_ptr=0 if has_weights else null,
            in_rank_ptr=0,
            num_tokens=0,
            num_rows=0,
            K=K,
            bias0_ptr=0 if num_bias else null,
            bias1_ptr=0 if num_bias > 1 else null,
            recv_count_ptr=0,
            recv_start_ptr=0,
            out_ptr=0,
            out_weights_ptr=0 if has_weights else null,
            bounds_ptr=0 if bounds else null,
            ready_ptr=null,
            relay_call_ptr=null,
            row_map_ptr=null,
            trace_ptr=null,
        )
        return self._keep_base((key, config, bounds), plan, call)

    def _count_addresses(self, handle: NormalHandle) -> tuple[int, int, int]:
        """The addresses of ``handle``'s ``host_info``, ``recv_count`` and ``recv_start``
        (:func:`count_offsets`), without making their views."""
        base = handle.counts.data_ptr()
        channels = handle.config.num_channels
        at = self._count_at.get(channels)
        if at is None:
            offsets = count_offsets(self.num_local_experts, self.num_ranks, channels)
            at = self._count_at[channels] = (4 * offsets[0], 4 * offsets[1])
        return base, base + at[0], base + at[1]

    def _keep_base(self, key: tuple, plan: KernelLaunch, call: tuple) -> tuple:
        """Keep under ``key`` the mode's template ``(plan, values, aligned, version)`` of
        ``call`` (addresses and ints, 0 in the fields each handle and each call set)."""
        values = list(call)
        aligned = 0
        for i in plan.pointers:
            aligned |= values[i]
        base = self._templates[key] = (plan, values, aligned, _launch_version)
        return base

    def _keep_template(
        self, handle: NormalHandle, key: tuple, plan: KernelLaunch, values: list, aligned: int
    ) -> _HandleCall:
        """Keep on ``handle`` under ``key`` the :class:`_HandleCall` of ``values`` (addresses
        and ints, 0 in the fields each call sets; ``aligned``: the or of the others)."""
        tensors = (handle.is_token_in_rank, handle.counts, handle.recv_src_idx, handle.bounds)
        entry = _HandleCall(plan, values, aligned, weakref.ref(self), _launch_version, tensors)
        _handle_calls(handle)[key] = entry
        return entry

    def _combine_plan(self, options: CombineOptions):
        config, R, H, layout = options.config, self.num_ranks, self.hidden, self.layout
        # A sender step holds [ranks x BLOCK_ROWS, BLOCK_WORDS] words: bounded, fewer rows
        # rather than narrower ones (a step's rows are contiguous).
        r_p2 = triton.next_power_of_2(max(R, 2))
        words = min(COMBINE_BW, triton.next_power_of_2(H // 2))
        rows = max(1, min(STEP_ROWS // r_p2, COMBINE_SEND_TILE // (r_p2 * words)))
        if options.awaits:  # reading a relay's rows (no tile in flight): half the rows, no spill
            rows = max(1, rows // 2)
        variant = CombineVariant(
            H=H,
            NUM_RANKS=R,
            NUM_CHANNELS=config.num_channels,
            MAX_CHANNELS=layout.max_channels,
            RING=config.nvl_recv_buffer_tokens,
            RING_STRIDE=layout.ring_tokens,
            SLOT_BYTES=layout.combine_slot,
            RING_OFFSET=layout.combine_ring,
            TAIL_OFFSET=layout.combine_tail,
            HEAD_OFFSET=layout.combine_head,
            STAGE_OFFSET=layout.stage_rings,
            HAS_WEIGHTS=options.has_weights,
            NUM_BIAS=options.num_bias,
            BOUNDS=options.bounds,
            AWAIT=options.awaits,
            PUBLISH=options.publish,
            # A relay's own rows go through the ring (not timed on GPUs without it).
            LOCAL=not options.relay,
            X_ALIGNED=options.x_aligned,
            ROW_MAP=options.row_map,
            RELEASE_STEPS=SEND_RELEASE_STEPS,
            USE_CLOCK=use_clock(self.device),
            BLOCK_TOKENS=_step_tokens(config, COMBINE_RECV_TILE // (r_p2 * 2 * words)),
            BLOCK_ROWS=rows,
            BLOCK_WORDS=words,
            BLOCK_RANKS=r_p2,
            BLOCK_K=options.block_k,
            PROFILE=self.trace is not None,
            VIA=self.transport.via,
        )
        # Sums round as in the reference (no fused multiply-add).
        grid = 2 * config.num_channels
        return (
            normal_combine.normal_combine_kernel,
            grid,
            variant,
            CombineCall,
            {
                "num_warps": COMBINE_WARPS,
                "enable_fp_fusion": False,
            },
        )

    def destroy(self) -> None:
        """Release the heap (collective: every rank calls it); raises if a wait had timed out
        (with the release's own failure, if a peer never arrived, as its cause)."""
        if self.copy_combine is not None:
            self.copy_combine.destroy()
        self.heap.close_checked(self.check)
