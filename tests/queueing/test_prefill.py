"""Prefill pool: service times and the TTFT quantile of W + S."""

from __future__ import annotations

import math

import numpy as np
import pytest

from queueing.ggc import WaitTail
from queueing.lengths import LengthSamples
from queueing.prefill import PrefillModel, prefill_service_s, quantile_of_sum, survival_of_sum
from queueing.profile import IterationProfile


@pytest.mark.parametrize(
    ("prompt", "budget", "iterations"), [(1, 512, 1), (512, 512, 1), (513, 512, 2), (4000, 512, 8)]
)
def test_a_prompt_takes_ceil_L_over_budget_iterations_plus_its_token_and_attention_work(
    profile: IterationProfile, prompt: int, budget: int, iterations: int
) -> None:
    expected = (
        iterations * profile.t0_s
        + profile.t_tok_s * prompt
        + profile.t_attn_s * prompt * (prompt + 1) / 2
    )
    got = prefill_service_s(profile, np.array([prompt], dtype=np.float64), budget)[0]
    assert got == pytest.approx(expected, rel=1e-12)


def test_quantile_of_sum_agrees_with_monte_carlo_within_its_confidence_interval() -> None:
    rng = np.random.default_rng(3)
    values = np.sort(rng.gamma(2.0, 0.05, 40))
    weights = rng.dirichlet(np.ones(40))
    tail = WaitTail(wait_probability=0.4, decay_rate_per_s=8.0)
    q = quantile_of_sum(values, weights, tail, 0.99)
    n = 400_000
    s = rng.choice(values, size=n, p=weights)
    w = np.where(rng.random(n) < tail.wait_probability, rng.exponential(1 / 8.0, n), 0.0)
    exceed = float(np.mean(s + w > q))
    half_width = 4 * math.sqrt(0.01 * 0.99 / n)
    assert abs(exceed - 0.01) < half_width


def test_quantile_of_sum_inverts_the_survival_exactly() -> None:
    values = np.array([0.05, 0.1, 0.3, 1.2])
    weights = np.array([0.4, 0.4, 0.19, 0.01])
    for pw in (0.0, 0.02, 0.3, 0.9):
        tail = WaitTail(wait_probability=pw, decay_rate_per_s=3.0)
        q = quantile_of_sum(values, weights, tail, 0.99)
        assert survival_of_sum(values, weights, tail, q) <= 0.01 + 1e-12
        assert survival_of_sum(values, weights, tail, q - 1e-6) > 0.01 - 1e-9


def test_the_p99_of_the_sum_is_below_the_sum_of_the_p99s(
    samples: LengthSamples, profile: IterationProfile
) -> None:
    model = PrefillModel.build(samples, profile, token_budget=2048)
    rate = 0.8 * 4 / model.mean_service_s
    total = model.ttft_quantile_s(workers=4, arrival_rate_rps=rate, ca2=1.0, quantile=0.99)
    wait = model.wait_tail(workers=4, arrival_rate_rps=rate, ca2=1.0).quantile_s(0.99)
    assert model.floor_quantile_s(0.99) < total < wait + model.floor_quantile_s(0.99)


def test_at_vanishing_load_the_ttft_quantile_is_the_service_quantile(
    samples: LengthSamples, profile: IterationProfile
) -> None:
    model = PrefillModel.build(samples, profile, token_budget=2048)
    service = prefill_service_s(profile, samples.prompt_tokens.astype(np.float64), 2048)
    empirical = float(np.quantile(service, 0.99))
    got = model.ttft_quantile_s(workers=50, arrival_rate_rps=1.0, ca2=1.0, quantile=0.99)
    assert got == pytest.approx(empirical, rel=0.02)


def test_the_mean_service_time_is_exact_over_all_samples(
    samples: LengthSamples, profile: IterationProfile
) -> None:
    model = PrefillModel.build(samples, profile, token_budget=1024)
    service = prefill_service_s(profile, samples.prompt_tokens.astype(np.float64), 1024)
    assert model.mean_service_s == pytest.approx(float(service.mean()), rel=1e-12)
    assert float((model.weights * model.service_s).sum()) == pytest.approx(model.mean_service_s)
