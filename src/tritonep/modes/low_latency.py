"""Low-latency mode: fixed per-expert receive slabs, online FP8, double buffering, no host sync.

Orchestrates :mod:`tritonep.kernels.ll_dispatch` and :mod:`tritonep.kernels.ll_combine` over
one symmetric heap. The heap of every rank holds, for each of two buffer sets (calls alternate
between them):

* dispatch receive slabs ``[E_local][R][max_tokens]`` of fixed-size messages
  (16-byte header, payload, scales), sized for the larger format (BF16's, but at hidden 8); a
  token's payload is stored once per rank, its other messages there being headers that
  refer to it;
* dispatch count flags ``[E_local][R]`` int64 (``call << 32 | count``);
* combine receive rows ``[max_tokens][max_topk][H]`` BF16;

plus ``[R]`` combine counters. Call counters live in a small device tensor, so calls need no
host synchronization and a captured CUDA graph can be replayed any number of times.

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

Errors without a host synchronization. Ids outside ``[-1, num_experts)`` are dropped by the
kernels and recorded, as is a wait that gave up, in the mode's status
(:mod:`tritonep.kernels.status`), whose host copy each call reads before it launches: the call
then launches as usual (so that its peers get what they wait for) and raises the recorded
error, a ``ValueError`` naming the token and the id, or a
:class:`~tritonep.errors.WaitTimeoutError` naming the rank, the peer and the phase.
:meth:`LowLatencyMode.check` waits for the device and raises the same. A timed-out call leaves
outputs that say so: a dispatch whose wait for a source gave up holds one row of 0xFF bytes
(NaN payload and scales, source token -1) where that source's block would start, counted in
``recv_count`` but in no ``layout_range`` block; a combine whose wait gave up returns NaN in
every row. A timeout stays (every later call raises it, and its outputs are poisoned the same
way, its waits giving up at once); bad ids are raised once.

The call path. Each configuration (dtypes, top-k, hook, statistics) gets a plan on its first
call: its kernels' variants (``DispatchVariant``, ``CombineVariant``), whose compiled kernels
later calls launch with addresses (:class:`~tritonep.kernels.launcher.KernelLaunch`). A call
then checks its tensors, allocates its outputs and launches, all under
``torch._C.DisableTorchFunction`` (a ``torch`` function mode, such as
``torch.set_default_device``'s, would otherwise intercept every tensor access). A dispatch
variant serves a class of batch sizes (one token; ids counted by adds, up to
:attr:`LowLatencyMode.count_adds`; beyond), compiled on the first call of its class: token counts
within a class are run-time values, so a new batch size of a class already used compiles nothing.
A dispatch checks ``x`` and ``topk_idx`` in full once per pair of shapes (and flags); later calls
with plain tensors of those shapes find their plan and batch class in one lookup.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
import triton

from ..heap import allocate
from ..kernels import ll_combine, ll_dispatch, phases, transport
from ..kernels.launcher import KernelLaunch, Shared
from ..kernels.ll_combine import CombineCall, CombineVariant
from ..kernels.ll_dispatch import DispatchCall, DispatchVariant, LowLatencyShared
from ..kernels.profiled import profiled
from ..kernels.status import STATUS_BAD_ID, Status, bad_id_error, check_status
from ..kernels.sync import DEFAULT_TIMEOUT_S, timeout_us, use_clock
from ..validation import (
    check_hidden,
    check_num_experts,
    check_ranks_agree,
    check_tensor,
    check_topk_idx,
    default_group,
)
from ..validation import (
    plain_tensor as _plain,
)
from .outputs import POISON_OUTPUTS
from .trace import SLOTS, TraceRecorder

MAX_TOPK = 16
#: The kernels as launched: compiled under the names profilers show
#: (``tritonep::low_latency::dispatch()``), by which DeepEP's benchmark finds them.
DISPATCH_KERNEL = profiled(ll_dispatch.ll_dispatch_kernel, "tritonep::low_latency::dispatch")
COMBINE_KERNEL = profiled(ll_combine.ll_combine_kernel, "tritonep::low_latency::combine")
PHASES = {
    code.value: phases.NAMES[code.value]
    for code in (
        phases.LL_DISPATCH_RECV,
        phases.LL_COMBINE_RECV,
        phases.LL_DISPATCH_IDS,
        phases.LL_COMBINE_IDS,
    )
}

_no_torch_function = torch._C.DisableTorchFunction
_Tensor, _BF16, _FLOAT32 = torch.Tensor, torch.bfloat16, torch.float32
_INT32, _INT64 = torch.int32, torch.int64


def _align(n: int, a: int = 128) -> int:
    return (n + a - 1) // a * a


def _groups(hidden: int) -> int:
    """Groups of 128 channels of a row, the last one partial where ``hidden`` is not a
    multiple of 128 (FP8 scales and LogFMT parameters are per group)."""
    return -(-hidden // 128)


def _rows_in_flight(hidden: int, itemsize: int, budget: int = 32768) -> int:
    """Rows a program moves per iteration: about ``budget`` bytes of (padded) payload in
    flight."""
    row_bytes = triton.next_power_of_2(_groups(hidden)) * 128 * itemsize
    return max(1, min(8, budget // row_bytes))


def message_bytes(hidden: int, use_fp8: bool) -> int:
    """One dispatch message: 16-byte header, payload, then float32 scales with FP8, from the
    next multiple of 16 bytes (:data:`~tritonep.kernels.ll_dispatch.HEADER_BYTES` +
    ``align(H, 16)``)."""
    payload = _align(hidden, 16) if use_fp8 else 2 * hidden
    scales = _groups(hidden) * 4 if use_fp8 else 0
    return _align(ll_dispatch.HEADER_BYTES.value + payload + scales, 16)


def combine_slot_bytes(hidden: int) -> int:
    """One row of the combine receive buffer: 256 bytes per group of 128 channels (``hidden``
    BF16 values, and room for a partial last group's LogFMT codes, which fill 160 of a group's
    bytes), then a float32 ``(log_amin, step)`` pair per group for LogFMT combines."""
    return 256 * _groups(hidden) + _align(_groups(hidden) * 8, 16)


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
        # Either format fits (BF16 messages are the larger but at hidden 8: 32 bytes, FP8's 48).
        message = max(message_bytes(hidden, False), message_bytes(hidden, True))
        recv_set = _align(e_local * num_ranks * max_tokens * message)
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


class HandleLayout(NamedTuple):
    """Where a dispatch's handle keeps its tensors, and the sizes a combine checks it against.

    The dispatch's one int32 allocation for ``recv_count`` (``[E_local]`` from word 0) also
    holds the handle's ``words`` from word ``first_word``, on a 16-byte boundary: counted from
    there, ``recv_src_info`` and then ``recv_topk_slot`` (``[E_local, R * max_tokens]`` each;
    together the dispatch kernel's ``[2, E_local, R * max_tokens]``) from word 0, and
    ``recv_layout_range`` (``[E_local, R]`` int64) from word ``range_word``, on a 16-byte
    boundary.
    """

    num_local_experts: int
    num_ranks: int
    max_tokens: int
    hidden: int
    num_experts: int
    first_word: int
    range_word: int
    words: int

    @staticmethod
    def of(num_ranks: int, max_tokens: int, hidden: int, num_experts: int) -> HandleLayout:
        e_local = num_experts // num_ranks
        range_word = _align(2 * e_local * num_ranks * max_tokens, 4)
        words = range_word + 2 * e_local * num_ranks
        return HandleLayout(
            e_local,
            num_ranks,
            max_tokens,
            hidden,
            num_experts,
            _align(e_local, 4),
            range_word,
            words,
        )

    def views(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(recv_src_info, recv_topk_slot, recv_layout_range)``, views of ``block``."""
        E, rows = self.num_local_experts, self.num_ranks * self.max_tokens
        src_info, topk_slot = block[: 2 * E * rows].view(2, E, rows).unbind(0)
        layout_range = block[self.range_word :].view(torch.int64).view(E, self.num_ranks)
        return src_info, topk_slot, layout_range


class LowLatencyHandle(Sequence):
    """What combine needs from dispatch: a sequence of eight items, the first five DeepEP's
    handle (indexing, ``len`` and unpacking work as on DeepEP's tuple), each also an attribute.

    Items:
        recv_src_info: ``[E_local, R * max_tokens]`` int32 token index on the source rank.
        recv_layout_range: ``[E_local, R]`` int64 ``begin << 32 | count`` per source rank.
        num_max_dispatch_tokens_per_rank: as given to dispatch.
        hidden: hidden size.
        num_experts: experts in total.
        recv_topk_slot: ``[E_local, R * max_tokens]`` int32 top-k column of each row.
        num_tokens, topk: the shape of the dispatch's ``topk_idx``; combine takes ids of
            that shape, whose rows it reads back from the slots of those tokens.

    The three tensors live in ``storage``, the allocation whose first words are the
    dispatch's ``recv_count``, laid out as ``layout`` (:class:`HandleLayout`) says; ``block``
    (their words) and each view are made when first read (a combine takes the addresses from
    ``storage`` and makes none).
    """

    __slots__ = ("_block", "_views", "layout", "num_tokens", "storage", "topk")

    ITEMS = (
        "recv_src_info",
        "recv_layout_range",
        "num_max_dispatch_tokens_per_rank",
        "hidden",
        "num_experts",
        "recv_topk_slot",
        "num_tokens",
        "topk",
    )

    def __init__(
        self, storage: torch.UntypedStorage, layout: HandleLayout, num_tokens: int, topk: int
    ):
        self.storage, self.layout, self.num_tokens, self.topk = storage, layout, num_tokens, topk
        self._block: torch.Tensor | None = None
        self._views: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def block(self) -> torch.Tensor:
        """The handle's ``layout.words`` int32 words (a tensor over ``storage``)."""
        if self._block is None:
            empty = torch.empty(0, dtype=torch.int32, device=self.storage.device)
            words = (self.layout.words,)
            self._block = empty.set_(self.storage, self.layout.first_word, words, (1,))
        return self._block

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._views is None:
            self._views = self.layout.views(self.block)
        return self._views

    @property
    def recv_src_info(self) -> torch.Tensor:
        return self._tensors()[0]

    @property
    def recv_topk_slot(self) -> torch.Tensor:
        return self._tensors()[1]

    @property
    def recv_layout_range(self) -> torch.Tensor:
        return self._tensors()[2]

    @property
    def num_max_dispatch_tokens_per_rank(self) -> int:
        return self.layout.max_tokens

    @property
    def hidden(self) -> int:
        return self.layout.hidden

    @property
    def num_experts(self) -> int:
        return self.layout.num_experts

    def __len__(self) -> int:
        return len(self.ITEMS)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(getattr(self, name) for name in self.ITEMS[index])
        return getattr(self, self.ITEMS[index])

    def __iter__(self):
        return (getattr(self, name) for name in self.ITEMS)

    def __repr__(self) -> str:
        layout = self.layout
        return (
            f"LowLatencyHandle(num_max_dispatch_tokens_per_rank={layout.max_tokens}, "
            f"hidden={layout.hidden}, num_experts={layout.num_experts}, "
            f"num_tokens={self.num_tokens}, topk={self.topk})"
        )


class _Plan(NamedTuple):
    """The launches of one configuration (see :meth:`LowLatencyMode._plan`) and, for a
    dispatch, how its outputs are allocated: empty tensors of their dtypes, with the shapes
    and strides to allocate (:meth:`LowLatencyMode._dispatch_plan`); ``()`` for a combine."""

    both: KernelLaunch | None
    send: KernelLaunch
    receive: KernelLaunch
    outputs: tuple


class LowLatencyMode:
    """Low-latency dispatch and combine for one expert-parallel group.

    Args:
        group: the process group (default: the world); every rank constructs it together.
        num_max_dispatch_tokens_per_rank: most tokens one rank dispatches in a call.
        hidden: hidden size, a multiple of 8 (BF16 rows of a multiple of 16 bytes; e.g.
            gpt-oss's 2880, whose last group of 128 channels, and scale, covers 64).
        num_experts: experts in total, a multiple of the number of ranks.
        max_topk: largest top-k a call may use (1 to 16).
        device: a CUDA device, or ``"cpu"`` for CPU ranks (kernels under the interpreter).
        timeout_s: limit of every wait inside the kernels.
        num_programs: programs per launch (default: up to 128 on GPUs, leaving some SMs
            free; 4 on CPU).
        check_ids: also read the top-k ids on the host before each call and raise
            ``ValueError`` there for ids outside ``[-1, num_experts)``, before anything is
            launched. That read waits for the GPU (skipped inside CUDA-graph capture).
            Without it the kernels drop such ids and the next call raises (module docs).
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
        check_ids: bool = False,
        profile: bool | TraceRecorder = False,
        gpus_per_node: int | None = None,
        enable_shrink: bool = False,
    ):
        self.group = default_group(group)
        check_ranks_agree(
            self.group,
            "LowLatencyMode",
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
            hidden=hidden,
            num_experts=num_experts,
            max_topk=max_topk,
            num_programs=num_programs,
            device_type=torch.device(device).type if device is not None else None,
            gpus_per_node=gpus_per_node,
            enable_shrink=enable_shrink,
        )
        self.check_ids = check_ids
        self.enable_shrink = bool(enable_shrink)
        self.rank = dist.get_rank(self.group)
        self.num_ranks = dist.get_world_size(self.group)
        self.num_local_experts = check_num_experts(num_experts, self.num_ranks)
        check_hidden("hidden", hidden, 8)
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
        self.state = torch.zeros(
            ll_dispatch.STATE_ROWS * num_programs, dtype=torch.int64, device=self.device
        )
        #: What went wrong, on the device and in host memory (:mod:`tritonep.kernels.status`).
        self.status = Status(self.device)
        # Dispatch senders: per-program slot counters and lists, and per-expert counts of
        # stored messages (the completing program zeroes each for the next call).
        # At least 2 bins: the scratch row (3 * bins + TOKEN_WORDS int32) stays even, so its
        # int64 words (the counting tally, the destination list) are 8-byte aligned in every
        # program's row.
        self._bins = triton.next_power_of_2(max(num_experts, 2))
        self.scratch = torch.empty(
            num_programs,
            3 * self._bins + ll_dispatch.TOKEN_WORDS.value,
            dtype=torch.int32,
            device=self.device,
        )
        self.expert_done = torch.zeros(self._bins, dtype=torch.int32, device=self.device)
        # Per (x shape, ids shape, flags) of a dispatch: (plan, num_tokens, topk).
        self._calls: dict[tuple, tuple] = {}
        self.count_adds = ll_dispatch.COUNT_ADDS
        #: ``[R]`` int32, 1 where a peer is masked (shrink mode; change it in stream order).
        self.peer_mask = torch.zeros(self.num_ranks, dtype=torch.int32, device=self.device)
        # Per source rank: the verdicts of the last dispatch and combine receive (call
        # tagged), and the combines whose signal was not waited for.
        self._verdicts = torch.zeros(2, self.num_ranks, dtype=torch.int64, device=self.device)
        self._skipped = torch.zeros(self.num_ranks, dtype=torch.int64, device=self.device)
        self._combine_input: torch.Tensor | None = None
        on_gpu = use_clock(self.device)
        #: Kernel traces (``profile=True``): :meth:`TraceRecorder.dump` writes them.
        self.trace = TraceRecorder.of(profile, self.rank, self.device, on_gpu)
        # Readings of untraced launches: only the interpreter's logical clock (the last word)
        # is ever used, by wait statistics.
        self._untraced = torch.zeros(
            num_programs * SLOTS + 1, dtype=torch.int64, device=self.device
        )
        # The lanes of a receiving program's group of dispatch items: its (expert, source)
        # items together where the batch is small and all counts come at once; for larger
        # batches, whose counts come spread out, one at a time (BLOCK_ITEMS 1), so that it
        # packs one while the next one's counts are still on the way (4x H100: 2 together
        # 14.6-14.7 against 15.1-15.5 us at 32 tokens, 26.0-26.9 against 24.6-24.7 at 128;
        # BENCHMARKS.md).
        self._items = min(4, triton.next_power_of_2(-(-num_experts // num_programs)))
        self._plans: dict[tuple, _Plan] = {}
        self._device_index = self.device.index if self.device.type == "cuda" else -1
        self._shared_args()
        # What a call needs besides its tensors: the handle's layout, the addresses of the
        # defaults of optional pointer arguments, the combine's expected input shape.
        self._handle_layout = HandleLayout.of(self.num_ranks, self.max_tokens, hidden, num_experts)
        self._slot_offset = 4 * self.num_local_experts * self.num_ranks * self.max_tokens
        self._range_offset = 4 * self._handle_layout.range_word
        self._handle_offset = 4 * self._handle_layout.first_word
        self._state_address = self.state.data_ptr()
        self._untraced_address = self._untraced.data_ptr()
        self._combine_shape = (self.num_local_experts, self.num_ranks * self.max_tokens, hidden)
        self._stats_shape = (self.num_local_experts,)
        self._count_words = self._handle_layout.first_word + self._handle_layout.words
        self._recorded = self.status.recorded
        # Outputs are allocated with new_empty on empty tensors of their dtype (their sizes
        # as separate ints): faster than torch.empty, whose keywords cost more to parse.
        self._empty_int32 = torch.empty(0, dtype=torch.int32, device=self.device)
        self._empty_bf16 = torch.empty(0, dtype=torch.bfloat16, device=self.device)

    def _shared_args(self) -> None:
        """The kernels' trailing arguments (:class:`LowLatencyShared`), tensors and addresses."""
        self._shared = Shared.of(
            LowLatencyShared(
                peer_ptrs=self.heap.peer_ptrs,
                pe_ptr=self.transport.pes,
                rank=self.rank,
                state_ptr=self.state,
                scratch_ptr=self.scratch,
                expert_done_ptr=self.expert_done,
                status_ptr=self.status.words,
                timeout_us=self._timeout_us,
                mask_ptr=self.peer_mask,
                verdict_ptr=self._verdicts,
                skipped_ptr=self._skipped,
            )
        )

    @property
    def count_adds(self) -> int:
        """Dispatch senders count the batch's ids by atomic adds while (programs with tokens)
        x tokens x top-k stays within this, by histograms beyond; 0: always histograms."""
        return self._count_adds

    @count_adds.setter
    def count_adds(self, value: int) -> None:
        self._count_adds = value
        self._calls.clear()  # their batch classes follow from it

    @property
    def timeout_s(self) -> float:
        """Limit of every wait inside the kernels, in seconds, at most ``MAX_TIMEOUT_S``. It
        may change between calls and a change compiles nothing (nor does a new batch size of
        a class already used). With ``enable_shrink``, a limit shorter than a peer's first call
        of a kernel variant (which compiles it: seconds) masks a live peer, so warm up every
        variant (dtype, hook, top-k, batch class: one token, up to ``count_adds`` ids, beyond)
        under a long limit, then shorten it."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._timeout_us = timeout_us(value)
        self._timeout_s = value
        if hasattr(self, "_shared"):
            self._shared_args()

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

    # ------------------------------------------------------------------------------ plans
    def _plan(self, kernel, call_type, variant, options: dict, outputs: tuple = ()) -> _Plan:
        """The launches of one configuration: both phases, send, receive. On GPUs
        without a hook both phases run in one cooperative launch (receivers spin on senders
        of the same launch, so all programs must be resident); with a hook, or under the
        interpreter (which runs programs one after another), they are two launches. A launch
        that only receives puts nothing, so it is not linked with NVSHMEM."""
        pointers = tuple(i for i, name in enumerate(call_type._fields) if name.endswith("_ptr"))
        grid = (self.num_programs,)

        def launch(do_send, do_recv, cooperative=False):
            meta = {**variant._replace(DO_SEND=do_send, DO_RECV=do_recv)._asdict(), **options}
            if do_send:
                meta.update(self.transport.options)
            if cooperative:
                meta["launch_cooperative_grid"] = True
            return KernelLaunch(kernel, grid, meta, call_type._fields, pointers)

        both = launch(True, True, True) if self.device.type == "cuda" else None
        return _Plan(both, launch(True, False), launch(False, True), outputs)

    def _launch_split(self, plan: _Plan, values: tuple, hook: bool, bundle, tensors: tuple):
        """Launch a call's phases as two launches (a hook, the interpreter) or traced, with
        ``values``: its bundle's fields, each tensor given as its address
        (:meth:`KernelLaunch.launch_values`). Returns the hook that receives (``hook``) or
        None; or False where the send needs the tensors (a first call, the interpreter,
        traces, a launch hook): nothing was launched then, and the caller launches its bundle
        through :meth:`_launch`. A receive that needs them makes it: ``bundle(values,
        *tensors)``."""
        if self.trace is not None or not plan.send.launch_values(values, self._shared):
            return False
        receive = plan.receive

        def received():
            if not receive.launch_values(values, self._shared):
                with _no_torch_function():
                    receive(bundle(values, *tensors), self._shared)

        if hook:
            return received
        received()
        return None

    def _launch(self, plan: _Plan, name: str, call, return_recv_hook: bool):
        """Launch a call's phases from its bundle (tensors); returns the hook that receives
        (``return_recv_hook``), else None."""
        both, send, receive = plan.both, plan.send, plan.receive
        if self.trace is None:
            if both is not None and not return_recv_hook:
                both(call, self._shared)
                return None
            send(call, self._shared)
            if not return_recv_hook:
                receive(call, self._shared)
                return None
        elif both is not None and not return_recv_hook:
            both(self._traced(call, name, True, True), self._shared)
            return None
        else:
            send(self._traced(call, name, True, False), self._shared)

        def hook():
            with _no_torch_function():
                received = call if self.trace is None else self._traced(call, name, False, True)
                receive(received, self._shared)

        if return_recv_hook:
            return hook
        hook()
        return None

    def _traced(self, call, name: str, send: bool, receive: bool):
        """``call`` with a readings buffer of its own (``profile``)."""
        assert self.trace is not None  # callers trace only with profile on
        readings = self.trace.buffer(name, self.num_programs, send, receive)
        return call._replace(trace_ptr=readings)

    # ------------------------------------------------------------------------------ errors
    def check(self) -> None:
        """Wait for the device and raise what a kernel recorded: :class:`WaitTimeoutError` if
        a wait gave up (never in shrink mode, where the peer is masked instead), ``ValueError``
        for ids outside ``[-1, num_experts)``; or
        :class:`~tritonep.errors.HeapGuardError` if a kernel wrote past the heap's regions."""
        self.status.raise_recorded(self.status.synced_record(), self._raise)
        self.heap.check_guard()

    def _raise(self, words: list[int]) -> None:
        code, _, phase = words[:3]
        if code == STATUS_BAD_ID.value:
            raise bad_id_error(words, PHASES.get(phase, f"phase {phase}"), self.num_experts)
        check_status(words, self.rank, PHASES, "expert {}")

    def _raise_recorded(self, hook) -> None:
        """Raise what an earlier call recorded, once this call's launches are made (its
        receive too: a rank that stopped between its phases would fall out of step)."""
        if hook is not None:
            hook()
        self.status.raise_recorded(self.status.record(), self._raise)

    @staticmethod
    def _poison(*outputs: torch.Tensor | None) -> None:
        """(Tests, ``POISON_OUTPUTS``) fill fresh outputs with 0xFF bytes, so that unwritten
        rows show: NaN or -1."""
        for t in outputs:
            if t is not None:
                # torch's stubs lack UntypedStorage.fill_, which exists at run time.
                t.untyped_storage().fill_(0xFF)  # type: ignore[attr-defined]

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
        recv_stats: torch.Tensor | None = None,
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
            recv_stats: optional ``[E_local]`` int32; the rows each local expert received
                are added to it (DeepEP's ``cumulative_local_expert_recv_stats``).
        Returns:
            ``(recv_x, recv_count, handle, hook)``: ``recv_x`` is ``[E_local, R * max, H]``
            BF16, or float8_e4m3fn with ``use_fp8`` (then a tuple with the scales: float32
            ``[E_local, R * max, ceil(H / 128)]``, or with ``pack_ue8m0`` int32
            ``[E_local, R * max, ceil(H / 512)]`` whose byte ``g % 4`` of column ``g // 4`` is
            the biased exponent of group ``g``; a partial last group of 128 channels has a
            scale of its own; rows past ``recv_count[e]`` are undefined, and so are the bytes
            of groups past ``ceil(H / 128)``),
            ``recv_count`` ``[E_local]`` int32, a :class:`LowLatencyHandle`, and the hook
            (None unless ``return_recv_hook``). The scales are column-major within each
            expert (strides ``(columns * R * max, 1, R * max)``), the layout in which
            TMA-based grouped GEMMs read them (DeepEP's); ``.contiguous()`` gives row-major.
        Raises:
            ``ValueError``/``TypeError`` naming the argument, before anything is launched;
            after its launches, what an earlier call recorded (module docs).
        """
        with _no_torch_function():
            recorded = self._recorded()
            out = self._dispatch(
                x,
                topk_idx,
                use_fp8,
                use_ue8m0 or pack_ue8m0,
                return_recv_hook,
                wait_stats,
                pack_ue8m0,
                recv_stats,
            )
            if recorded:
                self._raise_recorded(out[3])
            return out

    def _dispatch(self, x, topk_idx, use_fp8, use_ue8m0, hook, wait_stats, pack_ue8m0, recv_stats):
        at = self._device_index
        # A call with plain x and ids of shapes seen before takes their checked shapes and its
        # plan from one lookup (x and ids are checked in full once per shape).
        key = None
        if (
            type(x) is _Tensor
            and type(topk_idx) is _Tensor
            and x.dtype is _BF16
            and topk_idx.dtype is _INT64
            and x.get_device() == at
            and topk_idx.get_device() == at
            and x.is_contiguous()
            and topk_idx.is_contiguous()
            and not self.check_ids
        ):
            key = (
                x.shape,
                topk_idx.shape,
                use_fp8,
                use_ue8m0,
                pack_ue8m0,
                hook,
                wait_stats is None,
                recv_stats is None,
            )
            call = self._calls.get(key)
        if key is None or call is None:
            call = self._dispatch_call(
                x, topk_idx, use_fp8, use_ue8m0, hook, wait_stats, pack_ue8m0, recv_stats, key
            )
        plan, num_tokens, topk = call
        stats_address = self._state_address
        if wait_stats is not None:
            if not _plain(wait_stats, _INT64, at) or wait_stats.shape != (self.num_ranks,):
                check_tensor(
                    "wait_stats",
                    wait_stats,
                    dtype=_INT64,
                    shape=(self.num_ranks,),
                    device=self.device,
                )
            stats_address = wait_stats.data_ptr()
        if recv_stats is not None:
            if not (
                type(recv_stats) is _Tensor
                and recv_stats.dtype is _INT32
                and recv_stats.get_device() == at
                and recv_stats.is_contiguous()
                and recv_stats.shape == self._stats_shape
            ):  # plain_tensor, inlined: DeepEP's users pass these statistics on every call
                check_tensor(
                    "cumulative_local_expert_recv_stats",
                    recv_stats,
                    dtype=_INT32,
                    shape=self._stats_shape,
                    device=self.device,
                )
            count_stats = recv_stats.data_ptr()

        # Fresh outputs (users keep them). recv_count's allocation also holds the handle's
        # three tensors (HandleLayout), one allocation less per call (each costs about 2 us
        # of host time on a GPU, a view as much): it is resized in place to [E_local], and
        # the handle keeps its storage.
        empty_x, x_shape, empty_scales, scale_shape, scale_strides = plan.outputs
        recv_x = empty_x.new_empty(*x_shape)
        recv_count = self._empty_int32.new_empty(self._count_words)
        recv_count.resize_(self.num_local_experts)
        storage = recv_count.untyped_storage()
        count = recv_count.data_ptr()
        if empty_scales is None:
            recv_scales = None
            scales = count
        else:
            recv_scales = empty_scales.new_empty_strided(scale_shape, scale_strides)
            scales = recv_scales.data_ptr()
        if POISON_OUTPUTS:
            self._poison(recv_x, recv_scales, recv_count)  # (the whole storage: the handle's too)
        handle = LowLatencyHandle(storage, self._handle_layout, num_tokens, topk)
        x_address, ids = x.data_ptr(), topk_idx.data_ptr()
        out_x, src = recv_x.data_ptr(), count + self._handle_offset
        if recv_stats is None:
            count_stats = count
        # DispatchCall's fields in order, tensors as addresses: those of _dispatch_bundle's
        # (tests/test_call_path.py compares them).
        values = (
            x_address,
            ids,
            num_tokens,
            out_x,
            scales,
            src,  # out_src_ptr: recv_src_info, then recv_topk_slot
            count,
            src + self._range_offset,  # out_range_ptr: recv_layout_range (16-byte aligned)
            count_stats,
            stats_address,
            self._untraced_address,  # trace_ptr
        )
        # Outputs and the mode's own tensors are 16-byte aligned: the inputs decide.
        aligned = x_address | ids | count_stats | stats_address | out_x | scales | src
        both = plan.both
        if both is not None and not hook and self.trace is None:
            receive = None if both.launch_values(values, self._shared, aligned) else False
        else:
            tensors = (x, topk_idx, recv_x, recv_scales, recv_count, handle, recv_stats, wait_stats)
            receive = self._launch_split(plan, values, hook, self._dispatch_bundle, tensors)
        if receive is False:
            call = self._dispatch_bundle(
                values, x, topk_idx, recv_x, recv_scales, recv_count, handle, recv_stats, wait_stats
            )
            receive = self._launch(plan, "low-latency dispatch", call, hook)
        return (recv_x, recv_scales) if use_fp8 else recv_x, recv_count, handle, receive

    def _dispatch_call(
        self, x, topk_idx, use_fp8, use_ue8m0, hook, wait_stats, pack_ue8m0, recv_stats, key
    ):
        """Check ``x`` and ``topk_idx`` in full and find the call's plan (``(plan, num_tokens,
        topk)``), kept under ``key`` (None: not kept, e.g. with ``check_ids``)."""
        M, H, device = self.max_tokens, self.hidden, self.device
        at = self._device_index
        shape: tuple[int, ...] = x.shape if _plain(x, _BF16, at) else ()
        if len(shape) != 2 or shape[1] != H:
            check_tensor("x", x, dtype=_BF16, shape=(None, H), device=device)
        num_tokens = x.shape[0]
        if num_tokens > M:
            raise ValueError(f"x: {num_tokens} tokens exceed num_max_dispatch_tokens_per_rank={M}")
        ids_shape: tuple[int, ...] = topk_idx.shape if _plain(topk_idx, _INT64, at) else ()
        if self.check_ids or len(ids_shape) != 2 or ids_shape[0] != num_tokens or ids_shape[1] < 1:
            check_topk_idx(
                "topk_idx", topk_idx, num_tokens, self.num_experts, device, self.check_ids
            )
            ids_shape = topk_idx.shape
        topk = ids_shape[1]
        if topk > self.max_topk:
            raise ValueError(f"topk_idx: top-k {topk} exceeds max_topk={self.max_topk}")
        # The batch class: how the senders count the ids, by atomic adds or histograms
        # (ll_dispatch.COUNT_ADDS), and one token or more; from the shapes alone, so a captured
        # graph keeps its choice.
        per_program = -(-num_tokens // self.num_programs)
        senders = -(-num_tokens // per_program) if num_tokens else 1
        by_adds = senders * num_tokens * topk <= self.count_adds
        stats = (wait_stats is not None, recv_stats is not None)
        plan_key = (use_fp8, use_ue8m0, pack_ue8m0, topk, hook, *stats, by_adds, num_tokens == 1)
        plan = self._plans.get(plan_key)
        if plan is None:
            plan = self._plans[plan_key] = self._dispatch_plan(
                use_fp8, use_ue8m0, pack_ue8m0, topk, *stats, by_adds, num_tokens == 1
            )
        call = (plan, num_tokens, topk)
        if key is not None:
            self._calls[key] = call
        return call

    def _dispatch_bundle(
        self, values, x, topk_idx, recv_x, recv_scales, recv_count, handle, recv_stats, wait_stats
    ) -> DispatchCall:
        """A dispatch's arguments with their tensors, for a launch that needs them (see
        :meth:`_launch_split`): ``values`` (:class:`DispatchCall`'s fields, tensors as
        addresses) with each address replaced by its tensor."""
        return DispatchCall._make(values)._replace(
            x_ptr=x,
            topk_idx_ptr=topk_idx,
            out_x_ptr=recv_x,
            out_scales_ptr=recv_count if recv_scales is None else recv_scales,  # unused without FP8
            out_src_ptr=handle.block,  # [2, E_local, R * MAX_TOKENS]: recv_src_info, recv_topk_slot
            out_count_ptr=recv_count,
            out_range_ptr=handle.recv_layout_range,
            recv_stats_ptr=recv_count if recv_stats is None else recv_stats,
            wait_stats_ptr=self.state if wait_stats is None else wait_stats,
            trace_ptr=self._untraced,
        )

    def _dispatch_plan(
        self, use_fp8, use_ue8m0, pack_ue8m0, topk, wait_stats, recv_stats, by_adds, one_token
    ):
        H, R, M = self.hidden, self.num_ranks, self.max_tokens
        variant = DispatchVariant(
            H=H,
            K=topk,
            NUM_EXPERTS=self.num_experts,
            NUM_RANKS=R,
            MAX_TOKENS=M,
            MSG_BYTES=message_bytes(H, use_fp8),
            RECV_SET_BYTES=self.layout.recv_set,
            FLAG_SET_BYTES=self.layout.flags_set,
            RECV_OFFSET=self.layout.recv,
            FLAG_OFFSET=self.layout.flags,
            STAGE_OFFSET=self.layout.stage,
            GPUS_PER_NODE=self.gpus_per_node,
            USE_FP8=use_fp8,
            USE_UE8M0=use_ue8m0,
            PACK_UE8M0=pack_ue8m0,
            DO_SEND=True,
            DO_RECV=True,
            USE_CLOCK=use_clock(self.device),
            BLOCK_N=min(128, triton.next_power_of_2(max(M, 16))),
            COUNT_BY_ADDS=by_adds,
            ONE_TOKEN=one_token,
            BLOCK_K=triton.next_power_of_2(max(topk, 2)),
            BLOCK_SCALES=triton.next_power_of_2(_groups(H)),
            BLOCK_RANKS=triton.next_power_of_2(max(R, 2)),
            BINS=self._bins,
            # Messages copied together on receive: 64 KB of payload in flight, on 16 warps
            # (the pack's loads wait on the headers that locate the payloads).
            BLOCK_MSGS=_rows_in_flight(H, 1 if use_fp8 else 2, 65536),
            BLOCK_ITEMS=self._items if by_adds else 1,
            PROFILE=self.trace is not None,
            WAIT_STATS=wait_stats,
            RECV_STATS=recv_stats,
            SHRINK=self.enable_shrink,
            VIA=self.transport.via,
        )
        # How the outputs are allocated (new_empty on an empty tensor of their dtype): recv_x,
        # then the scales, column-major per expert (one column: a unit last stride, viewable).
        empty_x = torch.empty(
            0, dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16, device=self.device
        )
        x_shape = (self.num_local_experts, R * M, H)
        outputs: tuple = (empty_x, x_shape, None, None, None)
        if use_fp8:
            rows = R * M
            columns = -(-_groups(H) // 4) if pack_ue8m0 else _groups(H)
            empty_scales = torch.empty(
                0, dtype=torch.int32 if pack_ue8m0 else torch.float32, device=self.device
            )
            strides = (columns * rows, 1, rows if columns > 1 else 1)
            scale_shape = (self.num_local_experts, rows, columns)
            outputs = (empty_x, x_shape, empty_scales, scale_shape, strides)
        return self._plan(DISPATCH_KERNEL, DispatchCall, variant, {"num_warps": 16}, outputs)

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
        Raises:
            as :meth:`dispatch`.
        """
        with _no_torch_function():
            recorded = self._recorded()
            result = self._combine(
                x,
                topk_idx,
                topk_weights,
                handle,
                return_recv_hook,
                out,
                wait_stats,
                bool(use_logfmt),
            )
            if recorded:
                self._raise_recorded(result[1])
            return result

    def _combine(self, x, topk_idx, topk_weights, handle, hook, out, wait_stats, logfmt):
        R, H = self.num_ranks, self.hidden
        device, at = self.device, self._device_index
        if type(handle) is not LowLatencyHandle and not isinstance(handle, LowLatencyHandle):
            kind = type(handle).__name__
            raise TypeError(f"handle: expected the handle of a low-latency dispatch, got {kind}")
        if handle.layout is not self._handle_layout and handle.layout != self._handle_layout:
            raise ValueError("handle: it comes from a dispatch with other sizes")
        if not _plain(x, _BF16, at) or x.shape != self._combine_shape:
            check_tensor("x", x, dtype=_BF16, shape=self._combine_shape, device=device)
        # Token t's rows come back to slots [t][k] of this rank's receive set: ids of another
        # shape would read slots this call never filled, or past the set.
        num_tokens, topk = handle.num_tokens, handle.topk
        if self.check_ids or not _plain(topk_idx, _INT64, at):
            check_topk_idx("topk_idx", topk_idx, None, self.num_experts, device, self.check_ids)
        shape = topk_idx.shape
        if shape != (num_tokens, topk):
            raise ValueError(
                f"topk_idx: shape {list(topk_idx.shape)} differs from that of the dispatch "
                f"whose handle this is, [{num_tokens}, {topk}]"
            )
        if not _plain(topk_weights, _FLOAT32, at) or topk_weights.shape != shape:
            check_tensor(
                "topk_weights",
                topk_weights,
                dtype=_FLOAT32,
                shape=(num_tokens, topk),
                device=device,
            )
        if out is None:
            out = self._empty_bf16.new_empty(num_tokens, H)
            if POISON_OUTPUTS:
                self._poison(out)
        elif not _plain(out, _BF16, at) or out.shape != (num_tokens, H):
            check_tensor("out", out, dtype=_BF16, shape=(num_tokens, H), device=device)
        stats_address = self._state_address
        if wait_stats is not None:
            if not _plain(wait_stats, _INT64, at) or wait_stats.shape != (R,):
                check_tensor("wait_stats", wait_stats, dtype=_INT64, shape=(R,), device=device)
            stats_address = wait_stats.data_ptr()
        key = ("combine", topk, logfmt, hook, wait_stats is None)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._combine_plan(topk, logfmt, wait_stats is not None)
        src = handle.storage.data_ptr() + self._handle_offset
        x_address, ids = x.data_ptr(), topk_idx.data_ptr()
        weights, out_address = topk_weights.data_ptr(), out.data_ptr()
        # CombineCall's fields in order, tensors as addresses: those of _combine_bundle's
        # (tests/test_call_path.py compares them).
        values = (
            x_address,
            src,
            src + self._slot_offset,
            src + self._range_offset,
            ids,
            weights,
            num_tokens,
            out_address,
            stats_address,
            self._untraced_address,
        )
        both = plan.both
        if both is not None and not hook and self.trace is None:
            # The handle's views start on 16-byte boundaries of its block; the mode's tensors
            # are aligned: the rest decide.
            aligned = x_address | src | ids | weights | out_address | stats_address
            receive = None if both.launch_values(values, self._shared, aligned) else False
        else:
            tensors = (x, handle, topk_idx, topk_weights, out, wait_stats)
            receive = self._launch_split(plan, values, hook, self._combine_bundle, tensors)
        if receive is False:
            call = self._combine_bundle(values, x, handle, topk_idx, topk_weights, out, wait_stats)
            receive = self._launch(plan, "low-latency combine", call, hook)
        return out, receive

    def _combine_bundle(self, values, x, handle, topk_idx, topk_weights, out, wait_stats):
        """A combine's arguments with their tensors, as :meth:`_dispatch_bundle`."""
        return CombineCall._make(values)._replace(
            x_ptr=x,
            src_ptr=handle.recv_src_info,
            slot_ptr=handle.recv_topk_slot,
            range_ptr=handle.recv_layout_range,
            topk_idx_ptr=topk_idx,
            topk_weights_ptr=topk_weights,
            out_ptr=out,
            wait_stats_ptr=self.state if wait_stats is None else wait_stats,
            trace_ptr=self._untraced,
        )

    def _combine_plan(self, topk, logfmt, wait_stats):
        H, R = self.hidden, self.num_ranks
        variant = CombineVariant(
            H=H,
            K=topk,
            K_MAX=self.max_topk,
            NUM_EXPERTS=self.num_experts,
            NUM_RANKS=R,
            MAX_TOKENS=self.max_tokens,
            RECV_SET_BYTES=self.layout.combine_set,
            SLOT_BYTES=combine_slot_bytes(H),
            RECV_OFFSET=self.layout.combine,
            DONE_OFFSET=self.layout.done,
            STAGE_OFFSET=self.layout.stage,
            GPUS_PER_NODE=self.gpus_per_node,
            DO_SEND=True,
            DO_RECV=True,
            USE_CLOCK=use_clock(self.device),
            BLOCK_SCALES=triton.next_power_of_2(_groups(H)),
            BLOCK_RANKS=triton.next_power_of_2(max(R, 2)),
            # 16 warps: a BF16 sender keeps 64 KB in flight, the reduce takes whole rows
            # (BENCHMARKS.md, "Low-latency combine on 16 warps"). LogFMT encodes BLOCK_ROWS
            # rows x BLOCK_GROUPS groups at a time: whole rows, 32 KB of BF16 a step (its
            # sender is bound by instructions; few, large steps hide the load latency).
            BLOCK_ROWS=_rows_in_flight(H, 2, 32768 if logfmt else 65536),
            # A token's top-k rows reduced together: K x BLOCK_CHANNELS BF16 values are at most
            # 64 registers a thread (LogFMT: 4096 channels, the fastest measured; whole groups
            # of 128 channels, even where H is smaller).
            BLOCK_CHANNELS=min(
                triton.next_power_of_2(max(H, 128)),
                65536 // triton.next_power_of_2(topk),
                4096 if logfmt else 8192,
            ),
            PROFILE=self.trace is not None,
            WAIT_STATS=wait_stats,
            SHRINK=self.enable_shrink,
            VIA=self.transport.via,
            LOGFMT=logfmt,
            BLOCK_GROUPS=min(triton.next_power_of_2(_groups(H)), 64),
        )
        # No fused multiply-add: products round as in the reference, so the sum is bit-exact.
        options = {"num_warps": 16, "enable_fp_fusion": False}
        return self._plan(COMBINE_KERNEL, CombineCall, variant, options)

    def destroy(self) -> None:
        """Release the heap (collective: every rank calls it); raises if a wait had timed out
        (with the release's own failure, if a peer never arrived, as its cause)."""
        self.heap.close_checked(self.check)
