"""tritonep: expert-parallel all-to-all (MoE dispatch and combine) in Python and Triton.

The front door::

    import tritonep

    buffer = tritonep.Buffer(group)  # one per expert-parallel group, built by every rank
    recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(x, topk_idx=..., ...)

* :class:`Buffer` -- dispatch and combine in both modes (normal: training and prefill;
  low-latency: decode), with DeepEP's method names and return tuples; :class:`Config`, the SM
  budget and ring use of a normal-mode call; :class:`EventOverlap`, an event to wait on;
* :func:`quantize_fp8`, :func:`dequantize_fp8` -- rows to FP8 e4m3 with a float32 scale per
  128 channels (what a dispatch takes in FP8), and back to BF16;
* :class:`WaitTimeoutError`, :class:`HeapGuardError` -- what a call that failed raises.

Beside it: :mod:`tritonep.deep_ep`, DeepEP's own interface (V1 ``Buffer``, V2
``ElasticBuffer``) for code written for DeepEP, and :mod:`tritonep.integrations`:
Triton-distributed's layer interfaces, vLLM's and SGLang's call shapes, autograd operators and
an MoE layer.

Layers, in the order data flows through them: :mod:`tritonep.heap` (symmetric memory on GPUs,
shared memory for CPU ranks) -> :mod:`tritonep.kernels` (Triton kernels) ->
:mod:`tritonep.modes` (each mode's host-side orchestration) -> :mod:`tritonep.buffer` ->
:mod:`tritonep.deep_ep` and :mod:`tritonep.integrations`. Around them:
:mod:`tritonep.reference` (the pure-PyTorch oracle every kernel is tested against),
:mod:`tritonep.launch` (start N ranks), :mod:`tritonep.bench` (``tritonep bench``),
:mod:`tritonep.torch_backend` (the ``all_to_all_single`` baseline), :mod:`tritonep.soak`,
:mod:`tritonep.costmodel` and :mod:`tritonep.demo`.

``import tritonep`` is cheap: it first decides whether this process's kernels are compiled for
the GPU or run under Triton's interpreter (no usable GPU), which must happen before any kernel
is defined (:mod:`tritonep.interpret`); the names above are imported when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import interpret as _interpret

_interpret.decide()

__version__ = "0.1.0"

#: The public names and the modules that define them, imported on first use: defining the
#: kernels takes seconds, and must follow the decision above.
_EXPORTS = {
    "Buffer": "buffer",
    "Config": "modes.normal",
    "EventOverlap": "buffer",
    "HeapGuardError": "errors",
    "WaitTimeoutError": "errors",
    "dequantize_fp8": "kernels.fp8",
    "quantize_fp8": "kernels.fp8",
}

__all__ = [
    "Buffer",
    "Config",
    "EventOverlap",
    "HeapGuardError",
    "WaitTimeoutError",
    "__version__",
    "dequantize_fp8",
    "quantize_fp8",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tritonep' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:
    from .buffer import Buffer, EventOverlap
    from .errors import HeapGuardError, WaitTimeoutError
    from .kernels.fp8 import dequantize_fp8, quantize_fp8
    from .modes.normal import Config
