"""Run DeepEP's own tests, unmodified, with ``import deep_ep`` resolving to ``tritonep.deep_ep``.

DeepEP's tests (``tests/legacy/test_intranode.py``, ``tests/legacy/test_low_latency.py``,
``tests/elastic/test_ep.py``) import ``deep_ep`` and its ``deep_ep.utils`` helpers (``math``,
``refs``, ``gate``, ``testing``, ``envs``). This script builds, in a folder git ignores, a
``deep_ep`` package whose top level is tritonep's (``from tritonep.deep_ep import *``) and whose
``deep_ep/utils/`` are DeepEP's own files, copied unchanged. Those files import DeepEP's
compiled module (``deep_ep._C``) at import time, for names the tests never call through
them (``EventHandle``, NCCL communicator helpers): a small ``deep_ep/_C.py`` stands in for it.
On GPUs nothing else changes, ``init_dist`` included (NCCL, one GPU per process).

    # here, from a DeepEP checkout or its bare git mirror (at the revision to test):
    python scripts/deepep_tests.py extract PATH_TO_DEEPEP [--rev dd758ca] [--to .deepep]
    # on the GPU machine (carry .deepep): all three tests on 4 GPUs
    python scripts/deepep_tests.py run --num-processes 4 [--only ep] [--args-ep "..."]

``--cpu`` runs them on CPU ranks (gloo, kernels under the Triton interpreter), as a check where
there is no GPU: ``init_dist`` is replaced (the only change to DeepEP's files), tensors the
tests put on ``"cuda"`` go to the CPU, and the timing helpers of ``testing.py`` call the timed
function once (their times mean nothing there); small shapes by default.

Each test's output goes to ``deepep-<test>.log`` in ``--logs`` (default: ``$OUT`` if set, else
the build folder ``out/deepep``); the script prints each log's last lines and exits non-zero
if any test failed.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: DeepEP's files the tests need, relative to its repository root.
UTILS = [
    "__init__",
    "comm",
    "envs",
    "event",
    "find_pkgs",
    "gate",
    "math",
    "refs",
    "semantic",
    "testing",
]
TESTS = {
    "intranode": "tests/legacy/test_intranode.py",
    "low_latency": "tests/legacy/test_low_latency.py",
    "ep": "tests/elastic/test_ep.py",
}
FILES = [f"deep_ep/utils/{name}.py" for name in UTILS] + list(TESTS.values())
#: The tests' arguments besides ``--num-processes``: DeepEP's defaults on GPUs, small shapes
#: on CPU ranks (the interpreter runs a few hundred tokens a second).
GPU_ARGS = {"intranode": "", "low_latency": "", "ep": ""}
CPU_ARGS = {
    "intranode": "--num-tokens 64 --hidden 256 --num-topk 4 --num-experts 16",
    "low_latency": "--num-tokens 16 --hidden 512 --num-topk 4 --num-experts 16",
    "ep": "--num-tokens 24 --hidden 256 --num-topk 4 --num-experts 16 --skip-perf-test "
    "--test-first-only",
}

PACKAGE = '''"""deep_ep resolving to tritonep.deep_ep (tritonep's scripts/deepep_tests.py)."""
from tritonep.deep_ep import *  # noqa: F403
from tritonep.deep_ep import __version__, topk_idx_t  # noqa: F401
'''

COMPILED = '''"""Stands in for DeepEP's compiled module: DeepEP's utils import it at import time."""
from tritonep.deep_ep.utils import EventHandle  # noqa: F401


def _missing(*args, **kwargs):
    raise NotImplementedError("DeepEP's compiled module is not part of tritonep")


get_physical_domain_size = get_logical_domain_size = get_local_nccl_unique_id = _missing
create_nccl_comm = destroy_nccl_comm = init_jit = _missing
'''

CPU_INIT_DIST = '''def init_dist(local_rank: int, num_local_ranks: int, seed: int = 0):
    """tritonep's CPU check: ranks on gloo, kernels under the Triton interpreter, "cuda" tensors
    on the CPU (this function replaces DeepEP's NCCL one)."""
    global _local_rank
    _local_rank = local_rank
    from deep_ep._cpu import init_cpu_ranks
    init_cpu_ranks(local_rank, num_local_ranks)
    init_seed(seed)
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_local_ranks)))


