"""The fidelity bench's measurement rules (``sim.fidelity``): the measured window,
the warm-up against the decode pool's relaxation, how a P99 is estimated from
replications, and when a pool size is decided."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from queueing.catalog import MODELS, resolve_profile
from queueing.lengths import LengthSamples
from queueing.solver import CapacityModel, KvLink
from sim.fidelity import (
    WIDE_INTERVAL,
    Case,
    Measured,
    Transient,
    _decide,
    _resolvable,
    draw_cases,
    quantile_measured,
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


def test_the_pooled_p99s_interval_covers_the_true_p99_about_95_times_in_100() -> None:
    rng = np.random.default_rng(11)
    true_p99 = -math.log(0.01)  # of the unit exponential
    trials = 400
    covered = 0
    for _ in range(trials):
        m = quantile_measured([rng.exponential(size=2_000) for _ in range(8)])
        covered += abs(m.estimate_s - true_p99) <= m.half_width_s
    # Binomial(400, 0.95): 99.9 % of draws fall in [0.915, 0.98].
    assert 0.915 <= covered / trials <= 0.98


def test_a_tail_that_comes_in_excursions_is_the_pooled_p99_not_the_replications_mean() -> None:
    # Half the replications hold an excursion: 30 of their 1,000 samples uniform on
    # [10, 11], the rest uniform on [0, 1]. Of all samples 1.5 % are in [10, 11], so
    # the P99 solves 0.015 (11 - x) = 0.01: x = 11 - 2/3. A replication's own P99 is
    # about 10.67 with its excursion and 0.99 without: their mean is far below.
    rng = np.random.default_rng(5)

    def replication(excursion: bool) -> np.ndarray:
        high = 30 if excursion else 0
        return np.concatenate([rng.uniform(0, 1, 1_000 - high), rng.uniform(10, 11, high)])

    replications = [replication(i % 2 == 0) for i in range(400)]
    m = quantile_measured(replications)
    assert m.estimate_s == pytest.approx(11 - 2 / 3, rel=0.01)
    own_mean = float(np.mean([np.quantile(r, 0.99) for r in replications]))
    assert own_mean < 6.0


def test_a_quantile_needs_samples_and_a_level_inside_zero_and_one() -> None:
    with pytest.raises(ValueError, match="replications"):
        quantile_measured([])
    with pytest.raises(ValueError, match="replications"):
        quantile_measured([np.array([math.nan])])
    with pytest.raises(ValueError, match="quantile"):
        quantile_measured([np.ones(3)], quantile=1.0)
    # Requests with no such latency (NaN) are left out; one replication has no interval.
    single = quantile_measured([np.array([1.0, math.nan, 2.0])], quantile=0.5)
    assert single.estimate_s == 1.5 and math.isnan(single.half_width_s)


def _small_poisson_case() -> tuple[Case, LengthSamples]:
    """One drawn Poisson case on two Llama-3-8B workers at most 60 % utilised."""
    profile = resolve_profile("llama-3-8b@h100-sxm")
    return draw_cases(
        1,
        profiles=[profile],
        long_profiles=[profile],
        max_context={profile.name: MODELS[profile.model].max_context_tokens},
        rng=np.random.default_rng(11),
        max_utilisation=0.6,
        arrival_scvs=(1.0,),
        pool_sizes=(2,),
    )[0]


def test_a_wide_interval_gets_replications_up_to_its_own_limit() -> None:
    case, samples = _small_poisson_case()
    # 150 measured requests hold one or two beyond the P99: its interval is wide.
    held = run_case(case, samples, requests=150, replications=2, max_replications=2)
    assert held.replications == 2
    assert max(held.ttft_sim.relative_ci, held.tpot_sim.relative_ci) > WIDE_INTERVAL
    more = run_case(
        case, samples, requests=150, replications=2, max_replications=2, max_wide_replications=8
    )
    narrow = max(more.ttft_sim.relative_ci, more.tpot_sim.relative_ci) <= WIDE_INTERVAL
    assert more.replications == 8 or (2 < more.replications < 8 and narrow)


def test_a_pool_is_decided_only_when_the_one_smaller_is_slower_beyond_both_intervals() -> None:
    at_n = Measured(estimate_s=1.0, half_width_s=0.05)
    clear = Measured(estimate_s=1.2, half_width_s=0.05)
    close = Measured(estimate_s=1.08, half_width_s=0.05)
    slo, decided = _decide(at_n, clear, 5, 0.5)
    assert decided == 5
    assert 1.0 < slo < 1.2  # between the two simulated P99s
    assert slo == pytest.approx(math.sqrt(1.2))  # the log-midpoint at position 0.5
    assert _decide(at_n, close, 5, 0.5)[1] is None
    # One worker: nothing smaller to compare with, so decided by construction.
    assert _decide(at_n, None, 1, 0.5)[1] == 1


def test_more_replications_are_run_only_where_they_could_separate_the_sizes() -> None:
    at_n = Measured(estimate_s=1.0, half_width_s=0.05)
    assert _resolvable(at_n, Measured(estimate_s=1.05, half_width_s=0.05))
    # Both at the latency floor (no prompt waits at either size): 0.5 % apart.
    assert not _resolvable(at_n, Measured(estimate_s=1.005, half_width_s=0.0))


def test_a_rescored_row_is_the_row_a_new_run_would_print() -> None:
    # The simulated half of a run depends on the case's seed alone, so the same
    # model re-predicting it gives back the run's predictions and solver answers; a
    # saved row whose decode pool the model would now size otherwise is refused.
    case, samples = _small_poisson_case()
    run = run_case(case, samples, requests=400, replications=2)
    assert run.prefill_decision is not None and run.decode_decision is not None
    rescored_run = rescored(case, samples, replace(run, ttft_pred_s=0.0, tpot_pred_s=0.0))
    assert rescored_run == run
    with pytest.raises(ValueError, match="decode pool or measured window"):
        rescored(case, samples, replace(run, decode_workers=run.decode_workers + 1))
