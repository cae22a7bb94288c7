"""Decode pool: Little's-law batch, TPOT quantiles, admission limits."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, optimize, stats

from queueing.decode import (
    DecodeModel,
    _averaging,
    _class_density,
    _class_survival,
    _gamma_pair_excess,
    _infinite_server_averaging,
    _infinite_server_third_averaging,
)
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


def exact_life_average(lives: np.ndarray, life: float) -> float:
    """V(L) = 2 / L^2 int_0^L (L - t) E[(S - t)+] / E[S] dt, integrated numerically."""

    def autocorrelation(t: float) -> float:
        return float(np.maximum(lives - t, 0.0).mean() / lives.mean())

    integral = integrate.quad(lambda t: (life - t) * autocorrelation(t), 0, life, limit=200)[0]
    return 2.0 * integral / life**2


def test_equal_lives_keep_one_less_a_third_of_the_life_over_the_lifetime() -> None:
    # Lives all D: the autocorrelation falls linearly, 1 - t / D, and its mean over L
    # keeps 1 - L / (3 D) of the variance (2/3 over a whole life; an exponential of the
    # same correlation time D / 2 would keep 0.57).
    lives = np.full(100, 300.0)
    at = np.array([30.0, 150.0, 300.0])
    assert _infinite_server_averaging(lives, at=at) == pytest.approx(1.0 - at / 900.0, rel=1e-12)


def test_exponential_lives_keep_what_an_exponential_autocorrelation_keeps() -> None:
    # For exponential lives E[(S - t)+] / E[S] = e^(-t / E[S]), so the exact average is
    # g(L / E[S]) up to the sample's noise.
    lives = np.random.default_rng(7).exponential(200.0, size=200_000)
    at = np.array([20.0, 200.0, 800.0])
    assert _infinite_server_averaging(lives, at=at) == pytest.approx(
        _averaging(at / lives.mean()), rel=0.01
    )


def test_the_life_average_of_a_mixture_of_lives_matches_the_integral() -> None:
    lives = np.array([40.0] * 3 + [500.0] * 1 + [1500.0] * 1)
    at = np.array([10.0, 40.0, 300.0, 1500.0, 3000.0])
    expected = [exact_life_average(lives, life) for life in at]
    assert _infinite_server_averaging(lives, at=at) == pytest.approx(expected, rel=1e-6)


def test_equal_lives_keep_one_less_half_the_life_over_the_lifetime_of_the_third_cumulant() -> None:
    # Lives all D: the cube of a member's overlap with [0, L] integrates to
    # L^3 D - L^4 / 2, so the life average keeps 1 - L / (2 D) of the third cumulant.
    lives = np.full(50, 400.0)
    at = np.array([40.0, 200.0, 400.0])
    assert _infinite_server_third_averaging(lives, at=at) == pytest.approx(
        1.0 - at / 800.0, rel=1e-12
    )


def test_the_life_averages_cumulants_match_a_simulated_shot_noise() -> None:
    # Poisson arrivals (rate 0.4 per unit time) of members with lives 20, 60 or 300
    # and lognormal costs u; the mean of sum u over a life of 600 is simulated
    # directly, 40 batches of 1,000 windows. Its variance and third central moment
    # (the second and third cumulants) against lambda E[u^r] E[S] times what the
    # life keeps (V, W3), within three standard errors of the batch means; there
    # the variance's share is 0.35 where an exponential autocorrelation keeps 0.33,
    # and the third cumulant's 0.15 where the variance's share would give 0.35.
    rng = np.random.default_rng(11)
    rate, life, sigma = 0.4, 600.0, 0.5
    lives_pool = np.array([20.0, 60.0, 300.0])
    windows = np.empty(40_000)
    for i in range(len(windows)):
        count = rng.poisson(rate * (life + lives_pool.max()))
        start = rng.uniform(-lives_pool.max(), life, size=count)
        lives = rng.choice(lives_pool, size=count)
        cost = rng.lognormal(0.0, sigma, size=count)
        overlap = np.clip(np.minimum(start + lives, life) - np.maximum(start, 0.0), 0.0, None)
        windows[i] = float((cost * overlap).sum()) / life
    batches = windows.reshape(40, 1_000)
    centred = batches - batches.mean(axis=1, keepdims=True)
    at = np.array([life])
    for order, kept in (
        (2, _infinite_server_averaging(lives_pool, at=at)[0]),
        (3, _infinite_server_third_averaging(lives_pool, at=at)[0]),
    ):
        moments = (centred**order).mean(axis=1)
        error = 3.0 * moments.std(ddof=1) / math.sqrt(len(moments))
        u_moment = math.exp(order * order * sigma * sigma / 2.0)  # E[u^r], lognormal
        expected = rate * u_moment * lives_pool.mean() * kept
        assert error < 0.3 * expected  # precise enough to tell the shares apart
        assert abs(moments.mean() - expected) <= error


def test_a_skewed_class_is_the_shifted_gamma_of_its_three_moments() -> None:
    # Wilson-Hilferty's cube root against scipy's gamma of the same three moments:
    # the P99 (found on the survival) within a part in a thousand, the density with it.
    mean, sd = np.array([0.030]), np.array([0.002])
    for skewness in (0.1, 0.4, 1.0):
        shape = 4.0 / skewness**2
        fitted = stats.gamma(
            a=shape, loc=0.030 - 0.002 * math.sqrt(shape), scale=0.002 / math.sqrt(shape)
        )
        assert fitted.mean() == pytest.approx(0.030) and fitted.std() == pytest.approx(0.002)
        assert fitted.stats(moments="s") == pytest.approx(skewness)
        skew = np.array([skewness])
        p99 = optimize.brentq(
            lambda x, skew=skew: _class_survival(mean, sd, skew, x)[0] - 0.01, 0.02, 0.06
        )
        assert p99 == pytest.approx(fitted.ppf(0.99), rel=1e-3)
        assert _class_density(mean, sd, skew, p99)[0] == pytest.approx(fitted.pdf(p99), rel=0.02)
    # Without skewness it is the normal (to the 1e-9 floor kept on the skewness).
    assert _class_survival(mean, sd, np.array([0.0]), 0.034)[0] == pytest.approx(
        stats.norm(0.030, 0.002).sf(0.034), rel=1e-8
    )
