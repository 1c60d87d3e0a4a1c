"""Normal mode across nodes: a network leg and an NVLink leg, channel-ring dispatches pipelined.

The GPUs of the group form nodes of ``gpus_per_node`` (a parameter, not a constant 8); GPU
``r`` is local index ``r % G`` of node ``r // G``. A token travels

1. over the network once per destination node, to the GPU with the same local index there
   (the *rail* leg: a :class:`~tritonep.modes.normal.NormalMode` over the GPUs that share this
   local index, one per node), carrying its top-k ids (node-local there) and weights;
2. from that GPU, the forwarder, over NVLink to every GPU of its node that holds one of the
   token's experts (the *node* leg: a ``NormalMode`` over the node's GPUs), with the token's
   origin (source node, token index) as each row's source tag.

Outputs are in (source rank, source token) order, so every output equals that of the
single-node mode (and the reference) bit for bit: the first call orders the rows with one
gather and keeps the order in the handle; cached calls have the NVLink leg's receivers write
each row at its final position, and combine's senders read each row where the caller holds
it (``row_map``), so no pass over every row precedes or follows the legs. Combine walks
back: the node leg sums a token's rows of every GPU of the node in float32 (one BF16 row per
node), and only that sum crosses the network, where the rail leg adds the nodes' sums.

Both legs are the intranode kernels (channel rings, the count exchange, exact or worst-case
sizes, cached mode). The rail leg runs on the staged transport: its notify rows and ring slots
are built in mirrors in this rank's heap and moved, with their tails and heads, by NVSHMEM puts
and signals (NVSHMEM heaps, real nodes) or by copies (emulated nodes).

The legs run at once, pipelined through the forwarder's memory:

* the count exchange of the rail leg also carries, per channel, how many of the rows a source
  sends will go on to each GPU of the destination node, so the forwarder learns the node
  leg's counts (its notify) before any row arrives;
* the rail leg lays the rows it receives out channel by channel (then by source node), and its
  receivers flag each row once written (:class:`~tritonep.modes.normal.Relay`);
* the node leg's channel ``c`` forwards exactly the rows that channel ``c`` of the rail leg
  delivers, one range, and its senders wait for each row's flag: they forward rows while the
  network still delivers later ones. The rail leg runs on a side stream, the node leg on the
  caller's; each has the call's SM budget, so the call occupies twice ``num_sms`` SMs;
* combine likewise: the node leg's receivers flag each node sum as they finish it, and the rail
  leg's senders put sums on the network as they are flagged.

A relayed row goes through the forwarder's memory, not a ring-to-ring copy as in DeepEP: a
few microseconds of HBM traffic per megabyte, and the network leg never waits for the NVLink
leg (its rows land in the output, not in a ring the NVLink leg must drain first).

Worst-case sizing (``num_worst_tokens``) sizes both legs' outputs to that many rows (a
forwarder relays at most ``nodes x tokens per rank`` rows, which the usual
``tokens x ranks`` bound covers; more rows are reported, never written out of bounds, and a
forwarder that overflows relays none, so nothing waits for rows it dropped), and nothing
synchronizes with the host: the reordering runs on the device, padding rows last.
Exact sizing reads the host twice (each leg's received count), the second while the network
leg already moves rows.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import WaitTimeoutError
from ..kernels.layout import DispatchLayout
from ..kernels.normal_combine import COMBINE_CALLS
from ..kernels.normal_dispatch import DISPATCH_CALLS
from ..kernels.sync import DEFAULT_TIMEOUT_S
from ..validation import (
    check_dispatch_x,
    check_ranks_agree,
    check_tensor,
    check_topk_idx,
    default_group,
)
from .normal import Config, NormalDispatchOutput, NormalHandle, NormalMode, Relay, raise_after
from .trace import TraceRecorder

_no_torch_function = torch._C.DisableTorchFunction

#: Bits of a source tag that hold the token index (the rest hold the source node).
TOKEN_BITS = 20


@dataclass
class InternodeHandle:
    """What combine and cached dispatches need from an internode dispatch.

    Attributes:
        rail: the network leg's handle (rows on the forwarder, per source node).
        node: the NVLink leg's handle (rows here, per forwarder).
        tag: ``[M1]`` int32 source tag of each forwarded row (source node, token index).
        order: ``[M]`` int64, the node-leg row of each output row.
        position: ``[M]`` int32, the output row of each node-leg row (``order`` inverted).
        recv_src_idx: ``[M]`` int32, each output row's token index on its source rank.
        recv_src_rank: ``[M]`` int32, each output row's source rank.
        num_tokens, hidden, num_experts: as in :class:`~tritonep.modes.normal.NormalHandle`.
    """

    rail: NormalHandle
    node: NormalHandle
    tag: torch.Tensor
    order: torch.Tensor
    position: torch.Tensor
    recv_src_idx: torch.Tensor
    recv_src_rank: torch.Tensor
    num_tokens: int
    hidden: int
    num_experts: int

    @property
    def num_rows(self) -> int:
        return self.order.shape[0]

    @property
    def num_recv_tokens(self) -> int:
        """Rows received, or ``-1`` in worst-case mode (then ``host_info[0]`` on the device)."""
        return self.node.num_recv_tokens

    @property
    def host_info(self) -> torch.Tensor:
        """``[1 + E_local]`` int32 on the device: rows received, tokens per local expert."""
        return self.node.host_info


class InternodeMode:
    """Normal-mode dispatch and combine over several nodes (or groups of GPUs acting as nodes).

    Args:
        group: the process group (default: the world), ``nodes * gpus_per_node`` ranks in node
            order; every rank constructs the mode together.
        hidden, num_experts, max_topk, device, max_sms, ring_tokens, timeout_s, check_ids: as
            for :class:`~tritonep.modes.normal.NormalMode` (``max_sms`` and ``ring_tokens``
            size each leg).
        gpus_per_node: GPUs per node; must divide the group size.
        profile: record kernel traces of both legs (``self.trace``), or a recorder to share.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        hidden: int = 7168,
        num_experts: int = 256,
        gpus_per_node: int = 8,
        max_topk: int = 16,
        device: torch.device | str | None = None,
        max_sms: int | None = None,
        ring_tokens: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        check_ids: bool = False,
        profile: bool | TraceRecorder = False,
    ):
        group = default_group(group)
        R = dist.get_world_size(group)
        check_ranks_agree(
            group,
            "InternodeMode",
            gpus_per_node=gpus_per_node,
            hidden=hidden,
            num_experts=num_experts,
        )
        if not isinstance(gpus_per_node, int) or gpus_per_node < 1 or R % gpus_per_node:
            raise ValueError(
                f"gpus_per_node: expected a divisor of the {R} ranks, got {gpus_per_node}"
            )
        G, M = gpus_per_node, R // gpus_per_node
        if num_experts % R:
            raise ValueError(f"num_experts: expected a multiple of {R} ranks, got {num_experts}")
        self.group, self.rank, self.num_ranks = group, dist.get_rank(group), R
        self.gpus_per_node, self.num_nodes = G, M
        self.node_index, self.local_index = divmod(self.rank, G)
        self.hidden, self.num_experts, self.check_ids = hidden, num_experts, check_ids
        rails = [[n * G + g for n in range(M)] for g in range(G)]  # the ranks of one local index
        nodes = [[n * G + g for g in range(G)] for n in range(M)]  # the ranks of one node
        rail, node = _leg_groups(group, [rails, nodes])
        leg = functools.partial(
            NormalMode,
            max_topk=max_topk,
            device=device,
            max_sms=max_sms,
            ring_tokens=ring_tokens,
            timeout_s=timeout_s,
            check_ids=False,
        )
        # Errors of either leg name ranks by their number in ``group``, and the leg.
        self.node = leg(
            node, hidden, num_experts // M, label="node", rank_names=nodes[self.node_index]
        )
        # The rail leg crosses the network: staged in this rank's heap, then put (NVSHMEM
        # heaps) or copied (emulated nodes), so the same protocol runs either way. Its notify
        # rows also carry, per channel, the rows the relay forwards to each GPU of its node.
        self.rail = leg(
            rail,
            hidden,
            num_experts,
            label="rail",
            staged=True,
            rank_names=rails[self.local_index],
            notify_extra=self.node.layout.max_channels * G,
        )
        self.device = self.rail.device
        #: Kernel traces of both legs on one time axis ("rail ..." and "node ..." kernels),
        #: under this rank's number in the whole group.
        self.trace = TraceRecorder.of(profile, self.rank, self.device, self.device.type == "cuda")
        self.rail.trace = self.node.trace = self.trace
        self.num_local_experts = num_experts // R
        # What callers of a normal mode read: ring sizes and defaults (the legs share them).
        self.layout, self.default_config = self.rail.layout, self.rail.default_config
        # get_dispatch_layout's kernel: bad ids go to the network leg's status (which names
        # this rank by its number in the group).
        self._layout = DispatchLayout(self.device, num_experts, R, self.rail.status, self.rail.rank)
        self._streams = _Streams(self.device)
        self._relay_flags: dict[str, torch.Tensor] = {}

    def _flags(self, kind: str, rows: int) -> torch.Tensor:
        """Per-row flags of the relay of ``kind`` (dispatch and combine tag theirs with
        different call counters, so each has its own), grown on demand; fresh flags are zero,
        which no call's tag is. The zero fill runs on the current stream: the caller orders
        both legs after it (a leg that raced the fill could see a stale tag, or lose one)."""
        flags = self._relay_flags.get(kind)
        if flags is None or flags.numel() < rows:
            size = max(rows, 2 * flags.numel() if flags is not None else 1024)
            flags = torch.zeros(size, dtype=torch.int32, device=self.device)
            self._relay_flags[kind] = flags
        return flags

    @staticmethod
    def _calls(mode: NormalMode, counter) -> torch.Tensor:
        """A one-element view of one of a leg's device call counters."""
        return mode.state[counter.value : counter.value + 1]

    def _check_budget(self, config: Config) -> None:
        # Both legs run at once: the relay's reader spins while its writer must find SMs.
        if self.device.type == "cuda":
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            if 2 * config.num_sms > sms:
                raise ValueError(
                    f"config: num_sms={config.num_sms} per leg, twice that "
                    f"exceeds the {sms} SMs (both legs run at once)"
                )

    def get_dispatch_layout(self, topk_idx: torch.Tensor):
        """Routing statistics of ``topk_idx`` (``[N, K]`` int64 global expert ids, ``-1`` for
        none), from one kernel: ``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E]
        int32, is_token_in_rank [N, R] bool)``. Ids outside ``[-1, E)`` count as none and are
        recorded: the next dispatch or combine raises them."""
        with _no_torch_function():
            check_topk_idx(
                "topk_idx", topk_idx, None, self.num_experts, self.device, self.check_ids
            )
            return self._layout(topk_idx)

    @property
    def timeout_s(self) -> float:
        """Limit of every wait inside the kernels of both legs, in seconds; it may change
        between calls."""
        return self.rail.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self.rail.timeout_s = self.node.timeout_s = value

    def check(self) -> None:
        """Raise if a wait of either leg timed out (that first), worst-case outputs of either
        leg overflowed or ids were out of range. Both legs are read, so an overflow of both
        is raised once, not once now and again at the next check."""
        self._raise_first(lambda leg: leg.check())

    def _raise_first(self, read) -> None:
        """``read(leg)`` for both legs; raise the first timeout, else the first error."""
        errors = []
        for leg in (self.rail, self.node):
            try:
                read(leg)
            except (WaitTimeoutError, ValueError) as error:
                errors.append(error)
        if errors:
            raise next((e for e in errors if isinstance(e, WaitTimeoutError)), errors[0])

    def _recorded(self) -> bool:
        """Whether either leg's kernels recorded something (host copies: no synchronization)."""
        return bool(self.rail.status.recorded() or self.node.status.recorded())

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        handle: InternodeHandle | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
    ) -> NormalDispatchOutput[InternodeHandle]:
        """Send each token once per destination node, then once per destination GPU there.

        Args and returns as :meth:`tritonep.modes.normal.NormalMode.dispatch` (exact output
        sizes: two host reads of received counts, one per leg; worst-case sizes: none), but
        without ``src_tag`` and ``relay``, and the output's handle is an
        :class:`InternodeHandle`. In cached mode (``handle``) only ``x`` moves. What either
        leg recorded earlier is raised after the launches (as by ``NormalMode``).
        """
        with _no_torch_function():
            return raise_after(
                self._recorded,
                lambda: self._raise_first(NormalMode.raise_recorded),
                lambda: self._dispatch(
                    x,
                    topk_idx,
                    topk_weights,
                    num_tokens_per_expert,
                    is_token_in_rank,
                    handle,
                    expert_alignment,
                    num_worst_tokens,
                    config,
                ),
                synced=handle is None and not num_worst_tokens,
            )

    def _dispatch(
        self,
        x,
        topk_idx,
        topk_weights,
        num_tokens_per_expert,
        is_token_in_rank,
        handle,
        expert_alignment,
        num_worst_tokens,
        config,
    ) -> NormalDispatchOutput[InternodeHandle]:
        payload = check_dispatch_x("x", x)
        num_tokens = payload.shape[0]
        if num_tokens >= 1 << TOKEN_BITS:
            raise ValueError(
                f"x: at most {(1 << TOKEN_BITS) - 1} tokens per rank, got {num_tokens}"
            )
        G = self.gpus_per_node
        if handle is not None:
            if not isinstance(handle, InternodeHandle):
                raise TypeError(f"handle: expected an InternodeHandle, got {type(handle).__name__}")
            streams = self._streams
            flags = self._flags("dispatch", handle.rail.num_rows)  # before the side waits
            streams.fork()
            with streams.producer():
                calls = self._calls(self.node, DISPATCH_CALLS)
                rail = self.rail._dispatch(x, handle=handle.rail, relay=Relay(flags, calls))
            # The NVLink leg's receivers write each row at its final position: no gather of
            # every row after both legs.
            node = self.node._dispatch(
                rail.recv_x,
                handle=handle.node,
                src_tag=handle.tag,
                relay=Relay(flags, await_rows=True),
                row_map=handle.position,
            )
            streams.join(rail.recv_x, rail.handle.recv_src_idx)
            return NormalDispatchOutput(node.recv_x, None, None, None, handle)

        topk_idx = check_topk_idx(
            "topk_idx", topk_idx, num_tokens, self.num_experts, self.device, self.check_ids
        )
        if topk_weights is not None:
            check_tensor(
                "topk_weights",
                topk_weights,
                dtype=torch.float32,
                shape=tuple(topk_idx.shape),
                device=self.device,
            )
        if (num_tokens_per_expert is None) != (is_token_in_rank is None):
            raise ValueError(
                "num_tokens_per_expert, is_token_in_rank: give both (from "
                "get_dispatch_layout) or neither"
            )
        if is_token_in_rank is None:
            # The ids were checked above: the layout kernel alone, no second host read.
            _, per_expert, in_rank = self._layout(topk_idx)
        else:
            per_expert, in_rank = num_tokens_per_expert, is_token_in_rank
            check_tensor(
                "is_token_in_rank",
                in_rank,
                dtype=torch.bool,
                shape=(num_tokens, self.num_ranks),
                device=self.device,
            )
            check_tensor(
                "num_tokens_per_expert",
                per_expert,
                dtype=torch.int32,
                shape=(self.num_experts,),
                device=self.device,
            )
        config = self.rail._config(config)
        self._check_budget(config)
        C = config.num_channels
        in_node = token_in_node(in_rank, G)
        # Each row carries its origin through the relay: (source node, token index).
        tag = (self.node_index << TOKEN_BITS) | torch.arange(
            num_tokens, dtype=torch.int32, device=self.device
        )
        streams = self._streams
        streams.fork()
        with streams.producer():
            # With the counts, each source tells each destination node's relay how many rows
            # of every channel it will forward to each GPU there: the NVLink leg's counts are
            # known before any row arrives.
            rail_plan = self.rail.notify(
                in_node,
                per_expert,
                num_tokens,
                1,
                num_worst_tokens,
                config,
                extra=forward_counts(in_rank, C, G),
                channel_major=True,
            )
            # Fresh flags are zeroed on this stream: the NVLink leg, which reads them, waits
            # for that fill with the counts.
            flags = self._flags("dispatch", rail_plan.num_rows)
            notified = streams.mark()
            rail = self.rail._dispatch(
                x,
                topk_idx,
                topk_weights,
                handle=rail_plan,
                src_tag=tag,
                relay=Relay(flags, publish_to=self._calls(self.node, DISPATCH_CALLS)),
            )
        streams.wait(notified)
        send_counts, bounds = relay_layout(rail_plan, C, G)
        node_plan = self.node.notify(
            None,
            rail_plan.host_info[1:],
            rail_plan.num_rows,
            expert_alignment,
            num_worst_tokens,
            config,
            send_counts=send_counts,
            bounds=bounds,
        )
        node = self.node._dispatch(
            rail.recv_x,
            rail.recv_topk_idx,
            rail.recv_topk_weights,
            handle=node_plan,
            src_tag=rail.handle.recv_src_idx,
            relay=Relay(flags, await_rows=True),
        )
        streams.join(
            rail.recv_x, rail.recv_topk_idx, rail.recv_topk_weights, *_tensors(rail.handle)
        )
        # Rows arrive per relay (local index), each relay's in (channel, node, token) order;
        # outputs go in (source rank, token) order, padding rows (tag -1) last.
        forwarder = _owners(node.handle.recv_count, node.handle.num_rows)
        rail_src, node_src = rail.handle.recv_src_idx, node.handle.recv_src_idx
        assert rail_src is not None and node_src is not None  # every dispatch's handle has them
        tags = node_src.long()
        padding = tags < 0
        src_rank = torch.where(padding, -1, (tags >> TOKEN_BITS) * G + forwarder)
        token = torch.where(padding, -1, tags & ((1 << TOKEN_BITS) - 1))
        key = torch.where(padding, self.num_ranks << TOKEN_BITS, src_rank << TOKEN_BITS | token)
        order = torch.argsort(key, stable=True)
        position = torch.empty(order.shape, dtype=torch.int32, device=self.device)
        position[order] = torch.arange(order.shape[0], dtype=torch.int32, device=self.device)
        new_handle = InternodeHandle(
            rail.handle,
            node.handle,
            rail_src,
            order,
            position,
            token[order].to(torch.int32),
            src_rank[order].to(torch.int32),
            num_tokens,
            self.hidden,
            self.num_experts,
        )
        ids, weights = node.recv_topk_idx, node.recv_topk_weights
        return NormalDispatchOutput(
            _rows(node.recv_x, order),
            ids[order] if ids is not None else None,
            weights[order] if weights is not None else None,
            node.num_recv_tokens_per_expert,
            new_handle,
        )

    def combine(
        self,
        x: torch.Tensor,
        handle: InternodeHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sum each token's rows within every node (float32, one BF16 row per node), then the
        nodes' sums across the network. Args and returns as
        :meth:`tritonep.modes.normal.NormalMode.combine`, without ``relay``."""
        with _no_torch_function():
            return raise_after(
                self._recorded,
                lambda: self._raise_first(NormalMode.raise_recorded),
                lambda: self._combine(x, handle, topk_weights, bias),
            )

    def _combine(self, x, handle, topk_weights, bias):
        if not isinstance(handle, InternodeHandle):
            raise TypeError(f"handle: expected an InternodeHandle, got {type(handle).__name__}")
        check_tensor(
            "x", x, dtype=torch.bfloat16, shape=(handle.num_rows, handle.hidden), device=self.device
        )
        if topk_weights is not None:
            check_tensor(
                "topk_weights",
                topk_weights,
                dtype=torch.float32,
                shape=(handle.num_rows, None),
                device=self.device,
            )
        streams = self._streams
        flags = self._flags("combine", handle.rail.num_rows)  # before the side waits
        streams.fork()
        with streams.producer():
            calls = self._calls(self.rail, COMBINE_CALLS)
            # The NVLink leg's senders read each row where the caller holds it (its output
            # order): no scatter of every row into the leg's order first.
            per_node, per_node_w = self.node._combine(
                x, handle.node, topk_weights, relay=Relay(flags, calls), row_map=handle.position
            )
        relay = Relay(flags, await_rows=True, limit=handle.node.bounds)
        out = self.rail._combine(per_node, handle.rail, per_node_w, bias, relay=relay)
        streams.join(per_node, per_node_w)
        return out

    def destroy(self) -> None:
        """Release both legs' memory (collective)."""
        try:
            self.rail.destroy()
        finally:
            self.node.destroy()


#: Groups made for the legs, by world ranks; torch.distributed holds them until the process
#: group is destroyed, and so does this cache (weakly), no longer.
_subgroups: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _leg_groups(group: dist.ProcessGroup, splits: list[list[list[int]]]) -> list:
    """For each list of ``splits`` (disjoint lists of ranks of ``group``), the process group
    of the one that holds this rank.

    Groups are made once and kept for later modes over the same ranks (when every rank of
    ``group`` still has its own), so a buffer made and destroyed in a loop makes no new
    communicators. A group that is the whole world makes every group on every rank, in the
    same order, as ``dist.new_group`` requires. A smaller one (data parallel x expert
    parallel: other groups build their buffers at the same time) must not involve the other
    groups' ranks:

    * NCCL under a default group bound to a device: ``dist.split_group`` from ``group``
      (new NCCL groups there are split from the world's communicator, which every world rank
      would have to join);
    * otherwise groups made by their members alone (local synchronization). torch.distributed
      names such a group after its ranks and the number of groups its maker already knows, so
      members that know different numbers would never meet: ranks that know fewer first make
      groups of themselves alone. Every member makes its groups in the order of ``splits``,
      so no two wait on each other in opposite orders.
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    world = [dist.get_global_rank(group, r) for r in range(size)]
    mine = [
        tuple(world[r] for r in next(ranks for ranks in split if rank in ranks)) for split in splits
    ]
    kept = [_subgroups.get(ranks) for ranks in mine]
    known = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", ())
    views: list[tuple[int, bool]] = [(0, False)] * size  # (groups known, all kept) per rank
    dist.all_gather_object(views, (len(known), all(g is not None for g in kept)), group=group)
    if all(have for _, have in views):
        return kept
    if size == dist.get_world_size():
        for split, ranks in zip(splits, mine, strict=True):
            for other in split:
                made = dist.new_group([world[r] for r in other])
                if rank in other:
                    _subgroups[ranks] = made
        return [_subgroups[ranks] for ranks in mine]
    for _ in range(max(count for count, _ in views) - len(known)):
        dist.new_group([dist.get_rank()], use_local_synchronization=True)
    by_split = (
        dist.get_backend(group) == "nccl"
        and getattr(dist.group.WORLD, "bound_device_id", None) is not None
    )
    out = []
    for split, ranks in zip(splits, mine, strict=True):
        if by_split:
            made = dist.split_group(parent_pg=group, split_ranks=split)
        else:
            made = dist.new_group(list(ranks), use_local_synchronization=True)
        _subgroups[ranks] = made
        out.append(made)
    return out


class _Streams:
    """The legs run at once: the writing leg on a side stream, the reading one on the caller's."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        #: The caller's stream, as :meth:`fork` found it.
        self.main: torch.cuda.Stream | None = None

    def fork(self) -> None:
        if self.side is not None:
            self.main = torch.cuda.current_stream(self.device)
            self.side.wait_stream(self.main)

    def _caller(self) -> torch.cuda.Stream:
        if self.main is None:
            raise RuntimeError("_Streams: fork() must come before wait() and join()")
        return self.main

    def producer(self):
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def mark(self):
        """An event after the work queued on the side stream so far."""
        if self.side is None:
            return None
        event = torch.cuda.Event()
        event.record(self.side)
        return event

    def wait(self, event) -> None:
        if event is not None:
            self._caller().wait_event(event)

    def join(self, *tensors) -> None:
        """The caller's stream waits for the side stream; tensors made on the side stream are
        then in use on the caller's (so their memory is not reused too early)."""
        if self.side is None:
            return
        main = self._caller()
        main.wait_stream(self.side)
        for t in tensors:
            for u in t if isinstance(t, tuple) else (t,):
                if u is not None:
                    u.record_stream(main)


def forward_counts(is_token_in_rank: torch.Tensor, channels: int, gpus_per_node: int):
    """``[nodes, C * G]`` int32: for each destination node, the tokens of each channel that
    its relay will forward to each of its GPUs (what the relay's NVLink notify sends)."""
    n, ranks = is_token_in_rank.shape
    channel = torch.arange(n, device=is_token_in_rank.device) // max(-(-n // channels), 1)
    counts = torch.zeros(channels, ranks, dtype=torch.int32, device=is_token_in_rank.device)
    counts.index_add_(0, channel, is_token_in_rank.to(torch.int32))
    nodes = ranks // gpus_per_node
    return (
        counts.view(channels, nodes, gpus_per_node).transpose(0, 1).reshape(nodes, -1).contiguous()
    )


def relay_layout(rail_plan: NormalHandle, channels: int, gpus_per_node: int):
    """The NVLink leg of a relay from its network leg's notify, on the device: ``[G, C]``
    int32 rows each channel forwards to each GPU of the node, and ``[C + 1]`` int32 channel
    bounds over the relayed rows (channel-major: channel ``c`` relays the rows that channel
    ``c`` of every source node delivered). Rows past the network leg's outputs (worst-case
    sizing too small) are not relayed: the network leg reports the overflow."""
    extra = rail_plan.extra
    if extra is None:
        raise ValueError("rail_plan: expected a handle from notify(extra=forward_counts(...))")
    sources = extra.shape[0]
    counts = extra.view(sources, channels, gpus_per_node).sum(0, dtype=torch.int32)
    total = rail_plan.host_info[:1]
    fits = (total <= rail_plan.num_rows).to(torch.int32)
    bounds = torch.cat([rail_plan.recv_start[0], total]) * fits
    return (counts.t() * fits).contiguous(), bounds


def _tensors(handle: NormalHandle):
    return (
        handle.recv_count,
        handle.recv_start,
        handle.host_info,
        handle.recv_src_idx,
        handle.extra,
    )


def token_in_node(is_token_in_rank: torch.Tensor, gpus_per_node: int) -> torch.Tensor:
    """``[N, nodes]`` bool: whether each token goes to some GPU of each node."""
    n, ranks = is_token_in_rank.shape
    return is_token_in_rank.view(n, ranks // gpus_per_node, gpus_per_node).any(dim=2)


def _owners(recv_count: torch.Tensor, rows: int) -> torch.Tensor:
    """``[rows]`` int64: the source (rank of the leg) of each received row, from the
    ``[R, C]`` counts of a dispatch handle (rows arrive grouped by source; rows past the
    received ones get the number of sources). No host synchronization."""
    ends = recv_count.sum(dim=1).long().cumsum(0)
    positions = torch.arange(rows, device=recv_count.device)
    return torch.searchsorted(ends, positions, right=True)


def _rows(x, index):
    return tuple(t[index] for t in x) if isinstance(x, tuple) else x[index]
