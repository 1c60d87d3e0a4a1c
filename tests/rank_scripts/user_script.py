"""A user's first script: tritonep imported at the top, then ranks started one of two ways.

    python user_script.py spawn                                  # tritonep.launch.spawn
    torchrun --standalone --nproc_per_node=2 user_script.py      # its own process group

Importing ``tritonep.Buffer`` defines the kernels as its module loads, in this process and again in
every rank that ``spawn`` starts (a spawned process imports its parent's ``__main__``). Each
rank passes a block to the next one through the symmetric heap with a Triton kernel and
checks what it received from the previous one.
"""

import os
import sys

import torch
import torch.distributed as dist

import tritonep
from tritonep import Buffer  # noqa: F401  (defines the kernels at import)
from tritonep.heap import allocate
from tritonep.kernels.put_signal import put_signal, wait_signal
from tritonep.launch import spawn


def ring(rank: int, world_size: int, device: torch.device) -> bool:
    """Send ``[64]`` int32 to the next rank; True when the previous rank's block arrived."""
    heap = allocate(4096, device=device)
    block = torch.arange(64, dtype=torch.int32, device=device) + 1000 * rank
    put_signal(heap, block, (rank + 1) % world_size, data_offset=256, flag_offset=0, value=1)
    wait_signal(heap, flag_offset=0, value=1, peer=(rank - 1) % world_size, timeout_s=60)
    got = heap.view(rank, torch.int32, (64,), 256).cpu()
    heap.close()
    return torch.equal(got, torch.arange(64, dtype=torch.int32) + 1000 * ((rank - 1) % world_size))


def spawned_rank(ctx) -> tuple[bool, str]:
    return ring(ctx.rank, ctx.world_size, ctx.device), os.environ.get("TRITON_INTERPRET", "")


def main() -> None:
    if sys.argv[1:] == ["spawn"]:
        results = spawn(spawned_rank, 2)
        print(f"spawn: {results}", flush=True)
        assert all(ok for ok, _ in results), results
        return
    # torchrun: a process group of the script's own, as any torch script makes it.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    on_gpu = torch.cuda.device_count() >= world_size
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    ok = ring(rank, world_size, device)
    dist.barrier()
    dist.destroy_process_group()
    assert ok, f"rank {rank}: the previous rank's block did not arrive"
    print(f"rank {rank}/{world_size} ok (tritonep {tritonep.__version__})", flush=True)


if __name__ == "__main__":
    main()
