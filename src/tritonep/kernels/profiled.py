"""Kernels compiled under C++-style names, as profilers and DeepEP's benchmarks look for them.

A Triton kernel's symbol is its Python function's name. Profilers show CUDA kernels by their
demangled symbol (``void deep_ep::intranode::dispatch<8>(...)``), and DeepEP's benchmark
helper (``bench_kineto``) finds kernels by a substring of that name: a row of the profile
table, or a trace event containing ``::dispatch`` when a call launches several kernels. A
symbol that is an Itanium-mangled C++ name is demangled the same way, so a kernel compiled as
``_ZN8tritonep7elastic13dispatch_implEv`` is shown as ``tritonep::elastic::dispatch_impl()``.

:func:`kernel` is the decorator for new kernels (``@kernel("tritonep::elastic::dispatch_impl")``
instead of ``@triton.jit``); :func:`profiled` gives an existing kernel a second, named copy.
Only the symbol differs: the code, the constexprs and the specializations are the same.
"""

from __future__ import annotations

import types

import triton
from triton import knobs


def mangle(name: str) -> str:
    """The Itanium-mangled symbol of a ``void name()`` with ``::``-separated parts."""
    parts = name.split("::")
    if not all(p.isidentifier() for p in parts):
        raise ValueError(f"name: expected identifiers separated by '::', got {name!r}")
    return "_ZN" + "".join(f"{len(p)}{p}" for p in parts) + "Ev"


def _renamed(fn, symbol: str):
    """A copy of the function ``fn`` whose name is ``symbol`` (same code and annotations)."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, symbol, fn.__defaults__, fn.__closure__)
    copy.__qualname__ = symbol
    copy.__module__ = fn.__module__
    copy.__doc__ = fn.__doc__
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__annotations__ = dict(fn.__annotations__)  # the constexpr markers
    return copy


def kernel(name: str, **jit_options):
    """``@triton.jit(**jit_options)`` under the symbol of the C++ name ``name``."""

    symbol = mangle(name)

    def wrap(fn):
        if knobs.runtime.interpret:  # no symbol there (and the interpreter looks the source
            return triton.jit(fn, **jit_options)  # up by the function's own name)
        return triton.jit(_renamed(fn, symbol), **jit_options)

    return wrap


def profiled(jitted, name: str):
    """A second copy of the Triton kernel ``jitted`` whose symbol is that of ``name``."""
    held = getattr(jitted, "kwargs", None) or vars(jitted)  # the interpreter keeps them apart
    keys = ("do_not_specialize", "do_not_specialize_on_alignment", "debug", "noinline")
    options = {key: held[key] for key in keys if held.get(key) is not None}
    return kernel(name, **options)(jitted.fn)
