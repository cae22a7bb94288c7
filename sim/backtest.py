"""Back-testing: replay a trace on the simulated cluster under a scaling policy.

``run_backtest`` starts the cluster at the policy's initial allocation, ticks the
policy every ``interval_s`` of simulated time up to the last arrival, applies the
pool sizes it asks for through the cluster's scaling hook (new workers serve only
after the startup delay; removed ones drain), then lets every request finish.
``compare`` does that for several policies on the same trace and scenario.

Results (``BacktestResult``) carry the run's summary against the SLOs, GPU-hours
(the simulator's exact count: every worker from its start to its retirement, times
tensor parallelism), scale events per pool, and a per-window series (load,
replicas, P99s, SLO attainment, cumulative GPU-hours) for reports. Every request
is accounted for: ``lost_requests`` is the admitted ones that never finished,
``rejected_requests`` those refused at arrival for exceeding the model's context.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sim.policies import Allocation, BacktestPolicy, Scenario, make_policy
from sim.policies.base import replay
from sim.results import SimResults, SimSummary
from sim.trace import FloatArray, Trace

DEFAULT_SERIES_WINDOW_S = 60.0

Progress = Callable[[float], None]


@dataclass(frozen=True, kw_only=True, eq=False)
class WindowSeries:
    """Per-window figures of one run, windows of ``window_s`` from time 0.

    ``arrival_rate_rps`` and the P99s are over the requests *arriving* in the
    window (NaN when none arrived, or none has a TPOT); the replicas are
    time-averaged provisioned workers (starting or serving); the cumulative
    GPU-hours count provisioned workers too (draining tails are in the run's total,
    not here).
    """

    window_s: float
    start_s: FloatArray
    arrival_rate_rps: FloatArray
    prefill_replicas: FloatArray
    decode_replicas: FloatArray
    ttft_p99_s: FloatArray
    tpot_p99_s: FloatArray
    slo_attainment: FloatArray
    gpu_hours_cumulative: FloatArray

    def as_dict(self) -> dict[str, Any]:
        def clean(values: FloatArray) -> list[float | None]:
            return [float(v) if math.isfinite(v) else None for v in values]

        return {
            "window_s": self.window_s,
            "start_s": clean(self.start_s),
            "arrival_rate_rps": clean(self.arrival_rate_rps),
            "prefill_replicas": clean(self.prefill_replicas),
            "decode_replicas": clean(self.decode_replicas),
            "ttft_p99_s": clean(self.ttft_p99_s),
            "tpot_p99_s": clean(self.tpot_p99_s),
            "slo_attainment": clean(self.slo_attainment),
            "gpu_hours_cumulative": clean(self.gpu_hours_cumulative),
        }


@dataclass(frozen=True, kw_only=True, eq=False)
class BacktestResult:
    """One policy's run. ``timeline`` lists (time_s, prefill, decode) provisioned
    sizes from time 0, one entry per change; ``duration_s`` is the span the policy
    was in charge of (time 0 to the last arrival), which scale events per hour use."""

    policy: str
    summary: SimSummary
    scale_events: Mapping[str, int]
    duration_s: float
    initial: Allocation
    timeline: tuple[tuple[float, int, int], ...]
    series: WindowSeries
    wall_s: float

    @property
    def scale_events_per_hour(self) -> dict[str, float]:
        hours = self.duration_s / 3600.0
        return {
            pool: (count / hours if hours > 0 else 0.0) for pool, count in self.scale_events.items()
        }

    def as_dict(self, *, series: bool = True) -> dict[str, Any]:
        s = self.summary
        out: dict[str, Any] = {
            "requests": s.requests,
            "completed": s.completed,
            "lost_requests": s.lost_requests,
            "rejected_requests": s.rejected_requests,
            "slo_attainment": s.slo_attainment,
            "ttft_p99_s": s.ttft_p99_s,
            "tpot_p99_s": s.tpot_p99_s,
            "ttft_p50_s": s.ttft_p50_s,
            "tpot_p50_s": s.tpot_p50_s,
            "gpu_hours": s.gpu_hours,
            "scale_events": dict(self.scale_events),
            "scale_events_per_hour": self.scale_events_per_hour,
            "initial": {"prefill": self.initial.prefill, "decode": self.initial.decode},
            "duration_s": self.duration_s,
            "wall_s": self.wall_s,
        }
        if series:
            out["series"] = self.series.as_dict()
        return out


def run_backtest(
    trace: Trace,
    policy: BacktestPolicy,
    scenario: Scenario,
    *,
    series_window_s: float = DEFAULT_SERIES_WINDOW_S,
    progress: Progress | None = None,
) -> BacktestResult:
    """Replay ``trace`` under ``policy``; ``progress`` gets the fraction of simulated
    time done (0..1) after every tick. Raises ``ValueError`` for an empty trace, a
    non-positive tick interval or series window."""
    if not (math.isfinite(series_window_s) and series_window_s > 0):
        raise ValueError(f"series_window_s: must be a finite number > 0, got {series_window_s!r}")
    started = time.perf_counter()
    run = replay(trace, policy, scenario, progress=progress)
    results, end_s = run.results, run.end_s
    timeline = list(run.timeline)
    summary = results.summary(
        ttft_slo_s=scenario.slo.ttft_p99_s, tpot_slo_s=scenario.slo.tpot_p99_s
    )
    series = window_series(
        results,
        timeline,
        window_s=series_window_s,
        end_s=end_s,
        gpus_per_worker=scenario.profile.tensor_parallel,
        ttft_slo_s=scenario.slo.ttft_p99_s,
        tpot_slo_s=scenario.slo.tpot_p99_s,
    )
    return BacktestResult(
        policy=policy.name,
        summary=summary,
        scale_events=run.scale_events,
        duration_s=end_s,
        initial=policy.initial,
        timeline=tuple(timeline),
        series=series,
        wall_s=time.perf_counter() - started,
    )


def _time_average(times: FloatArray, values: FloatArray, edges: FloatArray) -> FloatArray:
    """The mean over each [edges[i], edges[i+1]) of a step function that takes
    ``values[j]`` from ``times[j]`` (times sorted, times[0] <= edges[0])."""
    knots = np.union1d(times, edges)
    level = values[np.searchsorted(times, knots, side="right") - 1]
    area = np.concatenate([[0.0], np.cumsum(level[:-1] * np.diff(knots))])
    at_edges = np.interp(edges, knots, area)
    averaged: FloatArray = np.diff(at_edges) / np.diff(edges)
    return averaged


def window_series(
    results: SimResults,
    timeline: list[tuple[float, int, int]],
    *,
    window_s: float,
    end_s: float,
    gpus_per_worker: int,
    ttft_slo_s: float,
    tpot_slo_s: float,
) -> WindowSeries:
    """Cut a finished run into windows of ``window_s`` covering [0, end_s]."""
    count = max(1, math.ceil(end_s / window_s) if end_s > 0 else 1)
    edges = window_s * np.arange(count + 1, dtype=np.float64)
    times = np.array([t for t, _, _ in timeline], dtype=np.float64)
    prefill = _time_average(times, np.array([p for _, p, _ in timeline], np.float64), edges)
    decode = _time_average(times, np.array([d for _, _, d in timeline], np.float64), edges)
    gpu_h = np.cumsum((prefill + decode) * window_s * gpus_per_worker) / 3600.0

    which = np.searchsorted(edges, results.arrival_s, side="right") - 1
    which = np.clip(which, 0, count - 1)
    ttft, tpot = results.ttft_s, results.tpot_s
    met = (
        np.isfinite(results.finish_s)
        & np.isfinite(ttft)
        & (ttft <= ttft_slo_s)
        & ((results.output_tokens == 1) | (np.isfinite(tpot) & (tpot <= tpot_slo_s)))
    )
    ttft_p99 = np.full(count, np.nan)
    tpot_p99 = np.full(count, np.nan)
    attainment = np.full(count, np.nan)
    arrivals = np.bincount(which, minlength=count).astype(np.float64)
    order = np.argsort(which, kind="stable")
    bounds = np.searchsorted(which[order], np.arange(count + 1))
    for w in range(count):
        rows = order[bounds[w] : bounds[w + 1]]
        if len(rows) == 0:
            continue
        t1 = ttft[rows]
        t1 = t1[np.isfinite(t1)]
        if len(t1):
            ttft_p99[w] = np.percentile(t1, 99)
        t2 = tpot[rows]
        t2 = t2[np.isfinite(t2)]
        if len(t2):
            tpot_p99[w] = np.percentile(t2, 99)
        attainment[w] = float(np.count_nonzero(met[rows])) / len(rows)
    return WindowSeries(
        window_s=window_s,
        start_s=edges[:-1].copy(),
        arrival_rate_rps=arrivals / window_s,
        prefill_replicas=prefill,
        decode_replicas=decode,
        ttft_p99_s=ttft_p99,
        tpot_p99_s=tpot_p99,
        slo_attainment=attainment,
        gpu_hours_cumulative=gpu_h,
    )


def compare(
    trace: Trace,
    names: Iterable[str],
    scenario: Scenario,
    *,
    initial: Allocation | None = None,
    series_window_s: float = DEFAULT_SERIES_WINDOW_S,
    progress: Callable[[str, str, float], None] | None = None,
) -> dict[str, BacktestResult]:
    """Run each named policy on the same trace and scenario, in the given order.

    ``progress(name, phase, fraction)`` reports each policy's planning (phase
    ``"plan"``, the oracle's window simulations) and run (phase ``"run"``).
    """
    out: dict[str, BacktestResult] = {}
    for name in names:
        policy = make_policy(
            name, trace, scenario, initial=initial, progress=_bind(progress, name, "plan")
        )
        out[name] = run_backtest(
            trace,
            policy,
            scenario,
            series_window_s=series_window_s,
            progress=_bind(progress, name, "run"),
        )
    return out


def _bind(
    progress: Callable[[str, str, float], None] | None, name: str, phase: str
) -> Progress | None:
    if progress is None:
        return None
    report = progress
    return lambda fraction: report(name, phase, fraction)
