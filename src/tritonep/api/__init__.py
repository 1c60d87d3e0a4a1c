"""Public APIs on top of the modes.

* :mod:`.buffer` -- :class:`Buffer`, DeepEP-like (``low_latency_dispatch``, ``..._combine``);
* :mod:`.layers` -- :class:`EPLowLatencyAllToAllLayer`, the seed layer's interface.
"""

from .buffer import Buffer, EventOverlap
from .layers import EPLowLatencyAllToAllLayer

__all__ = ["Buffer", "EPLowLatencyAllToAllLayer", "EventOverlap"]
