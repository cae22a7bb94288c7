from __future__ import annotations

import math

import numpy as np
import pytest

from queueing.absorption import (
    admitted_pmf,
    all_busy_probability,
    excursion_extras,
    excursion_ratio,
)


def _erlang_b(servers: int, load: float) -> float:
    blocking = 1.0
    for k in range(1, servers + 1):
        blocking = load * blocking / (k + load * blocking)
    return blocking


def test_a_boundary_admits_the_prompts_whose_tokens_fit_in_its_room() -> None:
    # Prompts of 300 tokens into a whole budget of 1,000: 300, 600 and 900 tokens
    # leave room, so the fourth starts too (split); 1,200 would not.
    pmf = admitted_pmf(np.full(100, 300.0), 1000, room_tokens=np.full(10, 1000.0))
    assert pmf[4] == pytest.approx(1.0)
    # A prompt as long as the budget leaves no room for a second.
    assert admitted_pmf(np.full(100, 1000.0), 1000, room_tokens=np.full(10, 1000.0))[
        1
    ] == pytest.approx(1.0)


def test_an_admitted_count_law_is_a_probability_law() -> None:
    rng = np.random.default_rng(3)
    lengths = rng.lognormal(np.log(400), 1.0, 5000)
    pmf = admitted_pmf(lengths, 2048, room_tokens=rng.uniform(0, 2048, 300))
    assert pmf.sum() == pytest.approx(1.0)
    assert (pmf >= 0).all()
    assert pmf[0] == 0.0  # the head is always admitted


def test_one_prompt_per_boundary_is_the_m_m_1_queue() -> None:
    one = np.array([0.0, 1.0])
    x = excursion_ratio(arrival_rate_rps=3.0, boundary_rate_per_s=5.0, admitted=one)
    # M/M/1: P(q >= 1) / P(q = 0) = rho / (1 - rho) with rho = 3 / 5.
    assert x == pytest.approx(0.6 / 0.4, rel=1e-9)


def test_boundaries_that_empty_the_queue_leave_it_queued_lambda_over_beta() -> None:
    everything = np.zeros(65)
    everything[-1] = 1.0  # 64 at a time: the queue never holds more
    x = excursion_ratio(arrival_rate_rps=3.0, boundary_rate_per_s=5.0, admitted=everything)
    assert x == pytest.approx(3.0 / 5.0, rel=1e-6)


def test_a_bulk_queue_excursion_matches_a_simulation_of_it() -> None:
    # Arrivals at 4/s, boundaries at 3/s each admitting 1, 2 or 3 (equally likely)
    # of those queued: P(q >= 1) / P(q = 0) from a direct event simulation.
    law = np.array([0.0, 1 / 3, 1 / 3, 1 / 3])
    lam, beta = 4.0, 3.0
    rng = np.random.default_rng(7)
    q, t_empty, t_queued = 0, 0.0, 0.0
    for _ in range(400_000):
        dt = rng.exponential(1.0 / (lam + beta))
        if q == 0:
            t_empty += dt
        else:
            t_queued += dt
        if rng.random() < lam / (lam + beta):
            q += 1
        else:
            q = max(0, q - int(rng.integers(1, 4)))
    simulated = t_queued / t_empty
    got = excursion_ratio(arrival_rate_rps=lam, boundary_rate_per_s=beta, admitted=law)
    assert got == pytest.approx(simulated, rel=0.03)


def test_a_queue_the_boundaries_cannot_keep_up_with_never_empties() -> None:
    one = np.array([0.0, 1.0])
    assert math.isinf(excursion_ratio(arrival_rate_rps=5.0, boundary_rate_per_s=5.0, admitted=one))


@pytest.mark.parametrize("workers,load", [(1, 0.6), (4, 2.5), (12, 9.0)])
def test_without_extras_the_pool_is_erlangs_loss_system_plus_the_queue(
    workers: int, load: float
) -> None:
    excursion = 0.4
    blocking = _erlang_b(workers, load)
    got = all_busy_probability(
        workers=workers,
        arrival_rate_rps=load / 0.1,
        solo_s=0.1,
        packed_s=0.08,
        absorbed_s=0.08,
        excursion=excursion,
        extra_share=0.0,
    )
    assert got == pytest.approx(blocking * (1 + excursion) / (1 + blocking * excursion), rel=1e-9)


