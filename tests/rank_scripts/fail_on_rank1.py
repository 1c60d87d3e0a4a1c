"""Rank 1 fails; rank 0 would wait for it forever in a collective."""

import sys

import torch
import torch.distributed as dist

from tritonep.launch import init_distributed

ctx = init_distributed()
if ctx.rank == 1:
    sys.exit(3)
dist.all_reduce(torch.ones(1, device=ctx.device))
