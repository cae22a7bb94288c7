"""The controller's own Prometheus metrics (DESIGN §4 "Metrics").

Every metric lives in a registry owned by ``ControllerMetrics`` rather than
prometheus-client's global one, so tests and several controllers in one process
never share series.

Each tick overwrites every gauge: a gauge always shows what the latest tick knew.
What a tick could not know (no observed P99, no prediction, a pool missing from a
mapping, ``None``) is written as NaN rather than left at an older value, because a
stale number on a dashboard looks like a live one. The per-pool and per-kind series
exist (as NaN) from the start, so queries never see them appear and vanish.
NaN drops out of PromQL comparisons and shows as a gap in Grafana.

Metrics (``pool`` is ``prefill`` or ``decode``):

- ``sara_controller_desired_replicas{pool}``: the replicas the latest tick asked for.
- ``sara_controller_current_replicas{pool}``: the replicas the actuator reported.
- ``sara_controller_predicted_p99_seconds{pool}``: the model's P99 (TTFT for prefill,
  TPOT for decode) at the desired replicas.
- ``sara_controller_observed_p99_seconds{pool}``: the P99 measured at the router.
- ``sara_controller_arrival_rate_rps{kind}``: ``raw`` (the window's measured rate) and
  ``smoothed`` (the EMA the solver used), in requests per second.
- ``sara_controller_decisions_total{pool,reason}``: ticks, by the reason that decided
  each pool's target.
- ``sara_controller_solve_seconds``: time of one solve (histogram, 100 µs to 100 ms).
- ``sara_controller_model_error_ratio{pool}``: observed / predicted P99.
- ``sara_controller_tick_failing``: 1 while the latest tick failed (its error is on
  ``/readyz`` and ``/v1/status``), 0 after one that succeeded; the alert's input.
- ``sara_controller_tick_failures_total``: ticks that failed (actuator, profile, or
  any other error).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from controller.policy import Decision
from queueing.pools import Pool

POOLS: tuple[str, ...] = tuple(pool.value for pool in Pool)
RATE_KINDS: tuple[str, ...] = ("raw", "smoothed")

# A solve is meant to take well under a millisecond (DESIGN §3.4); the buckets are
# dense (1, 1.5, 2, 3, 5, 7 per decade) from 100 µs to 100 ms so the histogram can
# tell 0.2 ms from 0.3 ms and still catch a pathological 50 ms solve.
SOLVE_SECONDS_BUCKETS: tuple[float, ...] = (
    *(
        round(mantissa * 10.0**exponent, 10)
        for exponent in (-4, -3, -2)
        for mantissa in (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)
    ),
    0.1,
)

# The text format that ``exposition()`` writes; serve it with this Content-Type.
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ControllerMetrics:
    """The controller's metrics, updated once per tick from plain values."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True) if registry is None else registry
        self.desired_replicas = Gauge(
            "sara_controller_desired_replicas",
            "Replicas the latest tick asked for, per pool.",
            ["pool"],
            registry=self.registry,
        )
        self.current_replicas = Gauge(
            "sara_controller_current_replicas",
            "Replicas the actuator reported at the latest tick, per pool.",
            ["pool"],
            registry=self.registry,
        )
        self.predicted_p99_seconds = Gauge(
            "sara_controller_predicted_p99_seconds",
            "Model-predicted P99 at the desired replicas (TTFT for prefill, TPOT for decode).",
            ["pool"],
            registry=self.registry,
        )
        self.observed_p99_seconds = Gauge(
            "sara_controller_observed_p99_seconds",
            "P99 observed at the router over the window (TTFT for prefill, TPOT for decode).",
            ["pool"],
            registry=self.registry,
        )
        self.arrival_rate_rps = Gauge(
            "sara_controller_arrival_rate_rps",
            "Arrival rate in requests per second: raw (measured) or smoothed (EMA).",
            ["kind"],
            registry=self.registry,
        )
        self.decisions = Counter(
            "sara_controller_decisions_total",
            "Ticks, by pool and by the reason that decided the pool's target.",
            ["pool", "reason"],
            registry=self.registry,
        )
        self.solve_seconds = Histogram(
            "sara_controller_solve_seconds",
            "Wall time of one capacity solve in seconds.",
            buckets=SOLVE_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.model_error_ratio = Gauge(
            "sara_controller_model_error_ratio",
            "Observed P99 divided by predicted P99, per pool (1 is a perfect model).",
            ["pool"],
            registry=self.registry,
        )
        self.tick_failing = Gauge(
            "sara_controller_tick_failing",
            "1 while the latest control tick failed, 0 after one that succeeded.",
            registry=self.registry,
        )
        self.tick_failures = Counter(
            "sara_controller_tick_failures",
            "Control ticks that failed (actuator, profile or any other error).",
            registry=self.registry,
        )
        for gauge in self._pool_gauges():
            for pool in POOLS:
                gauge.labels(pool=pool).set(math.nan)
        for kind in RATE_KINDS:
            self.arrival_rate_rps.labels(kind=kind).set(math.nan)

    def _pool_gauges(self) -> tuple[Gauge, ...]:
        return (
            self.desired_replicas,
            self.current_replicas,
            self.predicted_p99_seconds,
            self.observed_p99_seconds,
            self.model_error_ratio,
        )

    def record_tick(
        self,
        *,
        desired: Mapping[str, int],
        current: Mapping[str, int],
        predicted_p99_s: Mapping[str, float | None],
        observed_p99_s: Mapping[str, float | None],
        raw_rate_rps: float | None,
        smoothed_rate_rps: float | None,
        reasons: Mapping[str, str],
        solve_s: float | None,
        model_error: Mapping[str, float | None],
    ) -> None:
        """Publish one tick. Mappings are keyed by pool name (``prefill``, ``decode``).

        A pool absent from a mapping, or mapped to ``None``, reads NaN until a later
        tick knows it; ``solve_s=None`` (no solve ran: the tick held on missing data)
        adds no histogram observation. ``reasons`` counts one decision per pool it
        names. Raises ``ValueError`` naming the argument for an unknown pool, an
        empty reason or a negative or non-finite ``solve_s``.
        """
        per_pool: tuple[tuple[str, Gauge, Mapping[str, float | None] | Mapping[str, int]], ...] = (
            ("desired", self.desired_replicas, desired),
            ("current", self.current_replicas, current),
            ("predicted_p99_s", self.predicted_p99_seconds, predicted_p99_s),
            ("observed_p99_s", self.observed_p99_seconds, observed_p99_s),
            ("model_error", self.model_error_ratio, model_error),
        )
        # Check everything before touching a series, so a bad call publishes nothing.
        for name, _, values in (*per_pool, ("reasons", None, reasons)):
            _check_pools(name, values)
        for pool, reason in reasons.items():
            if not isinstance(reason, str) or not reason:
                raise ValueError(f"reasons.{pool}: must be a non-empty string, got {reason!r}")
        if solve_s is not None and not (math.isfinite(solve_s) and solve_s >= 0):
            raise ValueError(f"solve_s: must be a finite number >= 0, got {solve_s!r}")

        for _, gauge, values in per_pool:
            for pool in POOLS:
                gauge.labels(pool=pool).set(_or_nan(values.get(pool)))
        self.arrival_rate_rps.labels(kind="raw").set(_or_nan(raw_rate_rps))
        self.arrival_rate_rps.labels(kind="smoothed").set(_or_nan(smoothed_rate_rps))
        for pool, reason in reasons.items():
            self.decisions.labels(pool=pool, reason=reason).inc()
        if solve_s is not None:
            self.solve_seconds.observe(solve_s)

    def record_outcome(self, *, failed: bool) -> None:
        """Whether the latest tick failed (the alert follows ``tick_failing``)."""
        self.tick_failing.set(1.0 if failed else 0.0)
        if failed:
            self.tick_failures.inc()

    def record_decision(self, decision: Decision, *, solve_s: float | None) -> None:
        """Publish one tick's decision (``record_tick`` with its per-pool values)."""
        pools = decision.pools
        self.record_tick(
            desired=pools.map(lambda p: p.target).as_dict(),
            current=pools.map(lambda p: p.current).as_dict(),
            predicted_p99_s=pools.map(lambda p: p.predicted_p99_s).as_dict(),
            observed_p99_s=pools.map(lambda p: p.observed_p99_s).as_dict(),
            raw_rate_rps=decision.raw_rate_rps,
            smoothed_rate_rps=decision.smoothed_rate_rps,
            reasons=pools.map(lambda p: p.outcome.value).as_dict(),
            solve_s=solve_s,
            # The decision's error is relative (observed / predicted - 1); the metric
            # is the ratio itself, so 1 reads as a perfect model on the dashboard.
            model_error=pools.map(
                lambda p: None if p.model_error is None else 1.0 + p.model_error
            ).as_dict(),
        )

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (serve with ``CONTENT_TYPE``)."""
        return generate_latest(self.registry)


def _check_pools(name: str, values: Mapping[str, object]) -> None:
    for pool in values:
        if pool not in POOLS:
            raise ValueError(f"{name}: unknown pool {pool!r}, expected one of {list(POOLS)}")


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


__all__ = ["CONTENT_TYPE", "POOLS", "SOLVE_SECONDS_BUCKETS", "ControllerMetrics"]
