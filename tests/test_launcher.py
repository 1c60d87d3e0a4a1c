"""The fast launch path gives what ``kernel[grid]`` gives, and skips Triton's binding on repeats."""

from typing import NamedTuple

import pytest
import torch
import triton
import triton.language as tl

from tritonep.kernels import launcher


@triton.jit
def scaled_copy(src, dst, n, factor, BLOCK: tl.constexpr, ADD: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask) * factor + ADD, mask=mask)


# (offset into the source and destination, elements, factor, ADD): aligned and unaligned
# pointers, an element count that Triton turns into a constant (1), one divisible by 16.
CALLS = [(0, 100, 2, 0), (1, 99, 3, 0), (0, 1, 2, 0), (0, 64, -1, 0), (3, 77, 2, 5), (0, 100, 4, 0)]


def _launch_all(device, repeats):
    gen = torch.Generator().manual_seed(5)
    base = torch.randint(-1000, 1000, (256,), generator=gen, dtype=torch.int32).to(device)
    for _ in range(repeats):
        for offset, n, factor, add in CALLS:
            src = base[offset : offset + n]
            out = torch.full((256,), -7, dtype=torch.int32, device=device)  # poisoned
            dst = out[offset : offset + n]
            launcher.launch(
                scaled_copy,
                (triton.cdiv(n, 32),),
                (src, dst, n, factor),
                dict(BLOCK=32, ADD=add, num_warps=1),
            )
            assert torch.equal(dst, src * factor + add), (offset, n, factor, add)
            assert bool((out[:offset] == -7).all()) and bool((out[offset + n :] == -7).all())


def test_launch_matches_the_kernel_everywhere():
    _launch_all("cuda" if torch.cuda.is_available() else "cpu", repeats=2)


@pytest.mark.gpu
def test_repeated_shapes_skip_tritons_binding(monkeypatch):
    """After the first launch of each specialization, launches go straight to the compiled
    kernel: ``JITFunction.run`` (Triton's binding path) is not called again."""
    _launch_all("cuda", repeats=1)
    device = torch.cuda.current_device()
    variants = launcher.variants_of(scaled_copy, device, 4)
    assert variants is not None and variants.usable
    # Aligned and unaligned pointers, n == 1 (a constant), n % 16 == 0, another ADD: the six
    # calls but the last (the first one's shapes with another factor) need their own variant.
    assert len(variants.compiled) == 5, [key[2] for key in variants.compiled]
    # Each through a launcher of the runtime arguments alone (n == 1, made a constant by
    # Triton, among them), the outputs checked by _launch_all.
    assert all(entry[2] == () for entry in variants.compiled.values())
    calls = []
    original = type(scaled_copy).run

    def counting_run(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(scaled_copy), "run", counting_run)
    _launch_all("cuda", repeats=2)
    assert len(calls) == 0, f"{len(calls)} launches went through Triton's binding"
    assert len(variants.compiled) == 5


def test_launch_hooks_count_only_when_set():
    from triton import knobs

    chain = knobs.runtime.launch_enter_hook
    assert not launcher._hooked(chain) and not launcher._hooked(None)
    seen = []
    hook = lambda metadata: seen.append(metadata)
    chain.add(hook)
    try:
        assert launcher._hooked(chain)
        if torch.cuda.is_available():  # a profiler's hook still sees every launch
            _launch_all("cuda", repeats=2)
            assert len(seen) == 2 * len(CALLS)
    finally:
        chain.remove(hook)


@pytest.mark.gpu
def test_a_remembered_argument_gives_way_to_a_new_one():
    """The same tensor twice is remembered; an unaligned view in its place must still be
    specialized as unaligned (a wrong guess would read and write at the wrong addresses)."""
    base = torch.arange(300, dtype=torch.int32, device="cuda")
    out = torch.full((300,), -7, dtype=torch.int32, device="cuda")
    for src, dst in [(base, out), (base, out), (base, out), (base[1:], out[1:]), (base, out)]:
        out.fill_(-7)
        n = src.numel()
        launcher.launch(
            scaled_copy, (triton.cdiv(n, 32),), (src, dst, n, 3), dict(BLOCK=32, ADD=1, num_warps=1)
        )
        assert torch.equal(dst, src * 3 + 1)
        assert int(out[0]) == (-7 if n == 299 else 1)


