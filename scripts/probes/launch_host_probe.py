"""Where the host time of a low-latency launch goes: arguments, cooperative grids, allocations.

    PYTHONPATH=src python scripts/probes/launch_host_probe.py [--calls 200] [--repeats 7]

On one GPU, with kernels that do almost nothing (one store per program, 128 programs of 16
warps, as the low-latency kernels launch), it prints the host time per launch through
:meth:`tritonep.kernels.launcher.KernelLaunch.launch_values` (what an eager low-latency call
pays after its own Python), each split into the Python of ``launch_values`` (the compiled
launcher replaced by a no-op) and the rest (Triton's C launcher: parsing the arguments, then
``cuLaunchKernelEx``), for:

* ``few``: 3 runtime arguments, 1 constexpr;
* ``many``: 22 runtime arguments (20 pointers) and 33 constexprs, the shape of the low-latency
  dispatch kernel's arguments (11 per call, 11 per mode);
* ``many runtime``: the same 22 runtime arguments, 1 constexpr;
* each plain and cooperative (``launch_cooperative_grid``, as the one-launch dispatch and
  combine are).

So ``many`` against ``few`` prices the arguments a per-mode argument block on the device would
take off each launch, and ``cooperative`` against plain the cooperative grid. It also prints
the host time of the allocations and views a dispatch could make for its outputs on the GPU
(``new_empty``, ``new_empty_strided``, a slice, ``view(dtype)``), against the same on the CPU.

Times are this thread's CPU time per call, the least and median over ``--repeats`` runs of
``--calls`` back-to-back launches, synchronized between runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tritonep.kernels.launcher import KernelLaunch, Shared


@triton.jit(do_not_specialize=["n"])
def few_kernel(out_ptr, in_ptr, n, BLOCK: tl.constexpr):
    tl.store(out_ptr + tl.program_id(0), n)


@triton.jit(do_not_specialize=["n", "m"])
def many_kernel(
    out_ptr,  # [P] int32, one word per program
    p1,
    p2,
    p3,
    p4,
    p5,
    p6,
    p7,
    p8,
    p9,
    p10,  # unused pointers (a dispatch's per-call ones)
    n,  # stored
    q1,
    q2,
    q3,
    q4,
    q5,
    q6,
    q7,
    q8,
    q9,  # unused pointers (a mode's own)
    m,  # unused int
    C0: tl.constexpr,
    C1: tl.constexpr,
    C2: tl.constexpr,
    C3: tl.constexpr,
    C4: tl.constexpr,
    C5: tl.constexpr,
    C6: tl.constexpr,
    C7: tl.constexpr,
    C8: tl.constexpr,
    C9: tl.constexpr,
    C10: tl.constexpr,
    C11: tl.constexpr,
    C12: tl.constexpr,
    C13: tl.constexpr,
    C14: tl.constexpr,
    C15: tl.constexpr,
    C16: tl.constexpr,
    C17: tl.constexpr,
    C18: tl.constexpr,
    C19: tl.constexpr,
    C20: tl.constexpr,
    C21: tl.constexpr,
    C22: tl.constexpr,
    C23: tl.constexpr,
    C24: tl.constexpr,
    C25: tl.constexpr,
    C26: tl.constexpr,
    C27: tl.constexpr,
    C28: tl.constexpr,
    C29: tl.constexpr,
    C30: tl.constexpr,
    C31: tl.constexpr,
    C32: tl.constexpr,
):
    tl.store(out_ptr + tl.program_id(0), n)


@triton.jit(do_not_specialize=["n", "m"])
def many_runtime_kernel(
    out_ptr,
    p1,
    p2,
    p3,
    p4,
    p5,
    p6,
    p7,
    p8,
    p9,
    p10,
    n,
    q1,
    q2,
    q3,
    q4,
    q5,
    q6,
    q7,
    q8,
    q9,
    m,
    C0: tl.constexpr,
):
    """``many_kernel``'s runtime arguments with one constexpr."""
    tl.store(out_ptr + tl.program_id(0), n)


class FewCall(NamedTuple):
    out_ptr: object
    in_ptr: object
    n: int


class ManyCall(NamedTuple):
    out_ptr: object
    p1: object
    p2: object
    p3: object
    p4: object
    p5: object
    p6: object
    p7: object
    p8: object
    p9: object
    p10: object
    n: int


