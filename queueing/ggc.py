"""Waiting time in a G/G/c queue from two moments of each process.

The model keeps the shape of the M/M/c answer — a probability of waiting and an
exponential tail for the wait of those who wait — and corrects both for the
variability of arrivals (inter-arrival SCV ``ca2``) and of service (SCV ``cs2``):

* Conditional wait. Given that a job waits, its wait is taken as exponential with
  mean  z / (c * mu * (1 - rho)),  z = (ca2 + cs2) / 2. For z = 1 this is exact for
  M/M/c; the factor z is the Allen–Cunneen / Kingman two-moment correction, exact in
  heavy traffic (Kingman 1961 for c = 1; Köllerström 1974 for c servers), see also
  W. Whitt, "Approximations for the GI/G/m queue", Production and Operations
  Management 2(2), 1993.

* Probability of waiting. Erlang C is used for z = 1. For other variability the
  Halfin–Whitt many-server limit gives P(wait) = alpha(beta / sqrt(z)) with
  alpha(x) = 1 / (1 + x * Phi(x) / phi(x)) and beta = (1 - rho) * sqrt(c)
  (S. Halfin and W. Whitt, "Heavy-traffic limits for queues with many exponential
  servers", Operations Research 29(3), 1981, where z = (1 + ca2) / 2 for GI/M/c; the
  service term uses the same two-moment substitution). We scale Erlang C by the
  ratio alpha(beta / sqrt(z)) / alpha(beta), so the formula is exact for M/M/c at
  every size and follows the many-server limit's dependence on variability.

Its error against the simulator is measured by ``bench/model_fidelity.py`` and
reported in ``docs/model.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import special

from queueing.erlang import erlang_c


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
    z = max((ca2 + cs2) / 2.0, 1e-9)
    rho = load / servers
    p_mmc = erlang_c(servers, load)
    beta = (1.0 - rho) * math.sqrt(servers)
    z_arrivals = max((ca2 + 1.0) / 2.0, 1e-9)
    correction = _log_halfin_whitt_alpha(beta / math.sqrt(z_arrivals)) - _log_halfin_whitt_alpha(
        beta
    )
    p_wait = min(1.0, p_mmc * math.exp(correction))
    decay = servers * (1.0 - rho) / (mean_service_s * z)
    return WaitTail(wait_probability=p_wait, decay_rate_per_s=decay)
