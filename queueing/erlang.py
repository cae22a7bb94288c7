"""Erlang B and C, computed in log space so that any number of servers is safe.

Erlang B is the probability that a Poisson(a) variable equals ``c`` given that it is at
most ``c``:  B(c, a) = P(X = c) / P(X <= c),  X ~ Poisson(a).  The numerator comes
from ``gammaln`` in log space and the denominator from the regularised upper
incomplete gamma function, Q(c + 1, a) = P(X <= c), so neither factorials nor powers
are ever formed and nothing overflows at 10^5 servers or more. Erlang C follows from
B by the standard identity C = B / (1 - rho * (1 - B)), rho = a / c.
"""

from __future__ import annotations

import math

from scipy import special


def _check_servers(servers: int) -> None:
    if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
        raise ValueError(f"servers: must be an integer >= 1, got {servers!r}")


def _check_positive(name: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")


def erlang_b(servers: int, offered_load_erlangs: float) -> float:
    """Blocking probability of an M/M/c/c loss system (any load >= 0)."""
    _check_servers(servers)
    if not math.isfinite(offered_load_erlangs) or offered_load_erlangs < 0:
        raise ValueError(
            f"offered_load_erlangs: must be a finite number >= 0, got {offered_load_erlangs!r}"
        )
    a = float(offered_load_erlangs)
    if a == 0.0:
        return 0.0
    log_pmf = servers * math.log(a) - a - float(special.gammaln(servers + 1))
    cdf = float(special.gammaincc(servers + 1, a))
    if cdf <= 0.0:  # far past overload every server is busy: B -> 1
        return 1.0
    return min(1.0, math.exp(log_pmf) / cdf)


def erlang_c(servers: int, offered_load_erlangs: float) -> float:
    """Probability that an arrival waits in an M/M/c queue.

    ``offered_load_erlangs`` is a = lambda / mu. Raises ``ValueError`` for an unstable
    queue (a >= servers), where every arrival eventually waits and no steady state
    exists.
    """
    _check_servers(servers)
    _check_positive("offered_load_erlangs", offered_load_erlangs)
    if offered_load_erlangs >= servers:
        raise ValueError(
            f"offered_load_erlangs: {offered_load_erlangs!r} >= servers {servers}: "
            "the queue is unstable"
        )
    b = erlang_b(servers, offered_load_erlangs)
    rho = offered_load_erlangs / servers
    return b / (1.0 - rho * (1.0 - b))


def mmc_wait_quantile(
    arrival_rate_rps: float, service_rate_rps: float, servers: int, quantile: float
) -> float:
    """The ``quantile`` of the waiting time in queue of an M/M/c queue, in seconds.

    P(W > t) = C * exp(-(c * mu - lambda) * t), so the quantile is 0 when the
    probability of waiting C is at most 1 - quantile, and ln(C / (1 - q)) / (c mu - lambda)
    otherwise. Raises ``ValueError`` when an argument is out of range or the queue is
    unstable (lambda >= c * mu).
    """
    _check_positive("arrival_rate_rps", arrival_rate_rps)
    _check_positive("service_rate_rps", service_rate_rps)
    _check_servers(servers)
    if not (0.0 < quantile < 1.0):
        raise ValueError(f"quantile: must be in (0, 1), got {quantile!r}")
    capacity_rps = servers * service_rate_rps
    if arrival_rate_rps >= capacity_rps:
        raise ValueError(
            f"arrival_rate_rps: {arrival_rate_rps!r} >= servers * service_rate_rps "
            f"= {capacity_rps!r}: the queue is unstable"
        )
    wait_probability = erlang_c(servers, arrival_rate_rps / service_rate_rps)
    tail = 1.0 - quantile
    if wait_probability <= tail:
        return 0.0
    return math.log(wait_probability / tail) / (capacity_rps - arrival_rate_rps)
