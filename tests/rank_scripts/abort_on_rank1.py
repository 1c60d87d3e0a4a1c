"""Rank 1 aborts in native code (as a library's C++ might); rank 0 waits for it."""

import os

import torch
import torch.distributed as dist

from tritonep.launch import init_distributed


def expert_table_check():
    os.abort()


ctx = init_distributed()
if ctx.rank == 1:
    expert_table_check()
dist.all_reduce(torch.ones(1, device=ctx.device))
