"""The solver: monotone predictions, minimal answers, clear infeasibility."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queueing.lengths import LengthSamples
from queueing.pools import Pool
from queueing.solver import (
    BindingConstraint,
    CapacityModel,
    InfeasibleSLOError,
    SloTargets,
    evaluate,
    evaluate_pool,
    predicted_quantile_s,
    size_pools,
    solve,
)
from tests.profiles import TEST_8B

PROFILE = TEST_8B
_rng = np.random.default_rng(11)
SAMPLES = LengthSamples(
    prompt_tokens=np.clip(_rng.lognormal(np.log(900), 0.8, 4000), 4, 10000).astype(np.int64),
    output_tokens=np.clip(_rng.lognormal(np.log(120), 1.0, 4000), 1, 2000).astype(np.int64),
    source="lognormal",
)
SLO = SloTargets(ttft_p99_s=1.0, tpot_p99_s=0.05)
MODEL = CapacityModel.build(SAMPLES, PROFILE, tpot_slo_s=SLO.tpot_p99_s)

rates = st.floats(min_value=0.5, max_value=3000.0)
ca2s = st.floats(min_value=0.3, max_value=8.0)


def ttft(n: int, rate: float, ca2: float) -> float:
    return MODEL.prefill.ttft_quantile_s(workers=n, arrival_rate_rps=rate, ca2=ca2, quantile=0.99)


def tpot(m: int, rate: float, ca2: float) -> float:
    return MODEL.decode.tpot_quantile_s(workers=m, arrival_rate_rps=rate, ca2=ca2, quantile=0.99)


@settings(max_examples=150, deadline=None)
@given(rate=rates, ca2=ca2s, extra=st.integers(min_value=0, max_value=50))
def test_predicted_p99_ttft_never_rises_when_a_prefill_worker_is_added(
    rate: float, ca2: float, extra: int
) -> None:
    n = MODEL.prefill.min_stable_workers(rate) + extra
    assert ttft(n + 1, rate, ca2) <= ttft(n, rate, ca2) * (1 + 1e-9)


@settings(max_examples=150, deadline=None)
@given(rate=rates, ca2=ca2s, m=st.integers(min_value=1, max_value=400))
def test_predicted_p99_tpot_never_rises_when_a_decode_worker_is_added(
    rate: float, ca2: float, m: int
) -> None:
    # A normal-mixture quantile can creep up by a few parts per million when a class
    # whose mean lies above it loses spread (batches nearly empty, a fraction of a
    # microsecond here); anything larger is a defect.
    if not MODEL.decode.is_stable(workers=m, arrival_rate_rps=rate):
        return
    assert tpot(m + 1, rate, ca2) <= tpot(m, rate, ca2) * (1 + 1e-5)


@settings(max_examples=150, deadline=None)
@given(rate=rates, ca2=ca2s, fall=st.floats(min_value=0.05, max_value=1.0))
def test_predicted_p99s_never_rise_when_the_arrival_rate_falls(
    rate: float, ca2: float, fall: float
) -> None:
    n = MODEL.prefill.min_stable_workers(rate) + 1
    lower = rate * fall
    assert ttft(n, lower, ca2) <= ttft(n, rate, ca2) * (1 + 1e-9)
    m = 1
    while not MODEL.decode.is_stable(workers=m, arrival_rate_rps=rate):
        m += 1
    assert tpot(m, lower, ca2) <= tpot(m, rate, ca2) * (1 + 1e-9)


@settings(max_examples=120, deadline=None)
@given(rate=rates, ca2=ca2s, headroom=st.floats(min_value=0.0, max_value=0.5))
def test_the_answer_meets_the_slos_and_one_worker_fewer_does_not(
    rate: float, ca2: float, headroom: float
) -> None:
    result = solve(MODEL, arrival_rate_rps=rate, ca2=ca2, slo=SLO, headroom=headroom)
    ttft_target = SLO.ttft_p99_s / (1 + headroom)
    tpot_target = SLO.tpot_p99_s / (1 + headroom)
    assert result.ttft_p99_s <= ttft_target * (1 + 1e-6)
    assert result.tpot_p99_s <= tpot_target * (1 + 1e-6)
    n, m = result.prefill_workers, result.decode_workers
    if n > 1:
        fewer = (
            MODEL.prefill.utilisation(workers=n - 1, arrival_rate_rps=rate) >= 1
            or ttft(n - 1, rate, ca2) > ttft_target
        )
        assert fewer
    else:
        assert result.prefill_bound is BindingConstraint.MINIMUM
    if m > 1:
        tighter = SloTargets(ttft_p99_s=SLO.ttft_p99_s, tpot_p99_s=tpot_target)
        assert not evaluate(
            MODEL,
            prefill_workers=n,
            decode_workers=m - 1,
            arrival_rate_rps=rate,
            ca2=ca2,
            slo=tighter,
        ).decode.meets_slo
    else:
        assert result.decode_bound is BindingConstraint.MINIMUM


def test_a_ttft_slo_below_the_longest_prompts_prefill_is_infeasible_and_says_so() -> None:
    floor = MODEL.prefill.floor_quantile_s(0.99)
    slo = SloTargets(ttft_p99_s=floor * 0.8, tpot_p99_s=0.05)
    with pytest.raises(InfeasibleSLOError, match="ttft_p99_s") as info:
        solve(MODEL, arrival_rate_rps=5.0, ca2=1.0, slo=slo, headroom=0.0)
    assert info.value.floor_s == pytest.approx(floor)


def test_a_tpot_slo_below_one_iteration_is_infeasible_and_names_the_slo() -> None:
    with pytest.raises(InfeasibleSLOError, match="tpot_p99_s"):
        CapacityModel.build(SAMPLES, PROFILE, tpot_slo_s=PROFILE.t0_s / 2)


def test_a_thousand_worker_answer_is_found_within_the_bracket() -> None:
    result = solve(MODEL, arrival_rate_rps=12_000.0, ca2=1.0, slo=SLO)
    assert result.prefill_workers > 100
    assert result.decode_workers > 50


def test_evaluate_reports_an_unstable_pool_without_a_prediction() -> None:
    ev = evaluate(
        MODEL, prefill_workers=1, decode_workers=1, arrival_rate_rps=2000.0, ca2=1.0, slo=SLO
    )
    assert ev.prefill.p99_s is None
    assert not ev.feasible


@settings(max_examples=40, deadline=None)
@given(rate=rates, ca2=ca2s)
def test_sizing_alone_finds_the_solvers_answer(rate: float, ca2: float) -> None:
    sizes = size_pools(MODEL, arrival_rate_rps=rate, ca2=ca2, slo=SLO, headroom=0.15)
    result = solve(MODEL, arrival_rate_rps=rate, ca2=ca2, slo=SLO, headroom=0.15)
    assert (sizes.prefill_workers, sizes.decode_workers) == (
        result.prefill_workers,
        result.decode_workers,
    )
    assert (sizes.prefill_bound, sizes.decode_bound) == (result.prefill_bound, result.decode_bound)


@pytest.mark.parametrize("pool", list(Pool))
@pytest.mark.parametrize("workers", [1, 2, 5, 40])
def test_the_prediction_alone_is_the_what_ifs_and_none_where_the_pool_cannot_keep_up(
    pool: Pool, workers: int
) -> None:
    for rate in (1.0, 30.0, 2000.0):
        what_if = evaluate_pool(
            MODEL, pool, workers=workers, arrival_rate_rps=rate, ca2=2.0, target_s=SLO.of(pool)
        )
        alone = predicted_quantile_s(MODEL, pool, workers=workers, arrival_rate_rps=rate, ca2=2.0)
        assert alone == what_if.p99_s
        stable = MODEL.of(pool).is_stable(workers=workers, arrival_rate_rps=rate)
        assert (alone is None) is not stable
