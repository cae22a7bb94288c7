"""A time-ordered event heap for the discrete-event simulator.

Events at the same time come out in the order they were pushed (a tie-breaking
sequence number), so a run is deterministic and independent of how the payloads
compare.
"""

from __future__ import annotations

import heapq
import math
from typing import Generic, NamedTuple, TypeVar

K = TypeVar("K")
P = TypeVar("P")


class Event(NamedTuple, Generic[K, P]):
    time_s: float
    kind: K
    payload: P


class EventQueue(Generic[K, P]):
    """Min-heap of ``(time_s, kind, payload)`` events, FIFO among equal times."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K, P]] = []
        self._pushed = 0

    def push(self, time_s: float, kind: K, payload: P) -> None:
        """Schedule an event; ``time_s`` must be a finite number (ValueError otherwise)."""
        if not math.isfinite(time_s):
            raise ValueError(f"time_s: must be finite, got {time_s!r}")
        heapq.heappush(self._heap, (time_s, self._pushed, kind, payload))
        self._pushed += 1

    def pop(self) -> Event[K, P]:
        """The earliest event (first pushed among ties); IndexError when empty."""
        if not self._heap:
            raise IndexError("pop from an empty EventQueue")
        time_s, _, kind, payload = heapq.heappop(self._heap)
        return Event(time_s, kind, payload)

    def peek_time_s(self) -> float | None:
        """Time of the earliest event, or None when empty."""
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)
