"""DeepEP's ``deep_ep.utils`` event names: :class:`EventOverlap` and :class:`EventHandle`."""

from __future__ import annotations

import torch

from ..buffer import EventOverlap

__all__ = ["EventHandle", "EventOverlap"]


class EventHandle:
    """A CUDA event recorded on the current stream when created (DeepEP's ``EventHandle``).

    Attributes:
        event: the ``torch.cuda.Event``, or None on a machine without CUDA.
    """

    def __init__(self):
        self.event = None
        if torch.cuda.is_available():
            self.event = torch.cuda.Event()
            self.event.record()

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
