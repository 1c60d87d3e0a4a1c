"""A DeepEP-like communication buffer: one object per expert-parallel group.

Normal-mode calls (``get_dispatch_layout``, ``dispatch``, ``combine``) and low-latency calls
(``low_latency_dispatch`` / ``low_latency_combine``) take the same arguments and return the
same tuples as DeepEP's (:mod:`tritonep.deep_ep` is DeepEP's interface itself); every
difference from DeepEP is listed in ``docs/deepep-compat.md``. Beyond DeepEP's arguments the
buffer takes ``timeout_s``, ``check_ids``, ``device``, ``profile`` and ``gpus_per_node``, and has
:meth:`Buffer.check` and :meth:`Buffer.dump_trace`.

What keeps it fast: each mode's memory is allocated once and reused by every call (flags are
tagged with the call number, so nothing is reset between calls), calls run on the caller's
stream unless ``async_finish`` (or ``allocate_on_comm_stream``) asks for the communication
stream and its events (:class:`CallStreams`), and no call synchronizes with the host but an
exact-size normal dispatch without a handle, which waits for the received count (as DeepEP's),
unless ``check_ids=True``. Ids out of range are dropped by the kernels and raised by the next
call (:mod:`tritonep.kernels.status`). Every call runs its Python under
``torch._C.DisableTorchFunction``, so a process-wide ``torch.set_default_device`` costs it
nothing.
"""

from __future__ import annotations

import functools
import itertools
import os
import warnings
import weakref
from dataclasses import is_dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .heap import default_device
from .kernels.layout import DispatchLayout
from .kernels.status import Status, bad_id_error
from .kernels.sync import timeout_us
from .modes.internode import InternodeHandle, InternodeMode, token_in_node
from .modes.low_latency import LowLatencyHandle, LowLatencyMode
from .modes.normal import Config, NormalHandle, NormalMode
from .modes.trace import TraceRecorder
from .validation import (
    check_dispatch_x,
    check_num_experts,
    check_ranks_agree,
    check_tensor,
    check_topk_idx,
    default_group,
)


