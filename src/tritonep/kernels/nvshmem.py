"""NVSHMEM device calls for Triton kernels, and the launch options that link them.

The calls are declared here, not taken from PyTorch's private wrappers, so that kernels using
them compile anywhere Triton's CUDA compiler runs (the CPU suite compiles every kernel for
sm_90) and do not follow that module's changes between releases.

NVSHMEM's block-scoped calls expect every thread of the program to call them with the same
arguments, which is what a Triton scalar call does; its thread-level calls (such as
``nvshmemx_signal_op``) would run once per thread, so none is declared here.

Linking: a launch that puts passes :func:`link_options` (NVSHMEM's device library as an
extern library). Each module built that way must then be initialized for NVSHMEM before it
runs; a post-compile hook does it for every module that references NVSHMEM's device state,
and for no other. (PyTorch's own wrapper initializes every module of a kernel *name* once
that name was wrapped, which breaks the variants of the same kernel that put nothing: a
receive-only launch, or a leg of the mode whose peers are all mapped.)
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl
from triton.language import core

#: ``sig_op`` values of :func:`putmem_signal_block`: NVSHMEM's ``NVSHMEM_SIGNAL_SET`` and
#: ``NVSHMEM_SIGNAL_ADD`` (any other value is taken as an addition).
SIGNAL_SET = core.constexpr(9)
SIGNAL_ADD = core.constexpr(10)


def _call(symbol, arg_types, args, _semantic):
    """An NVSHMEM device function returning int32, called with every thread of the program."""
    signature = tuple(core.dtype(t) for t in arg_types)
    return core.extern_elementwise(
        "",
        "",
        args,
        {signature: (symbol, core.dtype("int32"))},
        is_pure=False,
        _semantic=_semantic,
    )


@core.extern
def _putmem_signal_block(dst, src, nbytes, signal, value, sig_op, pe, _semantic=None):
    types = ("int64", "int64", "int64", "int64", "uint64", "int32", "int32")
    args = [dst, src, nbytes, signal, value, sig_op, pe]
    return _call("nvshmemx_putmem_signal_block", types, args, _semantic)


@core.extern
def _putmem_block(dst, src, nbytes, pe, _semantic=None):
    types = ("int64", "int64", "int64", "int32")
    return _call("nvshmemx_putmem_block", types, [dst, src, nbytes, pe], _semantic)


@core.extern
def fence(_semantic=None):
    """Order this PE's earlier puts and signals to each PE before its later ones."""
    return _call("nvshmem_fence", (), [], _semantic)


@triton.jit
def putmem_signal_block(dst_addr, src_ptr, nbytes, signal_addr, value, SIG_OP: tl.constexpr, pe):
    """Copy ``nbytes`` from local ``src_ptr`` to PE ``pe``, then update its 64-bit signal.

    ``dst_addr`` and ``signal_addr`` are int64 addresses in this PE's own symmetric heap: NVSHMEM
    translates them to the same offsets on ``pe``. The signal changes (``SIGNAL_SET`` or
    ``SIGNAL_ADD`` of ``value``) only after the payload is visible there. Blocking: ``src_ptr``
    may be reused on return. Scalars may be Python ints (an argument equal to 1 arrives as a
    constexpr), hence the additions of zero.
    """
    return _putmem_signal_block(
        dst_addr + tl.zeros((), tl.int64),
        src_ptr.to(tl.int64),
        nbytes + tl.zeros((), tl.int64),
        signal_addr + tl.zeros((), tl.int64),
        (value + tl.zeros((), tl.int64)).to(tl.uint64),
        tl.full((), SIG_OP, tl.int32),
        pe + tl.zeros((), tl.int32),
    )


@triton.jit
def putmem_block(dst_addr, src_ptr, nbytes, pe):
    """Copy ``nbytes`` from local ``src_ptr`` to PE ``pe`` at this PE's symmetric ``dst_addr``.
    Blocking: ``src_ptr`` may be reused on return; ordered before later signals by
    :func:`fence`."""
    return _putmem_block(
        dst_addr + tl.zeros((), tl.int64),
        src_ptr.to(tl.int64),
        nbytes + tl.zeros((), tl.int64),
        pe + tl.zeros((), tl.int32),
    )


@triton.jit
def signal_op(signal_addr, value, SIG_OP: tl.constexpr, pe):
    """Set (``SIGNAL_SET``) or add to (``SIGNAL_ADD``) the 64-bit signal ``signal_addr``
    (this PE's symmetric address) on PE ``pe``, once per program.

    NVSHMEM's own ``nvshmemx_signal_op`` is a thread-level call: made the Triton way (by every
    thread of the program) an addition would land once per thread. A put of zero bytes with a
    signal is block-scoped: one signal for the program, after the threads have synchronized.
    """
    return putmem_signal_block(signal_addr, signal_addr, 0, signal_addr, value, SIG_OP, pe)


#: The symbol every module that uses NVSHMEM's device library holds, and that its
#: initialization fills in.
_DEVICE_STATE = "nvshmemi_device_state_d"


def link_options() -> dict:
    """Launch options that link NVSHMEM's device library into a kernel (hashable values, so
    they can sit in a mode's constexpr dict). Installs the module-initializing hook, again if
    something replaced it since (PyTorch's own NVSHMEM wrapper sets a hook of its own)."""
    _install_hook()
    return {"extern_libs": (("libnvshmem_device", _device_library()),)}


@functools.cache
def _device_library() -> str:
    try:
        from torch.distributed._symmetric_memory._nvshmem_triton import NvshmemLibFinder
    except ImportError as e:  # pragma: no cover - depends on the PyTorch build
        raise RuntimeError("this PyTorch build cannot link NVSHMEM into Triton kernels") from e
    return NvshmemLibFinder.find_device_library()


def _install_hook() -> None:
    from triton import knobs

    previous = knobs.runtime.jit_post_compile_hook
    if getattr(previous, "_tritonep", False):
        return

    def hook(*args, **kwargs):
        _initialize_module(kwargs)
        return previous(*args, **kwargs) if previous is not None else None

    # A mark on the function itself: the hook installed is whichever Triton holds now.
    hook._tritonep = True  # type: ignore[attr-defined]
    knobs.runtime.jit_post_compile_hook = hook


def _initialize_module(kwargs: dict) -> None:
    """Initialize a just-built module for NVSHMEM if it was linked with its device library and
    kept a reference to it (a variant that puts nothing keeps none, and has nothing to set)."""
    options = kwargs["compile"]
    if "libnvshmem_device" not in dict(options.get("extern_libs") or ()):
        return
    device = options["device"]
    kernel = kwargs["fn"].jit_function.device_caches[device][0].get(kwargs["key"])
    if kernel is None or not _holds_device_state(kernel.asm):
        return
    from torch._C._distributed_c10d import _nvshmemx_cumodule_init

    kernel.run  # noqa: B018 - loads the module, which Triton does lazily
    _nvshmemx_cumodule_init(kernel.module)


def _holds_device_state(asm: dict) -> bool:
    """Whether a compiled kernel references NVSHMEM's device state. The binary is read as well
    as the PTX: a kernel loaded from a Triton cache that kept only binaries has no PTX, and
    left uninitialized its first put reads an unset state (an illegal memory access)."""
    return _DEVICE_STATE in asm.get("ptx", "") or _DEVICE_STATE.encode() in asm.get("cubin", b"")
