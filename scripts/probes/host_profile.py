"""Where the host time of an eager call goes: cProfile over many calls of each operation.

    PYTHONPATH=src python scripts/probes/host_profile.py [--tokens 512] [--calls 200] [--top 18]

One rank (GPU 0, or a CPU rank, where the kernel launches are left out: under the interpreter
they would be all of the time, so only this project's Python work is measured). For each of
normal cached dispatch (BF16 and FP8), normal combine, normal full dispatch (on a GPU only),
low-latency dispatch and low-latency combine it prints the host time per call (wall clock of
the calls issued back to back, then one device sync) and the functions with the most own time
under cProfile. On a GPU it first splits each op into this project's Python work (the same calls
with the kernel launches left out) and the launch: the recorded launches issued again through
Triton's path (``kernel[grid](...)``, with its binding and cache key timed alone), through
``tritonep.kernels.launcher.launch`` (what the modes use), and through the bare compiled
kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import time

import torch


@contextlib.contextmanager
def _launcher_replaced(stand_in):
    """The modes' launches go to ``stand_in(fn, grid, args, meta)`` inside (those made from
    argument bundles too, with the bundles' values in order)."""
    from tritonep.kernels import launcher

    original_launch, bundled = launcher.launch, launcher.KernelLaunch.__call__

    def call(self, values, shared, grid=None):
        if any(v is None for v in values):
            values = tuple(self.placeholder if v is None else v for v in values)
        stand_in(self.fn, grid or self.grid, (*values, *shared.args), self.meta)

    launcher.launch, launcher.KernelLaunch.__call__ = stand_in, call
    try:
        yield
    finally:
        launcher.launch, launcher.KernelLaunch.__call__ = original_launch, bundled


def _profile(name, fn, calls, top):
    on_gpu = torch.cuda.is_available()
    # Left out on CPU ranks: their host work stays.
    with contextlib.nullcontext() if on_gpu else _launcher_replaced(lambda *launch: None):
        issued, total = _host_us(fn, calls)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            fn()
        profiler.disable()
    if on_gpu:
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    if not on_gpu:
        name += " (launches left out)"
    print(f"\n=== {name}: {issued:.1f} us/call issued, "
          f"{total:.1f} us/call with the final sync")  # fmt: skip
    lines = text.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    print("\n".join(lines[start : start + top + 1]))


class _Recorder:
    """Stands in for the launcher the modes call: records launches, optionally skips them."""

    def __init__(self):
        self.launches, self.skip = [], False

    def __call__(self, fn, grid, args, meta):
        if self.skip:
            return None
        self.launches.append((fn, grid, args, meta))
        return fn[grid](*args, **meta)


def _host_us(fn, calls):
    """Host microseconds per call of ``fn`` issued back to back (after a warm-up), and per
    call including the final device synchronization."""
    for _ in range(3):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = (time.perf_counter() - start) / calls * 1e6
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return issued, (time.perf_counter() - start) / calls * 1e6


def _per_call_us(fn, calls):
    return _host_us(fn, calls)[0]


