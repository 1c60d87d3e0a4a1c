"""Launch a Triton kernel with little host time: Triton's path once per shape, then its launcher.

``kernel[grid](*args, **meta)`` runs Triton's generic launch path on every call: it binds
every parameter (here 40 to 60, most of them constexprs), specializes each argument, builds a
cache key from all of them, checks the module globals the kernel read, and only then calls
the compiled kernel's launcher. On the GPU hosts that path added 20 to 50 us per launch to
the launcher's own 11 to 19 us, more than the device time of a small dispatch (BENCHMARKS.md,
host time of eager calls).

:func:`launch` keeps, per kernel, the compiled variants it has launched, keyed by the
constexprs and options (``meta``) and by the specialization of the runtime arguments. That
specialization is computed with Triton's own function (the one its binder calls: tensor dtype
and 16-byte alignment, integer width, divisibility and the value 1), so a variant is reused
exactly when Triton would pick it (an argument that is the same live object as before keeps
its specialization: replacing a tensor's storage in place with ``set_`` between launches is
the one change this would miss). A shape seen for the first time goes through
``kernel[grid]`` (compiling if needed); the result is checked against Triton's own binding,
and any disagreement turns the fast path off for that kernel.

Falls back to ``kernel[grid](*args, **meta)`` whenever the fast path does not apply: under the
interpreter, for objects that are not plain Triton kernels, while Triton's launch hooks are set
(as profilers set them), or when a kernel's runtime parameters are not exactly the positional
arguments. Launch options such as NVSHMEM linking (``extern_libs``) travel in ``meta`` like
the constexprs, so such launches take the fast path too.

With ``TRITONEP_KERNEL_RESOURCES=1`` in the environment every variant prints, when first
launched, its registers per thread and the bytes it spills (to standard error): the launch
shapes are bounded by registers, and a spill is the first thing to look for when a change
makes a kernel slower on a rank count that was not timed.
"""

from __future__ import annotations

import inspect
import os
import sys
import types
import weakref
from typing import Any, NamedTuple

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

try:  # Triton's per-argument specialization (what its generated binder calls)
    from triton._C.libtriton import native_specialize_impl
except ImportError:  # pragma: no cover - other Triton builds take the plain path
    native_specialize_impl = None


class _Variants:
    """The compiled variants of one kernel on one device, and how to specialize its arguments."""

    def __init__(self, fn: JITFunction, device: int, num_args: int):
        _, _, _, backend, binder = fn.device_caches[device]
        self.fn, self.num_args, self.backend, self.binder = fn, num_args, backend, binder
        params = fn.params
        self.usable = (
            native_specialize_impl is not None
            and len(params) >= num_args
            and all(not p.is_constexpr and not p.annotation_type for p in params[:num_args])
            and all(p.is_constexpr for p in params[num_args:])
        )
        self.flags = [
            (p.is_const, not p.do_not_specialize, not p.do_not_specialize_on_alignment)
            for p in params[:num_args]
        ]
        #: (meta, options, specialization) -> (compiled kernel, its launcher, the constexpr
        #: values in order that launcher takes: none for a runtime-only one)
        self.compiled: dict[tuple, tuple[Any, Any, tuple]] = {}
        self.held: list[Any] = [None] * num_args  # weakref.ref or _Const per position
        self.specs: list[tuple] = [()] * num_args
        self.seen: list[int] = [0] * num_args
        self.last_meta: dict | None = None
        self.last_meta_key: tuple = ()

    def key(self, args: tuple, meta: dict, knobs) -> tuple:
        specialize = self._specialize
        specialization = tuple(
            specialize(i, a, flags)
            for i, (a, flags) in enumerate(zip(args, self.flags, strict=True))
        )
        if meta is not self.last_meta:  # modes keep one meta dict per configuration
            self.last_meta, self.last_meta_key = meta, tuple(meta.items())
        # Triton's key also holds the debug and instrumentation settings of the moment.
        options = (knobs.runtime.debug, knobs.compilation.instrumentation_mode)
        return self.last_meta_key, options, specialization

    def _specialize(self, i: int, a: Any, flags: tuple) -> tuple:
        """Triton's specialization of argument ``i``, reused while it is the same object.

        Specializing a tensor costs about a microsecond, and a mode passes the same heap
        tensors and offsets on every call. A position whose object was the same on two calls
        in a row is remembered (a weak reference to a tensor: it is not kept alive), and while
        the same live object comes again its specialization stands (a tensor's dtype and
        storage do not change). A position whose object changes is learned again, so a new
        mode's tensors are remembered after its second call.
        """
        held = self.held[i]
        if held is not None and held() is a:
            return self.specs[i]
        spec = native_specialize_impl(self.backend, a, *flags)
        if self.seen[i] == id(a):
            self.held[i] = weakref.ref(a) if isinstance(a, torch.Tensor) else _Const(a)
        else:
            self.held[i] = None
        self.seen[i] = id(a)
        self.specs[i] = spec
        return spec

    def record(self, key: tuple, args: tuple, meta: dict, compiled) -> None:
        """Keep what ``fn[grid](*args, **meta)`` just launched, if Triton bound it as assumed,
        with a launcher of its runtime arguments alone where one can be made
        (:func:`runtime_launcher`)."""
        bound, specialization, _ = self.binder(*args, **meta)
        if specialization[: self.num_args] != list(key[2]):
            self.usable = False  # Triton specializes differently than assumed: never guess
            return
        if hasattr(compiled, "result"):  # compiled asynchronously
            compiled = compiled.result()
        lean = runtime_launcher(compiled, self.num_args)
        if lean is not None:
            self.compiled[key] = (compiled, lean, ())
        else:
            self.compiled[key] = (compiled, compiled.run, tuple(bound.values())[self.num_args :])
        if REPORT_RESOURCES:
            report_resources(self.fn, meta, compiled)