'''

CPU_SHIMS = '''"""tritonep's CPU check of DeepEP's tests: what a CPU rank lacks of CUDA."""
import os

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode


def _cpu(device):
    if device is not None and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class CudaOnCpu(TorchFunctionMode):
    """Tensors the tests create on (or move to) "cuda" stay on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(_cpu(a) if isinstance(a, (str, torch.device)) else a for a in args)
        name = getattr(func, "__name__", "")
        if name == "all_to_all_single" and args[0].dtype == torch.float8_e4m3fn:
            # gloo moves no FP8: the same bytes as uint8
            args = tuple(a.view(torch.uint8) if isinstance(a, torch.Tensor) else a for a in args)
        gathers = name in ("all_gather_into_tensor", "all_gather_single")
        if gathers and args[0].dim() > args[1].dim():
            # gloo gathers into [R * N, ...] only: the same memory
            args = (args[0].view(-1, *args[1].shape[1:]), *args[1:])
        return func(*args, **kwargs)


class Event:
    """torch.cuda.Event on a CPU rank: records nothing, every interval is 1 ms."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 1.0


def init_cpu_ranks(local_rank, num_ranks):
    ip = os.getenv("MASTER_ADDR", "127.0.0.1")
    port = int(os.getenv("MASTER_PORT", "8361"))
    dist.init_process_group("gloo", init_method=f"tcp://{ip}:{port}", world_size=num_ranks,
                            rank=local_rank)
    torch.set_default_dtype(torch.bfloat16)
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.Event = Event
    torch.cuda._sleep = lambda *args, **kwargs: None
    CudaOnCpu().__enter__()