class _Built:
    """A compiled kernel as the post-compile hook finds it in Triton's cache."""

    def __init__(self, asm):
        self.asm, self.module, self.loaded = asm, object(), False

    @property
    def run(self):
        self.loaded = True
        return None


def test_nvshmem_modules_are_initialized_only_where_they_use_nvshmem(monkeypatch):
    """Variants linked with NVSHMEM that reference its device state get their module
    initialized, also when loaded from a cache that kept only binaries (no PTX: left alone, the
    first put faulted); a variant of the same kernel that puts nothing (receive-only, or every
    peer mapped), linked or not, is left alone: initializing it fails on the device."""
    import types

    from tritonep.kernels import nvshmem

    initialized = []
    c10d = types.SimpleNamespace(_nvshmemx_cumodule_init=initialized.append)
    monkeypatch.setitem(__import__("sys").modules, "torch._C._distributed_c10d", c10d)
    linked = (("libnvshmem_device", "/lib/libnvshmem_device.bc"),)
    state = {"ptx": ".global .align 8 .b8 nvshmemi_device_state_d[512];", "cubin": b"\x7fELF"}
    unused = {"ptx": ".visible .entry ll_combine_kernel()", "cubin": b"\x7fELF"}
    cases = [
        (linked, state, True),
        (linked, {"cubin": b"\x7fELF\0.nv.global\0nvshmemi_device_state_d\0"}, True),
        (linked, unused, False),  # the library was not used
        (linked, {"cubin": b"\x7fELF\0ll_combine_kernel\0"}, False),
        ((), state, False),
        (None, unused, False),
    ]
    for libs, asm, expect in cases:
        built = _Built(asm)
        jit = types.SimpleNamespace(device_caches={0: ({"key": built},)})
        options = {"extern_libs": libs, "device": 0}
        nvshmem._initialize_module(
            {"compile": options, "fn": types.SimpleNamespace(jit_function=jit), "key": "key"}
        )
        assert (initialized[-1:] == [built.module]) == expect, (libs, asm)
        assert built.loaded == expect
        initialized.clear()


def test_nvshmem_hook_is_installed_once_and_keeps_the_previous_one(monkeypatch):
    from triton import knobs

    from tritonep.kernels import nvshmem

    monkeypatch.setattr(nvshmem, "_device_library", lambda: "/lib/libnvshmem_device.bc")
    earlier = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: earlier.append(kw))
    libs = (("libnvshmem_device", "/lib/libnvshmem_device.bc"),)
    assert nvshmem.link_options() == {"extern_libs": libs}
    hook = knobs.runtime.jit_post_compile_hook
    assert nvshmem.link_options() == {"extern_libs": libs}
    assert knobs.runtime.jit_post_compile_hook is hook  # not wrapped twice
    hook(compile={"extern_libs": None, "device": 0}, key="key", fn=None)
    assert len(earlier) == 1  # a hook set before (a profiler's, PyTorch's) still runs


@triton.jit(do_not_specialize=["n"])
def bundled_copy(src_ptr, dst_ptr, n, factor, BLOCK: tl.constexpr, ADD: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask) * factor + ADD, mask=mask)


class CopyCall(NamedTuple):
    src_ptr: object
    dst_ptr: object
    n: int


def _bundled_launches(device, repeats):
    """KernelLaunch: a call bundle and shared arguments, over aligned and unaligned pointers
    and element counts Triton would otherwise specialize (1, multiples of 16)."""
    gen = torch.Generator().manual_seed(6)
    base = torch.randint(-1000, 1000, (256,), generator=gen, dtype=torch.int32).to(device)
    grid = (8,)
    launch = launcher.KernelLaunch(
        bundled_copy, grid, dict(BLOCK=32, ADD=3, num_warps=1), CopyCall._fields, (0, 1)
    )
    shared = launcher.Shared.of((5,))
    for _ in range(repeats):
        for offset, n in [(0, 100), (1, 99), (0, 1), (0, 64), (3, 77), (0, 16)]:
            src = base[offset : offset + n]
            out = torch.full((256,), -7, dtype=torch.int32, device=device)
            dst = out[offset : offset + n]
            launch(CopyCall(src_ptr=src, dst_ptr=dst, n=n), shared)
            assert torch.equal(dst, src * 5 + 3), (offset, n)
            assert bool((out[:offset] == -7).all()) and bool((out[offset + n :] == -7).all())
    return launch