REPORT_RESOURCES = os.environ.get("TRITONEP_KERNEL_RESOURCES", "0") not in ("", "0")

#: The constexprs a resource report names a variant by (those that size its tiles).
_SHAPE_NAMES = (
    "NUM_RANKS",
    "BLOCK_TOKENS",
    "BLOCK_ROWS",
    "BLOCK_WORDS",
    "BLOCK_SEND_WORDS",
    "BLOCK_RECV_WORDS",
    "num_warps",
    "AWAIT",
    "PUBLISH",
)


def report_resources(fn, meta: dict, compiled) -> None:
    """Print a compiled variant's registers per thread and spilled bytes."""
    compiled._init_handles()
    shape = " ".join(f"{k}={meta[k]}" for k in _SHAPE_NAMES if k in meta)
    print(
        f"[tritonep] {fn.__name__} {shape}: {compiled.n_regs} registers, "
        f"{compiled.n_spills} bytes spilled",
        file=sys.stderr,
        flush=True,
    )


class _Const:
    """A strong reference with ``weakref.ref``'s call, for immutable arguments (ints)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __call__(self):
        return self.value


_variants: dict[tuple[int, int, int], _Variants] = {}


def variants_of(fn, device: int, num_args: int) -> _Variants | None:
    """The variants :func:`launch` keeps for ``fn`` (tests look at them)."""
    return _variants.get((id(fn), device, num_args))


def _hooked(hook) -> bool:
    """Whether a launch hook is set: Triton 3.6 keeps a chain of hooks (empty when none),
    earlier releases None or one callable."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(fn, grid: tuple[int, ...], args: tuple, meta: dict[str, Any]) -> None:
    """``fn[grid](*args, **meta)``: ``args`` are the kernel's runtime parameters in order,
    ``meta`` its constexprs and launch options (values hashable)."""
    if not isinstance(fn, JITFunction):
        fn[grid](*args, **meta)
        return
    from triton.runtime.driver import driver

    if _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
        fn[grid](*args, **meta)
        return
    device = driver.active.get_current_device()
    variants = _variants.get((id(fn), device, len(args)))
    if variants is None:
        compiled = fn[grid](*args, **meta)  # creates Triton's caches for this device
        variants = _variants[(id(fn), device, len(args))] = _Variants(fn, device, len(args))
        if variants.usable:
            variants.record(variants.key(args, meta, knobs), args, meta, compiled)
        return
    if not variants.usable:
        fn[grid](*args, **meta)
        return
    key = variants.key(args, meta, knobs)
    entry = variants.compiled.get(key)
    if entry is None:
        variants.record(key, args, meta, fn[grid](*args, **meta))
        return
    compiled, run, constexprs = entry
    grid = tuple(grid) + (1,) * (3 - len(grid))
    stream = driver.active.get_current_stream(device)
    run(
        grid[0],
        grid[1],
        grid[2],
        stream,
        compiled.function,
        compiled.packed_metadata,
        None,
        None,
        None,
        *args,
        *constexprs,
    )


