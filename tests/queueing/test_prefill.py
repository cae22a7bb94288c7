"""Prefill pool: service times and the TTFT quantile of W + S."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
import pytest
from scipy import optimize

from queueing.absorption import all_busy_probability, excursion_extras, excursion_ratio
from queueing.erlang import erlang_c
from queueing.ggc import WaitTail
from queueing.lengths import LengthSamples
from queueing.prefill import (
    _FILL_BANDS,
    PrefillModel,
    _fresh_start_wait_s,
    brief_wait_bands_s,
    mg1_wait_quantile_s,
    pair_min_share,
    prefill_service_s,
    quantile_of_sum,
    survival_of_sum,
)
from queueing.profile import IterationProfile
from tests.profiles import TEST_8B
from tests.queueing.equal_service import simulate_equal_service


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


@pytest.mark.parametrize("workers", [64, 200])
def test_a_large_pool_at_an_all_but_idle_rate_waits_for_no_one(
    samples: LengthSamples, profile: IterationProfile, workers: int
) -> None:
    # The load is far below the smallest float's share of busy time: Erlang C and the
    # absorbing chain's all-busy probability both underflow to zero, and their ratio
    # must not be taken.
    model = PrefillModel.build(samples, profile, token_budget=2048)
    assert erlang_c(workers, 1e-9 * model.mean_service_s) == 0.0
    tail = model.wait_tail(workers=workers, arrival_rate_rps=1e-9, ca2=1.0)
    assert tail.wait_probability == 0.0
    service = prefill_service_s(profile, samples.prompt_tokens.astype(np.float64), 2048)
    got = model.ttft_quantile_s(workers=workers, arrival_rate_rps=1e-9, ca2=1.0, quantile=0.99)
    assert got == pytest.approx(float(np.quantile(service, 0.99)), rel=0.02)


def test_the_mean_service_time_is_exact_over_all_samples(
    samples: LengthSamples, profile: IterationProfile
) -> None:
    model = PrefillModel.build(samples, profile, token_budget=1024)
    service = prefill_service_s(profile, samples.prompt_tokens.astype(np.float64), 1024)
    assert model.mean_service_s == pytest.approx(float(service.mean()), rel=1e-12)
    assert float((model.weights * model.service_s).sum()) == pytest.approx(model.mean_service_s)


@pytest.mark.parametrize("theta_per_s", [2.0, 20.0, 80.0])
def test_the_stream_share_and_the_fresh_start_wait_agree_with_monte_carlo(
    theta_per_s: float,
) -> None:
    # W_f ~ Exp(theta), V ~ U(0, D): a prompt joins the running stream when W_f >= V;
    # otherwise it waits D - V + W_f for the running iteration to end.
    iteration_s = 0.05
    share, wait_s = _fresh_start_wait_s(theta_per_s, iteration_s, 0.0)
    rng = np.random.default_rng(5)
    n = 400_000
    w = rng.exponential(1.0 / theta_per_s, n)
    v = rng.uniform(0.0, iteration_s, n)
    joins = w >= v
    assert share == pytest.approx(float(joins.mean()), abs=4 * math.sqrt(0.25 / n))
    fresh = iteration_s - v[~joins] + w[~joins]
    half_width = 4 * float(fresh.std()) / math.sqrt(fresh.size)
    assert wait_s == pytest.approx(float(fresh.mean()), abs=half_width)


def test_the_fresh_start_wait_runs_from_two_thirds_to_half_an_iteration() -> None:
    iteration_s = 0.05
    waits = [_fresh_start_wait_s(theta, iteration_s, 0.0) for theta in np.geomspace(1e-6, 1e6, 400)]
    shares = np.array([share for share, _ in waits])
    means = np.array([wait for _, wait in waits])
    assert means[0] == pytest.approx(2 * iteration_s / 3, rel=1e-6)
    assert means[-1] == pytest.approx(iteration_s / 2, rel=1e-4)
    assert np.all(np.diff(shares) < 0) and np.all(np.diff(means) <= 1e-15)
    # The series used for tiny theta * D meets the exact form where it takes over.
    below = _fresh_start_wait_s(0.999e-4 / iteration_s, iteration_s, 0.0)
    above = _fresh_start_wait_s(1.001e-4 / iteration_s, iteration_s, 0.0)
    assert below == pytest.approx(above, rel=1e-6)


def test_a_prompt_joining_the_stream_spans_its_packed_share_plus_one_iteration(
    samples: LengthSamples, profile: IterationProfile
) -> None:
    # Uniform offset o: E[ceil((o + L) / tau)] = L / tau + 1 full iterations of D.
    budget = 1024
    model = PrefillModel.build(samples, profile, token_budget=budget)
    one_base, one_fill, two_base, two_fill, two_share = model.stream.at(0.0)
    filled = (1 - two_share) * (one_base + one_fill) + two_share * (two_base + two_fill)
    lengths = samples.prompt_tokens.astype(np.float64)
    iteration_s = profile.t0_s + profile.t_tok_s * budget
    expected = (lengths / budget + 1) * iteration_s + profile.t_attn_s * lengths * (lengths + 1) / 2
    assert float((model.weights * filled).sum()) == pytest.approx(float(expected.mean()))
    # Over its offset, joining the stream never beats running the prompt alone.
    unfilled = (1 - two_share) * one_base + two_share * two_base
    assert np.all(unfilled >= model.service_s * (1 - 1e-12))


@pytest.mark.parametrize("decay", [1e-7, 0.3, 2.0, 9.0])
def test_the_stream_offset_is_the_queue_ahead_modulo_the_budget(
    samples: LengthSamples, profile: IterationProfile, decay: float
) -> None:
    # The offset, in budgets, is frac(N W_f / D) for an exponential stream wait: drawn
    # as the fractional part of Exp(decay) draws, each class's iterations and tokens
    # ahead match the branches' closed forms.
    budget = 1024
    model = PrefillModel.build(samples, profile, token_budget=budget)
    terms = model.stream
    one_base, _, two_base, _, two_share = terms.at(decay)
    rng = np.random.default_rng(7)
    offsets = np.modf(rng.exponential(1.0 / decay, 400_000))[0]
    for c in (0, len(model.weights) // 2, len(model.weights) - 1):
        share_of_l = terms.lengths[c] / budget
        two_more = offsets > 1.0 - (share_of_l - np.floor(share_of_l))
        assert two_share[c] == pytest.approx(two_more.mean(), abs=4e-3)
        # The tokens ahead, through each branch's base (t_tok per token of offset).
        for mask, base, extra in ((~two_more, one_base, 1.0), (two_more, two_base, 2.0)):
            if mask.sum() < 1_000:
                continue
            tokens_ahead = float(offsets[mask].mean()) * budget
            constant = (
                (np.floor(share_of_l) + extra) * profile.t0_s
                + profile.t_tok_s * terms.lengths[c]
                + terms.attention_s[c]
            )
            assert (base[c] - constant) / profile.t_tok_s == pytest.approx(
                tokens_ahead, rel=0.02, abs=3.0
            )


def _short_prompts_on_a_wide_budget(profile: IterationProfile) -> PrefillModel:
    """Prompts of about 200 tokens on a budget of 8,192: alone each pays t0, packed
    hardly any, so the solo load runs far above the packed one."""
    rng = np.random.default_rng(11)
    prompts = np.clip(rng.lognormal(np.log(200), 0.8, 4000), 8, 4000).astype(np.int64)
    short = LengthSamples(prompt_tokens=prompts, output_tokens=prompts, source="short")
    return PrefillModel.build(short, profile, token_budget=8192)


@pytest.mark.parametrize("solo_load", [0.5, 0.84, 0.95])
def test_poisson_arrivals_wait_as_the_absorbing_chain_says_at_any_solo_load(
    profile: IterationProfile, solo_load: float
) -> None:
    # Short prompts on a wide budget: a prompt alone pays t0, one packed hardly any,
    # so the solo load runs far above the packed one. Queued prompts are absorbed by
    # busy workers at boundaries with budget to spare (``queueing.absorption``, its
    # chain checked against simulations of it in test_absorption.py): P_w is that
    # chain's all-busy probability, up to the pool's size.
    model = _short_prompts_on_a_wide_budget(profile)
    workers = 12
    rate = solo_load * workers / model.mean_service_s
    packed_load = rate * model.packed_service_s / workers
    assert packed_load < 0.7 * solo_load  # the case this is about
    # While every worker is busy, each takes queued work once per prompt it serves.
    excursion = excursion_ratio(
        arrival_rate_rps=rate,
        boundary_rate_per_s=workers / model.mean_service_s,
        admitted=model.admitted,
    )
    assert model.excursion(workers=workers, arrival_rate_rps=rate) == excursion
    assert model.one_chunk_share == 1.0  # short prompts: every one fits an iteration
    # An excursion leaves the prompts behind its head beside it on one worker, each
    # adding its solo time less the t0 of the iteration it rides in.
    some, batch = excursion_extras(excursion=excursion, admitted=model.admitted)
    assert model.riding_service_s == pytest.approx(model.mean_service_s - profile.t0_s)
    chain = all_busy_probability(
        workers=workers,
        arrival_rate_rps=rate,
        solo_s=model.mean_service_s,
        packed_s=model.packed_service_s,
        absorbed_s=batch * model.riding_service_s,
        excursion=excursion,
        extra_share=some,
    )
    got = model.wait_tail(workers=workers, arrival_rate_rps=rate, ca2=1.0).wait_probability
    assert got == pytest.approx(chain, rel=1e-9)
    # Queued and absorbed prompts keep their workers busy: the pool waits more often
    # than Erlang's loss system (Erlang B at the solo load, from its recursion).
    blocking = 1.0
    for k in range(1, workers + 1):
        offered = rate * model.mean_service_s
        blocking = offered * blocking / (k + offered * blocking)
    assert got > blocking


@pytest.mark.parametrize("solo_load", [0.3, 0.6, 0.9])
def test_a_pool_of_multi_chunk_prompts_waits_as_erlang_c_says(
    profile: IterationProfile, solo_load: float
) -> None:
    # Every prompt runs 3 to 4 chunks and leaves less than a prompt of room in its
    # last one, so a busy worker takes exactly one queued prompt per prompt it serves,
    # at its last chunk's start, and that prompt runs in the finished one's place: for
    # the pool's all-busy time a worker is an M/G/N server that takes its next prompt
    # one iteration early, and P_w is Erlang C at the solo load. (Counted as running
    # beside the worker's own, those prompts put seed 2026 #29 of the randomised bench,
    # long prompts on 12 workers, at P_w 0.022 against 0.027-0.029 simulated.)
    rng = np.random.default_rng(5)
    prompts = rng.integers(3 * 2048 + 1100, 4 * 2048 - 1, 4000)
    lengths = LengthSamples(prompt_tokens=prompts, output_tokens=prompts, source="multi-chunk")
    model = PrefillModel.build(lengths, profile, token_budget=2048)
    assert model.one_chunk_share == 0.0
    assert model.admitted[1] == pytest.approx(1.0)  # K = 1: no second prompt fits
    workers = 6
    rate = solo_load * workers / model.mean_service_s
    got = model.wait_tail(workers=workers, arrival_rate_rps=rate, ca2=1.0).wait_probability
    assert got == pytest.approx(erlang_c(workers, rate * model.mean_service_s), rel=1e-9)


@pytest.mark.parametrize("packed_load", [0.3, 0.7, 0.95])
def test_one_worker_is_found_busy_for_the_share_of_time_it_is_busy(
    samples: LengthSamples, profile: IterationProfile, packed_load: float
) -> None:
    # Poisson arrivals see time averages: the worker is busy for lambda times its busy
    # time per prompt, the solo time for a prompt that found it idle and the packed
    # time for one it absorbed, so P = lambda (S_p + (1 - P)(S - S_p)).
    model = PrefillModel.build(samples, profile, token_budget=512)
    rate = packed_load / model.packed_service_s
    solo_load = rate * model.mean_service_s
    busy = rate * model.packed_service_s + rate * (model.mean_service_s - model.packed_service_s)
    got = model.wait_tail(workers=1, arrival_rate_rps=rate, ca2=1.0).wait_probability
    expected = solo_load / (1.0 + rate * (model.mean_service_s - model.packed_service_s))
    assert got == pytest.approx(expected, rel=1e-9)
    assert got < min(1.0, busy)


def test_while_prompts_queue_the_wait_decays_at_the_packed_drain_rate(
    samples: LengthSamples, profile: IterationProfile
) -> None:
    model = PrefillModel.build(samples, profile, token_budget=2048)
    workers = 4
    rate = 0.8 * workers / model.mean_service_s
    drain_per_s = workers / model.packed_service_s - rate
    poisson = model.wait_tail(workers=workers, arrival_rate_rps=rate, ca2=1.0)
    assert poisson.decay_rate_per_s == pytest.approx(
        drain_per_s / ((1 + model.packed_scv) / 2), rel=1e-12
    )
    # Gamma arrivals (ca2 = 2): the GI/M/c rate c mu (1 - sigma) at the packed times,
    # sigma = A*(c mu (1 - sigma)), carried to the packed SCV as (1 + ca2) / (ca2 + cs2).
    ca2 = 2.0
    service_rate = workers / model.packed_service_s
    sigma = optimize.brentq(
        lambda x: (1 + service_rate * (1 - x) * ca2 / rate) ** (-1 / ca2) - x, 0.0, 0.9999
    )
    bursty = model.wait_tail(workers=workers, arrival_rate_rps=rate, ca2=ca2)
    expected = service_rate * (1 - sigma) * (1 + ca2) / (ca2 + model.packed_scv)
    assert bursty.decay_rate_per_s == pytest.approx(expected, rel=1e-9)


def _md1_wait_cdf(x: float, *, rate: float, service_s: float) -> float:
    """Erlang's M/D/1 waiting-time distribution: (1 - rho) sum_{k <= x/D} of
    (lambda (k D - x))^k / k! e^(-lambda (k D - x))."""
    rho = rate * service_s
    total = 0.0
    for k in range(int(x // service_s) + 1):
        u = rate * (k * service_s - x)
        total += u**k / math.factorial(k) * math.exp(-u)
    return (1.0 - rho) * total


@pytest.mark.parametrize("rho", [0.3, 0.6, 0.85])
def test_the_exact_one_worker_wait_is_erlangs_for_constant_service(rho: float) -> None:
    service_s, quantile = 0.2, 0.99
    rate = rho / service_s
    x = mg1_wait_quantile_s(
        np.array([service_s]), np.array([1.0]), arrival_rate_rps=rate, quantile=quantile
    )
    assert x is not None
    # The grid's answer brackets the closed form's quantile to within a cell or two.
    cell = max(20.0 * max(rate * service_s**2 / (2 * (1 - rho)), service_s), 2 * service_s) / 4096
    assert _md1_wait_cdf(x - 2 * cell, rate=rate, service_s=service_s) < quantile
    assert _md1_wait_cdf(x + 2 * cell, rate=rate, service_s=service_s) >= quantile


def test_the_exact_one_worker_wait_matches_a_lindley_recursion_for_a_heavy_mix() -> None:
    # 95 % short prompts, 5 % forty times as long.
    service = np.array([0.05, 2.0])
    weights = np.array([0.95, 0.05])
    rate = 0.7 / float(np.dot(service, weights))
    x = mg1_wait_quantile_s(service, weights, arrival_rate_rps=rate, quantile=0.99)
    rng = np.random.default_rng(3)
    p99s = []
    for _ in range(8):  # independent runs: a t-interval over their P99s
        n = 200_000
        gaps = rng.exponential(1.0 / rate, n)
        s = rng.choice(service, size=n, p=weights)
        w = np.empty(n)
        w[0] = 0.0
        for i in range(1, n):
            w[i] = max(0.0, w[i - 1] + s[i - 1] - gaps[i])
        p99s.append(float(np.quantile(w[n // 10 :], 0.99)))
    mean = float(np.mean(p99s))
    half = 2.365 * float(np.std(p99s, ddof=1)) / math.sqrt(len(p99s))
    assert x is not None and abs(x - mean) <= half + 0.01 * mean


def _heavy_tailed_model() -> PrefillModel:
    # Lomax (Pareto II) prompts, tail index 1.9, clipped at 32k tokens.
    rng = np.random.default_rng(11)
    prompts = np.minimum(32_000, np.ceil(800 * (rng.pareto(1.9, 20_000) + 1e-3))).astype(np.int64)
    samples = LengthSamples(
        prompt_tokens=prompts, output_tokens=np.full(len(prompts), 100), source="lomax"
    )
    return PrefillModel.build(samples, TEST_8B, token_budget=2048)


def test_one_worker_with_a_heavy_tailed_mix_waits_as_its_exact_tail_says_and_continuously_in_ca2(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _heavy_tailed_model()
    rate = 0.7 / model.packed_service_s

    def p99(ca2: float) -> float:
        return model.ttft_quantile_s(workers=1, arrival_rate_rps=rate, ca2=ca2, quantile=0.99)

    matched = p99(1.0)
    # Nearby measured ca2 (never exactly 1) get nearly the same answer.
    assert p99(0.999) == pytest.approx(matched, rel=2e-3)
    assert p99(1.001) == pytest.approx(matched, rel=2e-3)
    # Without the exact wait (a model built after it is taken away, as a model keeps
    # the exact waits it computed) the exponential tail puts the P99 lower.
    monkeypatch.setattr("queueing.prefill.mg1_wait_quantile_s", lambda *a, **k: None)
    model = _heavy_tailed_model()
    assert p99(1.0) < 0.95 * matched


def _co_packed_groups(
    rng: np.random.Generator,
    *,
    rate: float,
    ca2: float,
    boundary_rate: float,
    boundary_scv: float,
    n: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Monte Carlo of what the model derives: Gamma-renewal arrivals and an
    independent renewal stream of boundaries (Gamma gaps), each taking every prompt
    queued since the last; for each arrival, how many others its boundary takes with
    it, and how many of those arrived before it."""
    gaps = rng.gamma(1.0 / ca2, ca2 / rate, n)
    arrivals = np.cumsum(gaps)
    count = int(n * boundary_rate / rate * 1.2)
    spans = rng.gamma(1.0 / boundary_scv, boundary_scv / boundary_rate, count)
    boundaries = np.cumsum(spans)
    taken_at = np.searchsorted(boundaries, arrivals)  # the boundary that takes each arrival
    keep = taken_at < len(boundaries)
    taken_at = taken_at[keep]
    group_sizes = np.bincount(taken_at)
    counts: np.ndarray = group_sizes[taken_at] - 1
    # Arrivals are in time order, so a group's members are consecutive.
    first_of_group = np.searchsorted(taken_at, taken_at, side="left")
    ahead: np.ndarray = np.arange(len(taken_at)) - first_of_group
    return counts[n // 10 :], ahead[n // 10 :]


@pytest.mark.parametrize(
    ("ca2", "boundary_scv"),
    [(1.0, 1.0), (4.0, 1.0), (1.0, 0.25)],
    ids=["poisson-arrivals", "clustered-arrivals", "regular-boundaries"],
)
def test_a_prompt_that_waits_briefly_shares_its_iteration_as_a_simulated_queue_packs_it(
    ca2: float, boundary_scv: float
) -> None:
    # Every prompt 250 tokens, a budget of 1000: a waiting prompt's iteration holds
    # it and min(K, 3) others, K the prompts its boundary takes beside it. The band
    # fills are the band means of that fill over the simulated K (the law is exact
    # for Poisson boundaries, and for Poisson arrivals whatever the boundaries).
    budget, length = 1000, 250
    samples = LengthSamples(
        prompt_tokens=np.full(1000, length), output_tokens=np.full(1000, 10), source="test"
    )
    model = PrefillModel.build(samples, TEST_8B, token_budget=budget)
    rate, boundary_rate = 40.0, 60.0
    leftover_s = model.fresh_fill_s
    co_packed = model.co_packing.fills(
        boundary_rate_per_s=boundary_rate,
        boundary_scv=boundary_scv,
        arrival_rate_rps=rate,
        ca2=ca2,
        leftover_s=leftover_s,
        queued_at_boundary=1.0,
    )
    # Five prompts ahead fill the budget whole, so the prompt is never split.
    assert co_packed.split_share[0] == 0.0
    fills = co_packed.bands_s[:, 0]
    counts, _ = _co_packed_groups(
        np.random.default_rng(3),
        rate=rate,
        ca2=ca2,
        boundary_rate=boundary_rate,
        boundary_scv=boundary_scv,
        n=400_000,
    )
    simulated = np.sort(np.minimum(counts, (budget - length) // length) * length * TEST_8B.t_tok_s)
    bands = np.asarray(_FILL_BANDS)
    edges = np.rint(bands * len(simulated)).astype(int)
    # Counts are whole prompts: a wrong law of K moves a band's mean by a good part of
    # one prompt's fill (the Poisson law for ca2 = 4 by 0.3 to 1 of it); the Monte
    # Carlo's noise on 40,000 boundaries is a few hundredths of one.
    tolerance = 0.1 * length * TEST_8B.t_tok_s
    for b in range(len(bands) - 1):
        chunk = simulated[edges[b] : edges[b + 1]]
        assert fills[b] == pytest.approx(float(chunk.mean()), abs=tolerance), (b, fills)


@pytest.mark.parametrize("ca2", [1.0, 4.0], ids=["poisson-arrivals", "clustered-arrivals"])
def test_a_prompt_is_split_when_the_prompts_ahead_leave_some_budget_but_too_little(
    ca2: float,
) -> None:
    # Every prompt 300 tokens, a budget of 1000: with three prompts ahead (900 tokens)
    # only 100 are left and the prompt runs over two iterations; with four or more
    # ahead nothing is left and it waits for the next boundary whole. So the split
    # share is the chance of exactly three ahead, and the split adds t0, the 900
    # tokens ahead and, when its second boundary finds work queued, the fill of its
    # second iteration (800 tokens of room) by a queue like the prompts ahead.
    budget, length = 1000, 300
    samples = LengthSamples(
        prompt_tokens=np.full(1000, length), output_tokens=np.full(1000, 10), source="test"
    )
    model = PrefillModel.build(samples, TEST_8B, token_budget=budget)
    rate, boundary_rate, queued = 40.0, 60.0, 0.4
    co_packed = model.co_packing.fills(
        boundary_rate_per_s=boundary_rate,
        boundary_scv=1.0,
        arrival_rate_rps=rate,
        ca2=ca2,
        leftover_s=model.fresh_fill_s,
        queued_at_boundary=queued,
    )
    _, ahead = _co_packed_groups(
        np.random.default_rng(5),
        rate=rate,
        ca2=ca2,
        boundary_rate=boundary_rate,
        boundary_scv=1.0,
        n=400_000,
    )
    split = float(np.mean(ahead == 3))
    assert co_packed.split_share[0] == pytest.approx(split, abs=0.004)
    assert co_packed.band_mass[:, 0].sum() == pytest.approx(1.0 - co_packed.split_share[0])
    queue_tokens = np.minimum(ahead * length, 800)
    expected_s = TEST_8B.t0_s + TEST_8B.t_tok_s * (900 + queued * float(queue_tokens.mean()))
    assert co_packed.split_extra_s[0] == pytest.approx(expected_s, rel=0.01)


@pytest.mark.parametrize(
    ("draw", "kappa"),
    [
        (lambda rng, n: rng.exponential(1.0, n), 0.5),
        (lambda rng, n: rng.uniform(0.0, 1.0, n), 2.0 / 3.0),
        (lambda rng, n: np.full(n, 0.3), 1.0),
    ],
)
def test_kappa_is_a_half_for_exponential_times_two_thirds_for_uniform_and_one_for_equal(
    draw: Callable[[np.random.Generator, int], np.ndarray], kappa: float
) -> None:
    # E[min(S1, S2)] / E[S]: 1/2 / 1 (exponential), 1/3 / 1/2 (uniform), S / S (equal).
    got = pair_min_share(draw(np.random.default_rng(3), 200_000))
    assert got == pytest.approx(kappa, abs=0.01)


@pytest.mark.parametrize(("theta_per_s", "others_per_s"), [(1e-3, 0.0), (40.0, 0.0), (40.0, 60.0)])
def test_the_brief_waits_bands_hold_its_mean_and_the_band_means_of_a_monte_carlo(
    theta_per_s: float, others_per_s: float
) -> None:
    # The brief wait: the end X D of the iteration in progress, X of density
    # proportional to 1 - e^(-theta D x) on [0, 1], unless another worker's boundary,
    # Exp(others), comes first.
    iteration_s = 0.05
    bands = brief_wait_bands_s(theta_per_s, iteration_s, others_per_s)
    _, mean_s = _fresh_start_wait_s(theta_per_s, iteration_s, others_per_s)
    masses = np.diff(_FILL_BANDS)
    assert float((bands * masses).sum()) == pytest.approx(mean_s, rel=2e-3)
    assert np.all(np.diff(bands) > 0)
    rng = np.random.default_rng(9)
    n = 400_000
    a = theta_per_s * iteration_s
    x = rng.uniform(0.0, 1.0, 4 * n)
    x = x[rng.uniform(0.0, 1.0, 4 * n) * -math.expm1(-a) < -np.expm1(-a * x)][:n]
    wait = np.minimum(x * iteration_s, rng.exponential(1.0 / max(others_per_s, 1e-12), x.size))
    ordered = np.sort(wait)
    cuts = (np.array(_FILL_BANDS) * ordered.size).astype(int)
    simulated = np.array([ordered[lo:hi].mean() for lo, hi in itertools.pairwise(cuts)])
    assert bands == pytest.approx(simulated, rel=0.01, abs=2e-4)


def _equal_prompts(tokens: int) -> LengthSamples:
    return LengthSamples(
        prompt_tokens=np.full(2000, tokens, dtype=np.int64),
        output_tokens=np.full(2000, 100, dtype=np.int64),
        source="equal",
    )


@pytest.mark.parametrize(("workers", "rho"), [(8, 0.12), (6, 0.16), (4, 0.3)])
def test_bursts_of_alike_prompts_wait_as_often_as_a_simulated_pool_of_equal_service(
    profile: IterationProfile, workers: int, rho: float
) -> None:
    # One-chunk prompts of one length: a worker serves each alone for S, so the pool
    # is GI/D/N, where a burst finds its own earlier members busy and none frees
    # early; GI/M/N's chance of waiting is half the simulated one here.
    model = PrefillModel.build(_equal_prompts(1500), profile, token_budget=2048)
    rate = rho * workers / model.mean_service_s
    # P(wait) does not depend on the time unit: unit service at the same load rho.
    simulated, _, _ = simulate_equal_service(
        servers=workers, rho=rho, ca2=4.0, arrivals=300_000, seed=21
    )
    tail = model.wait_tail(workers=workers, arrival_rate_rps=rate, ca2=4.0)
    assert tail.wait_probability == pytest.approx(simulated, rel=0.12)
    # Poisson arrivals keep the two-rate chain's answer: the factor is 1 at ca2 = 1.
    poisson = model.wait_tail(workers=workers, arrival_rate_rps=rate, ca2=1.0)
    exponential = model.wait_tail(workers=workers, arrival_rate_rps=rate, ca2=1.0 + 1e-9)
    assert exponential.wait_probability == pytest.approx(poisson.wait_probability, rel=1e-6)


@pytest.mark.parametrize("ca2", [0.0, 0.5])
def test_arrivals_smoother_than_poisson_wait_no_longer_than_poisson_ones(
    profile: IterationProfile, ca2: float
) -> None:
    model = PrefillModel.build(_equal_prompts(1500), profile, token_budget=2048)
    kwargs = {"workers": 4, "arrival_rate_rps": 0.6 * 4 / model.mean_service_s, "quantile": 0.99}
    smooth = model.ttft_quantile_s(ca2=ca2, **kwargs)
    assert math.isfinite(smooth)
    assert smooth <= model.ttft_quantile_s(ca2=1.0, **kwargs)


def test_a_pool_packed_almost_to_its_size_waits_with_a_probability_of_at_most_one(
    profile: IterationProfile,
) -> None:
    # Short prompts on a wide budget near the packed capacity: the solo load is far
    # beyond the pool, the packed one just under it. The chance of waiting stays a
    # probability, and a high one, and the P99 grows without bound
    # (the wait's decay rate vanishes at the packed capacity).
    model = _short_prompts_on_a_wide_budget(profile)
    workers = 4
    for ca2 in (0.5, 1.0, 4.0):
        for packed_load in (0.9, 0.99, 0.9995, 0.99999):
            rate = packed_load * workers / model.packed_service_s
            p = model.wait_tail(workers=workers, arrival_rate_rps=rate, ca2=ca2).wait_probability
            assert 0.8 < p <= 1.0
        calm, saturated = (
            model.ttft_quantile_s(
                workers=workers,
                arrival_rate_rps=load * workers / model.packed_service_s,
                ca2=ca2,
                quantile=0.99,
            )
            for load in (0.5, 0.99999)
        )
        assert saturated > 1000 * calm
