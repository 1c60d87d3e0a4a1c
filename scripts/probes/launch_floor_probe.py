"""The floor under a low-latency call: what a launch and one flag hand-off cost on their own.

    PYTHONPATH=src python scripts/probes/launch_floor_probe.py [--programs 128] [--warps 16]

A graph-replayed low-latency dispatch of one token takes about 9 us on one H100, most of it
fixed cost. This probe times, the same way (launches captured in a CUDA graph, replayed, CUDA
events, median per launch), kernels that do only what every such call must do, so that the
part of a small call that work could still remove shows as the difference:

* ``empty``: every program stores one word;
* ``empty cooperative``: the same, launched cooperatively (as the one-launch dispatch is);
* ``arrive``: every program adds itself to an arrival counter and the last one advances the
  call counter (the kernels' end of a launch);
* ``own counter``: every program reads its own call counter at the start and writes the next
  value at its end (no atomic: a program's counter is read again only by the same program of
  the next launch, after the kernel boundary);
* ``hand-off``: program 0 publishes one tagged flag per expert with one system-scope release,
  every program waits (acquire) for one of them, then arrives (or advances its own counter):
  a send, a count, a receive.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from tritonep.bench.timing import graph_median_us


@triton.jit
def empty_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 1)


@triton.jit
def arrive(state_ptr, call):
    tl.debug_barrier()
    arrived = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr, call + 1)


@triton.jit
def arrive_kernel(state_ptr):
    arrive(state_ptr, tl.load(state_ptr, volatile=True))


@triton.jit
def own_counter_kernel(state_ptr):
    counter = state_ptr + 2 + tl.program_id(0)
    call = tl.load(counter, volatile=True)
    tl.debug_barrier()
    tl.store(counter, call + 1)


@triton.jit
def handoff_kernel(flags_ptr, state_ptr, out_ptr, BINS: tl.constexpr, OWN: tl.constexpr):
    pid = tl.program_id(0)
    call = tl.load(state_ptr + (2 + pid if OWN else 0), volatile=True)
    bins = tl.arange(0, BINS)
    if pid == 0:
        tl.atomic_xchg(flags_ptr + bins, ((call + 1) << 32) | bins, sem="release", scope="sys")
    flag = flags_ptr + pid % BINS
    value = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    while (value >> 32) != call + 1:
        value = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    tl.store(out_ptr + pid, value & 0xFFFF)
    if OWN:
        tl.debug_barrier()
        tl.store(state_ptr + 2 + pid, call + 1)
    else:
        arrive(state_ptr, call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", type=int, default=128)
    parser.add_argument("--warps", type=int, default=16)
    args = parser.parse_args()
    p, w = args.programs, args.warps
    out = torch.zeros(p, dtype=torch.int64, device="cuda")
    state = torch.zeros(2 + p, dtype=torch.int64, device="cuda")
    flags = torch.zeros(2, 256, dtype=torch.int64, device="cuda")  # one row per hand-off
    variants = {
        "empty": lambda: empty_kernel[(p,)](out, num_warps=w),
        "empty cooperative": lambda: empty_kernel[(p,)](out, num_warps=w,
                                                          launch_cooperative_grid=True),
        "arrive (cooperative)": lambda: arrive_kernel[(p,)](state, num_warps=w,
                                                             launch_cooperative_grid=True),
        "own counter (cooperative)": lambda: own_counter_kernel[(p,)](
            state, num_warps=w, launch_cooperative_grid=True),
    }  # fmt: skip
    for own in (False, True):
        name = "hand-off, own counter" if own else "hand-off, arrive"
        variants[name] = lambda own=own: handoff_kernel[(p,)](
            flags[int(own)], state, out, BINS=256, OWN=own, num_warps=w,
            launch_cooperative_grid=True)  # fmt: skip
    print(f"{torch.cuda.get_device_name()}: {p} programs, {w} warps, graph-replayed")
    for name, launch in variants.items():
        print(f"{name:>24}: {graph_median_us(launch):6.2f} us per launch")
    assert int(state[1]) == 0, "arrival counter not reset"


if __name__ == "__main__":
    main()