def _breakdown(name, mode, fn, calls):
    """Host time of ``fn`` (one op of ``mode``) split into our work, Triton's and the launch."""
    recorder = _Recorder()
    with _launcher_replaced(recorder):
        fn()
        launches = list(recorder.launches)
        recorder.skip = True
        ours = _per_call_us(fn, calls)
    from triton.runtime.jit import JITFunction

    slow = []
    original = JITFunction.run

    def counting_run(self, *args, **kwargs):
        slow.append(1)
        return original(self, *args, **kwargs)

    JITFunction.run = counting_run
    try:
        whole = _per_call_us(fn, calls)
    finally:
        JITFunction.run = original

    def triton_path():
        for jit, grid, args, kwargs in launches:
            jit[grid](*args, **kwargs)

    bound = []
    for jit, grid, args, kwargs in launches:
        compiled = jit[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        binder = jit.device_caches[device][4]
        bound_args, _, _ = binder(*args, **kwargs)
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        bound.append((compiled[grid3], tuple(bound_args.values())))

    def launcher_only():
        for runner, values in bound:
            runner(*values)

    from triton.runtime.jit import compute_cache_key

    def binder_only():
        for jit, _, args, kwargs in launches:
            jit.device_caches[torch.cuda.current_device()][4](*args, **kwargs)

    def binder_and_key():
        for jit, _, args, kwargs in launches:
            caches = jit.device_caches[torch.cuda.current_device()]
            _, specialization, options = caches[4](*args, **kwargs)
            compute_cache_key(caches[1], specialization, options)

    from tritonep.kernels import launcher

    def fast_path():
        for jit, grid, args, kwargs in launches:
            launcher.launch(jit, grid, args, kwargs)

    triton_us = _per_call_us(triton_path, calls)
    fast_us = _per_call_us(fast_path, calls)
    launcher_us = _per_call_us(launcher_only, calls)
    binder_us = _per_call_us(binder_only, calls)
    key_us = _per_call_us(binder_and_key, calls)
    print(f"\n=== {name}: {whole:.1f} us/call issued = ours {ours:.1f} + the launch; "
          f"launches through Triton's path {triton_us:.1f} (binding {binder_us:.1f}, with the "
          f"cache key {key_us:.1f}), through tritonep's launcher {fast_us:.1f}, bare "
          f"{launcher_us:.1f}; {len(launches)} launch(es), "
          f"{sum(len(a) for _, _, a, _ in launches)} arguments, "
          f"{sum(len(k) for _, _, _, k in launches)} keywords; {len(slow)} of "
          f"{(calls + 3) * len(launches)} launches went through Triton's binding")  # fmt: skip


def _rank(ctx, tokens, calls, top):
    from tritonep.modes.low_latency import LowLatencyMode
    from tritonep.modes.normal import NormalMode
    from tritonep.reference.fp8 import quantize_fp8
    from tritonep.testing import route

    hidden, experts, topk = (7168, 256, 8) if ctx.device.type == "cuda" else (256, 16, 4)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(ctx.device)
    idx = route(gen, tokens, experts, topk, "random").to(ctx.device)
    w = torch.rand(tokens, topk, generator=gen).to(ctx.device)
    x_fp8 = tuple(t.to(ctx.device) for t in quantize_fp8(x.cpu()))

    mode = NormalMode(None, hidden, experts, max_topk=topk, device=ctx.device, check_ids=False)
    config = mode.default_config
    _, per_expert, in_rank = mode.get_dispatch_layout(idx)
    out = mode.dispatch(x, idx, w, per_expert, in_rank, config=config)
    out8 = mode.dispatch(x_fp8, idx, w, per_expert, in_rank, config=config)
    y = out.recv_x.clone()
    if ctx.device.type == "cuda":
        _breakdown("normal cached dispatch", mode, lambda: mode.dispatch(x, handle=out.handle),
                   calls)  # fmt: skip
        _breakdown("normal cached dispatch FP8", mode,
                   lambda: mode.dispatch(x_fp8, handle=out8.handle), calls)  # fmt: skip
        _breakdown("normal combine", mode, lambda: mode.combine(y, out.handle), calls)
    _profile("normal cached dispatch", lambda: mode.dispatch(x, handle=out.handle), calls, top)
    _profile("normal cached dispatch FP8", lambda: mode.dispatch(x_fp8, handle=out8.handle),
             calls, top)  # fmt: skip
    _profile("normal combine", lambda: mode.combine(y, out.handle), calls, top)
    if ctx.device.type == "cuda":  # its host reads the count that the notify kernel writes
        full = lambda: mode.dispatch(x, idx, w, per_expert, in_rank, config=config)
        _profile("normal full dispatch", full, calls, top)
    mode.check()
    mode.destroy()

    ll = LowLatencyMode(None, tokens, hidden, experts, max_topk=topk, device=ctx.device,
                        check_ids=False)  # fmt: skip
    state = {}

    def ll_dispatch():
        state["d"] = ll.dispatch(x, idx)

    ll_dispatch()
    expert_out = torch.zeros(state["d"][0][0].shape, dtype=torch.bfloat16, device=ctx.device)
    _profile("low-latency dispatch", ll_dispatch, calls, top)
    handle = state["d"][2]
    if ctx.device.type == "cuda":
        _breakdown("low-latency dispatch", ll, ll_dispatch, calls)
        _breakdown("low-latency combine", ll, lambda: ll.combine(expert_out, idx, w, handle),
                   calls)  # fmt: skip
    _profile("low-latency combine", lambda: ll.combine(expert_out, idx, w, handle), calls, top)
    ll.destroy()


def main() -> None:
    from tritonep.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--top", type=int, default=18)
    args = parser.parse_args()
    spawn(_rank, 1, args.tokens, args.calls, args.top, timeout=600)


if __name__ == "__main__":
    main()
