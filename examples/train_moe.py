"""Train an expert-parallel MoE layer for a few steps and check it against the dense layer.

Run it like any torchrun script (GPUs when every rank has one, else CPU ranks):

    python -m tritonep.launch -n 4 examples/train_moe.py [--steps 3] [--gpus-per-node 2]
    torchrun --nproc_per_node=4 examples/train_moe.py [--compile] [--checkpoint selective]

Each rank holds E/R experts and a copy of the router. Every step routes the rank's tokens,
dispatches them (tritonep.integrations.autograd), applies its experts, combines, takes a loss
and steps an optimizer; gradients of the replicated router are all-reduced as data parallelism
would. The first step's loss and the gradients of the router, the experts and the input tokens
are compared with the same layer computed densely on one process, which every rank can do
because the inputs come from fixed seeds.

``--compile`` runs the layer through ``torch.compile`` (Inductor on GPUs, ``aot_eager`` on CPU
ranks): dispatch and combine are registered operators, traced without a graph break.
``--checkpoint full`` recomputes the layer's forward in the backward pass (the dispatch runs
again); ``--checkpoint selective`` recomputes everything except the dispatch and the combine,
whose outputs are saved (no bytes move twice).
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from tritonep import Buffer
from tritonep.integrations.moe import MoELayer, dense_moe, init_params
from tritonep.launch import init_distributed

HIDDEN, EXPERTS_PER_RANK, TOPK, TOKENS = 128, 4, 2, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--gpus-per-node", type=int, default=None, help="emulate nodes")
    parser.add_argument("--compile", action="store_true", help="torch.compile the layer")
    parser.add_argument("--checkpoint", choices=["none", "full", "selective"], default="none")
    opts = parser.parse_args()
    ctx = init_distributed()
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    E = EXPERTS_PER_RANK * R
    router, experts = init_params(HIDDEN, E, seed=0)
    buffer = Buffer(device=dev, gpus_per_node=opts.gpus_per_node)
    layer = MoELayer(buffer, router.to(dev), experts.to(dev), TOPK)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    forward = _wrapped(layer, opts, dev)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16) for _ in range(R)]
    targets = [torch.randn(TOKENS, HIDDEN, generator=gen) for _ in range(R)]

    for step in range(opts.steps):
        optimizer.zero_grad()
        x = xs[me].to(dev, copy=True).requires_grad_()  # a leaf of its own, even on CPU
        out = forward(x)
        loss = ((out.float() - targets[me].to(dev)) ** 2).mean()
        loss.backward()
        dist.all_reduce(layer.router.grad)  # the router is replicated
        layer.router.grad /= R
        if step == 0:
            # The same step, densely, over every rank's tokens.
            r = router.clone().requires_grad_()
            e = experts.clone().requires_grad_()
            x_all = torch.cat(xs).float().requires_grad_()
            dense = dense_moe(x_all, r, e, TOPK)
            per_rank = ((dense - torch.cat(targets)) ** 2).mean(dim=1).view(R, TOKENS).mean(1)
            per_rank.mean().backward()  # the mean of the ranks' losses
            per_rank = per_rank.detach()
            mine = slice(me * EXPERTS_PER_RANK, (me + 1) * EXPERTS_PER_RANK)
            errors = {
                "loss": abs(loss.item() - float(per_rank[me])) / float(per_rank[me]),
                "router grad": _rel(layer.router.grad, r.grad),
                # Each rank's experts get the gradient of every rank's loss: R x the mean.
                "expert grad": _rel(layer.experts.grad, e.grad[mine] * R),
                # A rank's tokens reach only its own loss: R x their share of the mean.
                "input grad": _rel(x.grad, x_all.grad[me * TOKENS : (me + 1) * TOKENS] * R),
            }
            assert all(v < 2e-2 for v in errors.values()), f"rank {me}: {errors}"
        optimizer.step()
        losses = torch.tensor([loss.item()], device=dev)
        dist.all_reduce(losses)
        if me == 0:
            print(f"step {step}: mean loss {float(losses) / R:.5f}", flush=True)
    buffer.destroy()
    if me == 0:
        print("first step matches the dense layer (loss; router, expert and input gradients)")
    dist.barrier()
    dist.destroy_process_group()


#: Operators whose outputs selective checkpointing keeps: the communication.
SAVED = {torch.ops.tritonep.dispatch.default, torch.ops.tritonep.combine.default}


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


#: What ``checkpoint`` calls for a selective context (a partial, which Dynamo can trace).
SELECTIVE = functools.partial(create_selective_checkpoint_contexts, _policy)


def _wrapped(layer, opts, device):
    """The layer's forward with the requested activation checkpointing and compilation."""

    def forward(x):
        if opts.checkpoint == "none":
            return layer(x)
        extra = {"context_fn": SELECTIVE} if opts.checkpoint == "selective" else {}
        return checkpoint(layer, x, use_reentrant=False, **extra)

    if opts.compile:
        return torch.compile(forward, backend="inductor" if device.type == "cuda" else "aot_eager")
    return forward


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float().cpu() - want).abs().max() / want.abs().max().clamp_min(1e-12))


if __name__ == "__main__":
    main()
