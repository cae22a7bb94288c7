"""The two-moment G/G/c wait tail."""

from __future__ import annotations

import math

import pytest

from queueing import erlang_c
from queueing.ggc import WaitTail, ggc_wait_tail


@pytest.mark.parametrize(("servers", "rho"), [(1, 0.5), (4, 0.8), (50, 0.9), (2000, 0.97)])
def test_with_poisson_arrivals_and_exponential_service_it_is_exactly_mmc(
    servers: int, rho: float
) -> None:
    mean_s = 0.2
    lam = rho * servers / mean_s
    tail = ggc_wait_tail(arrival_rate_rps=lam, mean_service_s=mean_s, servers=servers, ca2=1, cs2=1)
    assert tail.wait_probability == pytest.approx(erlang_c(servers, lam * mean_s), rel=1e-12)
    assert tail.decay_rate_per_s == pytest.approx(servers / mean_s - lam, rel=1e-12)


def test_single_server_mean_wait_is_the_kingman_formula() -> None:
    # For c = 1 the model's mean wait is rho/(1-rho) * (ca2+cs2)/2 * E[S] (Kingman).
    rho, mean_s, ca2, cs2 = 0.7, 0.1, 2.0, 0.5
    tail = ggc_wait_tail(
        arrival_rate_rps=rho / mean_s, mean_service_s=mean_s, servers=1, ca2=ca2, cs2=cs2
    )
    kingman = rho / (1 - rho) * (ca2 + cs2) / 2 * mean_s
    # P(wait) differs from rho by the Halfin-Whitt factor; the conditional mean is exact.
    assert tail.mean_s / tail.wait_probability == pytest.approx(kingman / rho, rel=1e-12)


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
