"""A workload: request arrival times with their prompt and output lengths.

Pure data; loading files lives in ``sim.trace_io``, generating workloads in
``sim.workload``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class TraceError(ValueError):
    """A trace is malformed; the message says where."""


@dataclass(frozen=True, kw_only=True, eq=False)
class Trace:
    """Requests sorted by arrival. ``arrival_s`` starts at 0 for a loaded trace.

    ``prompt_tokens`` and ``output_tokens`` are >= 1. ``source`` says where the
    requests came from (a file name, or how they were generated).
    """

    arrival_s: FloatArray
    prompt_tokens: IntArray
    output_tokens: IntArray
    source: str

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        for name in ("prompt_tokens", "output_tokens"):
            length = len(getattr(self, name))
            if length != n:
                raise TraceError(f"{name}: length {length} != arrival_s length {n}")
        if n and not np.all(np.isfinite(self.arrival_s)):
            raise TraceError("arrival_s: contains a non-finite time")
        if n > 1 and np.any(np.diff(self.arrival_s) < 0):
            raise TraceError("arrival_s: not sorted by arrival time")
        if n and (self.prompt_tokens.min() < 1 or self.output_tokens.min() < 1):
            raise TraceError("prompt_tokens/output_tokens: every length must be >= 1")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        """Span from the first to the last arrival (0 for fewer than two requests)."""
        if len(self) < 2:
            return 0.0
        return float(self.arrival_s[-1] - self.arrival_s[0])

    @property
    def mean_rate_rps(self) -> float:
        if self.duration_s <= 0:
            raise TraceError("mean_rate_rps: needs at least two requests spread over time")
        return (len(self) - 1) / self.duration_s

    @property
    def interarrival_scv(self) -> float:
        """Squared coefficient of variation of the inter-arrival gaps (1 for Poisson)."""
        if len(self) < 3:
            raise TraceError("interarrival_scv: needs at least three requests")
        gaps = np.diff(self.arrival_s)
        mean = float(gaps.mean())
        if mean <= 0:
            raise TraceError("interarrival_scv: all requests arrive at the same instant")
        return float(gaps.var() / (mean * mean))
