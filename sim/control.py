"""The controller in the loop of a simulated cluster: a source, an actuator, a runner.

``SimulatedSource`` measures a ``Cluster`` the way the Prometheus source measures a
real deployment (windowed arrival rate, a short burst window, P99 TTFT/TPOT of the
window's requests, the length mix of the window's completions);
``SimulatedActuator`` scales its pools through the cluster's scaling hook (new
workers serve only after the startup delay; removed ones drain);
``SimulatedArrivals`` answers the forecaster from every arrival. ``run_controlled``
runs the production ``controller.tick.run_tick`` between them — the same tick the
real control loop runs, not a copy.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from controller.config import ControllerConfig
from controller.counters import interarrival_scv
from controller.histograms import TPOT_BUCKETS_S, TTFT_BUCKETS_S, bucketed, histogram_quantile
from controller.observation import Observation, PoolObservation
from controller.policy import CapacityModels, ControllerState, Decision
from controller.tick import run_tick
from queueing.lengths import LengthSamples
from queueing.pools import Pool
from queueing.profile import IterationProfile
from sim.cluster import Cluster, ClusterSnapshot
from sim.trace import FloatArray

MIN_LATENCY_SAMPLES = 20


class Snapshots(Protocol):
    """What the simulated source, actuator and history read: a ``Cluster`` or the
    read-only ``ClusterView`` a back-test policy gets."""

    @property
    def now_s(self) -> float: ...

    def snapshot(self, *, window_s: float) -> ClusterSnapshot: ...


class SimulatedArrivals:
    """The ``ArrivalHistory`` of a simulation: it knows every arrival since time 0."""

    def __init__(self, cluster: Snapshots) -> None:
        self.cluster = cluster

    @property
    def since_s(self) -> float:
        return 0.0

    @property
    def until_s(self) -> float:
        return self.cluster.now_s

    def note(self, observation: Observation, *, window_s: float, burst_window_s: float) -> None:
        """Nothing to record: the simulation keeps every arrival."""

    def _arrivals(self, start_s: float) -> FloatArray:
        # A little more than asked: the caller's bins select exactly what they hold.
        span_s = max(self.cluster.now_s - start_s, 0.0) + 1e-6
        return self.cluster.snapshot(window_s=span_s).window_arrival_s

    def counts_in_bins(self, edges_s: FloatArray) -> FloatArray:
        arrivals = self._arrivals(float(edges_s[0]))
        counts: FloatArray = np.histogram(arrivals, bins=edges_s)[0].astype(np.float64)
        return counts

    def count_between(self, start_s: float, end_s: float) -> float:
        lo, hi = np.searchsorted(self._arrivals(start_s), [start_s, end_s])
        return float(hi - lo)


class SimulatedActuator:
    """Scales a simulated cluster's pools; reports desired and serving workers."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def observe(self, pool: Pool) -> PoolObservation:
        return replicas_of(self.cluster.snapshot(window_s=1.0))[pool]

    def scale(self, pool: Pool, replicas: int) -> None:
        self.cluster.set_pool_size(pool, replicas, self.cluster.now_s)


class SimulatedSource:
    """Windowed measurements of a simulated cluster, as an ``Observation``.

    The ca² is read as the production sources read it: from a request counter sampled
    every ``scv_step_s`` over the last ``scv_span_s`` (``interarrival_scv``)."""

    def __init__(
        self,
        cluster: Snapshots,
        *,
        window_s: float,
        burst_window_s: float,
        scv_step_s: float = 5.0,
        scv_span_s: float = 300.0,
    ) -> None:
        self.cluster = cluster
        self.window_s = window_s
        self.burst_window_s = burst_window_s
        self.scv_step_s = scv_step_s
        self.scv_span_s = max(scv_span_s, window_s)

    def observe(self, *, now_s: float, replicas: Mapping[Pool, PoolObservation]) -> Observation:
        snap = self.cluster.snapshot(window_s=self.window_s)
        burst = self.cluster.snapshot(window_s=self.burst_window_s)
        return observation_from(
            snap, burst, now_s=now_s, replicas=replicas, interarrival_scv=self._scv(now_s)
        )

    def _scv(self, now_s: float) -> float | None:
        span_s = min(self.scv_span_s, now_s)
        arrivals = self.cluster.snapshot(window_s=span_s + 1e-6).window_arrival_s
        return counted_scv(
            arrivals, end_s=now_s, span_s=span_s, step_s=self.scv_step_s, window_s=self.window_s
        )


