"""Erlang B/C against exact rational arithmetic and the stable Erlang-B recursion."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from queueing import erlang_c, mmc_wait_quantile
from queueing.erlang import erlang_b


def exact_erlang_c(servers: int, load: Fraction) -> Fraction:
    """Erlang C from its textbook definition, in exact rationals."""
    terms = [load**k / math.factorial(k) for k in range(servers)]
    last = load**servers / math.factorial(servers) * servers / (servers - load)
    return last / (sum(terms) + last)


def recursive_erlang_b(servers: int, load: float) -> float:
    """B(0) = 1, B(k) = a B(k-1) / (k + a B(k-1)): slow but numerically stable."""
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return b


@pytest.mark.parametrize(
    ("servers", "load"),
    [
        (1, Fraction(1, 2)),
        (2, Fraction(1)),
        (3, Fraction(27, 10)),
        (10, Fraction(9)),
        (25, Fraction(20)),
        (60, Fraction(5999, 100)),
        (40, Fraction(1, 10)),
    ],
)
def test_erlang_c_matches_exact_rational_arithmetic(servers: int, load: Fraction) -> None:
    expected = float(exact_erlang_c(servers, load))
    assert erlang_c(servers, float(load)) == pytest.approx(expected, rel=1e-12, abs=1e-300)


@pytest.mark.parametrize(
    ("servers", "rho"),
    [(1_000, 0.95), (10_000, 0.99), (100_000, 0.999), (100_000, 0.5), (250_000, 0.9995)],
)
def test_erlang_b_at_huge_server_counts_agrees_with_the_stable_recursion(
    servers: int, rho: float
) -> None:
    load = servers * rho
    assert erlang_b(servers, load) == pytest.approx(recursive_erlang_b(servers, load), rel=1e-8)


def test_erlang_c_at_one_hundred_thousand_servers_is_a_probability_without_overflow() -> None:
    value = erlang_c(100_000, 99_900.0)
    assert 0.0 < value < 1.0
    assert math.isfinite(value)


def test_erlang_c_of_one_server_is_the_utilisation() -> None:
    assert erlang_c(1, 0.37) == pytest.approx(0.37, rel=1e-12)


@pytest.mark.parametrize(
    ("servers", "load"), [(0, 1.0), (3, 3.0), (3, 4.0), (2, -1.0), (2, math.nan)]
)
def test_erlang_c_rejects_bad_or_unstable_arguments(servers: int, load: float) -> None:
    with pytest.raises(ValueError):
        erlang_c(servers, load)


def test_mmc_wait_quantile_is_zero_when_few_arrivals_wait() -> None:
    # M/M/10 at load 2: the probability of waiting is far below 1 %.
    assert mmc_wait_quantile(2.0, 1.0, 10, 0.99) == 0.0


def test_mmc_wait_quantile_inverts_the_exponential_tail() -> None:
    lam, mu, c, q = 9.0, 1.0, 10, 0.99
    t = mmc_wait_quantile(lam, mu, c, q)
    tail = float(exact_erlang_c(c, Fraction(9))) * math.exp(-(c * mu - lam) * t)
    assert tail == pytest.approx(1 - q, rel=1e-9)


def test_mmc_wait_quantile_of_mm1_has_the_closed_form() -> None:
    # M/M/1: P(W > t) = rho * exp(-(mu - lambda) t).
    lam, mu = 0.8, 1.0
    assert mmc_wait_quantile(lam, mu, 1, 0.99) == pytest.approx(math.log(0.8 / 0.01) / 0.2)


@pytest.mark.parametrize(
    "args",
    [
        (1.0, 1.0, 1, 0.99),
        (2.0, 1.0, 1, 0.99),
        (1.0, 0.0, 2, 0.99),
        (1.0, 1.0, 2, 1.0),
        (1.0, 1.0, 2, 0.0),
        (-1.0, 1.0, 2, 0.5),
        (1.0, 1.0, 0, 0.5),
    ],
)
def test_mmc_wait_quantile_rejects_unstable_or_out_of_range_arguments(
    args: tuple[float, float, int, float],
) -> None:
    with pytest.raises(ValueError):
        mmc_wait_quantile(*args)