def test_bundled_launches_match_the_kernel_everywhere():
    _bundled_launches("cuda" if torch.cuda.is_available() else "cpu", repeats=2)


@pytest.mark.gpu
def test_bundled_launches_go_straight_to_the_compiled_kernel(monkeypatch):
    """After the first launch of each pointer alignment, a KernelLaunch calls a launcher of
    the compiled kernel's runtime arguments (:func:`launcher.runtime_launcher`) with addresses:
    Triton's binding is not called again, and a new element count (1, 16, 99) compiles
    nothing."""
    launch = _bundled_launches("cuda", repeats=1)
    assert launch.direct and len(launch.compiled) == 2, list(launch.compiled)  # two alignments
    # Launched by a launcher of the runtime arguments alone (BLOCK and ADD compiled in, the
    # outputs checked above).
    assert all(entry[5] == () for entry in launch.compiled.values())
    calls = []
    original = type(bundled_copy).run

    def counting_run(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(bundled_copy), "run", counting_run)
    before = launcher.triton_path_launches
    _bundled_launches("cuda", repeats=2)  # (a new KernelLaunch: its first launch is Triton's)
    assert launcher.triton_path_launches - before == len(calls) == 2, len(calls)
    assert len(bundled_copy.device_caches[torch.cuda.current_device()][0]) == 2


def _copy_runtime(src_ptr, dst_ptr, n, factor, BLOCK: tl.constexpr, ADD: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs) * factor + ADD + n)


#: Run in a process of its own: compiled, not interpreted (this process builds its kernels for
#: the interpreter, whose patches of Triton's builder a compile here would meet).
RUNTIME_LAUNCHER_CHECK = """
import json, re, types

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import driver as nvidia
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from tests.test_launcher import _copy_runtime
from tritonep.kernels import launcher

signature = {"src_ptr": "*i32", "dst_ptr": "*i32", "n": "constexpr", "factor": "i32"}
signature.update(BLOCK="constexpr", ADD="constexpr")
source = ASTSource(JITFunction(_copy_runtime), signature, {"n": 1, "BLOCK": 32, "ADD": 3})
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
sources = []  # the launchers' C, in the order they are made


def compile_module(src, name, library_dirs=None, include_dirs=None, libraries=None):
    sources.append(src)
    return types.SimpleNamespace(launch=print)


nvidia.compile_module_from_src = compile_module
nvidia.library_dirs = lambda: []
try:
    compiled._run = nvidia.CudaLauncher(compiled.src, compiled.metadata)  # Triton's own
except RuntimeError as error:  # a Triton whose launchers ask for a live driver (3.9 on CPU)
    if "active drivers" not in str(error):
        raise
    print(json.dumps({"no driver": str(error)}))
    raise SystemExit(0)
lean = launcher.runtime_launcher(compiled, 4)
print(json.dumps({
    "lean": lean is not None and lean.launch is print,
    "five": launcher.runtime_launcher(compiled, 5) is None,
    "formats": [re.search(r'PyArg_ParseTuple\\(args, "(\\w+)"', s).group(1) for s in sources],
    "params": [re.search(r"void \\*params\\[\\] = \\{([^}]*)\\}", s).group(1) for s in sources],
}))
"""


def test_runtime_launcher_takes_the_runtime_arguments_alone():
    """The launcher made for a compiled kernel (compiled here for an sm_90 target, without a
    GPU) parses its runtime parameters alone, a parameter Triton turned into a constant (the
    value 1) among them, and hands the kernel exactly what Triton's own launcher hands it."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-c", RUNTIME_LAUNCHER_CHECK],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "no driver" in result:  # CI's low end (Triton 3.6) and the GPU hosts run the check
        pytest.skip(f"Triton {triton.__version__} makes launchers only beside a GPU driver")
    assert result["lean"]
    assert result["five"]  # ADD is no runtime parameter
    formats, params = result["formats"], result["params"]
    # Triton's launch arguments (13), then 4 runtime parameters, then 2 constexprs.
    assert (len(formats[0]), len(formats[1])) == (13 + 4 + 2, 13 + 4)
    assert params[1] == params[0] and "arg3" in params[0] and "arg2" not in params[0]
