"""Decode pool: Little's-law batch, TPOT quantiles, admission limits."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, stats

from queueing.decode import DecodeModel, _gamma_pair_excess
from queueing.lengths import LengthSamples
from queueing.prefill import UnstableQueueError
from queueing.profile import IterationProfile


def build(samples: LengthSamples, profile: IterationProfile) -> DecodeModel:
    return DecodeModel.build(
        samples, profile, max_batch=2048, prefill_token_budget=2048, kv_link_bytes_per_s=50e9
    )


def test_on_one_worker_the_mean_batch_is_the_fixed_point_of_littles_law(
    samples: LengthSamples, profile: IterationProfile
) -> None:
    # B = lambda E[n] (t0 + a (B + 1)): a member's step costs t0, its own a and the
    # others' a B; with Poisson arrivals on one worker this is the negative binomial's
    # mean (the simulator checks the law itself: tests/sim/test_decode_batch_law.py).
    model = build(samples, profile)
    rate, workers = 15.0, 1
    decoding = samples.output_tokens >= 2
    steps = float((samples.output_tokens[decoding] - 1).mean())
    per_worker = rate * float(decoding.mean()) / workers
    b = 0.0
    for _ in range(10_000):  # plain fixed-point iteration, independent of the closed form
        b = per_worker * steps * (profile.t0_s + model.member_cost_s * (b + 1))
    got = model.load(workers=workers, arrival_rate_rps=rate, ca2=1.0, quantile=0.99).mean_batch
    assert got == pytest.approx(b, rel=1e-9)


def test_the_time_weighted_member_cost_matches_a_direct_sum(
    samples: LengthSamples, profile: IterationProfile
) -> None:
    model = build(samples, profile)
    total = 0.0
    steps = 0
    for p, o in zip(samples.prompt_tokens[:300], samples.output_tokens[:300], strict=True):
        for k in range(1, int(o)):
            total += profile.t_tok_s + profile.t_kv_s * (int(p) + k)
            steps += 1
    small = LengthSamples(
        prompt_tokens=samples.prompt_tokens[:300],
        output_tokens=samples.output_tokens[:300],
        source="first 300",
    )
    assert build(small, profile).member_cost_s == pytest.approx(total / steps, rel=1e-12)
    assert model.member_cost_s > profile.t_tok_s


def test_with_unlimited_workers_tpot_approaches_the_floor(
    samples: LengthSamples, profile: IterationProfile
) -> None:
    model = build(samples, profile)
    floor = model.floor_quantile_s(0.99)
    crowded = model.tpot_quantile_s(workers=2, arrival_rate_rps=30.0, ca2=1.0, quantile=0.99)
    sparse = model.tpot_quantile_s(workers=5000, arrival_rate_rps=30.0, ca2=1.0, quantile=0.99)
    assert floor <= sparse < crowded
    assert sparse == pytest.approx(floor, rel=0.02)


def test_the_tpot_quantile_inverts_the_survival(
    samples: LengthSamples, profile: IterationProfile
) -> None:
    model = build(samples, profile)
    x = model.tpot_quantile_s(workers=3, arrival_rate_rps=40.0, ca2=2.0, quantile=0.99)
    assert model.tpot_survival(
        workers=3, arrival_rate_rps=40.0, ca2=2.0, tpot_s=x
    ) == pytest.approx(0.01, abs=1e-7)


def test_requests_with_a_single_output_token_have_no_tpot(profile: IterationProfile) -> None:
    samples = LengthSamples(
        prompt_tokens=np.array([100, 200, 300, 400]),
        output_tokens=np.array([1, 1, 10, 20]),
        source="mixed",
    )
    assert build(samples, profile).decode_fraction == pytest.approx(0.5)


def test_an_overloaded_pool_is_reported_unstable(
    samples: LengthSamples, profile: IterationProfile
) -> None:
    model = build(samples, profile)
    assert not model.is_stable(workers=1, arrival_rate_rps=1e6)
    with pytest.raises(UnstableQueueError, match="decode_workers"):
        model.load(workers=1, arrival_rate_rps=1e6, ca2=1.0, quantile=0.99)


@pytest.mark.parametrize(("x", "ca2"), [(0.05, 4.0), (0.24, 4.0), (0.5, 2.0), (2.0, 0.5)])
def test_the_clustered_pairs_of_gamma_arrivals_match_the_renewal_density(
    x: float, ca2: float
) -> None:
    # J = int e^(-sigma tau) (h(tau) - lambda) dtau with h the renewal density, the sum
    # of the k-fold Gamma convolutions (Gamma(k / ca2) densities), integrated
    # numerically at lambda = 1, sigma = 1 / x.
    shape, sigma = 1.0 / ca2, 1.0 / x
    # Each fold's Laplace transform at sigma is the gap's to the k-th power; summing
    # the integrated folds term by term is the independent computation.
    numeric = -x
    for k in range(1, 1000):
        fold = integrate.quad(
            lambda t, k=k: math.exp(-sigma * t) * stats.gamma.pdf(t, k * shape, scale=1 / shape),
            0,
            np.inf,
            limit=200,
        )[0]
        numeric += fold
        if fold < 1e-10:
            break
    assert _gamma_pair_excess(x=x, ca2=ca2) == pytest.approx(numeric, rel=1e-4, abs=1e-8)


def test_poisson_arrivals_have_no_clustered_pairs_and_long_windows_keep_whitts_factor() -> None:
    assert _gamma_pair_excess(x=0.3, ca2=1.0) == pytest.approx(0.0, abs=1e-12)
    # As the window grows every pair is taken together: (ca2 - 1) / 2.
    assert _gamma_pair_excess(x=1e4, ca2=4.0) == pytest.approx(1.5, rel=1e-3)
