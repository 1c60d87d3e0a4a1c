"""Demo: dispatch and combine of a small MoE layer on 4 ranks, checked against the reference.

Runs on 4 GPUs when there are at least 4, else on 4 CPU rank processes (gloo, with Triton
kernels under the interpreter). Each rank runs the MoE layer of :mod:`tritonep.moe`: it routes
its tokens with a softmax top-k router, sends them to the experts' ranks, applies the experts
(one matmul each), brings the results back, and compares:

* what each rank received with :mod:`tritonep.reference` (bit for bit), and
* the layer's output with a dense single-process computation of the same layer.

Both modes go through tritonep's Triton kernels (:class:`tritonep.Buffer`: ``dispatch``
and ``combine`` for the normal mode, ``low_latency_dispatch`` and ``low_latency_combine`` for
the low-latency mode). It also passes a block around the ring of ranks through the symmetric
heap with the put/signal Triton kernel. Usage: ``python -m tritonep.demo [--ranks 4]``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from . import reference as ref
from .heap import shared_gpu
from .integrations.moe import dense_moe, init_params, local_experts, route
from .launch import gpus_suffice, spawn

HIDDEN, EXPERTS, TOPK = 256, 16, 4
TOKENS = [64, 40, 0, 23, 51, 9, 33, 17]  # per rank; one rank has none


def rank_tokens(rank: int, num_tokens: int, hidden: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error relative to the largest magnitude of ``want`` (0 for no tokens)."""
    if want.numel() == 0:
        return 0.0
    return float((got.float().cpu() - want).abs().max() / want.abs().max().clamp_min(1e-6))


def _rank_main(ctx, num_tokens_per_rank):
    from .buffer import Buffer
    from .heap import allocate
    from .kernels.put_signal import put_signal, wait_signal

    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    tokens = num_tokens_per_rank[:R]
    router, experts = init_params(HIDDEN, EXPERTS)
    xs = [rank_tokens(r, n, HIDDEN) for r, n in enumerate(tokens)]
    routed = [route(x, router, TOPK) for x in xs]
    ids_all, w_all = [r[0] for r in routed], [r[1] for r in routed]
    E_local = EXPERTS // R
    my_experts = experts[me * E_local : (me + 1) * E_local].to(dev)
    x, ids, w = xs[me].to(dev), ids_all[me].to(dev), w_all[me].to(dev)
    buffer = Buffer(device=dev)
    dist.barrier()
    start = time.perf_counter()

    # Normal mode: one row per (token, rank); apply every local expert the row names.
    _, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, EXPERTS)
    recv_x, recv_ids, recv_w, _, handle, _ = buffer.dispatch(
        x, topk_idx=ids, topk_weights=w, num_tokens_per_expert=per_expert,
        is_token_in_rank=in_rank,
    )  # fmt: skip
    expected = ref.normal_dispatch(xs, ids_all, w_all, EXPERTS)[me]
    ref.assert_bitwise_equal(recv_x, expected.recv_x.to(dev), f"rank {me} normal recv_x")
    ref.assert_bitwise_equal(recv_ids, expected.recv_topk_idx.to(dev), f"rank {me} recv_topk_idx")
    y = local_experts(recv_x, recv_ids, recv_w, my_experts)
    normal_out, _, _ = buffer.combine(y.to(torch.bfloat16), handle)

    # Low-latency mode, tritonep's Triton kernels: per-expert slabs (BF16 here), weights
    # applied by combine.
    max_tokens = max(tokens)
    slabs, recv_count, ll_handle, _, _ = buffer.low_latency_dispatch(
        x, ids, max_tokens, EXPERTS, use_fp8=False
    )
    ll_expected = ref.low_latency_dispatch(xs, ids_all, max_tokens, EXPERTS, use_fp8=False)[me]
    got = ref.LowLatencyDispatchResult.from_outputs(slabs, recv_count, ll_handle)
    ref.assert_low_latency_dispatch_equal(got, ll_expected, me)
    ll_y = torch.bmm(slabs.float(), my_experts.float()).to(torch.bfloat16)
    ll_out, _, _ = buffer.low_latency_combine(ll_y, ids, w, ll_handle)
    buffer.check()
    buffer.destroy()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start

    dense = dense_moe(xs[me], router, experts, TOPK)
    normal_err, ll_err = rel_err(normal_out, dense), rel_err(ll_out, dense)

    # The symmetric heap: pass a block to the next rank with the put/signal Triton kernel.
    heap = allocate(4096, device=dev)
    block = torch.arange(64, dtype=torch.int32, device=dev) + 1000 * me
    put_signal(heap, block, (me + 1) % R, data_offset=256, flag_offset=0, value=1)
    wait_signal(heap, flag_offset=0, value=1, peer=(me - 1) % R, timeout_s=60)
    got_block = heap.view(me, torch.int32, (64,), 256).cpu()
    heap_ok = torch.equal(got_block, torch.arange(64, dtype=torch.int32) + 1000 * ((me - 1) % R))
    heap.close()
    sent = int(ref.dispatch_layout(ids_all[me], EXPERTS, R).num_tokens_per_rank.sum())
    return {
        "rank": me,
        "tokens": tokens[me],
        "rows sent": sent,
        "rows received": recv_x.shape[0],
        "normal err": normal_err,
        "low-latency err": ll_err,
        "heap ring": heap_ok,
        "first call ms": elapsed * 1e3,
        "device": str(dev),
    }


def main(argv: list[str] | None = None) -> int:
    from .cli import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="python -m tritonep.demo", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--ranks", type=int, default=4, help=f"rank processes, dividing {EXPERTS}, at most 8"
    )
    opts = parser.parse_args(argv)
    if not 1 <= opts.ranks <= len(TOKENS) or EXPERTS % opts.ranks:
        parser.error(f"--ranks must divide {EXPERTS} and lie in [1, {len(TOKENS)}]")
    if shared_gpu():
        where = "GPU 0, shared by every rank (gloo, CUDA IPC)"
    elif gpus_suffice(opts.ranks):
        where = "GPUs (NCCL)"
    else:
        where = "CPU ranks (gloo, Triton interpreter)"
    print(
        f"tritonep demo: MoE layer, hidden {HIDDEN}, {EXPERTS} experts, top-{TOPK}, "
        f"{opts.ranks} ranks on {where}; normal and low-latency modes and the heap ring on "
        "tritonep's Triton kernels"
    )
    rows = spawn(_rank_main, opts.ranks, TOKENS, timeout=600)
    cols = [
        "rank",
        "tokens",
        "rows sent",
        "rows received",
        "normal err",
        "low-latency err",
        "heap ring",
        "first call ms",
    ]
    print("  ".join(f"{c:>15}" for c in cols))
    for row in rows:
        cells = [
            f"{row[c]:.2e}" if "err" in c else f"{row[c]:.1f}" if "ms" in c else str(row[c])
            for c in cols
        ]
        print("  ".join(f"{v:>15}" for v in cells))
    # BF16 expert outputs: the relative error of a correct layer is a few BF16 ulps.
    ok = all(
        r["normal err"] < 2e-2 and r["low-latency err"] < 2e-2 and r["heap ring"] for r in rows
    )
    print(
        "every received row matches the reference; layer output matches the dense layer"
        if ok
        else "MISMATCH: see the table"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
