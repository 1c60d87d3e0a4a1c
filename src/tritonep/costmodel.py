"""A cost model of hierarchical (RDMA + NVLink) dispatch and combine across nodes.

The internode design sends each token over the network once per destination node, to the GPU
with the same local index there, which forwards it over NVLink to every GPU of that node that
holds one of its experts; combine walks the same path backwards, reducing within the node
first. So per GPU and call:

* network rows = tokens x (other nodes the token goes to): ``N (M - 1) p_node``;
* NVLink rows = for every source node, the rows its tokens fan out to the node's other GPUs:
  ``N M (G - 1) p_rank`` (the forwarder sends what arrived from the network plus its own);

where ``M`` nodes of ``G`` GPUs, ``N`` tokens per GPU, and ``p_node`` / ``p_rank`` are the
probabilities that a token has at least one of its top-k experts on a given node / GPU. With
uniform routing over ``E`` experts (``k`` distinct per token),
``p_rank = 1 - C(E - E/(MG), k) / C(E, k)`` and likewise ``p_node`` with ``E/M``. Measured
routing replaces both by counts (:func:`measured_traffic`).

The legs are pipelined (forwarders start while rows still arrive), so a call takes the slower
leg's time plus a fixed cost (launches, the count exchange):
``t = fixed + max(network_bytes / B_net, nvlink_bytes / B_nvl)``; ``*_serial_us`` is the bound
for legs that do not overlap at all, ``fixed + network / B_net + nvlink / B_nvl``.

On one host that emulates nodes (``shared_links=True``) both legs are the intranode kernels
moving rows to one peer each (the rail leg to the same-index GPU of the other node, the node
leg to the node's other GPU), and the legs were measured to add up (2 x 2 on 4x H200: each leg
alone 359 + 525 us, both 886 us): ``t = fixed + (network + nvlink bytes) / B_leg`` with
``B_leg`` the kernels' rate to one peer, measured apart from any internode run (2-rank
intranode dispatch). ``python -m tritonep.costmodel`` prints predictions for 2 to 32 nodes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from math import comb

import torch


@dataclass(frozen=True)
class Links:
    """Per-GPU bandwidths (GB/s, one direction) and the fixed cost of a call (us).

    Defaults: NVLink at the all-to-all ceiling measured on 4x H200 (370 GB/s remote per GPU),
    a 400 Gb/s NIC per GPU at 90% (45 GB/s), and 25 us of launches and count exchange.
    ``emulated_leg_gbps``: on emulated nodes, the rate of a leg, the intranode kernels moving
    rows to one peer (2-rank dispatch, remote bytes: 195-198 GB/s on 2x H100, 2026-11-25).
    """

    nvlink_gbps: float = 370.0
    network_gbps: float = 45.0
    fixed_us: float = 25.0
    emulated_leg_gbps: float = 200.0


def uniform_probabilities(num_experts: int, topk: int, num_nodes: int, gpus_per_node: int):
    """``(p_node, p_rank)`` for uniform routing of ``topk`` distinct experts per token."""
    ranks = num_nodes * gpus_per_node
    if num_experts % ranks:
        raise ValueError(f"num_experts: {num_experts} is not a multiple of {ranks} GPUs")

    def p_hit(owned: int) -> float:
        return 1.0 - comb(num_experts - owned, topk) / comb(num_experts, topk)

    return p_hit(num_experts // num_nodes), p_hit(num_experts // ranks)


def row_bytes(hidden: int, use_fp8: bool) -> int:
    """Bytes of one token's payload: BF16, or e4m3 plus a float32 scale per (partial) 128
    channels."""
    return hidden + -(-hidden // 128) * 4 if use_fp8 else 2 * hidden


@dataclass(frozen=True)
class Traffic:
    """Rows one GPU moves per call, on average over GPUs."""

    network_rows: float
    nvlink_rows: float
    received_rows: float  # rows in the dispatch output (local rank included)


def uniform_traffic(tokens, num_experts, topk, num_nodes, gpus_per_node) -> Traffic:
    p_node, p_rank = uniform_probabilities(num_experts, topk, num_nodes, gpus_per_node)
    ranks = num_nodes * gpus_per_node
    return Traffic(
        network_rows=tokens * (num_nodes - 1) * p_node,
        nvlink_rows=tokens * num_nodes * (gpus_per_node - 1) * p_rank,
        received_rows=tokens * ranks * p_rank,
    )


def measured_traffic(topk_idx: list[torch.Tensor], num_experts: int, gpus_per_node: int):
    """Exact average rows per GPU for given routing: ``topk_idx[r]`` is rank ``r``'s
    ``[N_r, K]`` ids (``-1`` = none)."""
    ranks = len(topk_idx)
    nodes = ranks // gpus_per_node
    per_rank = num_experts // ranks
    network = nvlink = received = 0
    for r, idx in enumerate(topk_idx):
        owner = torch.where(idx >= 0, idx // per_rank, -1)
        in_rank = torch.stack([(owner == d).any(1) for d in range(ranks)], 1)  # [N, R]
        in_node = in_rank.view(-1, nodes, gpus_per_node).any(2)  # [N, M]
        my_node, my_local = divmod(r, gpus_per_node)
        network += int(in_node.sum()) - int(in_node[:, my_node].sum())
        # The forwarder on each destination node sends to that node's GPUs other than itself.
        fanout = in_rank.view(-1, nodes, gpus_per_node).clone()
        fanout[:, :, my_local] = False
        nvlink += int(fanout.sum())
        received += int(in_rank.sum())
    return Traffic(network / ranks, nvlink / ranks, received / ranks)


def predict(
    traffic: Traffic,
    hidden: int,
    use_fp8: bool = False,
    links: Links | None = None,
    shared_links: bool = False,
) -> dict:
    """Predicted dispatch and combine times (us; ``*_serial_us``: legs one after the other)
    and the bytes of each leg per GPU."""
    links = links or Links()
    out = {}
    for op, fp8 in (("dispatch", use_fp8), ("combine", False)):
        size = row_bytes(hidden, fp8)
        net_bytes, nvl_bytes = traffic.network_rows * size, traffic.nvlink_rows * size
        net_rate = links.emulated_leg_gbps if shared_links else links.network_gbps
        nvl_rate = links.emulated_leg_gbps if shared_links else links.nvlink_gbps
        t_net, t_nvl = net_bytes / net_rate / 1e3, nvl_bytes / nvl_rate / 1e3
        t = links.fixed_us + (t_net + t_nvl if shared_links else max(t_net, t_nvl))
        out[f"{op}_us"] = t
        out[f"{op}_serial_us"] = links.fixed_us + t_net + t_nvl
        out[f"{op}_network_MB"] = net_bytes / 1e6
        out[f"{op}_nvlink_MB"] = nvl_bytes / 1e6
        # DeepEP's accounting: received rows (local rank included) x row bytes / time.
        out[f"{op}_GBps"] = traffic.received_rows * size / t / 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    from .cli import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="python -m tritonep.costmodel",
        description=(
            "Predicted internode dispatch and combine times per GPU for uniform routing, at\n"
            "each node count: the slower of the network and NVLink legs plus a fixed cost\n"
            "(pipelined legs), and the serial bound beside it. The model and its terms: the\n"
            "docstring of tritonep.costmodel."
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--nodes", default="1,2,4,8,16,32", help="node counts, comma-separated")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (ranks) per node")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per GPU")
    parser.add_argument("--hidden", type=int, default=7168, help="hidden size (channels)")
    parser.add_argument("--topk", type=int, default=8, help="experts per token")
    parser.add_argument("--experts", type=int, default=256, help="experts in all")
    parser.add_argument("--fp8", action="store_true", help="FP8 dispatch payloads (not BF16)")
    parser.add_argument(
        "--nvlink-gbps",
        type=float,
        default=Links.nvlink_gbps,
        help="NVLink bandwidth per GPU, GB/s one way",
    )
    parser.add_argument(
        "--network-gbps",
        type=float,
        default=Links.network_gbps,
        help="network bandwidth per GPU, GB/s one way",
    )
    parser.add_argument(
        "--fixed-us",
        type=float,
        default=Links.fixed_us,
        help="fixed cost of a call (launches, count exchange), us",
    )
    parser.add_argument(
        "--emulated-leg-gbps",
        type=float,
        default=Links.emulated_leg_gbps,
        help="with --emulated: the rate of each leg, GB/s",
    )
    parser.add_argument(
        "--emulated", action="store_true", help="nodes emulated on one host: both legs share NVLink"
    )
    opts = parser.parse_args(argv)
    links = Links(opts.nvlink_gbps, opts.network_gbps, opts.fixed_us, opts.emulated_leg_gbps)
    cols = ["nodes", "dispatch_us", "dispatch_serial_us", "dispatch_GBps", "combine_us",
            "combine_GBps", "dispatch_network_MB", "dispatch_nvlink_MB"]  # fmt: skip
    print("  ".join(f"{c:>19}" for c in cols))
    for nodes in (int(v) for v in opts.nodes.split(",")):
        traffic = uniform_traffic(opts.tokens, opts.experts, opts.topk, nodes, opts.gpus_per_node)
        row = {"nodes": nodes, **predict(traffic, opts.hidden, opts.fp8, links, opts.emulated)}
        print("  ".join(f"{row[c]:>19.1f}" if c != "nodes" else f"{nodes:>19}" for c in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
