"""A script written for torchrun: sums the ranks and checks the total."""

import torch
import torch.distributed as dist

from tritonep.launch import init_distributed

ctx = init_distributed()
total = torch.tensor([ctx.rank + 1.0], device=ctx.device)
dist.all_reduce(total)
assert int(total.item()) == ctx.world_size * (ctx.world_size + 1) // 2, total
print(f"rank {ctx.rank}/{ctx.world_size} ok", flush=True)
# Tear down together: a rank that closes its connections while a peer still finishes the
# last collective can make the peer's communication thread abort at exit.
dist.barrier()
dist.destroy_process_group()
