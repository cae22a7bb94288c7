"""Back-testing: every policy accounts for every request, static ones never scale,
the runner applies what a policy asks and counts it, and the results serialise."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from queueing.catalog import resolve_profile
from queueing.solver import KvLink, SloTargets
from sim.backtest import BacktestResult, compare, run_backtest
from sim.policies import POLICY_NAMES, Allocation, ClusterView, Scenario, make_policy
from sim.policies.static import busiest_window
from sim.trace import Trace
from sim.trace_io import load_trace
from sim.workload import scale_rate, time_slice

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = Scenario(
    profile=resolve_profile("llama-2-70b-tp4@h100-sxm"),
    slo=SloTargets(ttft_p99_s=2.0, tpot_p99_s=0.1),
    link=KvLink(bytes_per_s=50e9),
    startup_s=60.0,
)


@pytest.fixture(scope="module")
def trace() -> Trace:
    """Ten minutes of the conversation trace at three times its rate (~8,000 requests),
    without those beyond Llama-2's 4,096-token context (rejected whatever the pools)."""
    piece = time_slice(
        load_trace(ROOT / "data/traces/AzureLLMInferenceTrace_conv.csv"), start_s=0, end_s=600
    )
    scaled = scale_rate(piece, 3.0, np.random.default_rng(5))
    keep = scaled.prompt_tokens + scaled.output_tokens <= 4096
    return Trace(
        arrival_s=scaled.arrival_s[keep],
        prompt_tokens=scaled.prompt_tokens[keep],
        output_tokens=scaled.output_tokens[keep],
        source=f"{scaled.source} within 4096 tokens",
    )


@pytest.fixture(scope="module")
def results(trace: Trace) -> dict[str, BacktestResult]:
    return compare(trace, POLICY_NAMES, SCENARIO)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_accounts_for_every_request(
    name: str, trace: Trace, results: dict[str, BacktestResult]
) -> None:
    s = results[name].summary
    assert s.requests == len(trace)
    assert s.lost_requests == 0
    assert s.completed == s.requests
    series = results[name].series
    # Every request is in exactly one window of the series.
    assert round(float(np.sum(series.arrival_rate_rps * series.window_s))) == len(trace)


@pytest.mark.parametrize("name", ["static-peak", "static-mean"])
def test_static_policies_never_scale(name: str, results: dict[str, BacktestResult]) -> None:
    r = results[name]
    assert r.scale_events == {"prefill": 0, "decode": 0}
    assert len(r.timeline) == 1
    assert np.all(r.series.prefill_replicas == r.initial.prefill)


def test_static_peak_provisions_at_least_static_mean(results: dict[str, BacktestResult]) -> None:
    peak, mean = results["static-peak"].initial, results["static-mean"].initial
    assert peak.prefill >= mean.prefill and peak.decode >= mean.decode


def test_the_busiest_window_is_the_densest_minute() -> None:
    arrivals = np.concatenate([np.arange(0, 100, 1.0), np.arange(100, 130, 0.1), [500.0]])
    t = Trace(
        arrival_s=arrivals,
        prompt_tokens=np.ones(len(arrivals), dtype=np.int64),
        output_tokens=np.ones(len(arrivals), dtype=np.int64),
        source="test",
    )
    lo, hi = busiest_window(t)
    # The minute from 70 s holds the last 30 sparse arrivals and all 300 dense ones
    # (330, the most); the minute from 100 s only the 300 dense ones.
    assert hi - lo == 330
    assert arrivals[lo] == 70.0


def test_the_oracle_meets_the_slo_at_a_lower_cost_than_static_peak(
    results: dict[str, BacktestResult],
) -> None:
    oracle, peak = results["oracle"].summary, results["static-peak"].summary
    assert oracle.slo_attainment is not None and oracle.slo_attainment >= 0.99
    assert peak.slo_attainment is not None
    if peak.slo_attainment >= 0.99:
        assert oracle.gpu_hours <= peak.gpu_hours


def test_results_serialise_to_strict_json(results: dict[str, BacktestResult]) -> None:
    for r in results.values():
        text = json.dumps(r.as_dict(), allow_nan=False)
        data = json.loads(text)
        for key in (
            "requests",
            "completed",
            "slo_attainment",
            "ttft_p99_s",
            "tpot_p99_s",
            "gpu_hours",
            "scale_events",
            "scale_events_per_hour",
            "lost_requests",
            "series",
        ):
            assert key in data
        assert set(data["scale_events"]) == {"prefill", "decode"}
        for key in (
            "arrival_rate_rps",
            "prefill_replicas",
            "decode_replicas",
            "ttft_p99_s",
            "tpot_p99_s",
            "gpu_hours_cumulative",
        ):
            assert len(data["series"][key]) == len(data["series"]["start_s"])


# -- the runner with a scripted policy -----------------------------------------------------


@dataclass
class Scripted:
    """Asks for the given allocations at the given tick times."""

    script: dict[float, Allocation]
    initial: Allocation = field(default_factory=lambda: Allocation(prefill=1, decode=1))
    name: str = "scripted"
    interval_s: float = 10.0
    seen_s: list[float] = field(default_factory=list)

    def tick(self, view: ClusterView) -> Allocation | None:
        self.seen_s.append(view.now_s)
        return self.script.get(view.now_s)


def test_the_runner_ticks_applies_changes_and_counts_one_event_per_pool_change(
    trace: Trace,
) -> None:
    policy = Scripted(
        script={
            10.0: Allocation(prefill=2, decode=1),
            20.0: Allocation(prefill=2, decode=1),  # no change: no event
            30.0: Allocation(prefill=3, decode=2),
            300.0: Allocation(prefill=2, decode=2),
        }
    )
    r = run_backtest(trace, policy, SCENARIO)
    end_s = float(trace.arrival_s[-1])
    assert policy.seen_s == [10.0 * k for k in range(1, math.floor(end_s / 10.0) + 1)]
    assert r.timeline == ((0.0, 1, 1), (10.0, 2, 1), (30.0, 3, 2), (300.0, 2, 2))
    assert r.scale_events == {"prefill": 3, "decode": 1}
    assert r.scale_events_per_hour["prefill"] == pytest.approx(3 / (end_s / 3600))
    # Time-averaged replicas of the first minute: 1 for 10 s, 2 for 20 s, 3 for 30 s.
    assert r.series.prefill_replicas[0] == pytest.approx((10 + 40 + 90) / 60)
    assert r.series.decode_replicas[0] == pytest.approx((30 + 60) / 60)


def test_gpu_hours_count_starting_workers_and_never_fall_below_the_provisioned_plan(
    trace: Trace,
) -> None:
    policy = Scripted(script={60.0: Allocation(prefill=4, decode=2)})
    r = run_backtest(trace, policy, SCENARIO)
    provisioned = float(r.series.gpu_hours_cumulative[-1])
    tp = SCENARIO.profile.tensor_parallel
    end_s = float(trace.arrival_s[-1])
    assert provisioned == pytest.approx((2 * 60 + 6 * (end_s - 60)) * tp / 3600, rel=0.02)
    # The simulator's total also runs to the last completion (and any drain).
    assert r.summary.gpu_hours >= provisioned * 0.999


def test_an_unknown_policy_name_is_an_error_that_lists_the_known_ones(trace: Trace) -> None:
    with pytest.raises(ValueError, match="static-peak"):
        make_policy("hpa", trace, SCENARIO)
