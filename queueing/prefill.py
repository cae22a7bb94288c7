"""Prefill pool: the P99 TTFT of N workers pulling from one shared queue (DESIGN §3.2).

A prefill worker runs a prompt of L tokens in chunks of at most the token budget tau,
so on its own the prompt takes ceil(L / tau) iterations:

    S(L) = ceil(L / tau) * t0 + t_tok * L + t_attn * L (L + 1) / 2

(the attention term counts causal query-key pairs, which do not depend on the
chunking). The first token leaves the worker at the end of the last chunk, so

    TTFT = W + S

with W the wait in the shared queue, a G/G/N queue handled by
``queueing.ggc.ggc_wait_tail``.

Packing: when prompts are queued, a worker fills the rest of a prompt's last
iteration with the next prompt's first chunk, so the fixed cost t0 is paid per
*budget* of tokens (L / tau iterations) instead of per prompt (ceil(L / tau)). The
busy time per prompt is therefore between the packed and the solo service time;
the share packed is the probability that a worker finds work queued when it
finishes a prompt, which for a FCFS queue equals the probability of waiting P_w.
P_w is taken at the packed time (one G/G/c evaluation; the whole correction is at
most one t0 per prompt). Stability needs only the packed time:
lambda * E[S_packed] < N.

Sharing iterations changes a prompt's own time too (``_shared_iteration_terms``):

* a queued prompt is picked up by the worker that frees up first. If that worker's
  previous prompt needed several chunks (probability p_multi, the share of prompts
  longer than tau), the queued prompt rides in the iteration of that prompt's last
  chunk (a tokens, from the empirical last-chunk distribution) and finishes
  ceil((a + L) / tau) iterations later; otherwise it starts a fresh iteration;
* when work is still queued at a prompt's last chunk, the rest of that iteration is
  filled by the next prompt (probability P_w for a queued prompt, P_w * rho for one
  that found a worker idle — work queues only while every worker is busy).

So TTFT is S (alone), S + fill (alone, last iteration filled), or W' + S_waited
(queued: W' the conditional wait, exponential, independent of the prompt's own
length under FCFS). The P99 is the quantile of that mixture, computed exactly —
not the sum of two P99s. The measured error against the simulator is in
``docs/model.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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


def _shared_iteration_terms(
    profile: IterationProfile, lengths: FloatArray, service: FloatArray, token_budget: int
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Per prompt: the time from pick-up to first token of a queued prompt (without and
    per unit of P_w), and the fill of a lone multi-chunk prompt's last iteration.

    The worker that frees up for a queued prompt is either done with its previous
    prompt (probability 1 - p_multi: the queued prompt starts a fresh iteration and
    takes its solo time) or scheduling that prompt's last chunk of ``a`` tokens
    (p_multi = the share of prompts longer than tau; ``a`` follows the empirical
    last-chunk distribution at 8 equal-mass points). In the second case the queued
    prompt gets tau - a tokens into that shared, full iteration and the rest in the
    iterations after it. Either way, when work is still queued, its last iteration
    is filled by the next prompt.
    """
    tau = float(token_budget)
    multi = lengths > tau
    p_multi = float(multi.mean())
    if p_multi > 0:
        last_chunks = lengths[multi] - (np.ceil(lengths[multi] / tau) - 1.0) * tau
        ahead = np.quantile(last_chunks, (np.arange(8) + 0.5) / 8)[None, :]  # equal masses
    else:
        ahead = np.zeros((1, 1))
    solo_iterations = np.ceil(lengths / tau)
    # Fresh start: the solo service, and the fill of its last iteration.
    fresh_fill = profile.t_tok_s * (solo_iterations * tau - lengths)
    # Shared start: tau - a tokens ride in the shared iteration, the rest follows.
    first = np.minimum(tau - ahead, lengths[:, None])
    rest = lengths[:, None] - first
    iterations = np.ceil(rest / tau - 1e-12)
    pairs_left = lengths[:, None] * (lengths[:, None] + 1.0) / 2.0 - first * (first + 1.0) / 2.0
    # The shared iteration itself (full: a + first tokens) is still ahead of the
    # queued prompt when the worker picks it, so it counts towards its first token.
    shared_iteration = profile.t0_s + profile.t_tok_s * (ahead + first)
    shared_base = (
        shared_iteration
        + iterations * profile.t0_s
        + profile.t_tok_s * rest
        + profile.t_attn_s * pairs_left
        + profile.t_attn_s * first * (first + 1.0) / 2.0
    )
    shared_fill = profile.t_tok_s * (iterations * tau - rest)
    waited_base: FloatArray = (1.0 - p_multi) * service + p_multi * shared_base.mean(axis=1)
    waited_per_pw: FloatArray = (1.0 - p_multi) * fresh_fill + p_multi * shared_fill.mean(axis=1)
    fill_alone: FloatArray = np.where(multi, fresh_fill, 0.0)
    return waited_base, waited_per_pw, fill_alone


