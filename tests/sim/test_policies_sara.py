"""The sara policy is the production tick in the loop, sara-forecast is the same
controller with its forecaster configured, and the forecaster extrapolates what it
should."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from controller.policy.forecast import seasonal_forecast, trend_forecast
from controller.policy.vocabulary import Reason
from queueing.catalog import resolve_profile
from queueing.pools import Pool
from queueing.solver import KvLink, SloTargets
from sim.backtest import run_backtest
from sim.policies import Allocation, SaraPolicy, Scenario, forecasting, make_policy
from sim.trace import Trace
from sim.trace_io import load_trace
from sim.workload import scale_rate, time_slice

ROOT = Path(__file__).resolve().parents[2]
PROFILE = resolve_profile("llama-2-70b-tp4@h100-sxm")
SCENARIO = Scenario(
    profile=PROFILE,
    slo=SloTargets(ttft_p99_s=1.5, tpot_p99_s=0.1),
    link=KvLink(bytes_per_s=50e9),
    startup_s=60.0,
)


class ArrivalsOf:
    """An ``ArrivalHistory`` over known arrival times (as the simulator's is)."""

    def __init__(self, arrival_s: np.ndarray, *, since_s: float = 0.0) -> None:
        self.arrival_s = np.sort(arrival_s)
        self.since_s = since_s
        self.until_s = math.inf  # every arrival is known, up to any time asked

    def note(self, observation: object, *, window_s: float) -> None:
        pass

    def counts_in_bins(self, edges_s: np.ndarray) -> np.ndarray:
        return np.histogram(self.arrival_s, bins=edges_s)[0].astype(np.float64)

    def count_between(self, start_s: float, end_s: float) -> float:
        lo, hi = np.searchsorted(self.arrival_s, [start_s, end_s])
        return float(hi - lo)


def test_sara_forecast_is_the_production_controller_with_its_forecaster_enabled() -> None:
    trace = time_slice(
        load_trace(ROOT / "data/traces/AzureLLMInferenceTrace_conv.csv"), start_s=0, end_s=600
    )
    policy = make_policy("sara-forecast", trace, SCENARIO)
    assert isinstance(policy, SaraPolicy)
    base = SCENARIO.controller_config
    # Nothing but the forecaster's switch differs from the plain controller's
    # configuration: its horizon is the pools' measured lead time at every tick
    # (controller.tick.forecast_config), as in a deployed controller.
    assert replace(policy.config, forecast=base.forecast) == base
    assert policy.config.forecast.enabled and not base.forecast.enabled
    assert replace(policy.config.forecast, enabled=False) == base.forecast
    assert policy.config == forecasting(SCENARIO, base)
    # With lead-time planning off, the scenario's worker startup plus one tick.
    off = replace(base, lead_time=replace(base.lead_time, enabled=False))
    assert forecasting(SCENARIO, off).forecast.horizon_s == (
        SCENARIO.worker_startup_s + base.interval_s
    )


def linear_arrivals(*, rate0: float, slope: float, start_s: float, end_s: float) -> np.ndarray:
    """Deterministic arrivals of a rate rate0 + slope * t: the k-th at Lambda^-1(k)."""
    total = rate0 * (end_s - start_s) + slope * (end_s**2 - start_s**2) / 2
    k = np.arange(1, math.floor(total) + 1, dtype=np.float64)
    base = rate0 * start_s + slope * start_s**2 / 2
    # Solve rate0 t + slope t^2 / 2 = base + k for t.
    return (-rate0 + np.sqrt(rate0**2 + 2 * slope * (base + k))) / slope


def test_a_significant_rising_trend_is_extrapolated_to_the_horizon() -> None:
    now = 600.0
    arrivals = linear_arrivals(rate0=5.0, slope=0.02, start_s=now - 300, end_s=now)
    got = trend_forecast(
        ArrivalsOf(arrivals),
        now_s=now,
        window_s=300.0,
        bin_s=30.0,
        horizon_s=120.0,
        min_t_stat=2.0,
    )
    assert got == pytest.approx(5.0 + 0.02 * (now + 120.0), rel=0.03)


def test_a_flat_or_falling_rate_gives_no_trend_forecast() -> None:
    now = 600.0
    flat = np.linspace(now - 300, now, 3001)[1:]
    assert (
        trend_forecast(
            ArrivalsOf(flat),
            now_s=now,
            window_s=300.0,
            bin_s=30.0,
            horizon_s=120.0,
            min_t_stat=2.0,
        )
        is None
    )
    falling = linear_arrivals(rate0=20.0, slope=-0.01, start_s=now - 300, end_s=now)
    assert (
        trend_forecast(
            ArrivalsOf(falling),
            now_s=now,
            window_s=300.0,
            bin_s=30.0,
            horizon_s=120.0,
            min_t_stat=2.0,
        )
        is None
    )


def test_the_daily_cycle_forecast_reads_yesterday_at_the_horizon_scaled_to_today() -> None:
    period = 1000.0
    # Yesterday: 2 req/s until 500 s, then 6 req/s. Today runs 1.5 x yesterday.
    yesterday = np.concatenate([np.arange(0.0, 500.0, 0.5), np.arange(500.0, period, 1 / 6)])
    today = np.concatenate(
        [period + np.arange(0.0, 500.0, 1 / 3), period + np.arange(500.0, period, 1 / 9)]
    )
    arrivals = np.concatenate([yesterday, today])
    now = period + 400.0
    arrivals = arrivals[arrivals <= now]
    got = seasonal_forecast(
        ArrivalsOf(arrivals),
        now_s=now,
        period_s=period,
        horizon_s=200.0,
        width_s=100.0,
        max_level_ratio=2.0,
    )
    # Yesterday at 600 s: 6 req/s; today's level over the last 100 s: 3 / 2 = 1.5.
    assert got == pytest.approx(6.0 * 1.5, rel=0.02)
    assert (
        seasonal_forecast(
            ArrivalsOf(arrivals),
            now_s=500.0,
            period_s=period,
            horizon_s=200.0,
            width_s=100.0,
            max_level_ratio=2.0,
        )
        is None
    )


def test_the_forecast_raises_only_the_planning_rate_and_never_the_measurements() -> None:
    trace = time_slice(
        load_trace(ROOT / "data/traces/AzureLLMInferenceTrace_conv.csv"), start_s=0, end_s=900
    )
    trace = scale_rate(trace, 3.0, np.random.default_rng(2))
    policy = SaraPolicy(
        SCENARIO,
        Allocation(prefill=2, decode=1),
        config=forecasting(SCENARIO, SCENARIO.controller_config),
    )
    run_backtest(trace, policy, SCENARIO)
    plain = SaraPolicy(SCENARIO, Allocation(prefill=2, decode=1))
    run_backtest(trace, plain, SCENARIO)
    assert policy.name == "sara-forecast" and plain.name == "sara"
    # Same measurements at the first tick (the runs diverge once they scale differently).
    assert policy.decisions[0].raw_rate_rps == plain.decisions[0].raw_rate_rps
    assert policy.decisions[0].state.to_dict() == plain.decisions[0].state.to_dict()
    both_raised = 0
    for d in policy.decisions:
        assert d.planning_rate_rps is not None and d.smoothed_rate_rps is not None
        assert d.planning_rate_rps >= d.smoothed_rate_rps
        raised = {r.pool for r in d.reasons if r.reason.value == "forecast_raised"}
        if raised == set(Pool):
            # Each pool reads the forecast on the line from the estimate to it, where its
            # load will be (its own lead time, less the decode batch's lag): never past
            # the forecast for the whole horizon.
            assert d.forecast_rate_rps is not None
            assert d.smoothed_rate_rps <= d.planning_rate_rps <= d.forecast_rate_rps + 1e-9
            both_raised += 1
    assert both_raised > 0
    # No trend before five minutes of history: the empty time before the start is no rise.
    early = [d for d in policy.decisions if (d.state.last_tick_s or 0.0) < 300.0]
    assert early and all(d.forecast_rate_rps is None for d in early)
    assert policy.forecasts == sum(
        any(r.reason.value == "forecast_raised" for r in d.reasons) for d in policy.decisions
    )
    assert policy.forecasts > 0  # the 3x conversation ramp does trip the trend


def test_the_controller_rides_through_silence_on_a_large_pool_and_a_phase_of_single_tokens() -> (
    None
):
    # Two shapes that once raised out of the tick: a window with no arrivals on 64
    # prefill workers (Erlang C below the smallest float), and a pooled mix whose
    # every request ended at its first token (no decode model can be built from it).
    rng = np.random.default_rng(5)
    busy = np.cumsum(rng.exponential(1 / 8.0, 2400))  # 8 req/s for about 300 s
    single = busy[-1] + 300.0 + np.cumsum(rng.exponential(1 / 4.0, 1000))  # after silence
    arrivals = np.concatenate([busy, single])
    prompts = rng.integers(50, 1500, len(arrivals))
    outputs = np.concatenate([rng.integers(2, 300, len(busy)), np.ones(len(single), np.int64)])
    trace = Trace(arrival_s=arrivals, prompt_tokens=prompts, output_tokens=outputs, source="edges")
    scenario = Scenario(
        profile=resolve_profile("llama-3-8b@h100-sxm"),
        slo=SloTargets(ttft_p99_s=1.0, tpot_p99_s=0.05),
        link=KvLink(bytes_per_s=50e9),
    )
    policy = make_policy("sara", trace, scenario, initial=Allocation(prefill=64, decode=4))
    result = run_backtest(trace, policy, scenario)
    assert result.summary.lost_requests == 0
    assert result.summary.completed == len(arrivals)
    reasons = {e.reason for d in policy.decisions for e in d.reasons}
    assert Reason.LENGTHS_KEPT in reasons
    assert min(d.target(Pool.PREFILL) for d in policy.decisions) < 64  # it did scale down
