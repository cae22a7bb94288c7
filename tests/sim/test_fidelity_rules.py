"""The fidelity bench's measurement rules (``sim.fidelity``): the measured window,
the warm-up against the decode pool's relaxation, and when a pool size is decided."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from queueing.catalog import MODELS, resolve_profile
from queueing.lengths import LengthSamples
from queueing.solver import CapacityModel, KvLink
from sim.fidelity import (
    Measured,
    Transient,
    _decide,
    _resolvable,
    draw_cases,
    rescored,
    run_case,
    steady_window,
    transient_s,
)
from tests.profiles import TEST_8B


def test_the_window_leaves_out_the_warm_up_and_the_cool_down() -> None:
    start, end = steady_window(100.0, Transient(warmup_s=10.0, cooldown_s=7.0))
    assert (start, end) == (10.0, 93.0)
    # A warm-up shorter than 5 % of the run is lengthened to 5 %.
    assert steady_window(100.0, Transient(warmup_s=1.0, cooldown_s=0.0))[0] == 5.0


def test_the_warm_up_covers_three_relaxations_of_the_decode_batch() -> None:
    rng = np.random.default_rng(3)
    samples = LengthSamples(
        prompt_tokens=rng.integers(100, 2000, 4000),
        output_tokens=rng.integers(50, 400, 4000),
        source="uniform",
    )
    model = CapacityModel.build(samples, TEST_8B, tpot_slo_s=0.05, link=KvLink())
    decode = model.decode
    workers, rate = 4, 40.0
    # Independently: rho = lambda_w E[n] a, a member's step t0 / (1 - rho) + a s with
    # s = (1 - 1/M) + 1 / (M (1 - rho)) at Poisson arrivals, tau = E[n] step / (1 - rho).
    steps = samples.output_tokens[samples.output_tokens >= 2] - 1.0
    per_worker = rate * float(np.mean(samples.output_tokens >= 2)) / workers
    rho = per_worker * float(steps.mean()) * decode.member_cost_s
    spread = (1 - 1 / workers) + 1 / (workers * (1 - rho))
    step_s = TEST_8B.t0_s / (1 - rho) + decode.member_cost_s * spread
    tau = float(steps.mean()) * step_s / (1 - rho)
    assert decode.relaxation_s(workers=workers, arrival_rate_rps=rate) == pytest.approx(tau)
    transient = transient_s(model, samples, decode_workers=workers, rate=rate, ca2=1.0)
    assert transient.warmup_s >= 3 * tau * (1 - 1e-12)
    assert transient.cooldown_s == pytest.approx(float(np.quantile(steps, 0.99)) * step_s)


def test_a_pool_is_decided_only_when_the_one_smaller_is_slower_beyond_both_intervals() -> None:
    at_n = Measured(mean_s=1.0, half_width_s=0.05)
    clear = Measured(mean_s=1.2, half_width_s=0.05)
    close = Measured(mean_s=1.08, half_width_s=0.05)
    slo, decided = _decide(at_n, clear, 5, 0.5)
    assert decided == 5
    assert 1.0 < slo < 1.2  # between the two simulated P99s
    assert slo == pytest.approx(math.sqrt(1.2))  # the log-midpoint at position 0.5
    assert _decide(at_n, close, 5, 0.5)[1] is None
    # One worker: nothing smaller to compare with, so decided by construction.
    assert _decide(at_n, None, 1, 0.5)[1] == 1


def test_more_replications_are_run_only_where_they_could_separate_the_sizes() -> None:
    at_n = Measured(mean_s=1.0, half_width_s=0.05)
    assert _resolvable(at_n, Measured(mean_s=1.05, half_width_s=0.05))
    # Both at the latency floor (no prompt waits at either size): 0.5 % apart.
    assert not _resolvable(at_n, Measured(mean_s=1.005, half_width_s=0.0))


def test_a_rescored_row_is_the_row_a_new_run_would_print() -> None:
    # The simulated half of a run depends on the case's seed alone, so the same
    # model re-predicting it gives back the run's predictions and solver answers; a
    # saved row whose decode pool the model would now size otherwise is refused.
    profile = resolve_profile("llama-3-8b@h100-sxm")
    case, samples = draw_cases(
        1,
        profiles=[profile],
        long_profiles=[profile],
        max_context={profile.name: MODELS[profile.model].max_context_tokens},
        rng=np.random.default_rng(11),
        max_utilisation=0.6,
        arrival_scvs=(1.0,),
        pool_sizes=(2,),
    )[0]
    run = run_case(case, samples, requests=400, replications=2)
    assert run.prefill_decision is not None and run.decode_decision is not None
    rescored_run = rescored(case, samples, replace(run, ttft_pred_s=0.0, tpot_pred_s=0.0))
    assert rescored_run == run
    with pytest.raises(ValueError, match="decode pool or measured window"):
        rescored(case, samples, replace(run, decode_workers=run.decode_workers + 1))
