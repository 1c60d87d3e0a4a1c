"""Public APIs on top of the modes.

* :mod:`.buffer` -- :class:`Buffer`, DeepEP-like (layout, low-latency dispatch and combine);
* :mod:`.layers` -- :class:`EPLowLatencyAllToAllLayer`, the seed layer's interface.
"""

from .buffer import Buffer, EventOverlap
from .layers import EPLowLatencyAllToAllLayer

__all__ = ["Buffer", "EPLowLatencyAllToAllLayer", "EventOverlap"]
