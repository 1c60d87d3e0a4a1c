"""Compiled kernels or Triton's interpreter: decided once per process, before any kernel exists.

Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` function is defined, that is when a
kernel module is imported: a kernel defined without it is built for a GPU, and on a machine
with no usable GPU its first launch fails ("0 active drivers"). ``import tritonep`` therefore
runs :func:`decide` before anything else of the package, so every entry point (``python -m
tritonep.demo``, a script that imports tritonep and calls ``spawn``, ``python -m
tritonep.launch``, ``torchrun``, a plain process group) gets the same answer:

* ``TRITON_INTERPRET`` already set (to anything non-empty): left as it is;
* no CUDA device usable by this process: ``TRITON_INTERPRET=1``, in ``os.environ``, so rank
  processes started from here inherit it;
* otherwise nothing changes: kernels are compiled for the GPU. That includes
  ``TRITONEP_SHARED_GPU=1``, whose ranks all run compiled kernels on GPU 0.

The device check asks NVML through ``torch.cuda.device_count()``: it creates no CUDA context
and leaves forked children free to use CUDA (a CPU build of torch answers without looking).

Ranks that run on the CPU although the machine has GPUs (more ranks than GPUs) are told so by
whoever starts them (:mod:`tritonep.launch` sets ``TRITON_INTERPRET=1`` for them), or turn the
interpreter on in :func:`tritonep.launch.init_distributed` while no kernel is defined yet
(:func:`use_for_cpu_ranks`). Where kernels cannot run on a rank's device (built for a GPU on a
CPU rank, or interpreted on a GPU rank, or Triton 3.6's interpreter beside numpy 2.4),
:func:`check` raises a :class:`RuntimeError` that says what to do, before any kernel runs.
"""

from __future__ import annotations

import os
import sys

ENV = "TRITON_INTERPRET"


def gpu_present() -> bool:
    """Whether this process can see a CUDA (or ROCm) device, asked without a CUDA context."""
    import torch

    return torch.cuda.device_count() > 0


def decide() -> None:
    """Turn the interpreter on for this process and its children when no GPU is usable
    (run by ``import tritonep``); an explicit ``TRITON_INTERPRET`` is kept."""
    if not os.environ.get(ENV) and not gpu_present():
        os.environ[ENV] = "1"


def _kernel_modules() -> list:
    modules = list(sys.modules.items())
    return [m for name, m in modules if name.startswith("tritonep.kernels.") and m is not None]


def kernels_defined() -> bool:
    """Whether a kernel module of tritonep has been imported in this process."""
    return bool(_kernel_modules())


def interpreting() -> bool:
    """Whether this process's kernels run under Triton's interpreter: as the kernels already
    defined were built, else as kernels defined now would be."""
    from triton import knobs
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for module in _kernel_modules():
        for value in vars(module).values():
            if isinstance(value, InterpretedFunction):
                return True
            if isinstance(value, JITFunction):
                return False
    return bool(knobs.runtime.interpret)


def use_for_cpu_ranks() -> None:
    """This process is a rank on the CPU: turn the interpreter on if no kernel is defined yet
    and ``TRITON_INTERPRET`` is not set (a GPU machine running more ranks than it has GPUs).
    What cannot be changed any more, :func:`check` reports."""
    if not os.environ.get(ENV) and not kernels_defined():
        os.environ[ENV] = "1"


def _numpy_trap() -> str | None:
    """Triton 3.6's interpreter converts 1-element arrays to ints, which numpy 2.4 refuses."""
    import numpy
    import triton

    def release(version: str) -> tuple[int, ...]:
        return tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())

    if release(triton.__version__) <= (3, 6) and release(numpy.__version__) >= (2, 4):
        return (
            f"Triton {triton.__version__}'s interpreter does not work with numpy "
            f"{numpy.__version__} (it needs numpy < 2.4). Install an older numpy, "
            f"pip install 'numpy<2.4', or a newer Triton, pip install 'triton>=3.7'"
        )
    return None


def check(device) -> None:
    """Raise a :class:`RuntimeError` saying what to do where this process's kernels cannot run
    on ``device`` (a ``torch.device``); called before a heap is allocated."""
    value = os.environ.get(ENV)
    if device.type == "cpu" and not interpreting():
        if value:
            why = f"{ENV}={value} is set"
            fix = f"unset {ENV}, or set {ENV}=1 before Python starts"
        else:
            why = "the kernels were defined before this process became a CPU rank"
            fix = (
                f"set {ENV}=1 before Python starts, or run one rank per GPU (ranks run on "
                "the CPU when there are fewer GPUs than ranks)"
            )
        raise RuntimeError(
            f"tritonep: this rank runs on the CPU, but its Triton kernels are compiled for a GPU "
            f"({why}); on the CPU they run under Triton's interpreter: {fix}"
        )
    if device.type == "cpu":
        trap = _numpy_trap()
        if trap:
            raise RuntimeError(f"tritonep: {trap}")
    if device.type == "cuda" and interpreting():
        raise RuntimeError(
            f"tritonep: {ENV}={value} is set, but this rank runs on {device}: Triton's "
            f"interpreter runs tritonep's kernels on CPU ranks only. Unset {ENV} to run on GPUs"
        )
