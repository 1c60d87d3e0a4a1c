"""Normal mode across nodes: a network leg, then an NVLink leg, each a channel-ring dispatch.

The GPUs of the group form nodes of ``gpus_per_node`` (a parameter, not a constant 8); GPU
``r`` is local index ``r % G`` of node ``r // G``. A token travels

1. over the network once per destination node, to the GPU with the same local index there
   (the *rail* leg: a :class:`~tritonep.modes.normal.NormalMode` over the GPUs that share this
   local index, one per node), carrying its top-k ids (node-local there) and weights;
2. from that GPU, the forwarder, over NVLink to every GPU of its node that holds one of the
   token's experts (the *node* leg: a ``NormalMode`` over the node's GPUs), with the token's
   origin (source node, token index) as each row's source tag.

Receivers then order their rows by (source rank, source token) with one gather, so every
output equals that of the single-node mode (and the reference) bit for bit. Combine walks
back: the node leg sums a token's rows of every GPU of the node in float32 (one BF16 row per
node), and only that sum crosses the network, where the rail leg adds the nodes' sums.

Both legs are the intranode kernels, so the count exchange, exact output sizes and cached
mode come with them. The rail leg runs on the staged transport: its notify rows and ring slots
are built in mirrors in this rank's heap and moved, with their tails and heads, by NVSHMEM puts
and signals (NVSHMEM heaps, real nodes) or by copies (emulated nodes). The present limit, on
the way to DeepEP's pipelined design (forwarders consuming the network rings while they fill,
see ``docs/multinode.md``): the legs run one after the other.

Worst-case sizing (``num_worst_tokens``) sizes both legs' outputs to that many rows (a
forwarder relays at most ``nodes x tokens per rank`` rows, which the usual
``tokens x ranks`` bound covers; more rows are reported, never written out of bounds), and
nothing synchronizes with the host: the reordering runs on the device, padding rows last.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..kernels.layout import dispatch_layout
from ..kernels.sync import DEFAULT_TIMEOUT_S
from ..validation import check_dispatch_x, check_ranks_agree, check_tensor, check_topk_idx
from .normal import Config, NormalDispatchOutput, NormalHandle, NormalMode
from .trace import TraceRecorder

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
        recv_src_idx: ``[M]`` int32, each output row's token index on its source rank.
        recv_src_rank: ``[M]`` int32, each output row's source rank.
        num_tokens, hidden, num_experts: as in :class:`~tritonep.modes.normal.NormalHandle`.
    """

    rail: NormalHandle
    node: NormalHandle
    tag: torch.Tensor
    order: torch.Tensor
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
        check_ids: bool = True,
        profile: bool | TraceRecorder = False,
    ):
        group = group or dist.group.WORLD
        R = dist.get_world_size(group)
        check_ranks_agree(group, "InternodeMode", gpus_per_node=gpus_per_node, hidden=hidden,
                          num_experts=num_experts)  # fmt: skip
        if not isinstance(gpus_per_node, int) or gpus_per_node < 1 or R % gpus_per_node:
            raise ValueError(f"gpus_per_node: expected a divisor of the {R} ranks, "
                             f"got {gpus_per_node}")  # fmt: skip
        G, M = gpus_per_node, R // gpus_per_node
        if num_experts % R:
            raise ValueError(f"num_experts: expected a multiple of {R} ranks, got {num_experts}")
        self.group, self.rank, self.num_ranks = group, dist.get_rank(group), R
        self.gpus_per_node, self.num_nodes = G, M
        self.node_index, self.local_index = divmod(self.rank, G)
        self.hidden, self.num_experts, self.check_ids = hidden, num_experts, check_ids
        members = [dist.get_global_rank(group, i) for i in range(R)]
        # Every rank creates every subgroup, in the same order, as torch.distributed requires.
        rails = [dist.new_group([members[n * G + g] for n in range(M)]) for g in range(G)]
        nodes = [dist.new_group([members[n * G + g] for g in range(G)]) for n in range(M)]
        legs = dict(max_topk=max_topk, device=device, max_sms=max_sms, ring_tokens=ring_tokens,
                    timeout_s=timeout_s, check_ids=False)  # fmt: skip
        # The rail leg crosses the network: staged in this rank's heap, then put (NVSHMEM
        # heaps) or copied (emulated nodes), so the same protocol runs either way.
        self.rail = NormalMode(rails[self.local_index], hidden, num_experts, **legs,
                               label="rail", staged=True)  # fmt: skip
        self.node = NormalMode(nodes[self.node_index], hidden, num_experts // M, **legs,
                               label="node")  # fmt: skip
        self.device = self.rail.device
        #: Kernel traces of both legs on one time axis ("rail ..." and "node ..." kernels),
        #: under this rank's number in the whole group.
        self.trace = TraceRecorder.of(profile, self.rank, self.device, self.device.type == "cuda")
        self.rail.trace = self.node.trace = self.trace
        self.num_local_experts = num_experts // R
        # What callers of a normal mode read: ring sizes and defaults (the legs share them).
        self.layout, self.default_config = self.rail.layout, self.rail.default_config
        self._arrivals = torch.zeros(1, dtype=torch.int32, device=self.device)

    def get_dispatch_layout(self, topk_idx: torch.Tensor):
        """``(num_tokens_per_rank [R], num_tokens_per_expert [E], is_token_in_rank [N, R])``."""
        check_topk_idx("topk_idx", topk_idx, None, self.num_experts, self.device, self.check_ids)
        return dispatch_layout(topk_idx, self.num_experts, self.num_ranks, self._arrivals)

    def check(self) -> None:
        """Raise if a wait of either leg timed out."""
        self.rail.check()
        self.node.check()

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
    ) -> NormalDispatchOutput:
        """Send each token once per destination node, then once per destination GPU there.

        Args and returns as :meth:`tritonep.modes.normal.NormalMode.dispatch` (exact output
        sizes: two host reads of received counts, one per leg; worst-case sizes: none), with
        an :class:`InternodeHandle`. In cached mode (``handle``) only ``x`` moves.
        """
        payload = check_dispatch_x("x", x)
        num_tokens = payload.shape[0]
        if num_tokens >= 1 << TOKEN_BITS:
            raise ValueError(f"x: at most {(1 << TOKEN_BITS) - 1} tokens per rank, "
                             f"got {num_tokens}")  # fmt: skip
        G = self.gpus_per_node
        if handle is not None:
            if not isinstance(handle, InternodeHandle):
                raise TypeError(f"handle: expected an InternodeHandle, got {type(handle).__name__}")
            rail = self.rail.dispatch(x, handle=handle.rail)
            node = self.node.dispatch(rail.recv_x, handle=handle.node, src_tag=handle.tag)
            recv_x = _rows(node.recv_x, handle.order)
            return NormalDispatchOutput(recv_x, None, None, None, handle)

        topk_idx = check_topk_idx("topk_idx", topk_idx, num_tokens, self.num_experts,
                                  self.device, self.check_ids)  # fmt: skip
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, dtype=torch.float32,
                         shape=tuple(topk_idx.shape), device=self.device)  # fmt: skip
        if (num_tokens_per_expert is None) != (is_token_in_rank is None):
            raise ValueError("num_tokens_per_expert, is_token_in_rank: give both (from "
                             "get_dispatch_layout) or neither")  # fmt: skip
        if is_token_in_rank is None:
            # The ids were checked above: the layout kernel alone, no second host read.
            _, per_expert, in_rank = dispatch_layout(
                topk_idx, self.num_experts, self.num_ranks, self._arrivals
            )
        else:
            per_expert, in_rank = num_tokens_per_expert, is_token_in_rank
            check_tensor("is_token_in_rank", in_rank, dtype=torch.bool,
                         shape=(num_tokens, self.num_ranks), device=self.device)  # fmt: skip
            check_tensor("num_tokens_per_expert", per_expert, dtype=torch.int32,
                         shape=(self.num_experts,), device=self.device)  # fmt: skip
        in_node = token_in_node(in_rank, G)
        rail = self.rail.dispatch(x, topk_idx, topk_weights, per_expert, in_node,
                                  num_worst_tokens=num_worst_tokens, config=config)  # fmt: skip
        # Each forwarded row carries its origin: (source node, token index on the source).
        from_node = _owners(rail.handle.recv_count, rail.handle.num_rows)
        tag = ((from_node << TOKEN_BITS) | rail.handle.recv_src_idx).to(torch.int32)
        node_ids = rail.recv_topk_idx  # node-local expert ids, -1 for other nodes
        _, per_expert2, in_rank2 = self.node.get_dispatch_layout(node_ids)
        node = self.node.dispatch(
            rail.recv_x, node_ids, rail.recv_topk_weights, per_expert2, in_rank2,
            expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
            config=config, src_tag=tag,
        )  # fmt: skip
        # Rows arrive per forwarder (local index), each forwarder's in (node, token) order;
        # outputs go in (source rank, token) order, padding rows (tag -1) last.
        forwarder = _owners(node.handle.recv_count, node.handle.num_rows)
        tags = node.handle.recv_src_idx.long()
        padding = tags < 0
        src_rank = torch.where(padding, -1, (tags >> TOKEN_BITS) * G + forwarder)
        token = torch.where(padding, -1, tags & ((1 << TOKEN_BITS) - 1))
        key = torch.where(padding, self.num_ranks << TOKEN_BITS, src_rank << TOKEN_BITS | token)
        order = torch.argsort(key, stable=True)
        new_handle = InternodeHandle(
            rail.handle, node.handle, tag, order, token[order].to(torch.int32),
            src_rank[order].to(torch.int32), num_tokens, self.hidden, self.num_experts,
        )  # fmt: skip
        weights = node.recv_topk_weights
        return NormalDispatchOutput(
            _rows(node.recv_x, order),
            node.recv_topk_idx[order],
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
        :meth:`tritonep.modes.normal.NormalMode.combine`."""
        if not isinstance(handle, InternodeHandle):
            raise TypeError(f"handle: expected an InternodeHandle, got {type(handle).__name__}")
        check_tensor("x", x, dtype=torch.bfloat16, shape=(handle.num_rows, handle.hidden),
                     device=self.device)  # fmt: skip
        back = torch.empty_like(x)
        back[handle.order] = x  # node-leg row order
        weights = None
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, dtype=torch.float32,
                         shape=(handle.num_rows, None), device=self.device)  # fmt: skip
            weights = torch.empty_like(topk_weights)
            weights[handle.order] = topk_weights
        per_node, per_node_w = self.node.combine(back, handle.node, weights)
        return self.rail.combine(per_node, handle.rail, per_node_w, bias)

    def destroy(self) -> None:
        """Release both legs' memory (collective)."""
        try:
            self.rail.destroy()
        finally:
            self.node.destroy()


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