class UnstableQueueError(ValueError):
    """The offered load meets or exceeds the pool's capacity."""


@dataclass(frozen=True, kw_only=True, eq=False)
class PrefillModel:
    """The prefill pool's service-time distribution, reduced to sorted classes.

    ``service_s`` (ascending) and ``weights`` are the classes; ``mean_service_s`` and
    ``service_scv`` are exact over all samples.
    """

    service_s: FloatArray
    fill_alone_s: FloatArray  # a multi-chunk prompt's last iteration filled by queued work
    waited_base_s: FloatArray  # span of a prompt that waited, without the P_w term
    waited_per_pw_s: FloatArray  # ... plus this times P_w (the next prompt's chunk)
    weights: FloatArray
    mean_service_s: float
    packed_service_s: float
    service_scv: float
    token_budget: int
    _floors: dict[float, float] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(
        cls, samples: LengthSamples, profile: IterationProfile, *, token_budget: int
    ) -> PrefillModel:
        service = prefill_service_s(profile, samples.prompt_tokens.astype(np.float64), token_budget)
        strata = stratify(service)
        mean = float(service.mean())
        lengths = samples.prompt_tokens.astype(np.float64)
        iterations_saved = np.ceil(lengths / token_budget) - lengths / token_budget
        waited_base, waited_per_pw, fill_alone = _shared_iteration_terms(
            profile, lengths, service, token_budget
        )
        return cls(
            service_s=strata.means(service),
            fill_alone_s=strata.means(fill_alone),
            waited_base_s=strata.means(waited_base),
            waited_per_pw_s=strata.means(waited_per_pw),
            weights=strata.weights,
            mean_service_s=mean,
            packed_service_s=mean - profile.t0_s * float(iterations_saved.mean()),
            service_scv=float(service.var() / (mean * mean)),
            token_budget=token_budget,
        )

    def utilisation(self, *, workers: int, arrival_rate_rps: float, ca2: float = 1.0) -> float:
        """Busy fraction of a worker: lambda * (busy time per prompt) / N."""
        if arrival_rate_rps * self.packed_service_s >= workers:
            return arrival_rate_rps * self.packed_service_s / workers
        busy_s = self.busy_service_s(workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2)
        return arrival_rate_rps * busy_s / workers

    def is_stable(self, *, workers: int, arrival_rate_rps: float) -> bool:
        return arrival_rate_rps * self.packed_service_s < workers

    def min_stable_workers(self, arrival_rate_rps: float) -> int:
        """The fewest workers that can keep up: lambda * E[S_packed] < N."""
        return max(1, math.floor(arrival_rate_rps * self.packed_service_s) + 1)

    def busy_service_s(self, *, workers: int, arrival_rate_rps: float, ca2: float) -> float:
        """Mean busy time per prompt: packed + (1 - P_w) * (solo - packed).

        P_w is taken at the packed time: slightly high, so the busy time is slightly
        low, but solo and packed differ by at most one t0 per prompt, so the error is
        a small fraction of that. Near saturation the busy time is kept below
        N / lambda (there P_w -> 1 and it tends to packed anyway).
        """
        packed = self.packed_service_s
        p_wait = ggc_wait_tail(
            arrival_rate_rps=arrival_rate_rps,
            mean_service_s=packed,
            servers=workers,
            ca2=ca2,
            cs2=self.service_scv,
        ).wait_probability
        busy_s = packed + (1.0 - p_wait) * (self.mean_service_s - packed)
        ceiling_s = packed + 0.5 * (workers / arrival_rate_rps - packed)
        return min(busy_s, ceiling_s)

    def wait_tail(self, *, workers: int, arrival_rate_rps: float, ca2: float) -> WaitTail:
        """Tail of the queueing wait; raises ``UnstableQueueError`` when overloaded."""
        return self._tail_and_busy(workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2)[0]

    def _tail_and_busy(
        self, *, workers: int, arrival_rate_rps: float, ca2: float
    ) -> tuple[WaitTail, float]:
        if not self.is_stable(workers=workers, arrival_rate_rps=arrival_rate_rps):
            raise UnstableQueueError(
                f"prefill_workers: {workers} workers cannot serve "
                f"{arrival_rate_rps:.4g} req/s of {self.packed_service_s:.4g} s prompts"
            )
        busy_s = self.busy_service_s(workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2)
        tail = ggc_wait_tail(
            arrival_rate_rps=arrival_rate_rps,
            mean_service_s=busy_s,
            servers=workers,
            ca2=ca2,
            cs2=self.service_scv,
        )
        return tail, busy_s

    def _atoms(
        self, *, workers: int, arrival_rate_rps: float, ca2: float
    ) -> tuple[FloatArray, FloatArray, FloatArray, float]:
        """TTFT atoms: values, weight without wait, weight with wait, and the wait's rate.

        Three groups per class: served alone, served alone but with the last iteration
        filled by queued work, and queued (probability P_w; plus the exponential
        conditional wait). A lone prompt's last iteration is filled when work is
        queued at that moment: probability P_w * rho, the M/M/c chance of a
        non-empty queue (waiting work exists only while every worker is busy).
        """
        tail, busy_s = self._tail_and_busy(
            workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2
        )
        pw = tail.wait_probability
        filled = pw * min(1.0, arrival_rate_rps * busy_s / workers)
        w = self.weights
        zeros = np.zeros_like(w)
        values = np.concatenate(
            [
                self.service_s,
                self.service_s + self.fill_alone_s,
                self.waited_base_s + pw * self.waited_per_pw_s,
            ]
        )
        no_wait = np.concatenate([w * (1.0 - pw) * (1.0 - filled), w * (1.0 - pw) * filled, zeros])
        with_wait = np.concatenate([zeros, zeros, w * pw])
        return values, no_wait, with_wait, tail.decay_rate_per_s

    def ttft_survival(
        self, *, workers: int, arrival_rate_rps: float, ca2: float, ttft_s: float
    ) -> float:
        """P(TTFT > ttft_s)."""
        values, no_wait, with_wait, theta = self._atoms(
            workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2
        )
        above = values > ttft_s
        waited = np.exp(-theta * np.maximum(ttft_s - values, 0.0))
        return float(no_wait[above].sum() + (with_wait * waited).sum())

    def ttft_quantile_s(
        self, *, workers: int, arrival_rate_rps: float, ca2: float, quantile: float
    ) -> float:
        """The ``quantile`` of TTFT in seconds."""
        values, no_wait, with_wait, theta = self._atoms(
            workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2
        )
        order = np.argsort(values, kind="stable")
        return mixed_atoms_quantile(
            values[order], no_wait[order], with_wait[order], theta, quantile
        )

    def floor_quantile_s(self, quantile: float) -> float:
        """The TTFT quantile with unlimited workers (no wait): the service quantile."""
        # Load-independent, so computed once per quantile (the solver asks every solve).
        cached = self._floors.get(quantile)
        if cached is None:
            no_wait = WaitTail(wait_probability=0.0, decay_rate_per_s=1.0)
            cached = quantile_of_sum(self.service_s, self.weights, no_wait, quantile)
            self._floors[quantile] = cached
        return cached


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
    """The ``quantile`` of W + S for S on sorted atoms, W with an exponential ``tail``."""
    pw = tail.wait_probability
    return mixed_atoms_quantile(
        values_s, weights * (1.0 - pw), weights * pw, tail.decay_rate_per_s, quantile
    )