'''

CPU_TIMING = """

# tritonep's CPU check: the timed function runs once (bench) or not at all (bench_kineto, whose
# callers include a large GEMM); times mean nothing on CPU ranks.
def bench(fn, num_warmups=50, num_tests=50, post_fn=None, flush_l2=True):
    fn()
    if post_fn is not None:
        post_fn()
    return 1e-3, 1e-3, 1e-3


def bench_kineto(fn, kernel_names, num_tests=30, suppress_kineto_output=False, trace_path=None,
                 flush_l2=True, barrier_comm_profiling=False, num_kernels_per_period=1,
                 barrier=None):
    one = 1e-3 if num_kernels_per_period == 1 else [1e-3] * num_kernels_per_period
    return tuple(one for _ in kernel_names) if isinstance(kernel_names, tuple) else one
"""


def extract(source: Path, rev: str, to: Path) -> None:
    """Copy DeepEP's files the tests need from a checkout or a (bare) git directory."""
    bare = (source / "HEAD").exists() and (source / "objects").exists()
    for name in FILES:
        target = to / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if bare or rev != "HEAD":
            git = [
                "git",
                f"--git-dir={source if bare else source / '.git'}",
                "show",
                f"{rev}:{name}",
            ]
            target.write_bytes(subprocess.run(git, check=True, capture_output=True).stdout)
        else:
            shutil.copyfile(source / name, target)
    print(f"{len(FILES)} files of DeepEP ({rev}) in {to}: carry this folder to the GPU machine")


def build(deepep: Path, out: Path, cpu: bool) -> None:
    """The ``deep_ep`` package and the tests in ``out``."""
    missing = [name for name in FILES if not (deepep / name).exists()]
    if missing:
        sys.exit(f"{deepep}: missing {missing}; run the extract step first")
    for built in (out / "deep_ep", out / "tests"):
        if built.exists():
            shutil.rmtree(built)
    package = out / "deep_ep"
    (package / "utils").mkdir(parents=True)
    (package / "__init__.py").write_text(PACKAGE)
    (package / "_C.py").write_text(COMPILED)
    for name in UTILS:
        text = (deepep / f"deep_ep/utils/{name}.py").read_text()
        if cpu and name == "envs":
            text = re.sub(
                r"^def init_dist\(.*?(?=^def )", CPU_INIT_DIST, text, count=1, flags=re.S | re.M
            )
            assert "tritonep's CPU check" in text, "init_dist not found in envs.py"
        if cpu and name == "testing":
            text += CPU_TIMING
        (package / "utils" / f"{name}.py").write_text(text)
    if cpu:
        (package / "_cpu.py").write_text(CPU_SHIMS)
    for test in TESTS.values():
        (out / test).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(deepep / test, out / test)


def run(args) -> int:
    out = Path(args.out).resolve()
    build(Path(args.deepep).resolve(), out, args.cpu)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(out), str(REPO / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("PYTHONUNBUFFERED", "1")
    if args.cpu:
        env.update(TRITON_INTERPRET="1", TORCHDYNAMO_DISABLE="1", CUDA_VISIBLE_DEVICES="")
    else:  # as tritonep's GPU checks run (see scripts/gpu_check.sh), sharing their kernel cache
        env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
        env.setdefault("TRITON_CACHE_DIR", str(REPO / ".triton-cache"))
    logs = Path(args.logs or out).resolve()
    logs.mkdir(parents=True, exist_ok=True)
    defaults = CPU_ARGS if args.cpu else GPU_ARGS
    failed = []
    for name in args.only.split(","):
        test = out / TESTS[name]
        extra = getattr(args, f"args_{name}")
        extra = defaults[name] if extra is None else extra
        cmd = [
            sys.executable,
            test.name,
            "--num-processes",
            str(args.num_processes),
            *shlex.split(extra),
        ]
        log = logs / f"deepep-{name}.log"
        print(f"[{name}] {' '.join(cmd)}  (log: {log})", flush=True)
        start = time.monotonic()
        with open(log, "w") as f:
            try:
                code = subprocess.run(
                    cmd,
                    cwd=test.parent,
                    env=env,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=args.timeout,
                ).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        tail = log.read_text().splitlines()[-15:]
        verdict = "passed" if code == 0 else f"FAILED ({code})"
        print(f"[{name}] {verdict} in {time.monotonic() - start:.0f} s", flush=True)
        print("\n".join("    " + line for line in tail), flush=True)
        if code != 0:
            failed.append(name)
    print("all passed" if not failed else f"failed: {', '.join(failed)}")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    ex = sub.add_parser("extract", help="copy DeepEP's files the tests need")
    ex.add_argument("source", help="a DeepEP checkout or its (bare) git directory")
    ex.add_argument("--rev", default="HEAD", help="revision (git sources; default HEAD)")
    ex.add_argument("--to", default=".deepep", help="destination (default .deepep, ignored)")
    rn = sub.add_parser("run", help="build deep_ep on tritonep and run the tests")
    rn.add_argument("--deepep", default=".deepep", help="the extracted files (default .deepep)")
    rn.add_argument("--out", default="out/deepep", help="build and log folder (default out/deepep)")
    rn.add_argument("--only", default="intranode,low_latency,ep", help="tests to run, in order")
    rn.add_argument("--num-processes", type=int, default=4, help="ranks (default 4)")
    rn.add_argument("--cpu", action="store_true", help="CPU ranks and small shapes (no GPU)")
    rn.add_argument("--timeout", type=float, default=3000, help="seconds per test")
    rn.add_argument(
        "--logs",
        default=os.environ.get("OUT"),
        help="folder of the logs (default: $OUT if set, else the build folder)",
    )
    for name in TESTS:
        rn.add_argument(
            f"--args-{name.replace('_', '-')}",
            dest=f"args_{name}",
            default=None,
            help=f"arguments of {TESTS[name]} (default: see CPU_ARGS / GPU_ARGS)",
        )
    args = parser.parse_args()
    if args.step == "extract":
        extract(Path(args.source), args.rev, Path(args.to))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
