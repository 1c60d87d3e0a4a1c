"""NVSHMEM device calls for Triton kernels, and the launch wrapper that links them.

The calls are declared here, not taken from PyTorch's private wrappers, so that kernels using
them compile anywhere Triton's CUDA compiler runs (the CPU suite compiles every kernel for
sm_90) and do not follow that module's changes between releases. Linking NVSHMEM's device
library into a kernel and initializing its module once built are PyTorch's job
(:func:`requires_nvshmem`, which needs the NVSHMEM backend's library at first use).

NVSHMEM's block-scoped calls expect every thread of the program to call them with the same
arguments, which is what a Triton scalar call does.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl
from triton.language import core

#: ``sig_op`` values of :func:`putmem_signal_block`.
SIGNAL_SET = core.constexpr(0)
SIGNAL_ADD = core.constexpr(5)


def _call(symbol, arg_types, args, _semantic):
    """An NVSHMEM device function returning int32, called with every thread of the program."""
    signature = tuple(core.dtype(t) for t in arg_types)
    return core.extern_elementwise(
        "", "", args, {signature: (symbol, core.dtype("int32"))}, is_pure=False,
        _semantic=_semantic,
    )  # fmt: skip


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
def _signal_op(signal, value, sig_op, pe, _semantic=None):
    types = ("int64", "int64", "int32", "int32")
    return _call("nvshmemx_signal_op", types, [signal, value, sig_op, pe], _semantic)


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
    (this PE's symmetric address) on PE ``pe``."""
    return _signal_op(
        signal_addr + tl.zeros((), tl.int64),
        value + tl.zeros((), tl.int64),
        tl.full((), SIG_OP, tl.int32),
        pe + tl.zeros((), tl.int32),
    )


@functools.cache
def requires_nvshmem(kernel):
    """``kernel`` launched with NVSHMEM's device library linked and its module initialized
    (one wrapper per kernel, however many modes use it)."""
    try:
        from torch.distributed._symmetric_memory._nvshmem_triton import (
            requires_nvshmem as link,
        )
    except ImportError as e:  # pragma: no cover - depends on the PyTorch build
        raise RuntimeError("this PyTorch build cannot link NVSHMEM into Triton kernels") from e
    return link(kernel)
