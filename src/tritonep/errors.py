"""Exceptions raised by tritonep, with the facts a user needs to find the culprit."""

from __future__ import annotations


class WaitTimeoutError(TimeoutError):
    """A bounded wait inside a kernel gave up.

    Attributes:
        rank: the rank that waited.
        peer: the rank it waited for (``-1`` when unknown).
        phase: what it waited for (e.g. ``"signal"``, ``"notify"``, ``"channel 3 tail"``).
        timeout_s: the limit that passed.
    """

    def __init__(self, rank: int, peer: int, phase: str, timeout_s: float):
        self.rank, self.peer, self.phase, self.timeout_s = rank, peer, phase, timeout_s
        if peer >= 0:
            waited = (
                f"waiting for peer {peer}; that peer is stuck, crashed, or called with "
                "different arguments"
            )
        else:  # e.g. a relay between two launches on this GPU: its writer names the peer
            waited = "waiting for no single peer (the phase says for what)"
        super().__init__(f"rank {rank} timed out after {timeout_s:g} s in phase '{phase}' {waited}")


class HeapGuardError(RuntimeError):
    """Bytes past the end of a symmetric heap's regions were written: a kernel of this rank or
    of a peer wrote out of bounds (``SymmetricHeap.check_guard``).

    Attributes:
        rank: the rank whose heap guard was written.
        first: the first written byte, counted from the guard's start.
        count: the written bytes.
    """

    def __init__(self, rank: int, first: int, count: int):
        self.rank, self.first, self.count = rank, first, count
        super().__init__(
            f"rank {rank}: {count} bytes past the end of its symmetric heap's regions were "
            f"written (the first at byte {first} past the end): a kernel of this rank or of a "
            "peer wrote out of bounds; results of this heap's calls are not to be trusted"
        )
