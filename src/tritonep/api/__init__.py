"""Public APIs on top of the modes.

* :mod:`.buffer` -- :class:`Buffer`, DeepEP-like (layout, low-latency dispatch and combine);
* :mod:`.layers` -- :class:`EPAll2AllLayer` and :class:`EPLowLatencyAllToAllLayer`, the seed
  layers' interfaces;
* :mod:`.autograd` -- normal-mode dispatch and combine as differentiable functions.
"""

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
]
