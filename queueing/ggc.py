"""Waiting time in a G/G/c queue from two moments of each process.

The model keeps the shape of the M/M/c answer — a probability of waiting and an
exponential tail for the wait of those who wait — and corrects both for the
variability of arrivals (inter-arrival SCV ``ca2``) and of service (SCV ``cs2``).
Arrivals with SCV ``ca2`` are represented by the Gamma renewal process of that SCV
(the two-moment choice that keeps Poisson as ``ca2 = 1``; its Laplace transform is
``A*(s) = (1 + s ca2 / lambda)^(-1 / ca2)``).

* Probability of waiting. For ``ca2 = 1`` it is Erlang C. Otherwise, with up to
  ``EXACT_GIM_SERVERS`` servers, it is the exact GI/M/c probability of waiting
  (Takács; e.g. Gross, Shortle, Thompson & Harris, *Fundamentals of Queueing
  Theory*, the GI/M/c section): ``P(wait) = J / (1 - sigma)``, sigma the root in
  (0, 1) of ``sigma = A*(c mu (1 - sigma))``, J from the boundary sums over
  ``U_j = A*(j mu)``. It equals Erlang C for Poisson arrivals (checked to 1e-12 in
  the tests) and keeps what the many-server limit loses at light load on few
  servers: Gamma arrivals with ca2 = 4 at rho = 0.3 on 4 servers wait with
  probability 0.26, where the Halfin–Whitt limit below gives 0.10. Its alternating
  sums lose precision beyond a few dozen servers, where the Halfin–Whitt many-server
  limit is accurate: P(wait) = alpha(beta / sqrt(z_a)) with
  alpha(x) = 1 / (1 + x Phi(x) / phi(x)), beta = (1 - rho) sqrt(c),
  z_a = (1 + ca2) / 2 (S. Halfin and W. Whitt, "Heavy-traffic limits for queues with
  many exponential servers", Operations Research 29(3), 1981), applied as the ratio
  alpha(beta / sqrt(z_a)) / alpha(beta) to Erlang C. Up to ``EXACT_GIM_SERVERS`` the
  larger of the two is used (the conservative side, and it keeps P(wait) falling
  with every server added across the switch).

* Conditional wait. Given that a job waits, its wait is taken as exponential. In
  GI/M/c it is exactly so, with rate ``c mu (1 - sigma)``; in heavy traffic
  ``1 - sigma -> 2 (1 - rho) / (1 + ca2)``, which is the Allen–Cunneen / Kingman rate
  ``2 c mu (1 - rho) / (ca2 + cs2)`` at ``cs2 = 1`` (Kingman 1961; W. Whitt,
  "Approximations for the GI/G/m queue", Production and Operations Management 2(2),
  1993). The rate used, ``c mu (1 - sigma) (1 + ca2) / (ca2 + cs2)``, is therefore
  exact for GI/M/c at every load and the two-moment heavy-traffic rate for general
  service; for Poisson arrivals (sigma = rho) it is the Kingman rate exactly.

Its error against the simulator is measured by ``bench/model_fidelity.py`` and
reported in ``docs/model.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import special

from queueing.erlang import erlang_c
from queueing.lengths import FloatArray

# Up to this many servers the exact GI/M/c probability of waiting is evaluated (its
# boundary sums hold 1e-12 against Erlang C there); beyond, the many-server limit.
EXACT_GIM_SERVERS = 64


def arrival_transform(s_per_s: float, *, arrival_rate_rps: float, ca2: float) -> float:
    """A*(s) = E[exp(-s X)] of the Gamma renewal arrivals' gap X (deterministic at
    ca2 = 0): the probability that a gap ends before an independent Exp(s) clock."""
    if ca2 <= 1e-12:
        return math.exp(-s_per_s / arrival_rate_rps)
    return float((1.0 + s_per_s * ca2 / arrival_rate_rps) ** (-1.0 / ca2))


def _gim_sigma(arrival_rate_rps: float, service_rate: float, servers: int, ca2: float) -> float:
    """The root sigma in (0, 1) of sigma = A*(c mu (1 - sigma)) (rho < 1).

    h(sigma) = A*(c mu (1 - sigma)) - sigma is convex (A* is) and positive at 0, so
    Newton's method from 0 climbs to the root without overshooting.
    """
    rho = arrival_rate_rps / (servers * service_rate)
    if abs(ca2 - 1.0) <= 1e-12:
        return rho
    rate = servers * service_rate
    sigma = 0.0
    for _ in range(200):
        x = rate * (1.0 - sigma)
        if ca2 <= 1e-12:
            value = math.exp(-x / arrival_rate_rps)
            slope = value / arrival_rate_rps  # -dA*/ds
        else:
            base = 1.0 + x * ca2 / arrival_rate_rps
            value = base ** (-1.0 / ca2)
            slope = value / base / arrival_rate_rps
        h = value - sigma
        step = h / (rate * slope - 1.0)  # h' = c mu (-dA*/ds) - 1 < 0 left of the root
        sigma -= step
        if abs(step) <= 1e-15:
            break
    return min(max(sigma, 0.0), rho if ca2 < 1.0 else 1.0 - 1e-15)


def _gim_wait_probability(
    arrival_rate_rps: float, service_rate: float, servers: int, ca2: float, sigma: float
) -> float:
    """Exact GI/M/c P(wait) = J / (1 - sigma) (Takács)."""
    c = servers
    j = np.arange(1, c + 1, dtype=np.float64)
    x = j * service_rate
    # log A*(s) of the Gamma renewal arrivals (deterministic spacing at ca2 = 0).
    regular = ca2 <= 1e-12
    log_u = -x / arrival_rate_rps if regular else -np.log1p(x * ca2 / arrival_rate_rps) / ca2
    u = np.exp(log_u)
    log_1mu = np.log1p(-u)
    log_cj = np.cumsum(log_u - log_1mu)
    log_binom = special.gammaln(c + 1.0) - special.gammaln(j + 1.0) - special.gammaln(c - j + 1.0)
    with np.errstate(over="ignore", invalid="ignore"):
        weight = np.exp(log_binom - log_cj - log_1mu)
        terms = weight * (c * (1.0 - u) - j) / (c * (1.0 - sigma) - j)
        total = 1.0 / (1.0 - sigma) + float(terms.sum())
    if not math.isfinite(total) or total <= 0.0:
        # The boundary weights overflow (very regular arrivals on many servers): no
        # usable exact value; the caller keeps the many-server limit.
        return 0.0
    return min(1.0, 1.0 / (total * (1.0 - sigma)))


def _gim_wait_probability_smooth(
    arrival_rate_rps: float, service_rate: float, servers: int, ca2: float, sigma: float
) -> float:
    """The GI/M/c P(wait), stepping around the removable 0/0 where c (1 - sigma) is an
    integer j (then both factors of that j's term vanish together)."""
    gap = servers * (1.0 - sigma)
    if abs(gap - round(gap)) > 1e-6 or round(gap) < 1:
        return _gim_wait_probability(arrival_rate_rps, service_rate, servers, ca2, sigma)
    values = []
    for factor in (1.0 - 1e-5, 1.0 + 1e-5):
        rate = arrival_rate_rps * factor
        shifted = _gim_sigma(rate, service_rate, servers, ca2)
        values.append(_gim_wait_probability(rate, service_rate, servers, ca2, shifted))
    return 0.5 * (values[0] + values[1])


# Spitzer's series for GI/D/c: summed in blocks that double from the first, up to
# this many terms in all (they fall geometrically, slowly near saturation, where the
# rest is bounded by the geometric series of the last ratio).
_SPITZER_FIRST_BLOCK = 64
_SPITZER_TERMS = 1_024


@dataclass(frozen=True, kw_only=True)
class GidWait:
    """The wait of FCFS Gamma renewal arrivals at c servers of equal service times."""

    wait_probability: float
    mean_wait_s: float  # over all arrivals, those that do not wait included

    @property
    def conditional_mean_s(self) -> float:
        """E[W | W > 0]."""
        return self.mean_wait_s / self.wait_probability


def _geometric_rest(terms: FloatArray) -> float:
    """The sum beyond ``terms`` of a series whose terms fall by their last ratio."""
    if terms[-2] <= 0.0:
        return 0.0
    ratio = float(terms[-1] / terms[-2])
    return float(terms[-1]) * ratio / (1.0 - ratio) if 0.0 < ratio < 1.0 else 0.0


def gid_wait(*, arrival_rate_rps: float, service_s: float, servers: int, ca2: float) -> GidWait:
    """Exact P(wait) and mean wait of FCFS Gamma renewal arrivals (SCV ``ca2``) at c
    servers of constant service time ``service_s``.

    With equal service times customer n starts when customer n - c leaves, so the
    queue is a GI/D/1 queue fed every c-th arrival, whose gaps are Gamma of shape
    c / ca2 and rate lambda / ca2, and Spitzer's identity gives
    P(no wait) = exp(-sum_k P(S_k > 0) / k) and E[W] = sum_k E[max(S_k, 0)] / k,
    S_k = k D - T_k, T_k the sum of k such gaps (F. Spitzer, "A combinatorial lemma
    and its application to probability theory", Trans. AMS 82, 1956; the
    every-c-th reduction holds only for constant service). With shape s = c / ca2 and
    x = lambda D / ca2, P(S_k > 0) is the regularised incomplete gamma P(k s, k x) and
    E[max(S_k, 0)] / k = D P(k s, k x) - (c / lambda) P(k s + 1, k x).

    The series are summed to ``_SPITZER_TERMS`` terms and a geometric rest: exact to
    1e-6 up to rho = 0.9 on one server and to 1e-9 at rho = 0.95 on 32, low near
    saturation (M/D/1 at rho = 0.99: P(wait) 0.984 for 0.99, mean 31 for 49.5).
    """
    if servers < 1:
        raise ValueError(f"servers: must be >= 1, got {servers!r}")
    rho = arrival_rate_rps * service_s / servers
    if not (0.0 < rho < 1.0):
        raise ValueError(f"arrival_rate_rps: load {rho:.6g} per server must be in (0, 1)")
    if not (math.isfinite(ca2) and ca2 >= 0.0):
        raise ValueError(f"ca2: must be a finite number >= 0, got {ca2!r}")
    if ca2 == 0.0:
        # Evenly spaced arrivals: customer n - c left D <= c / lambda after it came.
        return GidWait(wait_probability=0.0, mean_wait_s=0.0)
    shape = servers / ca2
    x = arrival_rate_rps * service_s / ca2
    gap_s = servers / arrival_rate_rps
    log_idle = 0.0
    mean_s = 0.0
    start, size = 1, _SPITZER_FIRST_BLOCK
    while True:
        k = np.arange(start, start + size, dtype=np.float64)
        started = special.gammainc(k * shape, k * x)
        log_terms = started / k
        mean_terms = service_s * started - gap_s * special.gammainc(k * shape + 1.0, k * x)
        log_idle += float(log_terms.sum())
        mean_s += float(mean_terms.sum())
        start += size
        if log_terms[-1] <= 1e-15 * log_idle:
            break
        if start + 2 * size > _SPITZER_TERMS + 1:
            # The rest of each series, by the geometric series of its last ratio.
            log_idle += _geometric_rest(log_terms)
            mean_s += _geometric_rest(mean_terms)
            break
        size *= 2
    return GidWait(wait_probability=-math.expm1(-log_idle), mean_wait_s=max(mean_s, 0.0))


def _log_halfin_whitt_alpha(beta: float) -> float:
    """log alpha(beta), alpha(beta) = 1 / (1 + beta * Phi(beta) / phi(beta)).

    Phi(b) / phi(b) = sqrt(pi / 2) * erfc(-b / sqrt 2) * exp(b^2 / 2); working with its
    logarithm keeps large beta (many servers at moderate load) from overflowing.
    """
    if beta <= 0.0:
        return 0.0
    log_ratio = (
        0.5 * math.log(math.pi / 2.0)
        + math.log(float(special.erfc(-beta / math.sqrt(2.0))))
        + 0.5 * beta * beta
    )
    return -float(np.logaddexp(0.0, math.log(beta) + log_ratio))


@dataclass(frozen=True, kw_only=True)
class WaitTail:
    """P(W > t) = wait_probability * exp(-decay_rate_per_s * t) for t >= 0."""

    wait_probability: float
    decay_rate_per_s: float

    def __post_init__(self) -> None:
        if not (0.0 <= self.wait_probability <= 1.0):
            raise ValueError(f"wait_probability: must be in [0, 1], got {self.wait_probability!r}")
        if not (math.isfinite(self.decay_rate_per_s) and self.decay_rate_per_s > 0):
            raise ValueError(
                f"decay_rate_per_s: must be a finite number > 0, got {self.decay_rate_per_s!r}"
            )

    def survival(self, t_s: float) -> float:
        """P(W > t_s)."""
        if t_s < 0:
            return 1.0
        return self.wait_probability * math.exp(-self.decay_rate_per_s * t_s)

    def quantile_s(self, quantile: float) -> float:
        """The ``quantile`` of W in seconds (0 when P(wait) <= 1 - quantile)."""
        tail = 1.0 - quantile
        if self.wait_probability <= tail:
            return 0.0
        return math.log(self.wait_probability / tail) / self.decay_rate_per_s

    @property
    def mean_s(self) -> float:
        return self.wait_probability / self.decay_rate_per_s


def ggc_wait_tail(
    *,
    arrival_rate_rps: float,
    mean_service_s: float,
    servers: int,
    ca2: float,
    cs2: float,
) -> WaitTail:
    """Two-moment G/G/c waiting-time tail (see the module docstring for the sources).

    Raises ``ValueError`` when an argument is out of range or the queue is unstable
    (arrival_rate_rps * mean_service_s >= servers).
    """
    if not (math.isfinite(arrival_rate_rps) and arrival_rate_rps > 0):
        raise ValueError(f"arrival_rate_rps: must be a finite number > 0, got {arrival_rate_rps!r}")
    if not (math.isfinite(mean_service_s) and mean_service_s > 0):
        raise ValueError(f"mean_service_s: must be a finite number > 0, got {mean_service_s!r}")
    for name, value in (("ca2", ca2), ("cs2", cs2)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
    load = arrival_rate_rps * mean_service_s
    if load >= servers:
        raise ValueError(
            f"arrival_rate_rps: offered load {load:.6g} >= servers {servers}: the queue is unstable"
        )
    rho = load / servers
    service_rate = 1.0 / mean_service_s
    p_mmc = erlang_c(servers, load)
    if abs(ca2 - 1.0) <= 1e-12:
        p_wait = p_mmc
        sigma = rho
    else:
        beta = (1.0 - rho) * math.sqrt(servers)
        z_arrivals = max((ca2 + 1.0) / 2.0, 1e-9)
        correction = _log_halfin_whitt_alpha(
            beta / math.sqrt(z_arrivals)
        ) - _log_halfin_whitt_alpha(beta)
        p_wait = min(1.0, p_mmc * math.exp(correction))
        sigma = _gim_sigma(arrival_rate_rps, service_rate, servers, ca2)
        if servers <= EXACT_GIM_SERVERS:
            exact = _gim_wait_probability_smooth(
                arrival_rate_rps, service_rate, servers, ca2, sigma
            )
            p_wait = min(1.0, max(p_wait, exact))
    z = max((ca2 + cs2) / 2.0, 1e-9)
    z_gim = max((ca2 + 1.0) / 2.0, 1e-9)
    decay = servers * service_rate * (1.0 - sigma) * z_gim / z
    return WaitTail(wait_probability=p_wait, decay_rate_per_s=decay)
