"""Public APIs on top of the modes.

* :mod:`.buffer` -- :class:`Buffer`, DeepEP-like (layout, low-latency dispatch and combine);
* :mod:`.layers` -- :class:`EPAll2AllLayer` and :class:`EPLowLatencyAllToAllLayer`, the seed
  layers' interfaces;
* :mod:`.autograd` -- normal-mode dispatch and combine as differentiable functions;
* :func:`quantize_fp8` -- tokens to FP8 e4m3 with per-128-channel scales in one launch, the
  normal mode's FP8 input (bit-exact with :func:`tritonep.reference.quantize_fp8`), and
  :func:`dequantize_fp8`, received FP8 rows back to BF16 in one launch.
"""

from ..kernels.fp8 import dequantize_fp8, quantize_fp8
from . import autograd
from .buffer import Buffer, EventOverlap
from .layers import EPAll2AllLayer, EPLayoutDesc, EPLowLatencyAllToAllLayer

__all__ = [
    "Buffer",
    "EPAll2AllLayer",
    "EPLayoutDesc",
    "EPLowLatencyAllToAllLayer",
    "EventOverlap",
    "autograd",
    "dequantize_fp8",
    "quantize_fp8",
]
