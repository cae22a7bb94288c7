"""Where the autoscaling policies start: the load of the first five minutes, measured
as the simulated controller measures it."""

from __future__ import annotations

import numpy as np

from queueing.catalog import resolve_profile
from queueing.lengths import LengthSamples
from queueing.solver import SloTargets
from sim.policies import Scenario, solver_allocation, warm_start
from sim.trace import Trace


def _bursty_start() -> Trace:
    # Five minutes of 30-s windows that alternate a Poisson 20 req/s with a Poisson
    # 2 req/s: each window is Poisson (gap SCV about 1), the five minutes together are
    # not (their gap SCV counts the changes of rate between windows).
    rng = np.random.default_rng(3)
    parts = []
    for k in range(12):  # two windows more than the warm start reads
        rate = 20.0 if k % 2 == 0 else 2.0
        n = rng.poisson(rate * 30.0)
        parts.append(np.sort(30.0 * k + rng.uniform(0.0, 30.0, n)))
    arrivals = np.concatenate(parts)
    n = len(arrivals)
    return Trace(
        arrival_s=arrivals,
        prompt_tokens=rng.integers(200, 2000, n),
        output_tokens=rng.integers(20, 400, n),
        source="alternating Poisson windows",
    )


def _gap_scv(arrivals: np.ndarray) -> float:
    gaps = np.diff(arrivals)
    return float(gaps.var() / gaps.mean() ** 2)


def test_the_warm_start_pools_the_windows_ca2_as_the_controller_does() -> None:
    trace = _bursty_start()
    scenario = Scenario(
        profile=resolve_profile("llama-3-8b@h100-sxm"),
        slo=SloTargets(ttft_p99_s=0.5, tpot_p99_s=0.05),
    )
    first = trace.arrival_s < 300.0
    t = trace.arrival_s[first]
    windows = [_gap_scv(t[(t > e - 30.0) & (t <= e)]) for e in np.arange(30.0, 300.1, 30.0)]
    pooled = float(np.mean(windows))
    whole = _gap_scv(t)
    assert 0.7 < pooled < 1.3 < 2.0 < whole  # Poisson windows; the changes between them
    lengths = LengthSamples(
        prompt_tokens=trace.prompt_tokens[first].astype(np.int64),
        output_tokens=trace.output_tokens[first].astype(np.int64),
        source="the five minutes",
    )
    expected = solver_allocation(scenario, lengths, rate_rps=len(t) / 300.0, ca2=pooled)
    assert warm_start(trace, scenario) == expected
    # The five minutes' own gap SCV would ask for more (so the test can tell them apart).
    at_whole = solver_allocation(scenario, lengths, rate_rps=len(t) / 300.0, ca2=whole)
    assert at_whole.prefill > expected.prefill