def _simulated_all_busy(
    workers: int, lam: float, solo_s: float, absorbed_s: float, extra_share: float, events: int
) -> float:
    """The share of time at b = N of the (busy, extras) chain, simulated event by
    event: an independent check of the banded solve and of the extras' tail."""
    rng = np.random.default_rng(19)
    b = e = 0
    at_n = total = 0.0
    for _ in range(events):
        loaded = min(e, b)
        rates = np.array(
            [
                lam if b < workers else lam * extra_share,
                (b - loaded) / solo_s,
                loaded / absorbed_s,
            ]
        )
        out = rates.sum()
        dt = rng.exponential(1.0 / out)
        total += dt
        if b == workers:
            at_n += dt
        u = rng.random() * out
        move = 0 if u < rates[0] else (1 if u < rates[0] + rates[1] else 2)
        if move == 0:
            if b < workers:
                b += 1
            else:
                e += 1
        elif move == 1:
            b -= 1
        else:
            e -= 1
    return at_n / total


def test_absorbed_extras_hold_the_pool_busy_as_a_simulation_of_the_chain_says() -> None:
    workers, lam, solo_s, absorbed_s, share = 4, 30.0, 0.1, 0.09, 0.8
    simulated = _simulated_all_busy(workers, lam, solo_s, absorbed_s, share, 300_000)
    got = all_busy_probability(
        workers=workers,
        arrival_rate_rps=lam,
        solo_s=solo_s,
        packed_s=absorbed_s,
        absorbed_s=absorbed_s,
        excursion=0.0,
        extra_share=share,
    )
    assert got == pytest.approx(simulated, rel=0.04)
    # ... and above Erlang B, which holds without extras.
    assert got > 1.2 * _erlang_b(workers, lam * solo_s)


def test_extras_that_outgrow_the_pool_keep_every_worker_busy() -> None:
    # Extras arrive faster than N workers run them: the chain's mass runs to the tail.
    got = all_busy_probability(
        workers=2,
        arrival_rate_rps=30.0,
        solo_s=0.1,
        packed_s=0.08,
        absorbed_s=0.08,
        excursion=0.5,
        extra_share=0.9,
    )
    assert got == 1.0


def test_bad_chain_parameters_are_named() -> None:
    with pytest.raises(ValueError, match="extra_share"):
        all_busy_probability(
            workers=2,
            arrival_rate_rps=1.0,
            solo_s=0.1,
            packed_s=0.1,
            absorbed_s=0.1,
            excursion=0,
            extra_share=2,
        )
    with pytest.raises(ValueError, match="absorbed_s"):
        all_busy_probability(
            workers=2,
            arrival_rate_rps=1.0,
            solo_s=0.1,
            packed_s=0.1,
            absorbed_s=0,
            excursion=0,
            extra_share=0.5,
        )
    with pytest.raises(ValueError, match="token_budget"):
        admitted_pmf(np.ones(3), 0, room_tokens=np.ones(3))


def test_an_excursion_that_a_boundary_empties_leaves_its_later_arrivals_as_extras() -> None:
    # A boundary that admits everything ends an excursion at the first boundary, an
    # exponential time at rate beta: the arrivals behind the head are geometric, so
    # some come with probability lambda / (lambda + beta) and, when they do, 1 + X of
    # them on average (X = lambda / beta).
    lam, beta = 3.0, 5.0
    everything = np.zeros(65)
    everything[-1] = 1.0
    x = excursion_ratio(arrival_rate_rps=lam, boundary_rate_per_s=beta, admitted=everything)
    some, batch = excursion_extras(excursion=x, admitted=everything)
    assert some == pytest.approx(lam / (lam + beta), rel=1e-9)
    assert batch == pytest.approx(1.0 + lam / beta, rel=1e-6)


def test_a_boundary_with_room_for_two_leaves_at_most_one_extra() -> None:
    two = np.array([0.0, 0.0, 1.0])
    some, batch = excursion_extras(excursion=0.5, admitted=two)
    assert some == pytest.approx(0.5 / 1.5)
    assert batch == pytest.approx(1.0)
    # ... and one with room for the head alone leaves none.
    assert excursion_extras(excursion=0.5, admitted=np.array([0.0, 1.0]))[0] == 0.0


def test_a_bad_excursion_is_named() -> None:
    with pytest.raises(ValueError, match="excursion"):
        excursion_extras(excursion=-1.0, admitted=np.array([0.0, 1.0]))
