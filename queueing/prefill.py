"""Prefill pool: the P99 TTFT of N workers pulling from one shared queue (DESIGN §3.2).

A prefill worker runs a prompt of L tokens in chunks of at most the token budget tau,
so on its own the prompt takes ceil(L / tau) iterations:

    S(L) = ceil(L / tau) * t0 + t_tok * L + t_attn * L (L + 1) / 2

(the attention term counts causal query-key pairs, which do not depend on the
chunking). The first token leaves the worker at the end of the last chunk, so

    TTFT = W + S

with W the wait in the shared queue, a G/G/N queue handled by
``queueing.ggc.ggc_wait_tail``. W of a request does not depend on its own S (FCFS), so
P(TTFT > x) = sum_i w_i P(W > x - s_i) over the service classes, and the P99 is the
quantile of that sum — not the sum of two P99s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from queueing.ggc import WaitTail, ggc_wait_tail
from queueing.lengths import FloatArray, LengthSamples, stratify
from queueing.profile import IterationProfile


def prefill_service_s(
    profile: IterationProfile, prompt_tokens: FloatArray, token_budget: int
) -> FloatArray:
    """Seconds a worker with nothing else to do needs for each prompt (vectorised)."""
    if token_budget < 1:
        raise ValueError(f"token_budget: must be >= 1, got {token_budget!r}")
    lengths = np.asarray(prompt_tokens, dtype=np.float64)
    iterations = np.ceil(lengths / token_budget)
    result: FloatArray = (
        iterations * profile.t0_s
        + profile.t_tok_s * lengths
        + profile.t_attn_s * lengths * (lengths + 1.0) / 2.0
    )
    return result


class UnstableQueueError(ValueError):
    """The offered load meets or exceeds the pool's capacity."""


@dataclass(frozen=True, kw_only=True, eq=False)
class PrefillModel:
    """The prefill pool's service-time distribution, reduced to sorted classes.

    ``service_s`` (ascending) and ``weights`` are the classes; ``mean_service_s`` and
    ``service_scv`` are exact over all samples.
    """

    service_s: FloatArray
    weights: FloatArray
    mean_service_s: float
    service_scv: float
    token_budget: int

    @classmethod
    def build(
        cls, samples: LengthSamples, profile: IterationProfile, *, token_budget: int
    ) -> PrefillModel:
        service = prefill_service_s(profile, samples.prompt_tokens.astype(np.float64), token_budget)
        strata = stratify(service)
        mean = float(service.mean())
        return cls(
            service_s=strata.means(service),
            weights=strata.weights,
            mean_service_s=mean,
            service_scv=float(service.var() / (mean * mean)),
            token_budget=token_budget,
        )

    def utilisation(self, *, workers: int, arrival_rate_rps: float) -> float:
        """Offered load per worker: lambda * E[S] / N."""
        return arrival_rate_rps * self.mean_service_s / workers

    def min_stable_workers(self, arrival_rate_rps: float) -> int:
        """The fewest workers with utilisation below 1."""
        return max(1, math.floor(arrival_rate_rps * self.mean_service_s) + 1)

    def wait_tail(self, *, workers: int, arrival_rate_rps: float, ca2: float) -> WaitTail:
        """Tail of the queueing wait; raises ``UnstableQueueError`` at utilisation >= 1."""
        utilisation = self.utilisation(workers=workers, arrival_rate_rps=arrival_rate_rps)
        if utilisation >= 1.0:
            raise UnstableQueueError(
                f"prefill_workers: {workers} workers cannot serve "
                f"{arrival_rate_rps:.4g} req/s of {self.mean_service_s:.4g} s prompts "
                f"(utilisation {utilisation:.3f})"
            )
        return ggc_wait_tail(
            arrival_rate_rps=arrival_rate_rps,
            mean_service_s=self.mean_service_s,
            servers=workers,
            ca2=ca2,
            cs2=self.service_scv,
        )

    def ttft_survival(
        self, *, workers: int, arrival_rate_rps: float, ca2: float, ttft_s: float
    ) -> float:
        """P(TTFT > ttft_s)."""
        tail = self.wait_tail(workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2)
        return survival_of_sum(self.service_s, self.weights, tail, ttft_s)

    def ttft_quantile_s(
        self, *, workers: int, arrival_rate_rps: float, ca2: float, quantile: float
    ) -> float:
        """The ``quantile`` of TTFT in seconds."""
        tail = self.wait_tail(workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2)
        return quantile_of_sum(self.service_s, self.weights, tail, quantile)

    def floor_quantile_s(self, quantile: float) -> float:
        """The TTFT quantile with unlimited workers (no wait): the service quantile."""
        no_wait = WaitTail(wait_probability=0.0, decay_rate_per_s=1.0)
        return quantile_of_sum(self.service_s, self.weights, no_wait, quantile)


def survival_of_sum(values_s: FloatArray, weights: FloatArray, tail: WaitTail, x_s: float) -> float:
    """P(W + S > x) for S on the sorted atoms ``values_s`` and W with ``tail``."""
    above = values_s > x_s
    mass_above = float(weights[above].sum())
    below = ~above
    waited = tail.wait_probability * np.exp(-tail.decay_rate_per_s * (x_s - values_s[below]))
    return mass_above + float((weights[below] * waited).sum())


def quantile_of_sum(
    values_s: FloatArray, weights: FloatArray, tail: WaitTail, quantile: float
) -> float:
    """The ``quantile`` of W + S, exactly, for S on sorted atoms and W's exponential tail.

    Between consecutive atoms s_k <= x < s_(k+1) the survival is
    A_k + P_w * exp(-theta * x) * E_k, with A_k the mass above s_k and
    E_k = sum_(i<=k) w_i exp(theta s_i) (kept in log space), so each segment's
    crossing has a closed form; the answer is in the first segment whose right end
    is at or below 1 - quantile.
    """
    if not (0.0 < quantile < 1.0):
        raise ValueError(f"quantile: must be in (0, 1), got {quantile!r}")
    p = 1.0 - quantile
    theta = tail.decay_rate_per_s
    mass_above = 1.0 - np.cumsum(weights)  # A_k
    mass_above[-1] = 0.0
    with np.errstate(divide="ignore"):
        log_e = np.logaddexp.accumulate(np.log(weights) + theta * values_s)
        log_pw = math.log(tail.wait_probability) if tail.wait_probability > 0 else -math.inf
    next_atom = np.append(values_s[1:], np.inf)
    right_end = mass_above + np.exp(log_pw + log_e - theta * next_atom)
    k = int(np.argmax(right_end <= p))  # the last segment always qualifies (survival -> 0)
    gap = p - float(mass_above[k])
    if gap <= 0.0 or log_pw == -math.inf:
        return float(values_s[k])
    crossing = (log_pw + float(log_e[k]) - math.log(gap)) / theta
    return max(float(values_s[k]), crossing)