def _per_call_us(fn, calls: int, repeats: int) -> tuple[float, float]:
    runs = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.thread_time()
        for _ in range(calls):
            fn()
        runs.append((time.thread_time() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return min(runs), statistics.median(runs)


def _launches(programs: int, warps: int, cooperative: bool):
    """(name, launch, call, shared) for each argument shape."""
    word = torch.zeros(programs, dtype=torch.int32, device="cuda")
    extra = {"launch_cooperative_grid": True} if cooperative else {}
    few = KernelLaunch(
        few_kernel, (programs,), {"BLOCK": 16, "num_warps": warps, **extra}, FewCall._fields, (0, 1)
    )
    pointers = tuple(range(11))
    constexprs = {f"C{i}": i + 1 for i in range(33)}
    meta = {**constexprs, "num_warps": warps, **extra}
    many = KernelLaunch(many_kernel, (programs,), meta, ManyCall._fields, pointers)
    many_runtime = KernelLaunch(
        many_runtime_kernel,
        (programs,),
        {"C0": 1, "num_warps": warps, **extra},
        ManyCall._fields,
        pointers,
    )
    shared_many = Shared.of((*[word] * 9, 7))
    yield "few", few, FewCall(word, word, 3), Shared.of(())
    yield "many", many, ManyCall(word, *[word] * 10, 3), shared_many
    yield "many runtime", many_runtime, ManyCall(word, *[word] * 10, 3), shared_many


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--programs", type=int, default=128)
    parser.add_argument("--warps", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("launch_host_probe: needs a GPU")
    print(f"{torch.cuda.get_device_name()}, {args.programs} programs of {args.warps} warps")
    print(f"{'launch':28s} {'total us':>9s} {'median':>7s} {'Python':>7s} {'C + driver':>10s}")
    for cooperative in (False, True):
        for name, launch, call, shared in _launches(args.programs, args.warps, cooperative):
            launch(call, shared)  # compiles, keeps the compiled kernel
            launch(call, shared)
            values = tuple(v if isinstance(v, int) else v.data_ptr() for v in call)
            assert launch.launch_values(values, shared), f"{name}: no direct launch"
            least, median = _launch_us(launch, values, shared, args.calls, args.repeats)
            # The same Python with a launcher that does nothing.
            saved = dict(launch.compiled)
            for key, entry in saved.items():
                launch.compiled[key] = ("".format, *entry[1:])  # C, takes any arguments
            python, _ = _launch_us(launch, values, shared, args.calls, args.repeats)
            launch.compiled.update(saved)
            label = f"{name}{' cooperative' if cooperative else ''}"
            print(f"{label:28s} {least:9.2f} {median:7.2f} {python:7.2f} {least - python:10.2f}")
    print("allocations and views, least us per call (each made, then freed):")
    for device in ("cuda", "cpu"):
        for label, op in {**_allocations(device), **_output_sets(device)}.items():
            least, _ = _per_call_us(op, args.calls, args.repeats)
            print(f"  {label:46s} {device:4s} {least:6.2f}")


def _launch_us(launch, values, shared, calls: int, repeats: int) -> tuple[float, float]:
    return _per_call_us(lambda: launch.launch_values(values, shared), calls, repeats)


def _allocations(device: str) -> dict:
    """What a dispatch's outputs could be made of: allocations, or views of one."""
    e8 = torch.empty(0, dtype=torch.float8_e4m3fn, device=device)
    e32 = torch.empty(0, dtype=torch.int32, device=device)
    block = torch.empty(1 << 20, dtype=torch.int32, device=device)
    return {
        "new_empty recv_x [36, 1024, 7168] e4m3": lambda: e8.new_empty(36, 1024, 7168),
        "new_empty [36] int32": lambda: e32.new_empty(36),
        "new_empty_strided scales [36, 1024, 56]": lambda: e32.new_empty_strided(
            (36, 1024, 56), (56 * 1024, 1, 1024)
        ),
        "slice of an int32 block": lambda: block[1000:],
        "view(float32) of an int32 block": lambda: block.view(torch.float32),
    }


def _output_sets(device: str) -> dict:
    """A dispatch's outputs (128 tokens, hidden 7168, 288 experts on 8 ranks: 36 local experts,
    1024 rows each): four allocations; three, as the mode makes them (the counts' allocation,
    resized in place, also holds the handle's words); recv_x and one int32 allocation of which
    the scales, the counts and the handle's words are views."""
    E, rows, G = 36, 1024, 56
    words = 2 * E * rows + 2 * E * 8  # the handle: src info and top-k slot, then layout range
    e8 = torch.empty(0, dtype=torch.float8_e4m3fn, device=device)
    e32 = torch.empty(0, dtype=torch.int32, device=device)
    ef = torch.empty(0, dtype=torch.float32, device=device)

    def four():
        return (
            e8.new_empty(E, rows, 7168),
            e32.new_empty(E),
            e32.new_empty(words),
            ef.new_empty_strided((E, rows, G), (G * rows, 1, rows)),
        )

    def three_and_resize():
        # As the mode makes them: recv_count's allocation also holds the handle's words.
        count = e32.new_empty(E + words)
        count.resize_(E)
        return (
            e8.new_empty(E, rows, 7168),
            count,
            count.untyped_storage(),
            ef.new_empty_strided((E, rows, G), (G * rows, 1, rows)),
        )

    def two_and_views():
        block = e32.new_empty(words + E + E * rows * G)
        scales = block.as_strided((E, rows, G), (G * rows, 1, rows), words + E)
        return (
            e8.new_empty(E, rows, 7168),
            block[words : words + E],
            block,
            scales.view(torch.float32),
        )

    return {
        "dispatch outputs: 4 allocations": four,
        "dispatch outputs: 3 allocations, one resized": three_and_resize,
        "dispatch outputs: 2 allocations + 3 views": two_and_views,
    }


if __name__ == "__main__":
    main()