def mixed_atoms_quantile(
    values_s: FloatArray,
    no_wait: FloatArray,
    with_wait: FloatArray,
    decay_rate_per_s: float,
    quantile: float,
) -> float:
    """Exact quantile of a mixture of atoms, some plus an exponential wait.

    Atom i sits at ``values_s[i]`` (sorted ascending); ``no_wait[i]`` of probability
    is the atom alone, ``with_wait[i]`` the atom plus an Exp(theta) wait. Between
    consecutive atoms s_k <= x < s_(k+1) the survival is
    A_k + exp(-theta * x) * E_k, with A_k the mass of atoms above s_k and
    E_k = sum_(i<=k) with_wait_i * exp(theta * s_i) (kept in log space), so each
    segment's crossing has a closed form; the answer lies in the first segment whose
    right end is at or below 1 - quantile.
    """
    if not (0.0 < quantile < 1.0):
        raise ValueError(f"quantile: must be in (0, 1), got {quantile!r}")
    p = 1.0 - quantile
    theta = decay_rate_per_s
    mass_above = 1.0 - np.cumsum(no_wait + with_wait)  # A_k
    mass_above[-1] = 0.0
    with np.errstate(divide="ignore"):
        log_e = np.logaddexp.accumulate(np.log(with_wait) + theta * values_s)
    next_atom = np.append(values_s[1:], np.inf)
    right_end = mass_above + np.exp(log_e - theta * next_atom)
    # A tolerance keeps a quantile that falls exactly on a class edge (the classes
    # have equal masses) from jumping between neighbouring atoms on rounding noise.
    tolerance = 1e-12
    k = int(np.argmax(right_end <= p + tolerance))  # the last segment always qualifies
    gap = p - float(mass_above[k])
    if gap <= tolerance or log_e[k] == -math.inf:
        return float(values_s[k])
    crossing = (float(log_e[k]) - math.log(gap)) / theta
    return max(float(values_s[k]), crossing)
