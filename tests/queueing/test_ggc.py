"""The two-moment G/G/c wait tail."""

from __future__ import annotations

import math

import numpy as np
import pytest

from queueing import erlang_c
from queueing.ggc import (
    WaitTail,
    _gim_sigma,
    _gim_wait_probability_smooth,
    arrival_transform,
    ggc_wait_tail,
    gid_wait,
)
from tests.queueing.equal_service import simulate_equal_service


@pytest.mark.parametrize(("servers", "rho"), [(1, 0.5), (4, 0.8), (50, 0.9), (2000, 0.97)])
def test_with_poisson_arrivals_and_exponential_service_it_is_exactly_mmc(
    servers: int, rho: float
) -> None:
    mean_s = 0.2
    lam = rho * servers / mean_s
    tail = ggc_wait_tail(arrival_rate_rps=lam, mean_service_s=mean_s, servers=servers, ca2=1, cs2=1)
    assert tail.wait_probability == pytest.approx(erlang_c(servers, lam * mean_s), rel=1e-12)
    assert tail.decay_rate_per_s == pytest.approx(servers / mean_s - lam, rel=1e-12)


@pytest.mark.parametrize(
    ("ca2", "rho", "rel"), [(1.0, 0.7, 1e-12), (2.0, 0.999, 2e-3), (4.0, 0.999, 3e-3)]
)
def test_single_server_conditional_wait_is_kingmans_in_heavy_traffic(
    ca2: float, rho: float, rel: float
) -> None:
    # For c = 1 Kingman's mean wait is rho/(1-rho) * (ca2+cs2)/2 * E[S]: exact for
    # Poisson arrivals here at any load, the heavy-traffic limit otherwise.
    mean_s, cs2 = 0.1, 0.5
    tail = ggc_wait_tail(
        arrival_rate_rps=rho / mean_s, mean_service_s=mean_s, servers=1, ca2=ca2, cs2=cs2
    )
    kingman_conditional = 1 / (1 - rho) * (ca2 + cs2) / 2 * mean_s
    assert tail.mean_s / tail.wait_probability == pytest.approx(kingman_conditional, rel=rel)


def test_burstier_arrivals_wait_more_and_longer() -> None:
    kwargs = {"arrival_rate_rps": 80.0, "mean_service_s": 0.1, "servers": 10, "cs2": 0.5}
    calm = ggc_wait_tail(ca2=1.0, **kwargs)
    bursty = ggc_wait_tail(ca2=4.0, **kwargs)
    assert bursty.wait_probability > calm.wait_probability
    assert bursty.decay_rate_per_s < calm.decay_rate_per_s


def test_unstable_queue_is_rejected_with_the_load_named() -> None:
    with pytest.raises(ValueError, match="unstable"):
        ggc_wait_tail(arrival_rate_rps=10, mean_service_s=1, servers=10, ca2=1, cs2=1)


def test_wait_quantile_inverts_the_survival() -> None:
    tail = WaitTail(wait_probability=0.3, decay_rate_per_s=5.0)
    t = tail.quantile_s(0.99)
    assert tail.survival(t) == pytest.approx(0.01, rel=1e-12)
    assert t == pytest.approx(math.log(30) / 5.0)
    assert WaitTail(wait_probability=0.005, decay_rate_per_s=1.0).quantile_s(0.99) == 0.0


# --- bursty arrivals on few servers: the exact GI/M/c answer ---------------------


