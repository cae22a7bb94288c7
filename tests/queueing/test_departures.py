"""The prefill pool's departures, which are the decode pool's arrivals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from queueing.lengths import LengthSamples
from queueing.pools import Pool
from queueing.solver import (
    CapacityModel,
    SloTargets,
    evaluate,
    solve,
    solve_decode,
)
from sim.fidelity import simulated_departure_scv
from tests.profiles import TEST_8B


@pytest.fixture
def model(samples: LengthSamples) -> CapacityModel:
    return CapacityModel.build(samples, TEST_8B, tpot_slo_s=0.05)


def test_a_loaded_pool_passes_on_fewer_bursts_than_it_receives_and_no_fewer_than_simulated(
    model: CapacityModel, samples: LengthSamples
) -> None:
    # Four workers at 75 % under arrivals of SCV 4: a burst leaves as a queue drained
    # at the service rate. QNA's linking equation smooths less than the simulated
    # chunked-prefill pool does (1.92 simulated against 2.39 predicted over three runs
    # of 20,000 requests on llama-3.1-8b H100, ``bench/departures.py``), the safe side.
    workers, ca2 = 4, 4.0
    rate = 0.75 * workers / model.prefill.mean_service_s
    simulated = simulated_departure_scv(
        samples,
        TEST_8B,
        token_budget=model.token_budget,
        workers=workers,
        rate=rate,
        ca2=ca2,
        requests=12_000,
        rng=np.random.default_rng(11),
    )
    predicted = model.prefill.departure_scv(workers=workers, arrival_rate_rps=rate, ca2=ca2)
    assert simulated < 0.8 * ca2
    assert simulated <= predicted < ca2


def test_at_light_load_departures_keep_the_arrivals_scv(model: CapacityModel) -> None:
    # rho -> 0: every prompt leaves its service time after it arrived, the gaps of
    # the arrivals unchanged (QNA's 1 - rho^2 weight tends to one).
    for ca2 in (0.5, 1.0, 4.0):
        light = model.prefill.departure_scv(workers=4, arrival_rate_rps=1e-6, ca2=ca2)
        assert light == pytest.approx(ca2, abs=1e-6)


def test_an_overloaded_pool_releases_at_its_service_rate_alone(model: CapacityModel) -> None:
    # rho >= 1: the queue never empties, so the gaps are the service's, averaged over
    # the workers; the arrivals' SCV no longer matters.
    rate = 2.0 * 3 / model.prefill.packed_service_s
    expected = 1.0 + (model.prefill.service_scv - 1.0) / math.sqrt(3)
    for ca2 in (1.0, 8.0):
        scv = model.prefill.departure_scv(workers=3, arrival_rate_rps=rate, ca2=ca2)
        assert scv == pytest.approx(expected, rel=1e-12)


def test_the_decode_pool_is_sized_behind_the_prefill_pool_the_solver_chose(
    model: CapacityModel,
) -> None:
    slo = SloTargets(ttft_p99_s=2.0, tpot_p99_s=0.05)
    rate = 6.0 / model.prefill.mean_service_s
    result = solve(model, arrival_rate_rps=rate, ca2=8.0, slo=slo, headroom=0.1)
    behind, _ = solve_decode(
        model,
        prefill_workers=result.prefill_workers,
        arrival_rate_rps=rate,
        ca2=8.0,
        slo=slo,
        headroom=0.1,
    )
    assert result.decode_workers == behind
    seen = model.arrival_scv(
        Pool.DECODE, prefill_workers=result.prefill_workers, arrival_rate_rps=rate, ca2=8.0
    )
    assert seen < 8.0
    predicted = model.decode.tpot_quantile_s(
        workers=result.decode_workers, arrival_rate_rps=rate, ca2=seen, quantile=0.99
    )
    assert result.tpot_p99_s == pytest.approx(predicted, rel=1e-12)


def test_a_what_if_predicts_the_decode_pool_at_the_scv_its_prefill_pool_passes_on(
    model: CapacityModel,
) -> None:
    slo = SloTargets(ttft_p99_s=2.0, tpot_p99_s=0.05)
    rate = 3.0 / model.prefill.mean_service_s
    for prefill_workers in (4, 16):
        seen = model.arrival_scv(
            Pool.DECODE, prefill_workers=prefill_workers, arrival_rate_rps=rate, ca2=4.0
        )
        what_if = evaluate(
            model,
            prefill_workers=prefill_workers,
            decode_workers=2,
            arrival_rate_rps=rate,
            ca2=4.0,
            slo=slo,
        )
        assert what_if.decode.p99_s == pytest.approx(
            model.decode.tpot_quantile_s(workers=2, arrival_rate_rps=rate, ca2=seen, quantile=0.99),
            rel=1e-12,
        )
    # A larger prefill pool is less loaded, so it passes more of the bursts on.
    assert model.arrival_scv(
        Pool.DECODE, prefill_workers=16, arrival_rate_rps=rate, ca2=4.0
    ) > model.arrival_scv(Pool.DECODE, prefill_workers=4, arrival_rate_rps=rate, ca2=4.0)


def test_the_prefill_pool_sees_the_requests_own_scv(model: CapacityModel) -> None:
    assert model.arrival_scv(Pool.PREFILL, prefill_workers=2, arrival_rate_rps=1.0, ca2=3.0) == 3.0


def test_solve_decode_names_a_prefill_pool_that_is_not_a_whole_number(
    model: CapacityModel,
) -> None:
    slo = SloTargets(ttft_p99_s=2.0, tpot_p99_s=0.05)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="prefill_workers"):
            solve_decode(model, prefill_workers=bad, arrival_rate_rps=1.0, ca2=1.0, slo=slo)  # type: ignore[arg-type]