def counted_scv(
    arrival_s: np.ndarray, *, end_s: float, span_s: float, step_s: float, window_s: float
) -> float | None:
    """The ca² a production source reads from a request counter sampled every
    ``step_s`` over ``span_s`` back from ``end_s`` (``interarrival_scv``), for sorted
    arrival times."""
    times = end_s - step_s * np.arange(int(span_s // step_s), -1, -1)
    counter = np.searchsorted(arrival_s, times, side="right").astype(np.float64)
    samples = list(zip(times.tolist(), counter.tolist(), strict=True))
    return interarrival_scv([samples], step_s=step_s, window_s=window_s)


def replicas_of(snap: ClusterSnapshot) -> dict[Pool, PoolObservation]:
    """Each pool's replicas as an actuator reports them: desired (starting or serving)
    and ready (serving); draining workers are on their way out and count as neither."""
    return {
        pool: PoolObservation(current_replicas=p.starting + p.serving, ready_replicas=p.serving)
        for pool, p in ((Pool.PREFILL, snap.prefill), (Pool.DECODE, snap.decode))
    }


def observation_from(
    snap: ClusterSnapshot,
    burst: ClusterSnapshot,
    *,
    now_s: float,
    replicas: Mapping[Pool, PoolObservation],
    interarrival_scv: float | None,
) -> Observation:
    """The ``Observation`` of a measurement window ``snap`` and its short burst window,
    with the ca² the source read (over a longer span: ``counted_scv``)."""
    return Observation(
        time_s=now_s,
        prefill=replicas[Pool.PREFILL],
        decode=replicas[Pool.DECODE],
        arrival_rate_rps=snap.window_arrival_rate_rps,
        burst_arrival_rate_rps=burst.window_arrival_rate_rps,
        interarrival_scv=interarrival_scv,
        lengths=_lengths(snap),
        ttft_p99_s=_p99(snap.window_ttft_s, TTFT_BUCKETS_S),
        tpot_p99_s=_p99(snap.window_tpot_s, TPOT_BUCKETS_S),
        prefill_queue_depth=float(snap.prefill.queue_length),
    )


def _p99(values: np.ndarray, bounds: tuple[float, ...]) -> float | None:
    """The window's P99 as the controller reads it from the router's histogram: linear
    inside the bucket that holds the rank. On a latency tail the mass sits low in
    each bucket, so this reads a few percent above the exact order statistic (about
    5 % on the demo's windows, up to 13 %); a controller calibrated on the exact P99
    would learn a smaller correction than the deployed one and size differently."""
    finite = values[np.isfinite(values)]
    if len(finite) < MIN_LATENCY_SAMPLES:
        return None
    return histogram_quantile(0.99, bucketed(finite, bounds))


def _lengths(snap: ClusterSnapshot) -> LengthSamples | None:
    """The pairs of the window's completed requests, however few: as a histogram window
    gives one pair per request, and the controller pools windows until the mix holds
    enough requests (``controller.policy.leadtime.MIN_POOLED_REQUESTS``)."""
    if len(snap.window_output_tokens) == 0:
        return None
    return LengthSamples(
        prompt_tokens=snap.window_completed_prompt_tokens.astype(np.int64),
        output_tokens=snap.window_output_tokens.astype(np.int64),
        source=f"window ending at {snap.time_s:.0f} s",
    )


@dataclass(frozen=True, kw_only=True)
class ControlledRun:
    decisions: tuple[Decision, ...]
    final_state: ControllerState


def run_controlled(
    cluster: Cluster,
    config: ControllerConfig,
    *,
    profile: IterationProfile,
    until_s: float,
    state: ControllerState | None = None,
) -> ControlledRun:
    """Run the production tick (``controller.tick.run_tick``) every
    ``config.interval_s`` of simulated time until ``until_s``."""
    source = SimulatedSource(
        cluster,
        window_s=config.window_s,
        burst_window_s=config.burst_window_s,
        scv_span_s=config.lead_time.pool_s,
    )
    actuator = SimulatedActuator(cluster)
    history = SimulatedArrivals(cluster)
    models = CapacityModels()
    state = state or ControllerState()
    decisions: list[Decision] = []
    t = config.interval_s
    while t <= until_s:
        cluster.run_until(t)
        done = run_tick(
            now_s=t,
            config=config,
            config_version="simulated",
            state=state,
            source=source,
            actuator=actuator,
            load_profile=lambda _spec: profile,
            models=models,
            history=history,
            timer=time.perf_counter,
        )
        assert done.record.decision is not None  # the simulated actuator never fails
        decisions.append(done.record.decision)
        state = done.state
        t += config.interval_s
    return ControlledRun(decisions=tuple(decisions), final_state=state)