# --------------------------------------------------------------------------------------------
# Kernels whose arguments come as named bundles, launched with addresses.


def kernel_params(fn) -> tuple[list[str], list[str]]:
    """The names of a kernel's runtime parameters and of its constexprs, in order (a JIT
    kernel or one the interpreter runs)."""
    runtime: list[str] = []
    constexprs: list[str] = []
    for p in inspect.signature(getattr(fn, "fn", fn)).parameters.values():
        (constexprs if "constexpr" in str(p.annotation) else runtime).append(p.name)
    return runtime, constexprs


def not_specialized(fn) -> set[str]:
    """The parameters a kernel does not specialize on their value (``do_not_specialize``)."""
    names = getattr(fn, "do_not_specialize", None)
    if names is None:  # the interpreter keeps the decorator's arguments
        names = getattr(fn, "kwargs", {}).get("do_not_specialize", ())
    runtime, _ = kernel_params(fn)
    return {runtime[n] if isinstance(n, int) else n for n in names or ()}


class Shared(NamedTuple):
    """The trailing runtime arguments of a kernel that stay the same from call to call (a
    buffer's memory, its rank, its limit): ``args`` as given (tensors and ints), ``values``
    the same with each tensor replaced by its address."""

    args: tuple
    values: tuple

    @staticmethod
    def of(args: tuple) -> Shared:
        values = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
        return Shared(tuple(args), values)


def runtime_launcher(compiled, num_args: int):
    """Triton's launcher for ``compiled``, generated for its ``num_args`` runtime parameters
    alone; None where it cannot be made (another backend or Triton release: the caller keeps
    Triton's own launcher).

    Triton's own launcher takes every parameter, the constexprs too, and parses each of them
    on every launch, though the kernel never receives them (they are compiled in): on an
    H200 host a kernel with the low-latency dispatch's arguments (22 runtime, 33 constexprs)
    launched in 10.8 us, 7.3 us with one constexpr (``scripts/probes/launch_host_probe.py``).
    Triton generates the same launcher, passing the kernel the same arguments, from the
    signature without the constexpr parameters; the module is compiled (about a second, once
    per signature on an empty cache) and kept in Triton's cache like its own launchers.
    """
    src = getattr(compiled, "src", None)
    signature = getattr(src, "signature", None)
    fn = getattr(src, "fn", None)
    params = getattr(fn, "params", None)
    if not isinstance(signature, dict) or params is None or len(params) != len(signature):
        return None
    # The kernel's declared runtime parameters first, then its constexprs (some at least).
    declared = [p.is_constexpr for p in params]
    if any(declared[:num_args]) or not declared[num_args:] or not all(declared[num_args:]):
        return None
    items = list(signature.items())
    # A runtime parameter Triton specialized to a constant (an int of value 1, say a rank)
    # stays: the launcher takes it and passes it on to nobody, as Triton's own does.
    runtime = dict(items[:num_args])
    source = types.SimpleNamespace(fn=fn, signature=runtime, constants={})
    try:
        lean = type(compiled.run)(source, compiled.metadata)
    except Exception:  # a launcher class that builds otherwise: Triton's own stays
        return None
    return lean if hasattr(lean, "launch") else None


#: Launches that went through Triton's own launch path (``kernel[grid]``: binding, cache key,
#: compiling where needed) rather than straight to a compiled kernel, over the process.
triton_path_launches = 0


