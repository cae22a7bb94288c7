"""What every back-testing policy shares: the scenario, the allocation it returns,
the read-only view of the cluster it decides on, and the protocol itself.

A policy is asked for its starting allocation once, then ticked every
``interval_s`` seconds of simulated time with a ``ClusterView``: what a controller
could measure at that instant (windowed snapshots of the cluster, as
``sim.control.SimulatedSource`` turns them into observations). It returns the pool
sizes it wants, or None to leave them. The runner (``sim.backtest``) applies them
through the cluster's scaling hook, so every policy pays the same startup delay and
drains the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from controller.config import ControllerConfig, PoolLimits, SloConfig
from queueing.budget import token_budget
from queueing.lengths import LengthSamples
from queueing.pools import Pool
from queueing.profile import IterationProfile
from queueing.solver import CapacityModel, InfeasibleSLOError, KvLink, SloTargets, solve
from sim.cluster import Cluster, ClusterConfig, ClusterSnapshot
from sim.control import counted_scv
from sim.results import SimResults
from sim.trace import FloatArray, Trace

# A controller that has seen fewer requests than this falls back to the whole
# trace's length mix when it needs one (the statistics of a handful are noise).
MIN_WINDOW_REQUESTS = 50


@dataclass(frozen=True, kw_only=True)
class Allocation:
    """Worker counts of both pools (each >= 1)."""

    prefill: int
    decode: int

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")

    def of(self, pool: Pool) -> int:
        return self.prefill if pool is Pool.PREFILL else self.decode


@dataclass(frozen=True, kw_only=True, eq=False)
class Scenario:
    """The cluster and SLOs every policy of one comparison is judged on.

    ``startup_s`` (seconds from a scale-up to serving) defaults to the profile's.
    ``headroom`` is what the solver-based policies plan with (SLO / (1 + headroom));
    ``max_replicas`` caps every pool of every policy. ``controller`` is the
    ``sara`` policy's configuration; by default the production defaults with this
    scenario's SLOs, profile, link and replica cap.
    """

    profile: IterationProfile
    slo: SloTargets
    link: KvLink = field(default_factory=KvLink)
    startup_s: float | None = None
    headroom: float = 0.15
    max_replicas: int = 64
    controller: ControllerConfig | None = None

    def __post_init__(self) -> None:
        if self.startup_s is not None and not (
            math.isfinite(self.startup_s) and self.startup_s >= 0
        ):
            raise ValueError(f"startup_s: must be a finite number >= 0, got {self.startup_s!r}")
        if not (math.isfinite(self.headroom) and 0 <= self.headroom < 10):
            raise ValueError(f"headroom: must be in [0, 10), got {self.headroom!r}")
        if isinstance(self.max_replicas, bool) or self.max_replicas < 1:
            raise ValueError(f"max_replicas: must be an integer >= 1, got {self.max_replicas!r}")

    @property
    def worker_startup_s(self) -> float:
        return self.profile.startup_s if self.startup_s is None else self.startup_s

    @property
    def token_budget(self) -> int:
        """The Sarathi budget (and maximum decode batch) that fits the TPOT SLO."""
        return token_budget(self.profile, tpot_slo_s=self.slo.tpot_p99_s)

    @property
    def controller_config(self) -> ControllerConfig:
        if self.controller is not None:
            return self.controller
        limits = PoolLimits(min_replicas=1, max_replicas=self.max_replicas)
        return ControllerConfig(
            profile=self.profile.name,
            slo=SloConfig(ttft_p99_s=self.slo.ttft_p99_s, tpot_p99_s=self.slo.tpot_p99_s),
            headroom=self.headroom,
            kv_link_gbps=self.link.bytes_per_s * 8.0 / 1e9,
            prefill=limits,
            decode=limits,
        )

    def cluster_config(self, allocation: Allocation) -> ClusterConfig:
        return ClusterConfig(
            prefill_workers=allocation.prefill,
            decode_workers=allocation.decode,
            profile=self.profile,
            token_budget=self.token_budget,
            kv_link_bytes_per_s=self.link.bytes_per_s,
            kv_link_latency_s=self.link.latency_s,
            startup_s=self.worker_startup_s,
        )

    def capacity_model(self, lengths: LengthSamples) -> CapacityModel:
        return CapacityModel.build(
            lengths, self.profile, tpot_slo_s=self.slo.tpot_p99_s, link=self.link
        )

    def clamp(self, workers: int) -> int:
        return min(max(1, workers), self.max_replicas)


class ClusterView:
    """Read-only access to a running simulation: the clock and windowed snapshots."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster

    @property
    def now_s(self) -> float:
        return self._cluster.now_s

    def snapshot(self, *, window_s: float = 30.0) -> ClusterSnapshot:
        """The pools now and the requests of the last ``window_s`` seconds."""
        return self._cluster.snapshot(window_s=window_s)


