"""Every kernel compiles for Hopper (sm_90) on this machine, GPU or not.

The interpreter accepts code that the compiler rejects, so the CPU suite also runs Triton's
real compiler (front end, LLVM and ptxas) for an H100/H200 target. It runs in a subprocess
because this process builds its kernels for the interpreter.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.nvidia")

# kernel module, kernel name, signature, constexprs
KERNELS = [
    (
        "tritonep.kernels.put_signal",
        "put_signal_kernel",
        {
            "src_ptr": "*i32",
            "num_elems": "i32",
            "peer_ptrs": "*i64",
            "peer": "i32",
            "data_offset": "i64",
            "flag_offset": "i64",
            "value": "i32",
            "BLOCK": "constexpr",
        },
        {"BLOCK": 1024},
    ),
    (
        "tritonep.kernels.put_signal",
        "wait_signal_kernel",
        {
            "peer_ptrs": "*i64",
            "rank": "i32",
            "peer": "i32",
            "flag_offset": "i64",
            "value": "i32",
            "timeout": "i64",
            "status_ptr": "*i32",
            "USE_CLOCK": "constexpr",
        },
        {"USE_CLOCK": True},
    ),
]

COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name, signature, constexprs = json.loads(sys.argv[1])
kernel = getattr(importlib.import_module(module), name)
hopper = GPUTarget("cuda", 90, 32)
compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=hopper)
assert compiled.asm["cubin"]
print(compiled.asm["ptx"])
"""


def compile_ptx(module, name, signature, constexprs):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE, json.dumps([module, name, signature, constexprs])],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("kernel", KERNELS, ids=[k[1] for k in KERNELS])
def test_compiles_for_sm90(kernel):
    assert ".target sm_90" in compile_ptx(*kernel)


def test_flags_use_system_scope_release_and_acquire():
    assert "atom.global.sys.release.exch.b32" in compile_ptx(*KERNELS[0])
    ptx = compile_ptx(*KERNELS[1])
    assert "ld.global.sys.acquire.b32" in ptx  # atomic_add(p, 0, acquire) becomes an acquire load
    assert "%globaltimer" in ptx