class KernelLaunch:
    """One variant of a kernel and its grid, launched from a named argument bundle.

    ``KernelLaunch(fn, grid, meta, call_fields, pointers)`` then ``launch(call, shared)``: the
    kernel's runtime parameters are the fields of ``call`` (a NamedTuple of the values that
    change from call to call) followed by ``shared.args``; ``meta`` holds its constexprs and
    launch options. ``pointers`` are the indices of ``call``'s tensor fields; a pointer the
    variant does not use may be None, and ``placeholder`` (a small tensor on the kernel's
    device) is passed in its place.

    A launch first takes Triton's path (``fn[grid](...)``), which compiles the variant if
    needed; the compiled kernel is then kept under the alignment of the call's pointers (the
    one thing about this variant's arguments that Triton specializes and that may change from
    call to call: integers of the call must be ``do_not_specialize``, the shared arguments
    must keep their specialization, both checked against Triton's own binding, or the kernel
    always takes Triton's path). Later launches with the same key hand a launcher Triton
    generated for the runtime parameters alone (:func:`runtime_launcher`) the arguments as
    addresses and ints: no binding, no cache key, no constexprs to parse, no ``data_ptr``
    calls or driver pointer queries in the launcher, nothing that a ``torch`` function mode
    (``torch.set_default_device``) intercepts.

    Triton's path is taken whenever this one does not apply: under the interpreter, while a
    launch hook is set (profilers), on another current device, for a new key.

    A caller that has the addresses already (outputs it allocated, offsets into one
    allocation) hands them to :meth:`launch_values`, and builds the tensor bundle only when
    that returns False.
    """

    def __init__(
        self,
        fn,
        grid: tuple[int, ...],
        meta: dict[str, Any],
        call_fields: tuple,
        pointers: tuple[int, ...],
        placeholder: torch.Tensor | None = None,
    ):
        self.fn, self.meta = fn, meta
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.pointers = pointers
        self.placeholder = placeholder
        self._null = placeholder.data_ptr() if placeholder is not None else None
        self.direct = isinstance(fn, JITFunction)
        if self.direct:
            free = not_specialized(fn)
            ints = [name for i, name in enumerate(call_fields) if i not in pointers]
            self.direct = all(name in free for name in ints)
        #: key -> (C launcher, function, packed metadata, cooperative, pdl, constexpr values)
        self.compiled: dict[Any, tuple] = {}
        self.device = -1
        self._shared_spec: list | None = None
        #: (shared, debug, instrumentation mode, launcher, head, tail) of the last launch
        #: whose pointers were all aligned (:meth:`launch_values`).
        self._hot: tuple | None = None

    def key(self, addresses) -> Any:
        """The alignment of the call's pointers: True when all are 16-byte aligned."""
        aligned = 0
        for a in addresses:
            aligned |= a
        if aligned & 15 == 0:
            return True
        return tuple(a & 15 == 0 for a in addresses)

    def __call__(self, call: tuple, shared: Shared, grid: tuple[int] | None = None) -> None:
        """Launch with ``call`` and ``shared`` (on ``grid``, one dimension, where given: the
        grid is not part of a variant)."""
        if self.direct and self.compiled:
            values = list(call)
            aligned = 0
            null = self._null
            for i in self.pointers:
                v = values[i]
                if v is not None:
                    a = v.data_ptr()
                elif null is not None:
                    a = null
                else:
                    raise TypeError(f"call: field {i} is None and the launch has no placeholder")
                values[i] = a
                aligned |= a
            if self.launch_values(values, shared, aligned, grid):
                return
        self._triton_path(call, shared, grid)

    def launch_values(
        self, values, shared: Shared, aligned: int | None = None, grid: tuple[int] | None = None
    ) -> bool:
        """Launch with ``values``, the call's fields with each tensor given as its address,
        if a compiled kernel for their alignment is kept and nothing asks for Triton's path
        (see the class docs); returns whether it launched. A caller that gets False
        launches through :meth:`__call__` with the tensors. ``aligned``: the bitwise or of
        the pointer fields, if the caller has it (else it is computed here); ``grid``: one
        dimension, where the launch's differs from the variant's."""
        # The usual call (every pointer 16-byte aligned, the shared arguments and Triton's
        # settings of the last such launch, no launch hook) checks only that, then launches.
        hot = self._hot
        rt = knobs.runtime
        enter, exit_ = rt.launch_enter_hook, rt.launch_exit_hook
        if (
            hot is not None
            and aligned is not None
            and not aligned & 15
            and hot[0] is shared
            and rt.debug is hot[1]
            and knobs.compilation.instrumentation_mode is hot[2]
            and not getattr(enter, "calls", True)
            and not getattr(exit_, "calls", True)
            and torch._C._cuda_getDevice() == self.device
        ):
            g0, g1, g2 = self.grid if grid is None else (grid[0], 1, 1)
            hot[3](
                g0,
                g1,
                g2,
                torch._C._cuda_getCurrentRawStream(self.device),
                *hot[4],
                *values,
                *hot[5],
            )
            return True
        if not self.direct:
            return False
        if (enter is not None and getattr(enter, "calls", True)) or (
            exit_ is not None and getattr(exit_, "calls", True)
        ):
            return False  # a launch hook is set (_hooked, inlined)
        if aligned is None:
            aligned = 0
            for i in self.pointers:
                aligned |= values[i]
        # The key's alignment part, as :meth:`key` computes it from the addresses.
        alignment: bool | tuple[bool, ...]
        if aligned & 15 == 0:
            alignment = True
        else:
            alignment = tuple(values[i] & 15 == 0 for i in self.pointers)
        debug, instrumentation = rt.debug, knobs.compilation.instrumentation_mode
        entry = self.compiled.get((alignment, debug, instrumentation))
        if entry is None or torch._C._cuda_getDevice() != self.device:
            return False
        run, function, packed, cooperative, pdl, constexprs = entry
        # What the launcher takes around the call's values: Triton's launch arguments (the
        # stream aside), then the shared arguments and the constexprs, if it takes them.
        head = (function, cooperative, pdl, None, None, packed, None, None, None)
        tail = shared.values + constexprs
        if alignment is True:
            self._hot = (shared, debug, instrumentation, run, head, tail)
        g0, g1, g2 = self.grid if grid is None else (grid[0], 1, 1)
        run(g0, g1, g2, torch._C._cuda_getCurrentRawStream(self.device), *head, *values, *tail)
        return True

    def _triton_path(self, call: tuple, shared: Shared, grid: tuple[int] | None = None) -> None:
        global triton_path_launches
        triton_path_launches += 1
        if any(v is None for v in call):
            call = tuple(self.placeholder if v is None else v for v in call)
        compiled = self.fn[grid or self.grid](*call, *shared.args, **self.meta)
        if self.direct and compiled is not None:
            self._record(call, shared, compiled)

    def _record(self, call: tuple, shared: Shared, compiled) -> None:
        """Keep the kernel Triton just launched, if its binding is what :meth:`key` assumes."""
        from triton.runtime.driver import driver

        device = driver.active.get_current_device()
        binder = self.fn.device_caches[device][4]
        _, specialization, _ = binder(*call, *shared.args, **self.meta)
        n = len(call)
        addresses = [call[i].data_ptr() for i in self.pointers]
        shared_spec = specialization[n:]
        assumed = all(
            (specialization[i][1] == "D") == (a % 16 == 0)
            for i, a in zip(self.pointers, addresses, strict=True)
        )
        if self._shared_spec is None:
            self._shared_spec = shared_spec
        if not assumed or shared_spec != self._shared_spec or self.device not in (-1, device):
            self.direct = False  # Triton specializes otherwise than assumed: never guess
            self.compiled.clear()
            self._hot = None
            return
        if hasattr(compiled, "result"):  # compiled asynchronously
            compiled = compiled.result()
        runner = compiled.run
        scratch = getattr(runner, "global_scratch_size", 1) or getattr(
            runner, "profile_scratch_size", 1
        )
        if scratch or not hasattr(runner, "launch"):
            self.direct = False  # a launcher that allocates scratch: leave it to Triton
            self._hot = None
            return
        num_args = n + len(shared.args)
        lean = runtime_launcher(compiled, num_args)
        if lean is not None:
            run, constexprs = lean.launch, ()
        else:
            bound, _, _ = binder(*call, *shared.args, **self.meta)
            run, constexprs = runner.launch, tuple(bound.values())[num_args:]
        key = (self.key(addresses), knobs.runtime.debug, knobs.compilation.instrumentation_mode)
        self.device = device
        self.compiled[key] = (
            run,
            compiled.function,
            compiled.packed_metadata,
            runner.launch_cooperative_grid,
            runner.launch_pdl,
            constexprs,
        )
        if REPORT_RESOURCES:
            report_resources(self.fn, self.meta, compiled)