class BacktestPolicy(Protocol):
    """A scaling policy under test. ``interval_s``: seconds between ticks (> 0)."""

    @property
    def name(self) -> str: ...

    @property
    def interval_s(self) -> float: ...

    @property
    def initial(self) -> Allocation:
        """The pool sizes at time 0 (serving from the start)."""
        ...

    def tick(self, view: ClusterView) -> Allocation | None:
        """The wanted pool sizes now, or None to leave both as they are."""
        ...


# -- solver helpers shared by the policies that plan from known load -----------------


def interarrival_scv(arrival_s: FloatArray) -> float:
    """SCV of the gaps of sorted arrival times; 1 (Poisson) with too few to measure."""
    if len(arrival_s) < 10:
        return 1.0
    gaps = np.diff(arrival_s)
    mean = float(gaps.mean())
    return float(gaps.var() / (mean * mean)) if mean > 0 else 1.0


def window_lengths(trace: Trace, lo: int, hi: int) -> LengthSamples:
    """The lengths of requests ``lo:hi``, or of the whole trace when they are too few."""
    if hi - lo < MIN_WINDOW_REQUESTS:
        lo, hi = 0, len(trace)
    return LengthSamples(
        prompt_tokens=trace.prompt_tokens[lo:hi].astype(np.int64),
        output_tokens=trace.output_tokens[lo:hi].astype(np.int64),
        source=f"{trace.source} requests {lo}..{hi}",
    )


def solver_allocation(
    scenario: Scenario,
    lengths: LengthSamples,
    *,
    rate_rps: float,
    ca2: float,
    headroom: float | None = None,
) -> Allocation:
    """The solver's answer for a load, capped at ``scenario.max_replicas``.

    No traffic needs one worker per pool. When the SLOs cannot be met at all (the
    longest prompts alone are too slow), the pools are sized for 1.2 times the
    blocking floor instead, as the controller itself does.
    """
    if rate_rps <= 0:
        return Allocation(prefill=1, decode=1)
    model = scenario.capacity_model(lengths)
    room = scenario.headroom if headroom is None else headroom
    try:
        result = solve(model, arrival_rate_rps=rate_rps, ca2=ca2, slo=scenario.slo, headroom=room)
    except InfeasibleSLOError:
        relaxed = SloTargets(
            ttft_p99_s=max(scenario.slo.ttft_p99_s, model.prefill.floor_quantile_s(0.99) * 1.2),
            tpot_p99_s=max(scenario.slo.tpot_p99_s, model.decode.floor_quantile_s(0.99) * 1.2),
        )
        try:
            result = solve(model, arrival_rate_rps=rate_rps, ca2=ca2, slo=relaxed, headroom=room)
        except InfeasibleSLOError:
            return Allocation(prefill=scenario.max_replicas, decode=scenario.max_replicas)
    return Allocation(
        prefill=scenario.clamp(result.prefill_workers),
        decode=scenario.clamp(result.decode_workers),
    )


def window_allocation(
    trace: Trace, scenario: Scenario, *, start_s: float, end_s: float, headroom: float | None = None
) -> Allocation:
    """The solver's allocation for the requests arriving in [start_s, end_s)."""
    lo, hi = (int(i) for i in np.searchsorted(trace.arrival_s, [start_s, end_s], side="left"))
    rate = (hi - lo) / (end_s - start_s)
    return solver_allocation(
        scenario,
        window_lengths(trace, lo, hi),
        rate_rps=rate,
        ca2=interarrival_scv(trace.arrival_s[lo:hi]),
        headroom=headroom,
    )


WARM_START_WINDOW_S = 300.0
# The measurement window the warm start's ca² is measured over, as a controller does.
WARM_START_MEASUREMENT_S = 30.0
WARM_START_STEP_S = 5.0  # the production sources' sub-window of the ca² estimate


def warm_start(trace: Trace, scenario: Scenario) -> Allocation:
    """Where the autoscaling policies start: the solver's allocation for the first
    five minutes of load, as if the cluster had been sized for the traffic just
    before the trace began. The same for every reactive policy, so none of them
    wins or loses by its starting point.

    The load is measured as the simulated controller measures it: the mean rate,
    and the ca² its source reads at the end of the five minutes, from 5-s counts
    about each 30-s window's level (``sim.control.counted_scv``). The gap SCV of five
    minutes at once would count the rate's changes over minutes as burstiness: on
    the code trace it is 192, and the solver's answer at it is 22 prefill workers
    where the oracle's first window needs 5.
    """
    end_s = min(WARM_START_WINDOW_S, max(trace.duration_s, 1.0))
    lo, hi = (int(i) for i in np.searchsorted(trace.arrival_s, [0.0, end_s], side="left"))
    measured = counted_scv(
        trace.arrival_s[lo:hi],
        end_s=end_s,
        span_s=end_s,
        step_s=WARM_START_STEP_S,
        window_s=WARM_START_MEASUREMENT_S,
    )
    return solver_allocation(
        scenario,
        window_lengths(trace, lo, hi),
        rate_rps=(hi - lo) / end_s,
        ca2=1.0 if measured is None else measured,
    )


