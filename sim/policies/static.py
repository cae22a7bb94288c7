"""Fixed allocations planned offline from the whole trace: ``static-peak`` and
``static-mean``. They never scale; they are what capacity planning without an
autoscaler buys (peak) or risks (mean).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.policies.base import (
    Allocation,
    ClusterView,
    Scenario,
    interarrival_scv,
    solver_allocation,
    window_lengths,
)
from sim.trace import Trace

PEAK_WINDOW_S = 60.0


@dataclass(frozen=True, kw_only=True)
class StaticPolicy:
    """One allocation for the whole run. ``interval_s`` only paces the (empty) ticks."""

    name: str
    initial: Allocation
    interval_s: float = 3600.0

    @property
    def schedule(self) -> tuple[object, ...]:
        """Every size it asks for: one, from the start (``base.replay`` reuses runs)."""
        return ("constant", self.initial.prefill, self.initial.decode)

    def tick(self, view: ClusterView) -> Allocation | None:
        return None


def busiest_window(trace: Trace, window_s: float = PEAK_WINDOW_S) -> tuple[int, int]:
    """Request indices ``lo:hi`` of the busiest ``window_s`` starting at an arrival."""
    t = trace.arrival_s
    ends = np.searchsorted(t, t + window_s, side="left")
    lo = int(np.argmax(ends - np.arange(len(t))))
    return lo, int(ends[lo])


def static_peak(trace: Trace, scenario: Scenario) -> StaticPolicy:
    """The solver's allocation for the busiest minute: its rate and burstiness (SCV of
    its own gaps), the whole trace's length mix, the scenario's headroom."""
    lo, hi = busiest_window(trace)
    allocation = solver_allocation(
        scenario,
        window_lengths(trace, 0, len(trace)),
        rate_rps=(hi - lo) / PEAK_WINDOW_S,
        ca2=interarrival_scv(trace.arrival_s[lo:hi]),
    )
    return StaticPolicy(name="static-peak", initial=allocation)


def static_mean(trace: Trace, scenario: Scenario) -> StaticPolicy:
    """The solver's allocation for the trace's mean rate and its overall burstiness."""
    allocation = solver_allocation(
        scenario,
        window_lengths(trace, 0, len(trace)),
        rate_rps=trace.mean_rate_rps,
        ca2=interarrival_scv(trace.arrival_s),
    )
    return StaticPolicy(name="static-mean", initial=allocation)