def _simulate_gim_c(
    *, servers: int, rho: float, ca2: float, arrivals: int, seed: int
) -> tuple[float, float]:
    """P(wait) and the mean wait of those who wait in a FCFS queue with Gamma renewal
    arrivals (SCV ca2) and exponential service of mean 1, by the Kiefer-Wolfowitz
    recursion (the sorted times at which each server next frees up)."""
    rng = np.random.default_rng(seed)
    lam = rho * servers
    shape = 1.0 / ca2
    gaps = rng.gamma(shape, 1.0 / (shape * lam), size=arrivals)
    services = rng.exponential(1.0, size=arrivals)
    free = np.zeros(servers)
    now = 0.0
    waits = np.empty(arrivals)
    for i in range(arrivals):
        now += gaps[i]
        k = int(np.argmin(free))
        start = max(now, free[k])
        waits[i] = start - now
        free[k] = start + services[i]
    waits = waits[arrivals // 20 :]
    waited = waits[waits > 0]
    return float(len(waited) / len(waits)), float(waited.mean())


@pytest.mark.parametrize("servers", [1, 2, 4, 7, 16, 64])
@pytest.mark.parametrize("rho", [0.3, 0.5, 0.75, 0.9])
def test_the_gim_c_formula_is_erlang_c_for_poisson_arrivals(servers: int, rho: float) -> None:
    # Includes c (1 - rho) = j exactly (c = 4, rho = 0.5 or 0.75), a removable 0/0.
    lam = rho * servers
    sigma = _gim_sigma(lam, 1.0, servers, 1.0 + 1e-13)
    assert sigma == pytest.approx(rho, rel=1e-9)
    exact = _gim_wait_probability_smooth(lam, 1.0, servers, 1.0 + 1e-13, sigma)
    assert exact == pytest.approx(erlang_c(servers, lam), rel=1e-6)


@pytest.mark.parametrize(("servers", "rho", "ca2"), [(4, 0.3, 4.0), (1, 0.5, 2.0), (8, 0.6, 4.0)])
def test_bursty_arrivals_on_few_servers_wait_as_often_and_as_long_as_simulated(
    servers: int, rho: float, ca2: float
) -> None:
    tail = ggc_wait_tail(
        arrival_rate_rps=rho * servers, mean_service_s=1.0, servers=servers, ca2=ca2, cs2=1.0
    )
    p_sim, mean_sim = _simulate_gim_c(servers=servers, rho=rho, ca2=ca2, arrivals=60_000, seed=3)
    # 60,000 correlated arrivals: a few per cent of sampling error.
    assert tail.wait_probability == pytest.approx(p_sim, rel=0.08)
    assert 1.0 / tail.decay_rate_per_s == pytest.approx(mean_sim, rel=0.1)


@pytest.mark.parametrize("ca2", [0.0, 0.5, 1.0, 4.0])
def test_the_arrival_transform_is_the_chance_a_gap_ends_before_an_exponential_clock(
    ca2: float,
) -> None:
    lam, s = 3.0, 5.0
    rng = np.random.default_rng(11)
    n = 200_000
    gaps = (
        np.full(n, 1.0 / lam)
        if ca2 == 0.0
        else rng.gamma(1.0 / ca2, ca2 / lam, n)  # mean 1/lam, SCV ca2
    )
    beaten = gaps < rng.exponential(1.0 / s, n)
    expected = arrival_transform(s, arrival_rate_rps=lam, ca2=ca2)
    assert expected == pytest.approx(float(beaten.mean()), abs=4 * math.sqrt(0.25 / n))
    if ca2 == 1.0:
        assert expected == pytest.approx(lam / (lam + s), rel=1e-12)


@pytest.mark.parametrize(("servers", "rho"), [(1, 0.5), (1, 0.9)])
def test_equal_service_with_poisson_arrivals_on_one_server_is_pollaczek_khinchine(
    servers: int, rho: float
) -> None:
    wait = gid_wait(arrival_rate_rps=rho, service_s=1.0, servers=servers, ca2=1.0)
    assert wait.wait_probability == pytest.approx(rho, rel=1e-6)
    assert wait.mean_wait_s == pytest.approx(rho / (2.0 * (1.0 - rho)), rel=1e-5)


@pytest.mark.parametrize(
    ("servers", "rho", "ca2"), [(8, 0.12, 4.0), (6, 0.16, 4.0), (4, 0.75, 2.0), (3, 0.4, 1.0)]
)
def test_equal_service_waits_as_often_and_as_long_as_a_simulated_fcfs_queue(
    servers: int, rho: float, ca2: float
) -> None:
    wait = gid_wait(arrival_rate_rps=rho * servers, service_s=1.0, servers=servers, ca2=ca2)
    p_sim, mean_sim, half_width = simulate_equal_service(
        servers=servers, rho=rho, ca2=ca2, arrivals=200_000, seed=17
    )
    assert wait.wait_probability == pytest.approx(p_sim, rel=0.06, abs=2e-3)
    assert abs(wait.mean_wait_s - mean_sim) <= half_width + 1e-3


@pytest.mark.parametrize("ca2", [0.0, 1e-9])
def test_evenly_spaced_arrivals_below_saturation_never_wait_for_equal_service(ca2: float) -> None:
    wait = gid_wait(arrival_rate_rps=7.9, service_s=1.0, servers=8, ca2=ca2)
    assert wait.wait_probability == 0.0
    assert wait.mean_wait_s == 0.0


def test_bursts_on_equal_servers_wait_more_often_than_on_exponential_ones() -> None:
    # Equal service times free no worker early, so a burst larger than the idle
    # workers waits in full; exponential ones free one at once.
    kwargs = {"arrival_rate_rps": 8 * 0.12, "servers": 8}
    equal = gid_wait(service_s=1.0, ca2=4.0, **kwargs)
    exponential = ggc_wait_tail(mean_service_s=1.0, ca2=4.0, cs2=1.0, **kwargs)
    assert equal.wait_probability > 1.8 * exponential.wait_probability


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"arrival_rate_rps": 5.0, "service_s": 1.0, "servers": 4, "ca2": 1.0}, "load"),
        ({"arrival_rate_rps": 1.0, "service_s": 1.0, "servers": 0, "ca2": 1.0}, "servers"),
        ({"arrival_rate_rps": 1.0, "service_s": 1.0, "servers": 2, "ca2": -1.0}, "ca2"),
    ],
)
def test_bad_gid_input_is_rejected_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        gid_wait(**kwargs)