# -- the run itself: one loop for every back-test and for the oracle's confirmation ---


@dataclass(frozen=True, kw_only=True, eq=False)
class Replay:
    """A finished run under a policy: the results, the provisioned sizes from time 0
    (one entry per change), the scale events per pool and the span it was ticked."""

    results: SimResults
    timeline: tuple[tuple[float, int, int], ...]
    scale_events: dict[str, int]
    end_s: float


# Replays of fixed schedules, most recent last: (trace, scenario, schedule, replay).
# The oracle replays static-peak and its own plan while it plans, and a comparison
# replays both again; the simulation is deterministic, so the same schedule on the
# same trace and scenario objects gives the same run.
_FIXED_REPLAYS: list[tuple[Trace, Scenario, tuple[object, ...], Replay]] = []
_FIXED_REPLAYS_KEPT = 8


def replay(
    trace: Trace,
    policy: BacktestPolicy,
    scenario: Scenario,
    *,
    progress: Callable[[float], None] | None = None,
) -> Replay:
    """Start the cluster at the policy's initial allocation, tick it every
    ``interval_s`` of simulated time up to the last arrival, apply the sizes it asks
    for through the cluster's scaling hook (clamped to the scenario's limits), then
    let every request finish. ``progress`` gets the fraction of simulated time done.
    Raises ``ValueError`` for an empty trace or a non-positive tick interval.

    A policy whose sizes are fixed in advance says so with a ``schedule`` attribute
    (a hashable description of every size it will ask for, and when); its replay
    on the same trace and scenario is then simulated once and reused."""
    if len(trace) == 0:
        raise ValueError("trace: has no requests")
    if not (math.isfinite(policy.interval_s) and policy.interval_s > 0):
        raise ValueError(f"interval_s: policy {policy.name} ticks every {policy.interval_s!r} s")
    schedule = getattr(policy, "schedule", None)
    if schedule is not None:
        for seen_trace, seen_scenario, seen_schedule, done in _FIXED_REPLAYS:
            if seen_trace is trace and seen_scenario is scenario and seen_schedule == schedule:
                if progress is not None:
                    progress(1.0)
                return done
    run = _replay(trace, policy, scenario, progress=progress)
    if schedule is not None:
        _FIXED_REPLAYS.append((trace, scenario, schedule, run))
        del _FIXED_REPLAYS[:-_FIXED_REPLAYS_KEPT]
    return run


def _replay(
    trace: Trace,
    policy: BacktestPolicy,
    scenario: Scenario,
    *,
    progress: Callable[[float], None] | None,
) -> Replay:
    initial = policy.initial
    cluster = Cluster(scenario.cluster_config(initial), trace)
    view = ClusterView(cluster)
    end_s = float(trace.arrival_s[-1])
    sizes = {Pool.PREFILL: initial.prefill, Pool.DECODE: initial.decode}
    timeline = [(0.0, initial.prefill, initial.decode)]
    events = {pool.value: 0 for pool in (Pool.PREFILL, Pool.DECODE)}
    k = 1
    while (now_s := k * policy.interval_s) <= end_s:
        cluster.run_until(now_s)
        wanted = policy.tick(view)
        if wanted is not None:
            changed = False
            for pool in (Pool.PREFILL, Pool.DECODE):
                target = scenario.clamp(wanted.of(pool))
                if target != sizes[pool]:
                    cluster.set_pool_size(pool, target, now_s)
                    sizes[pool] = target
                    events[pool.value] += 1
                    changed = True
            if changed:
                timeline.append((now_s, sizes[Pool.PREFILL], sizes[Pool.DECODE]))
        if progress is not None:
            progress(now_s / end_s if end_s > 0 else 1.0)
        k += 1
    results = cluster.finish()
    if progress is not None:
        progress(1.0)
    return Replay(results=results, timeline=tuple(timeline), scale_events=events, end_s=end_s)


def slo_met(results: SimResults, slo: SloTargets) -> NDArray[np.bool_]:
    """Per request: finished, with its TTFT and (for more than one output token) its
    TPOT within the SLOs — what ``SimSummary.slo_attainment`` counts."""
    ttft, tpot = results.ttft_s, results.tpot_s
    met: NDArray[np.bool_] = (
        np.isfinite(results.finish_s)
        & np.isfinite(ttft)
        & (ttft <= slo.ttft_p99_s)
        & ((results.output_tokens == 1) | (np.isfinite(tpot) & (tpot <= slo.tpot_p99_s)))
    )
    return met
