"""What the controller measures each tick (pure data; sources live in adapters).

Every measured number is optional: a source that could not measure something (empty
PromQL result, NaN, HTTP error, scrape failure) leaves it ``None`` rather than
inventing a value, and the policy treats missing or stale data as a reason to hold.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from queueing.lengths import LengthSamples
from queueing.pools import Pool


@dataclass(frozen=True, kw_only=True)
class PoolObservation:
    """One pool's replicas as the actuator reports them."""

    current_replicas: int  # what the Deployment / process group is set to
    ready_replicas: int  # how many are serving

    def __post_init__(self) -> None:
        for name in ("current_replicas", "ready_replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an integer >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True, eq=False)
class Observation:
    """Measurements over the window ending at ``time_s`` (seconds, the controller's clock).

    ``arrival_rate_rps`` is over the full window, ``burst_arrival_rate_rps`` over the
    short burst window at its end. ``lengths`` are (prompt, output) samples of the
    window's requests (or reconstructed from histograms); ``ttft_p99_s`` and
    ``tpot_p99_s`` are the P99s observed at the router (or at the engines: see
    docs/engines.md for which pool each field is read from).

    ``arrival_counts`` are the arrivals themselves where the source read the request
    counters' samples: ``(time, arrivals since the first time)`` at the sample times
    over the window, in time order. The forecaster's record takes them over the
    window's rates: a rate spreads its window's arrivals evenly (Prometheus's ``rate``
    also extrapolates to the window's edges), the counts say when they came.
    """

    time_s: float
    prefill: PoolObservation
    decode: PoolObservation
    arrival_rate_rps: float | None = None
    burst_arrival_rate_rps: float | None = None
    interarrival_scv: float | None = None
    lengths: LengthSamples | None = None
    ttft_p99_s: float | None = None
    tpot_p99_s: float | None = None
    prefill_queue_depth: float | None = None
    kv_usage_fraction: float | None = None  # the decode pool's mean KV-cache usage, 0..1
    arrival_counts: tuple[tuple[float, float], ...] | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.time_s, int | float) and math.isfinite(self.time_s)):
            raise ValueError(f"time_s: must be a finite number, got {self.time_s!r}")
        if self.arrival_counts is not None:
            _check_counts(self.arrival_counts)

    def replicas(self, pool: Pool) -> PoolObservation:
        return self.prefill if pool is Pool.PREFILL else self.decode

    def observed_p99_s(self, pool: Pool) -> float | None:
        """The P99 the pool's size sets: TTFT (prefill) or TPOT (decode)."""
        return self.ttft_p99_s if pool is Pool.PREFILL else self.tpot_p99_s


def _check_counts(counts: tuple[tuple[float, float], ...]) -> None:
    if len(counts) < 2 or not all(math.isfinite(t) and math.isfinite(n) for t, n in counts):
        raise ValueError(f"arrival_counts: needs >= 2 finite (time, count) pairs, got {counts!r}")
    for (t0, n0), (t1, n1) in itertools.pairwise(counts):
        if not (t1 > t0 and n1 >= n0):
            raise ValueError(
                f"arrival_counts: times must increase and counts not decrease, got "
                f"({t0}, {n0}) then ({t1}, {n1})"
            )


def usable(value: float | None) -> bool:
    """A measured number the policy may act on: present, finite and not negative."""
    return value is not None and math.isfinite(value) and value >= 0


class ObservationSource(Protocol):
    def observe(self, *, now_s: float, replicas: Mapping[Pool, PoolObservation]) -> Observation:
        """The window ending now; ``replicas`` are what the actuator reported this tick.

        Never raises for a measurement problem: what could not be measured is ``None``.
        """
        ...