def ranks_per_node(group: dist.ProcessGroup) -> int | None:
    """Members of ``group`` per node, or None when they share one node.

    World rank ``r`` is on node ``r // LOCAL_WORLD_SIZE``, as torchrun numbers ranks; the
    group may be part of the world (data parallel x expert parallel), but its ranks must come
    node by node, as many on each node, because the internode mode takes group ranks
    ``n * G`` to ``n * G + G - 1`` as node ``n``.
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if local <= 0:
        return None
    size = dist.get_world_size(group)
    nodes = [dist.get_global_rank(group, i) // local for i in range(size)]
    num_nodes = len(set(nodes))
    if num_nodes == 1:
        return None
    per_node = size // num_nodes
    blocks = [nodes[n * per_node : (n + 1) * per_node] for n in range(num_nodes)]
    if size % num_nodes or any(len(set(block)) != 1 for block in blocks):
        raise ValueError(
            f"group: its ranks must come node by node, as many on each node; group ranks "
            f"0..{size - 1} are on nodes {nodes} (world rank // LOCAL_WORLD_SIZE={local})"
        )
    return per_node


#: Live buffers by :attr:`Buffer.key`: the autograd operators name their buffer by number.
_BUFFERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def buffer_by_key(key: int) -> Buffer:
    """The live :class:`Buffer` whose :attr:`~Buffer.key` is ``key``."""
    buffer = _BUFFERS.get(key)
    if buffer is None:
        raise ValueError(f"buffer: no live Buffer with key {key} (destroyed or collected)")
    return buffer


class HoldsEvent(Protocol):
    """An object holding a CUDA event as ``.event`` (the DeepEP interface's ``EventHandle``)."""

    @property
    def event(self) -> torch.cuda.Event | None: ...


class EventOverlap:
    """A CUDA event to wait on (or None when there is nothing to wait for), as in DeepEP.

    Args:
        event: the recorded ``torch.cuda.Event``, an object holding one as ``.event`` (the
            DeepEP interface's ``EventHandle``), or None.
        extra_tensors: tensors kept alive until the event is waited on.
    """

    def __init__(
        self, event: torch.cuda.Event | HoldsEvent | None = None, extra_tensors: tuple = ()
    ):
        self.event = event
        self.extra_tensors = extra_tensors
        #: Called once after the next :meth:`current_stream_wait` (DeepEP V2's hook).
        self.hook_after_wait = None
        self._release_handle_by_call = False

    def cuda_event(self) -> torch.cuda.Event | None:
        """The underlying CUDA event (the event itself, or the one an event handle holds)."""
        event = self.event
        if event is not None and hasattr(event, "event"):
            return event.event
        return event

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Make the current stream wait for the event, then run the hook registered with
        :meth:`register_hook_after_wait`; ``release_handle`` drops the event afterwards."""
        event = self.cuda_event()
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        hook, self.hook_after_wait = self.hook_after_wait, None
        if hook is not None:
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook) -> None:
        """Run ``hook()`` once, right after the next :meth:`current_stream_wait`."""
        if self.hook_after_wait is not None:
            raise RuntimeError("register_hook_after_wait: a hook is already registered")
        self.hook_after_wait = hook

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        """``with event(release_handle=True):`` drops the event when the block ends."""
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


#: What a call without ``async_finish`` returns as its event (nothing to wait for).
_NO_EVENT = EventOverlap(None)


@functools.cache
def _warn_logfmt_once() -> None:
    warnings.warn(
        "use_logfmt: LogFMT-10 combines are exact to DeepEP's rule but their encoding "
        "currently costs more time than the bytes it saves over NVLink (see BENCHMARKS.md); "
        "pass use_logfmt=False for speed",
        stacklevel=3,
    )


def _event_after(device: torch.device, async_finish: bool, tensors: tuple) -> EventOverlap:
    if not async_finish or device.type != "cuda":
        return _NO_EVENT
    event = torch.cuda.Event()
    event.record()
    return EventOverlap(event, tensors)


def _tensors(*items) -> list[torch.Tensor]:
    """The tensors among ``items`` (tuples opened), for stream bookkeeping."""
    out = []
    for item in items:
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, tuple):
            out.extend(_tensors(*item))
    return out


def cuda_event(event) -> torch.cuda.Event | None:
    """The CUDA event inside an :class:`EventOverlap`, an event handle, or the event itself;
    None when there is none."""
    while event is not None and not isinstance(event, torch.cuda.Event):
        event = getattr(event, "event", None)
    return event


class CallStreams:
    """The streams a buffer's kernels run on, and the order of its calls on the device.

    A call without ``async_finish`` (V2: ``async_with_compute_stream``) and without
    ``allocate_on_comm_stream`` runs on the caller's current stream (:meth:`on_current`): when
    it returns, its outputs are ready in that stream's order and belong to it, which is all
    DeepEP promises there (its kernels run on its communication stream between two stream
    waits, an order the caller cannot tell apart), at no host cost for events, stream switches
    or ``record_stream``. The other calls run on the communication stream (:meth:`on_comm`,
    :meth:`finish`), joined to the caller's stream by events, as DeepEP's.

    The buffer's memory serves every call, so each call's kernels must follow the previous
    call's, whichever stream either came from: a call on another stream than the last call's
    first makes its stream wait for that one (a host cost only when the stream changes). Under
    CUDA-graph capture that wait is left out: a capture may not wait for work outside it, and
    capture begins after the capturing stream's earlier work (``torch.cuda.graph``).
    """

    def __init__(self) -> None:
        #: The communication stream, made by the first call that needs it.
        self.comm: torch.cuda.Stream | None = None
        self._last: torch.cuda.Stream | None = None  # where the last call's kernels ran
        self._last_raw: int | None = None  # that stream's ``cudaStream_t``, compared per call

    def comm_stream(self, device: int) -> torch.cuda.Stream:
        """The communication stream (made on CUDA device ``device`` on first use)."""
        if self.comm is None:
            self.comm = torch.cuda.Stream(device)
            # Reused for every fork and join: a wait takes the event's last record at the
            # time of the wait, so recording it again later changes no earlier wait.
            self._fork, self._join = torch.cuda.Event(), torch.cuda.Event()
        return self.comm

    def on_current(self, device: int, previous_event) -> None:
        """Order a call on the current stream (of CUDA device ``device``) after the buffer's
        last call and after ``previous_event`` (an event, an object holding one, or None)."""
        raw = torch._C._cuda_getCurrentRawStream(device)
        if raw != self._last_raw:
            self._follow(torch.cuda.current_stream(device), raw)
        if previous_event is not None:
            event = cuda_event(previous_event)
            if event is not None:
                torch.cuda.current_stream(device).wait_event(event)

    def on_comm(self, device: int, previous_event, inputs: tuple, fn):
        """Run ``fn`` on the communication stream after ``previous_event`` (else after the
        current stream's work) and after the buffer's last call; returns ``(fn's result,
        the caller's stream)``."""
        compute = torch.cuda.current_stream(device)
        comm = self.comm_stream(device)
        event = cuda_event(previous_event)
        joined = None  # the stream the communication stream now follows
        if event is None:
            event = self._fork
            event.record(compute)
            joined = compute.cuda_stream
        comm.wait_event(event)
        raw = comm.cuda_stream
        if self._last_raw in (raw, joined):
            self._last, self._last_raw = comm, raw
        else:
            self._follow(comm, raw)
        # The inputs are in use on the communication stream from now on, also when ``fn``
        # raises after its launches (an error an earlier call recorded).
        for t in _tensors(*inputs):
            t.record_stream(comm)
        with torch.cuda.stream(comm):
            return fn(), compute

    def finish(self, compute: torch.cuda.Stream, async_finish: bool, outputs) -> EventOverlap:
        """Hand the outputs of :meth:`on_comm` to the caller's stream: an event to wait on
        (``async_finish``), or a wait now."""
        tensors = _tensors(*outputs)
        for t in tensors:
            t.record_stream(compute)
        comm = self.comm
        assert comm is not None  # (on_comm made it)
        if async_finish:
            event = torch.cuda.Event()
            event.record(comm)
            return EventOverlap(event, tuple(tensors))
        self._join.record(comm)
        compute.wait_event(self._join)
        return EventOverlap(None)

    def join(self) -> None:
        """Order the current stream after the buffer's last call (before reading what the
        kernels recorded, or releasing their memory)."""
        last = self._last
        if last is not None:
            current = torch.cuda.current_stream(last.device)
            if current.cuda_stream != self._last_raw:
                current.wait_stream(last)

    def _follow(self, stream: torch.cuda.Stream, raw: int) -> None:
        last = self._last
        if last is not None and not torch.cuda.is_current_stream_capturing():
            stream.wait_stream(last)
        self._last, self._last_raw = stream, raw


def _handle_tensors(handle) -> tuple:
    """The tensors a normal-mode handle holds (its legs' too, across nodes): a call on the
    communication stream reads them there, so they are recorded on it like its inputs."""
    if handle is None:
        return ()
    return tuple(
        t
        for value in vars(handle).values()
        for t in (_handle_tensors(value) if is_dataclass(value) else (value,))
        if isinstance(t, torch.Tensor)
    )


def _dispatch(
    mode,
    notifier: NormalMode | None,
    x,
    topk_idx,
    topk_weights,
    num_tokens_per_expert,
    is_token_in_rank,
    handle,
    expert_alignment: int,
    num_worst_tokens: int,
    config: Config | None,
):
    """``mode.dispatch``, after ``notifier``'s count exchange when given (a dispatch without
    top-k: the rows follow the exchange's handle)."""
    if notifier is not None:
        payload = x[0] if type(x) is tuple else x
        handle = notifier.notify(
            is_token_in_rank,
            num_tokens_per_expert,
            payload.shape[0],
            expert_alignment,
            num_worst_tokens,
            config,
        )
    return mode.dispatch(
        x,
        topk_idx,
        topk_weights,
        num_tokens_per_expert,
        is_token_in_rank,
        handle,
        expert_alignment,
        num_worst_tokens,
        config,
    )


def _combine(
    mode: NormalMode | InternodeMode,
    handle: NormalHandle | InternodeHandle,
    x: torch.Tensor,
    topk_weights: torch.Tensor | None,
    bias: torch.Tensor | tuple[torch.Tensor, ...] | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``mode.combine``; ``TypeError`` (as the mode raises it) before anything is launched
    unless ``handle`` is of the mode's kind: across nodes an ``InternodeHandle``, else a
    ``NormalHandle``."""
    if isinstance(mode, InternodeMode):
        if isinstance(handle, InternodeHandle):
            return mode.combine(x, handle, topk_weights, bias)
        expected = "an InternodeHandle"
    else:
        if isinstance(handle, NormalHandle):
            return mode.combine(x, handle, topk_weights, bias)
        expected = "a NormalHandle"
    raise TypeError(f"handle: expected {expected}, got {type(handle).__name__}")


class Buffer:
    """The communication buffer of one expert-parallel group.

    Args:
        group: the process group (every rank constructs the buffer together); it may be part
            of a larger world (data parallel x expert parallel), each group with its buffer.
        num_nvl_bytes: accepted for DeepEP compatibility (normal mode sizes itself).
        num_rdma_bytes: if non-zero, must cover the low-latency size hint of the first call.
        low_latency_mode: accepted; the low-latency calls work either way.
        num_qps_per_rank: accepted and ignored (no RDMA queue pairs here).
        explicitly_destroy: accepted; :meth:`destroy` releases the memory either way.
        timeout_s: limit of every wait inside the kernels, in seconds (at most
            ``tritonep.kernels.sync.MAX_TIMEOUT_S``, about 35 minutes); assigning
            ``buffer.timeout_s`` later changes it for the following calls of both modes
            (without compiling anything).
        check_ids: read top-k ids on the host to reject out-of-range ids before launching (a
            GPU synchronization per call with ids). False or None (the default): never; the
            kernels drop such ids, record the first (rank, token, column, id), and the next
            call of the mode (dispatch or combine, normal or low-latency) raises
            ``ValueError`` after its launches.
        device: where the modes' memory and outputs live: a CUDA device, or ``"cpu"`` for CPU
            ranks; None: :func:`tritonep.heap.default_device` of the group.
        profile: record kernel traces of every call (:meth:`dump_trace`).
        gpus_per_node: ranks per node when the group spans several nodes, group ranks
            ``n * G`` to ``n * G + G - 1`` being node ``n`` (normal mode then
            goes through :class:`~tritonep.modes.internode.InternodeMode`, low-latency mode
            stages what goes to other nodes and puts it there); None: found from where the
            ranks run (world rank ``r`` on node ``r // LOCAL_WORLD_SIZE``, as torchrun numbers
            them; one node without that variable).
        enable_shrink: low-latency shrink mode (as DeepEP's): a rank that stops answering is
            masked when a wait for it times out, instead of raising, and the calls go on
            without it; :meth:`low_latency_update_mask_buffer` masks and unmasks ranks by hand.
            A masked rank is neither sent to nor waited for, and the top-k choices of its
            experts are dropped (as if their ids were ``-1``). Every rank must pass the same
            value. The normal mode is not affected.
        copy_combine_tokens: if > 0 (one node only), normal-mode combines of exact-size
            dispatches (no ``num_worst_tokens``) in which no rank dispatched more tokens than
            this, and some rank at least ``copy_combine_min_tokens``, hand the rows back by copy
            engines, no SM moving them (:mod:`tritonep.modes.copy_combine`); the others take
            the rings. Reserves ``(R - 1) * copy_combine_tokens * (2 * hidden + 64)`` bytes of
            symmetric memory, made at the first normal-mode call.
        copy_combine_min_tokens: the fewest tokens (on the rank with the most) for which those
            combines take the copy engines (default:
            :func:`tritonep.modes.copy_combine.default_min_tokens` of the rank count; 0: all).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        explicitly_destroy: bool = False,
        timeout_s: float = 100.0,
        check_ids: bool | None = None,
        device: torch.device | str | None = None,
        profile: bool = False,
        gpus_per_node: int | None = None,
        enable_shrink: bool = False,
        copy_combine_tokens: int = 0,
        copy_combine_min_tokens: int | None = None,
    ):
        self.group = default_group(group)
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self._ll: LowLatencyMode | None = None
        self._normal: NormalMode | InternodeMode | None = None
        self.timeout_s, self.check_ids, self.device = timeout_s, check_ids, device
        self.profile = profile
        self.enable_shrink = bool(enable_shrink)
        # Masked ranks set before the low-latency mode exists (it is built on the first call).
        self._pending_mask = [0] * self.group_size
        if gpus_per_node is None:
            gpus_per_node = ranks_per_node(self.group)
        # One collective here, so that ranks built differently fail together now instead of
        # some raising on a first call while their peers wait in it for them.
        check_ranks_agree(
            self.group,
            "Buffer",
            num_rdma_bytes=num_rdma_bytes,
            gpus_per_node=gpus_per_node,
            enable_shrink=self.enable_shrink,
            copy_combine_tokens=copy_combine_tokens,
            copy_combine_min_tokens=copy_combine_min_tokens,
            profile=bool(profile),
            device_type=torch.device(device).type
            if device is not None
            else default_device(self.group).type,
        )
        if gpus_per_node is not None and (gpus_per_node < 1 or self.group_size % gpus_per_node):
            raise ValueError(
                f"gpus_per_node: expected a divisor of the {self.group_size} ranks, "
                f"got {gpus_per_node}"
            )
        self.gpus_per_node = gpus_per_node or self.group_size
        self.num_nodes = self.group_size // self.gpus_per_node
        if type(copy_combine_tokens) is not int or copy_combine_tokens < 0:
            raise ValueError(
                f"copy_combine_tokens: expected an int >= 0, got {copy_combine_tokens!r}"
            )
        if copy_combine_min_tokens is not None and (
            type(copy_combine_min_tokens) is not int or copy_combine_min_tokens < 0
        ):
            raise ValueError(
                f"copy_combine_min_tokens: expected an int >= 0 or None, got "
                f"{copy_combine_min_tokens!r}"
            )
        if copy_combine_tokens and self.num_nodes > 1:
            raise ValueError("copy_combine_tokens: within one node only (the group spans nodes)")
        self.copy_combine_tokens = copy_combine_tokens
        self.copy_combine_min_tokens = copy_combine_min_tokens
        # get_dispatch_layout's kernels (per number of experts) and where they record bad ids,
        # which this buffer's next normal-mode dispatch or combine raises.
        self._layouts: dict[int, DispatchLayout] = {}
        self._layout_status: Status | None = None
        self._streams = CallStreams()  # where normal-mode calls run, in what order
        self._mode_configs: dict = {}  # config given -> (mode, its config there) (_mode_config)
        #: A number naming this buffer in operators (:mod:`tritonep.integrations.autograd`).
        self.key = next(_KEYS)
        _BUFFERS[self.key] = self

    #: SM budget of normal-mode calls (DeepEP's class-wide setting).
    num_sms: int = 24
    #: Whether a worst-case dispatch returns its per-expert counts as an empty list (DeepEP's
    #: interface) instead of the ``[E_local]`` int32 device tensor.
    _empty_worst_counts = False

    @classmethod
    def set_num_sms(cls, new_num_sms: int) -> None:
        """Set the SM budget of later normal-mode calls.

        Args:
            new_num_sms: programs per launch, half senders and half receivers: an even int
                of at least 2 (``ValueError`` otherwise).
        """
        if not isinstance(new_num_sms, int) or new_num_sms < 2 or new_num_sms % 2:
            raise ValueError(f"new_num_sms: expected an even int >= 2, got {new_num_sms}")
        cls.num_sms = new_num_sms

    @classmethod
    def get_dispatch_config(cls, num_ranks: int) -> Config:
        """The default :class:`~tritonep.modes.normal.Config` of a dispatch (``num_ranks`` is
        accepted for DeepEP's signature: the config does not depend on it)."""
        return Config(num_sms=cls.num_sms)

    @classmethod
    def get_combine_config(cls, num_ranks: int) -> Config:
        """The default config of a combine (combine uses its dispatch's channels; ``num_ranks``
        is accepted for DeepEP's signature)."""
        return Config(num_sms=cls.num_sms)

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current stream, to pass as ``previous_event``."""
        if not torch.cuda.is_available():
            return EventOverlap(None)
        event = torch.cuda.Event()
        event.record()
        return EventOverlap(event)

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Where this rank's tokens go, computed by one kernel.

        Args:
            topk_idx: ``[N, K]`` int64 global expert ids, ``-1`` for none.
            num_experts: experts in total, a multiple of the number of ranks.
            previous_event: an event the computation must wait for.
            async_finish: return an event recorded after the kernel.
            allocate_on_comm_stream: accepted; the kernel runs on the current stream.
        Returns:
            ``(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [nodes] int32 or None,
            num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool, event)``; the
            second item counts tokens per node, None within one node.
        """
        with torch._C.DisableTorchFunction():
            check_num_experts(num_experts, self.group_size)
            check_topk_idx(
                "topk_idx", topk_idx, None, num_experts, check_range=bool(self.check_ids)
            )
            waited = cuda_event(previous_event)
            if waited is not None:
                torch.cuda.current_stream(topk_idx.device).wait_event(waited)
            # Once the normal mode exists, its kernel and status: bad ids are then recorded
            # once, whether the layout kernel or the dispatch kernel meets them first.
            mode = self._normal
            layout: DispatchLayout | None
            if mode is not None and mode.num_experts == num_experts:
                layout = mode._layout
            else:
                layout = self._layouts.get(num_experts)
            if layout is None or layout.device != topk_idx.device:
                layout = self._layout(topk_idx.device, num_experts)
            per_rank, per_expert, in_rank = layout(topk_idx)
            per_node = None
            if self.num_nodes > 1:
                per_node = token_in_node(in_rank, self.gpus_per_node).sum(0, dtype=torch.int32)
            event = _event_after(topk_idx.device, async_finish, (topk_idx,))
            return per_rank, per_node, per_expert, in_rank, event

    def _layout(self, device: torch.device, num_experts: int) -> DispatchLayout:
        if self._layout_status is None or self._layout_status.words.device != device:
            self._layout_status = Status(device)
            self._layouts.clear()
        layout = DispatchLayout(
            device, num_experts, self.group_size, self._layout_status, self.rank
        )
        self._layouts[num_experts] = layout
        return layout

    def _raise_layout_record(self) -> None:
        """Raise the bad ids a layout kernel recorded (once)."""
        status = self._layout_status
        assert status is not None  # called once a layout kernel recorded, so it has a status

        def raise_error(words):
            raise bad_id_error(words, "get_dispatch_layout")

        status.raise_recorded(status.record(), raise_error)

    @property
    def timeout_s(self) -> float:
        """Limit of every wait inside the kernels, in seconds. Assigning it applies to the
        next calls of both modes (with ``enable_shrink``: warm up every kernel under a long
        limit, then shorten it, or a peer still compiling its first call is masked)."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        timeout_us(value)  # ValueError outside (0, MAX_TIMEOUT_S]
        self._timeout_s = value
        for mode in (self._normal, self._ll):
            if mode is not None:
                mode.timeout_s = value

    # -------------------------------------------------------------------------- normal mode
    def _normal_mode(self, hidden: int, num_experts: int | None) -> NormalMode | InternodeMode:
        mode = self._normal
        if mode is None:
            if num_experts is None:
                raise ValueError("handle: no dispatch has run on this buffer yet")
            mode = self._normal = self._new_normal_mode(hidden, num_experts)
        elif mode.hidden != hidden or (num_experts is not None and mode.num_experts != num_experts):
            raise ValueError(
                f"hidden and num_experts must stay ({mode.hidden}, {mode.num_experts}) for this "
                f"buffer; got ({hidden}, {num_experts})"
            )
        return mode

    def _new_normal_mode(self, hidden: int, num_experts: int) -> NormalMode | InternodeMode:
        """The normal mode of the first normal-mode call."""
        max_sms = max(32, type(self).num_sms) if torch.cuda.is_available() else None
        check_ids, profile = bool(self.check_ids), self._profile()
        if self.num_nodes > 1:
            return InternodeMode(
                self.group,
                hidden,
                num_experts,
                self.gpus_per_node,
                device=self.device,
                timeout_s=self.timeout_s,
                check_ids=check_ids,
                max_sms=max_sms,
                profile=profile,
            )
        return NormalMode(
            self.group,
            hidden,
            num_experts,
            device=self.device,
            timeout_s=self.timeout_s,
            check_ids=check_ids,
            max_sms=max_sms,
            profile=profile,
            copy_combine_tokens=self.copy_combine_tokens,
            copy_combine_min_tokens=self.copy_combine_min_tokens,
        )

    def _mode_config(self, mode: NormalMode | InternodeMode, config: Config | None) -> Config:
        """The config ``mode`` runs a dispatch with, for ``config`` (None: the class's
        :meth:`get_dispatch_config`), made once per config (configs are frozen) and mode."""
        key = (config, type(self).num_sms) if config is None else config
        known = self._mode_configs.get(key)
        if known is not None and known[0] is mode:
            return known[1]
        given = config or self.get_dispatch_config(self.group_size)
        # A config may ask for more ring slots than the buffer has (DeepEP's defaults ask for
        # 256 and more): it gets them all.
        slots = min(given.nvl_recv_buffer_tokens, mode.layout.ring_tokens)
        sms = given.num_sms
        if mode.device.type != "cuda":  # SM counts mean nothing to the interpreter
            sms = min(sms, mode.default_config.num_sms)
        # Built anew rather than replaced: configs may be subclasses with other arguments
        # (tritonep.deep_ep.Config takes DeepEP's names).
        made = Config(
            sms, given.nvl_send_chunk, slots, given.rdma_send_chunk, given.rdma_recv_buffer_tokens
        )
        self._mode_configs[key] = (mode, made)
        return made

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: NormalHandle | InternodeHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Normal-mode dispatch: each token goes once to every rank holding one of its experts.

        Args:
            x: ``[N, H]`` BF16, or ``(e4m3 [N, H], scales [N, S])``: 4-byte scale words
                copied unchanged, as in DeepEP (float32, e.g. per 128 channels; int32, e.g.
                packed UE8M0; any strides; ``1 <= S <= ceil(H / 32)``). Rows of a multiple of
                16 bytes: FP8 needs ``H`` a multiple of 16, BF16 of 8 (e.g. 2880, whose last
                group of 128 channels holds 64).
            handle: a handle of an earlier dispatch: cached mode (same routing, only ``x``
                moves; no layout arguments needed, no host synchronization; ``topk_idx`` and
                ``topk_weights`` must be None).
            num_tokens_per_rank: ``[R]`` int32 from :meth:`get_dispatch_layout` (not needed).
            num_tokens_per_rdma_rank: ``[nodes]`` int32 from :meth:`get_dispatch_layout`
                across nodes (not needed), None within one node.
            is_token_in_rank: ``[N, R]`` bool from :meth:`get_dispatch_layout`; required
                without ``handle``.
            num_tokens_per_expert: ``[E]`` int32 from :meth:`get_dispatch_layout`; its length
                is the number of experts; required without ``handle``.
            topk_idx: ``[N, K]`` int64 global expert ids, ``-1`` for none; or None: rows go
                where ``is_token_in_rank`` says, with the per-expert counts of
                ``num_tokens_per_expert`` (within one node), and ``recv_topk_idx`` and
                ``recv_topk_weights`` come back None.
            topk_weights: ``[N, K]`` float32, or None.
            expert_alignment: round the per-expert counts up to a multiple of this.
            num_worst_tokens: if > 0, outputs have this many rows (padding ids ``-1``) and the
                call does not wait for the received count (CUDA-graph capturable; the only
                host read left is the id check of ``check_ids``, skipped under capture).
            config: SM budget and ring use (default: :meth:`get_dispatch_config`). With
                ``handle``, the handle's config is used, and ``expert_alignment`` and
                ``num_worst_tokens`` are those of the handle's dispatch.
            previous_event: an event the call must wait for (besides the current stream's work
                without ``async_finish`` and ``allocate_on_comm_stream``).
            async_finish: run on the communication stream after ``previous_event`` (else after
                the current stream's work) and return an event to wait on; otherwise the call
                runs on the current stream (its outputs ready in that stream's order).
            allocate_on_comm_stream: run on the communication stream (outputs allocated there
                and recorded on the current stream), as with ``async_finish``.
        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
            handle, event)``: ``recv_x`` ``[M, H]`` like ``x`` (or the FP8 tuple) ordered by
            source rank then source token, ``recv_topk_idx`` ``[M, K]`` int64 local expert ids
            (``-1`` elsewhere), ``recv_topk_weights`` ``[M, K]`` float32 (None without
            ``topk_weights``), the per-local-expert counts (a list of ints; an ``[E_local]``
            int32 device tensor in worst-case mode), a
            :class:`~tritonep.modes.normal.NormalHandle` (an
            :class:`~tritonep.modes.internode.InternodeHandle` across nodes) and an
            :class:`EventOverlap`. In cached mode the three middle outputs are None and the
            handle is returned again (DeepEP returns None there).
        Raises:
            ``ValueError``/``TypeError`` naming the argument, before anything is launched;
            after its launches, what an earlier call recorded (bad ids, a timeout).
        """
        # One function (host time): checks, then the mode's calls on the chosen stream.
        with torch._C.DisableTorchFunction():  # a function mode would see every tensor access
            status = self._layout_status
            recorded = status is not None and status.recorded()
            if num_tokens_per_rdma_rank is not None and self.num_nodes == 1:
                raise ValueError("num_tokens_per_rdma_rank: must be None within one node")
            if handle is not None and (topk_idx is not None or topk_weights is not None):
                # As DeepEP asserts: rows follow the handle's routing, so ids given here would
                # be ignored, and ignoring them silently hides a caller's mistake.
                name = "topk_idx" if topk_idx is not None else "topk_weights"
                raise ValueError(
                    f"{name}: must be None with a handle (cached mode moves rows along the "
                    "handle's routing)"
                )
            # Once the mode exists it checks x and the layout tensors in full before it
            # launches; here only what picks the mode and the stream (a payload tensor).
            payload = x[0] if type(x) is tuple and len(x) == 2 else x
            mode = self._normal
            if mode is None or type(payload) is not torch.Tensor or payload.dim() != 2:
                payload = check_dispatch_x("x", x)
            if handle is not None:
                if mode is None or mode.hidden != payload.shape[1]:
                    mode = self._normal_mode(payload.shape[1], None)
            else:
                counts: Any = num_tokens_per_expert
                if mode is None or type(counts) is not torch.Tensor or counts.dim() != 1:
                    check_tensor("num_tokens_per_expert", counts, dtype=torch.int32, shape=(None,))
                if (
                    mode is None
                    or mode.hidden != payload.shape[1]
                    or mode.num_experts != counts.shape[0]
                ):
                    mode = self._normal_mode(payload.shape[1], counts.shape[0])
                config = self._mode_config(mode, config)
            # Without top-k (as DeepEP allows) the layout arguments alone route the rows: the
            # count exchange runs first and the rows follow its handle.
            notifier = None
            if handle is None and topk_idx is None:
                notifier = self._notifier(
                    mode, payload, is_token_in_rank, num_tokens_per_expert, topk_weights
                )

            on_comm = payload.is_cuda and (async_finish or allocate_on_comm_stream)
            if payload.is_cuda and not on_comm:
                self._streams.on_current(payload.get_device(), previous_event)
            event = _NO_EVENT
            if notifier is None and not on_comm:  # the common call: straight to the mode
                given: Any = handle  # (the mode raises TypeError for the other mode's kind)
                out = mode.dispatch(
                    x,
                    topk_idx,
                    topk_weights,
                    num_tokens_per_expert,
                    is_token_in_rank,
                    given,
                    expert_alignment,
                    num_worst_tokens,
                    config,
                )
            else:
                run = functools.partial(
                    _dispatch,
                    mode,
                    notifier,
                    x,
                    topk_idx,
                    topk_weights,
                    num_tokens_per_expert,
                    is_token_in_rank,
                    handle,
                    expert_alignment,
                    num_worst_tokens,
                    config,
                )
                if not on_comm:
                    out = run()
                else:
                    # (A cached dispatch reads its handle there too.)
                    inputs = (x, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert)
                    inputs += _handle_tensors(handle)
                    out, compute = self._streams.on_comm(
                        payload.get_device(), previous_event, inputs, run
                    )
                    outputs = (
                        out.recv_x,
                        out.recv_topk_idx,
                        out.recv_topk_weights,
                        *_handle_tensors(out.handle),
                    )
                    event = self._streams.finish(compute, async_finish, outputs)
            if recorded:
                self._raise_layout_record()
            per_expert = out.num_recv_tokens_per_expert
            if self._empty_worst_counts and type(per_expert) is torch.Tensor:
                per_expert = []
            return (
                out.recv_x,
                out.recv_topk_idx,
                out.recv_topk_weights,
                per_expert,
                out.handle,
                event,
            )

    def _notifier(self, mode, payload, is_token_in_rank, num_tokens_per_expert, topk_weights):
        """``mode``, checked to run a dispatch without top-k (its count exchange first)."""
        if topk_weights is not None:
            raise ValueError("topk_weights: needs topk_idx")
        if not isinstance(mode, NormalMode):
            raise ValueError(
                "topk_idx: required for a group that spans nodes (a dispatch "
                "without top-k runs within one node)"
            )
        if is_token_in_rank is None:
            raise ValueError("is_token_in_rank: required without topk_idx and handle")
        check_tensor(
            "is_token_in_rank",
            is_token_in_rank,
            dtype=torch.bool,
            shape=(payload.shape[0], self.group_size),
            device=mode.device,
        )
        check_tensor(
            "num_tokens_per_expert",
            num_tokens_per_expert,
            dtype=torch.int32,
            device=mode.device,
        )
        return mode

    def combine(
        self,
        x: torch.Tensor,
        handle: NormalHandle | InternodeHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Normal-mode combine: each token gets the float32 sum of the rows every rank it went to
        hands back, plus the bias, in BF16.

        Args:
            x: ``[M, H]`` BF16, one row per row the dispatch delivered (each rank has reduced
                its own experts' outputs for the token into it).
            handle: from :meth:`dispatch`.
            topk_weights: ``[M, K]`` float32 summed along with the rows, or None.
            bias: ``[N, H]`` BF16 or a tuple of up to two, added to the sums.
            config: accepted; combine uses its dispatch's channels.
            previous_event, async_finish, allocate_on_comm_stream: as in :meth:`dispatch`.
        Returns:
            ``(combined_x [N, H] BF16, combined_topk_weights [N, K] float32 or None, event)``.
        """
        with torch._C.DisableTorchFunction():
            if not isinstance(handle, (NormalHandle, InternodeHandle)):
                raise TypeError(f"handle: expected a dispatch handle, got {type(handle).__name__}")
            status = self._layout_status
            recorded = status is not None and status.recorded()
            mode = self._normal
            if (
                mode is None
                or mode.hidden != handle.hidden
                or mode.num_experts != handle.num_experts
            ):
                mode = self._normal_mode(handle.hidden, handle.num_experts)
            event = _NO_EVENT
            if type(x) is torch.Tensor and not x.is_cuda:
                out, out_weights = _combine(mode, handle, x, topk_weights, bias)
            elif not (async_finish or allocate_on_comm_stream):
                if type(x) is torch.Tensor:  # (else the mode raises, before any stream work)
                    self._streams.on_current(x.get_device(), previous_event)
                out, out_weights = _combine(mode, handle, x, topk_weights, bias)
            else:
                run = functools.partial(_combine, mode, handle, x, topk_weights, bias)
                device = x.get_device() if type(x) is torch.Tensor else mode.device.index
                inputs = (x, topk_weights, bias, *_handle_tensors(handle))
                (out, out_weights), compute = self._streams.on_comm(
                    device, previous_event, inputs, run
                )
                event = self._streams.finish(compute, async_finish, (out, out_weights))
            if recorded:
                self._raise_layout_record()
            return out, out_weights, event

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int,
        hidden: int,
        num_ranks: int,
        num_experts: int,
        num_nodes: int = 1,
    ) -> int:
        """Bytes of symmetric memory per rank that the low-latency mode needs.

        Args:
            num_max_dispatch_tokens_per_rank, hidden, num_experts: as for
                :meth:`low_latency_dispatch`.
            num_ranks: ranks of the group.
            num_nodes: nodes the group spans (not in DeepEP's signature: across nodes a
                staging region is added).
        Returns:
            bytes per rank (int), for top-k up to 16.
        """
        return LowLatencyMode.size_hint(
            num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, num_nodes=num_nodes
        )

    def _low_latency(self, num_max: int, hidden: int, num_experts: int) -> LowLatencyMode:
        mode = self._ll
        if mode is None:
            # The sizes decide whether num_rdma_bytes suffices: ranks must agree on them
            # before any rank can raise over it alone.
            check_ranks_agree(
                self.group,
                "Buffer's low-latency mode",
                num_max_dispatch_tokens_per_rank=num_max,
                hidden=hidden,
                num_experts=num_experts,
            )
            need = self.get_low_latency_rdma_size_hint(
                num_max, hidden, self.group_size, num_experts, self.num_nodes
            )
            if self.num_rdma_bytes and self.num_rdma_bytes < need:
                raise ValueError(
                    f"num_rdma_bytes: {self.num_rdma_bytes} is less than the {need} bytes this "
                    "configuration needs (get_low_latency_rdma_size_hint)"
                )
            mode = self._ll = LowLatencyMode(
                self.group,
                num_max,
                hidden,
                num_experts,
                device=self.device,
                timeout_s=self.timeout_s,
                check_ids=bool(self.check_ids),
                profile=self._profile(),
                gpus_per_node=self.gpus_per_node,
                enable_shrink=self.enable_shrink,
            )
            if any(self._pending_mask):
                mode.peer_mask.copy_(torch.tensor(self._pending_mask, dtype=torch.int32))
        elif (mode.max_tokens, mode.hidden, mode.num_experts) != (num_max, hidden, num_experts):
            raise ValueError(
                "num_max_dispatch_tokens_per_rank, hidden and num_experts must stay "
                f"({mode.max_tokens}, {mode.hidden}, {mode.num_experts}) for this buffer; got "
                f"({num_max}, {hidden}, {num_experts})"
            )
        return mode

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ):
        """Low-latency dispatch (see :meth:`tritonep.modes.low_latency.LowLatencyMode.dispatch`).

        Args:
            x: ``[N, H]`` BF16, ``N <= num_max_dispatch_tokens_per_rank``.
            topk_idx: ``[N, K]`` int64 global expert ids (``-1`` = none), ``K <= 16``.
            num_max_dispatch_tokens_per_rank: rows per source rank in each expert's slab.
            num_experts: experts in total.
            cumulative_local_expert_recv_stats: optional ``[E_local]`` int32; the received
                count of every local expert is added to it.
            dispatch_wait_recv_cost_stats: optional ``[R]`` int64; the time this rank waited
                for each source rank is added to it (ns on GPUs), to find a slow rank.
            use_fp8: FP8 e4m3 payload with float32 scales per 128 channels, else BF16.
            round_scale: round the scales up to powers of two.
            use_ue8m0: return those scales packed: four UE8M0 exponent bytes per int32
                (implies ``round_scale``).
            async_finish: return an event recorded after the call.
            return_recv_hook: only send; call the returned hook to receive.
        Returns:
            ``(recv_x, recv_count, handle, event, hook)``: ``recv_x`` is
            ``[E_local, R * num_max, H]`` BF16, or float8_e4m3fn with ``use_fp8`` (then a
            tuple with the scales, column-major within each expert as DeepEP returns them:
            ``[E_local, R * num_max, ceil(H / 128)]`` float32 (a partial last group of 128
            channels has a scale of its own), or with ``use_ue8m0``
            ``[E_local, R * num_max, ceil(H / 512)]`` int32 whose byte ``g % 4`` of column
            ``g // 4`` is group ``g``'s exponent),
            ``recv_count`` ``[E_local]`` int32, the handle
            ``(src_info [E_local, R * num_max] int32, layout_range [E_local, R] int64,
            num_max, hidden, num_experts, topk_slot [E_local, R * num_max] int32)``, an
            :class:`EventOverlap` and the hook (None unless ``return_recv_hook``).
        """
        mode = self._ll
        if (
            mode is None
            or mode.max_tokens != num_max_dispatch_tokens_per_rank
            or mode.num_experts != num_experts
        ):
            with torch._C.DisableTorchFunction():  # a function mode would see every tensor access
                check_tensor("x", x, dtype=torch.bfloat16, shape=(None, None))
                mode = self._low_latency(num_max_dispatch_tokens_per_rank, x.shape[1], num_experts)
        # Positional (keywords cost eager calls time); the mode checks the tensors.
        recv_x, recv_count, handle, hook = mode.dispatch(
            x,
            topk_idx,
            use_fp8,
            round_scale or use_ue8m0,  # use_ue8m0
            return_recv_hook,
            dispatch_wait_recv_cost_stats,  # wait_stats
            use_ue8m0,  # pack_ue8m0
            cumulative_local_expert_recv_stats,  # recv_stats
        )
        event = _NO_EVENT
        if async_finish:
            with torch._C.DisableTorchFunction():
                event = _event_after(mode.device, True, (x, topk_idx))
        return recv_x, recv_count, handle, event, hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """``[E_local, R * num_max, H]`` BF16 to write expert outputs into for ``zero_copy``
        (``handle``, from :meth:`low_latency_dispatch`, is accepted: the tensor depends only
        on the buffer's sizes)."""
        return self._require_ll().get_next_combine_buffer(handle)

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ):
        """Low-latency combine: ``out[t] = sum_k w[t, k] * expert_k(t)`` in float32, to BF16.

        Args:
            x: ``[E_local, R * num_max, H]`` BF16 expert outputs, rows as dispatch packed them.
            topk_idx: ``[N, K]`` int64, as given to dispatch.
            topk_weights: ``[N, K]`` float32.
            handle: from :meth:`low_latency_dispatch`.
            use_logfmt: rows travel as LogFMT-10, DeepEP's lossy 10-bit format: each
                128-channel group whose magnitudes are all below 1 as a sign and a 9-bit
                log-scale code per channel (relative error at most 2.2%, typically 0.3%),
                other groups as BF16; about 35% fewer bytes cross the links
                (:mod:`tritonep.reference.logfmt`). Encoding costs more time than it
                saves on NVLink (about 2.5 times BF16's combine time, BENCHMARKS.md): a
                warning says so once.
            zero_copy: ``x`` came from :meth:`get_next_low_latency_combine_buffer`. Rows go
                to their peers straight from wherever ``x`` lives, so there is no copy for
                this flag to skip: any ``x`` works either way, at the same speed.
            async_finish: return an event recorded after the call.
            return_recv_hook: only send; call the hook to reduce.
            out: optional ``[N, H]`` BF16 output.
            combine_wait_recv_cost_stats: optional ``[R]`` int64, as in dispatch.
        Returns:
            ``(combined_x [N, H] BF16, event, hook)``; the hook is None unless
            ``return_recv_hook``.
        """
        mode = self._ll
        if mode is None:
            mode = self._require_ll()  # (raises)
        if use_logfmt:
            _warn_logfmt_once()
        out, hook = mode.combine(
            x,
            topk_idx,
            topk_weights,
            handle,
            zero_copy,
            return_recv_hook,
            out,
            combine_wait_recv_cost_stats,  # wait_stats
            use_logfmt,
        )
        event = _NO_EVENT
        if async_finish:
            with torch._C.DisableTorchFunction():
                event = _event_after(mode.device, True, (x, topk_idx, topk_weights))
        return out, event, hook

    def clean_low_latency_buffer(
        self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int
    ) -> None:
        """Nothing to clear: signals are tagged with the call number and never reset.

        Like DeepEP's, the call sizes the low-latency memory if no call has yet (collective:
        every rank calls it), and raises ``ValueError`` if the arguments differ from the
        sizes of earlier low-latency calls on this buffer.

        Args:
            num_max_dispatch_tokens_per_rank, hidden, num_experts: as for
                :meth:`low_latency_dispatch`.
        """
        self._low_latency(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask one rank of the group in low-latency calls.

        Needs ``enable_shrink=True``. The change applies to calls issued after it, in stream
        order (no host synchronization, capturable). Unmask only a rank that is in step with
        this one: one that made the same calls (two ranks that masked each other at the same
        call and unmask each other at the same call are); a rank masked because it stopped
        answering comes back only with a new buffer on every rank.

        Args:
            rank_to_mask: the rank, ``0 <= rank_to_mask < group size``.
            mask: True masks it, False unmasks it.
        """
        self._require_shrink("low_latency_update_mask_buffer")
        if not isinstance(rank_to_mask, int) or not 0 <= rank_to_mask < self.group_size:
            raise ValueError(
                f"rank_to_mask: expected a rank in [0, {self.group_size}), got {rank_to_mask!r}"
            )
        if self._ll is None:
            self._pending_mask[rank_to_mask] = int(bool(mask))
        else:
            self._ll.peer_mask[rank_to_mask] = int(bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write which ranks are masked into ``mask_status``: ``[R]`` int32, 1 = masked (on
        any device; a copy in stream order, synchronous for a host tensor)."""
        self._require_shrink("low_latency_query_mask_buffer")
        check_tensor("mask_status", mask_status, dtype=torch.int32, shape=(self.group_size,))
        if self._ll is None:
            mask_status.copy_(torch.tensor(self._pending_mask, dtype=torch.int32))
        else:
            mask_status.copy_(self._ll.peer_mask)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (see :meth:`low_latency_update_mask_buffer` for when it is safe)."""
        self._require_shrink("low_latency_clean_mask_buffer")
        self._pending_mask = [0] * self.group_size
        if self._ll is not None:
            self._ll.peer_mask.zero_()

    def _require_shrink(self, what: str) -> None:
        if not self.enable_shrink:
            raise RuntimeError(f"{what}: needs a Buffer constructed with enable_shrink=True")

    def _require_ll(self) -> LowLatencyMode:
        if self._ll is None:
            raise RuntimeError("call low_latency_dispatch before the low-latency combine")
        return self._ll

    def dump_trace(self, path: str) -> str:
        """Write this rank's kernel traces, both modes on one time axis (Chrome trace JSON,
        for Perfetto), to ``path`` (which may contain ``{rank}``); needs ``profile=True``.
        Returns the path written."""
        recorder = self._trace_recorder()
        if recorder is None:
            raise RuntimeError("profile: construct the Buffer with profile=True and make a call")
        return str(recorder.dump(path.format(rank=self.rank)))

    def clear_trace(self) -> None:
        """Drop the kernel traces recorded so far (e.g. those of warm-up calls, whose
        programs waited for peers still compiling the profiled kernels)."""
        recorder = self._trace_recorder()
        if recorder is not None:
            recorder.clear()

    def _trace_recorder(self) -> TraceRecorder | None:
        """The recorder both modes share (one time axis), once a mode exists."""
        modes = [m for m in (self._normal, self._ll) if m is not None]
        return modes[0].trace if modes else None

    def _profile(self) -> bool | TraceRecorder:
        """What a new mode gets as ``profile``: the shared recorder, else the flag."""
        return self._trace_recorder() or self.profile

    def check(self) -> None:
        """Wait for the device; raise :class:`WaitTimeoutError` if a kernel wait gave up,
        ``ValueError`` if worst-case outputs were too small, or
        :class:`~tritonep.errors.HeapGuardError` if a kernel wrote past a heap's regions.

        A timeout stays: every later call of the mode gives up its waits at once (no second
        wait for the same peer) and every later ``check()`` raises the same error, naming the
        limit the failed wait had; destroy the buffer and build a new one. An overflow of
        worst-case outputs is raised once: the ranks stay in step and later calls work."""
        self._streams.join()
        for mode in (self._normal, self._ll):
            if mode is not None:
                mode.check()
        if self._layout_status is not None:
            status = self._layout_status
            if status.synced_record()[0]:
                self._raise_layout_record()

    def destroy(self) -> None:
        """Release the buffer's memory (collective). Every mode is released even if one of
        them reports a timeout (peers wait for each release); the first error is raised
        after that."""
        self._streams.join()
        modes = (self._normal, self._ll)
        self._normal = self._ll = None
        error = None
        for mode in modes:
            if mode is not None:
                try:
                    mode.destroy()
                except Exception as e:  # raised below, after every release
                    error = error or e
        if error is not None:
            raise error
