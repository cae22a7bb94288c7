"""Prefill pool: the P99 TTFT of N workers pulling from one shared queue (DESIGN §3.2).

A prefill worker runs a prompt of L tokens in chunks of at most the token budget tau,
so on its own the prompt takes ceil(L / tau) iterations:

    S(L) = ceil(L / tau) * t0 + t_tok * L + t_attn * L (L + 1) / 2

(the attention term counts causal query-key pairs, which do not depend on the
chunking). The first token leaves the worker at the end of the last chunk.

A worker admits queued prompts at an iteration boundary whenever its running prompts
leave budget over — at the start of a prompt's last chunk, not at its end — and
fills the iteration with as many as fit. While prompts queue, every worker runs
full iterations of tau tokens, D = t0 + t_tok * tau each, so it serves the queue as
a stream of tokens: a prompt costs its share of the iterations, the packed time
L / tau * t0 + t_tok * L + attention, and the queue drains at N / E[S_packed] - lambda.
Stability needs lambda * E[S_packed] < N.

The wait is that of a G/G/N queue (``queueing.ggc.ggc_wait_tail``) in this token
stream: P_w from the solo times, scaled by the chain of ``queueing.absorption``
(queued prompts are absorbed by busy workers at boundaries with budget to spare,
and keep only their own worker busy), the exponential tail's rate theta from the
packed times (mean and SCV). Bursts on workers
of alike solo times wait more often than GI/M/N says, as none of the workers a burst
started frees early: P_w takes the exact GI/D/N ratio for that (``_burst_factor``,
``queueing.ggc.gid_wait``), at the weight of the solo times' regularity. Call it W_f, the
time until the workers' streams reach the prompt. The iteration holding that point
started V earlier, V uniform on [0, D) (the stream's offset within an iteration):

* W_f >= V: the worker admits the prompt at the start of that iteration; the
  admission wait W_f - V is again exponential (memoryless), with mass
  P_w (1 - e^-a) / a, a = theta * D, and the prompt then needs ceil((o + L) / tau)
  full iterations, o the tokens ahead of it: the queue ahead, which the N workers
  take tau at a time, modulo tau (``_StreamTerms.at``);
* W_f < V: it arrived while that iteration was running and is admitted at its end
  or, sooner, at another busy worker's boundary with budget to spare — after less
  than an iteration (``_fresh_start_wait_s``, spread over its bands by
  ``brief_wait_bands_s``; the boundaries of workers a burst started together come
  together); then it starts a fresh iteration, or rides in another prompt's last
  chunk when that boundary was a last chunk's start.

The last iteration of a prompt is filled by queued work, when there is any: for a
prompt admitted into the stream, whenever one arrived during its wait (probability
lambda / (lambda + theta) for an exponential wait); for one that found an idle worker
with the probability that a boundary with budget to spare finds work queued,
P_w / E[min(chunks, 2)] (waiting prompts are taken one per such boundary, and a
prompt run alone has min(chunks, 2) of them). A one-chunk prompt that waited briefly
shares its iteration with the prompts taken at the same boundary: those that arrived
since the boundary before it and those that arrive during its wait, K of them
(``_CoPacking``), so its fill is a distribution, not a mean: with a budget several
prompts wide, the few waiting prompts packed with two or three others set the P99.
The prompts ahead of it at that boundary take their tokens first; when they leave
some of the budget but less than it needs, it is split over two iterations (in
bursts, the source of most of the P99). A multi-chunk prompt's last chunk comes
iterations later, when those have gone; its fill stays the mean P_w times the
budget its last chunk leaves.

So TTFT is S (alone), S + fill (alone, last iteration filled), a short wait + S or a
ride (queued briefly), or W + the stream's iterations (W exponential); the P99 is the
exact quantile of that mixture — not the sum of two P99s. The derivation and the
measured error against the simulator are in ``docs/model.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from queueing.absorption import (
    admitted_pmf,
    all_busy_probability,
    excursion_extras,
    excursion_ratio,
)
from queueing.erlang import erlang_c
from queueing.ggc import WaitTail, arrival_transform, ggc_wait_tail, gid_wait
from queueing.lengths import FloatArray, LengthSamples, Strata, stratify
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


@dataclass(frozen=True, kw_only=True)
class _StreamTerms:
    """Per class, a prompt admitted into a running stream of full iterations.

    At an offset of o = f tau tokens into its first iteration it spans
    ceil(f + L / tau) iterations: one more than floor(L / tau), or two more when f
    passes 1 - frac(L / tau). ``at`` prices both branches for the offset's law.
    """

    whole: FloatArray  # floor(L / tau)
    fraction: FloatArray  # frac(L / tau)
    lengths: FloatArray  # L, tokens
    attention_s: FloatArray
    t0_s: float
    t_tok_s: float
    tau: float

    def at(self, decay: float) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray, FloatArray]:
        """(one more: base, fill; two more: base, fill; the share of two more) for an
        offset f in [0, 1) of density proportional to e^(-decay f) (uniform at 0),
        each branch priced at its mean offset. From admission the prompt's time to
        its first token is the branch's base, plus its fill when work fills the rest
        of its last iteration.

        Why the offset decays: the tokens ahead of the prompt in the iteration that
        admits it are the queue ahead of it, less the whole budgets the boundaries
        before took. That queue is what the N workers' streams, N tau tokens per
        iteration time D, take during its admission wait W_f - V, so
        f = frac(N (W_f - V) / D); the admission wait is exponential of rate theta
        (memoryless), and the fraction of an exponential has density proportional to
        e^(-decay f) on [0, 1), decay = theta D / N. It is uniform only when the
        wait spans many budgets of queue; a queue short against a budget finds the
        prompt near its iteration's start, and it then rarely needs one iteration
        more than its length does."""
        cut = 1.0 - self.fraction  # offsets below it end within whole + 1 iterations
        inside = _truncated_exponential_mean(decay, cut)
        beyond = cut + _truncated_exponential_mean(decay, self.fraction)
        if decay < 1e-9:
            two_share = self.fraction
        else:
            two_share = (np.exp(-decay * cut) - math.exp(-decay)) / -math.expm1(-decay)

        def branch(iterations: FloatArray, offset: FloatArray) -> tuple[FloatArray, FloatArray]:
            tokens = offset * self.tau
            base = (
                iterations * self.t0_s + self.t_tok_s * (tokens + self.lengths) + self.attention_s
            )
            fill = self.t_tok_s * (iterations * self.tau - tokens - self.lengths)
            return base, fill

        one_base, one_fill = branch(self.whole + 1.0, inside)
        two_base, two_fill = branch(self.whole + 2.0, beyond)
        return one_base, one_fill, two_base, two_fill, two_share


def _truncated_exponential_mean(decay: float, width: FloatArray) -> FloatArray:
    """The mean of x on [0, width) of density proportional to e^(-decay x):
    1 / decay - width / (e^(decay width) - 1), width / 2 at decay 0."""
    x = decay * width
    small = x < 1e-6
    safe = np.where(small, 1.0, x)
    # 1 / (e^x - 1) as e^-x / (1 - e^-x), which does not overflow at large x.
    exact = width * (1.0 / safe - np.exp(-safe) / -np.expm1(-safe))
    result: FloatArray = np.where(small, width * (0.5 - x / 12.0), exact)
    return result


# The co-packed tokens' distribution: cells per token budget, the most prompts
# summed (beyond, every cell is the budget's), and the probability bands whose mean
# fills stand for it (finer towards the tail, where the P99 of those who wait lies).
_FILL_CELLS = 256
_MAX_CO_PACKED = 512
# The most prompts one boundary's group is followed to (for the rank of a prompt in it).
_MAX_GROUP = 100_000
_FILL_BANDS = (0.0, 0.5, 0.75, 0.9, 0.96, 0.99, 1.0)
_BAND_LO = np.array(_FILL_BANDS[:-1])[:, None]
_BAND_HI = np.array(_FILL_BANDS[1:])[:, None]
_BAND_MASS = np.diff(_FILL_BANDS)
_FIRST_BAND = np.eye(1, len(_BAND_MASS))[0]


def _band_shares(cdf: FloatArray, below: FloatArray) -> FloatArray:
    """Each cell's probability inside each band (rows: bands, which cut the quantile
    axis; columns: cells, ``below`` and ``cdf`` their distribution function at their
    two ends)."""
    shares: FloatArray = np.clip(
        np.minimum(cdf[None, :], _BAND_HI) - np.maximum(below[None, :], _BAND_LO), 0.0, None
    )
    return shares


@dataclass(frozen=True, kw_only=True)
class _CoPacking:
    """The prompts a worker takes at one boundary beside a prompt that waited briefly.

    A worker that reaches a boundary with budget to spare takes the queued prompts in
    order until the budget is spent; while every worker is busy the queue empties at
    each such boundary. A prompt that waits therefore shares its iteration with the K
    prompts that arrived since the boundary before it (ahead) or arrive before the
    next one (behind). With those boundaries a Poisson stream of rate beta, its age
    and its residual are independent Exp(beta) clocks, and each gap of the arrival
    process (a renewal process) beats such a clock with probability q = A*(beta), its
    Laplace transform: each count is geometric, P(>= j) = q^j, and K, their sum, is
    negative binomial of shape 2, P(K = k) = (k + 1)(1 - q)^2 q^k (for Poisson
    arrivals q = lambda / (lambda + beta); clustered arrivals raise q at the same rate,
    so the prompts that wait wait in company).

    ``sums[k]`` is the distribution of k prompts' total tokens on cells of
    tau / ``_FILL_CELLS`` tokens, the last cell holding every total at or beyond the
    budget (a prompt's fill is at most what its chunk leaves of it); ``cell_s`` the
    cells' values times t_tok, the seconds that many tokens add to an iteration.
    """

    cell_s: FloatArray
    sums: FloatArray  # (k + 1 prompts summed, _FILL_CELLS + 1 cells)
    one_chunk: npt.NDArray[np.bool_]  # per class: every prompt runs in one chunk
    t0_s: float  # an iteration's fixed cost, which a split prompt pays twice

    @classmethod
    def build(
        cls, profile: IterationProfile, lengths: FloatArray, strata: Strata, token_budget: int
    ) -> _CoPacking:
        tau = float(token_budget)
        cell_tokens = tau / _FILL_CELLS
        index = np.minimum(np.rint(lengths / cell_tokens), _FILL_CELLS).astype(np.int64)
        one = np.bincount(index, minlength=_FILL_CELLS + 1) / len(lengths)
        rows = [np.eye(1, _FILL_CELLS + 1, 0)[0]]
        while len(rows) <= _MAX_CO_PACKED and rows[-1][:_FILL_CELLS].sum() > 1e-9:
            total = np.convolve(rows[-1], one)
            row = total[: _FILL_CELLS + 1].copy()
            row[_FILL_CELLS] += total[_FILL_CELLS + 1 :].sum()  # at or beyond the budget
            rows.append(row)
        return cls(
            cell_s=profile.t_tok_s * cell_tokens * np.arange(_FILL_CELLS + 1, dtype=np.float64),
            sums=np.array(rows),
            one_chunk=strata.means((lengths <= tau).astype(np.float64)) >= 1.0,
            t0_s=profile.t0_s,
        )

    def fills(
        self, *, boundary_rate_per_s: float, boundary_scv: float, arrival_rate_rps: float,
        ca2: float, leftover_s: FloatArray, queued_at_boundary: float,
    ) -> CoPackedFills:  # fmt: skip
        """What the prompts taken at the same boundary do to each class's prompt
        that waited briefly (``CoPackedFills``), ``leftover_s`` the seconds of budget
        its chunk leaves, ``queued_at_boundary`` the chance that a boundary finds
        work queued.

        The boundaries' gaps have SCV ``boundary_scv``: as Gamma gaps of shape
        k = 1 / SCV, the gap holding an arrival is length-biased, Gamma of shape k + 1,
        k + 1 exponential phases of rate k beta, and K is negative binomial of shape
        k + 1 with q = A*(k beta): exact for Poisson boundaries (shape 2) and, for
        any boundaries, for Poisson arrivals (K mixed Poisson over the biased gap); for
        one worker of regular iterations it tends to Poisson(lambda / beta), half the
        exponential clocks' mean.

        The worker takes them in arrival order, so the prompt's own rank among the
        K + 1 is uniform (the arrivals in a gap are exchangeable): the j ahead of it
        take their tokens first, and when they leave some of the budget but less
        than the prompt needs it is split, the rest of it in the next iteration (when
        they leave none, it stays queued for the next boundary and starts fresh).
        """
        shape = 1.0 / max(boundary_scv, 1e-3)
        q = arrival_transform(
            shape * boundary_rate_per_s, arrival_rate_rps=arrival_rate_rps, ca2=ca2
        )
        # P(K = k) = C(k + r - 1, k) (1 - q)^r q^k, by its ratio q (k - 1 + r) / k,
        # out to 40 standard deviations beyond its mean: a prompt with few ahead may
        # sit in a group of many, whose sum is past the summed rows.
        r = shape + 1.0
        rows = len(self.sums)
        gap = max(1.0 - q, 1e-12)
        terms = max(rows, min(_MAX_GROUP, math.ceil((r * q + 40.0 * math.sqrt(r * q)) / gap)))
        k = np.arange(1, terms, dtype=np.float64)
        ratios = np.concatenate([[1.0], q * (k - 1.0 + r) / k])
        group = (1.0 - q) ** r * np.cumprod(ratios)
        counts = group[:rows]
        total = counts @ self.sums
        total[-1] += max(0.0, 1.0 - float(counts.sum()))  # more prompts than summed: full
        # The j prompts ahead, j uniform on 0..K: P(j) = sum over k >= j of P(K = k) / (k + 1).
        ranks = np.cumsum((group / np.arange(1, terms + 1))[::-1])[::-1][:rows]
        ahead = ranks @ self.sums
        ahead[-1] += max(0.0, 1.0 - float(ranks.sum()))
        split_share, split_extra_s = self._split(ahead, leftover_s, queued_at_boundary)
        bands_s, band_mass = self._bands(total, leftover_s, split_share)
        return CoPackedFills(
            bands_s=bands_s,
            band_mass=band_mass,
            split_share=split_share,
            split_extra_s=split_extra_s,
        )

    def _split(
        self, ahead: FloatArray, leftover_s: FloatArray, queued_at_boundary: float
    ) -> tuple[FloatArray, FloatArray]:
        """Per class, P(the tokens ahead exceed what the prompt's chunk leaves but not
        the budget) and the mean time the split then adds to running alone: one more
        iteration's t0, the tokens ahead, and the fill of its second iteration. The
        prompts behind it are taken by other boundaries while its first iteration
        runs, so that iteration is filled only when its own boundary finds work
        queued, by a queue taken to be like the prompts ahead."""
        cells = self.cell_s
        # Running sums over the cells (their values ascend) give each class's sums
        # over the cells above its leftover and below the last, which holds every
        # total at or beyond the budget (no room for a chunk there).
        mass = np.concatenate([[0.0], np.cumsum(ahead)])
        value = np.concatenate([[0.0], np.cumsum(ahead * cells)])
        first = np.searchsorted(cells, leftover_s, side="right")  # first cell above it
        last = len(cells) - 1
        share = np.maximum(mass[last] - mass[first], 0.0)
        ahead_s = np.divide(
            value[last] - value[first], share, out=np.zeros_like(share), where=share > 1e-15
        )
        # Seconds of budget its second iteration leaves: two budgets less the tokens
        # ahead and its own; E[min(X, room)] = (sum of p v below room) + room P(X >= room).
        room_s = np.maximum(leftover_s + cells[-1] - ahead_s, 0.0)
        cut = np.searchsorted(cells, room_s, side="left")
        second_fill_s = queued_at_boundary * (value[cut] + room_s * (mass[-1] - mass[cut]))
        extra: FloatArray = self.t0_s + ahead_s + second_fill_s
        result_share: FloatArray = np.where(self.one_chunk, share, 0.0)
        return result_share, extra

    def _bands(
        self, total: FloatArray, leftover_s: FloatArray, split_share: FloatArray
    ) -> tuple[FloatArray, FloatArray]:
        """Per band of ``_FILL_BANDS`` (rows) and class (columns): the mean seconds the
        co-packed prompts add to the iteration, capped at ``leftover_s``, over the
        band's quantiles below 1 - ``split_share`` (above it the iteration is full and
        the prompt split, ``_split``), and the probability those quantiles hold."""
        cdf = np.cumsum(total)
        below = cdf - total
        lo, hi = _BAND_LO, _BAND_HI
        inside = _band_shares(cdf, below)
        # E[min(S, l); band] = (sum of p v over cells below l) + l (mass at or above l),
        # from running sums over the cells (the cells' values ascend).
        mass_below = np.cumsum(inside, axis=1)
        value_below = np.cumsum(inside * self.cell_s, axis=1)
        cut = np.searchsorted(self.cell_s, leftover_s, side="left")  # cells below l: [0, cut)
        zero = np.zeros((len(lo), 1))
        below_mass = np.concatenate([zero, mass_below], axis=1)[:, cut]
        below_value = np.concatenate([zero, value_below], axis=1)[:, cut]
        band_total = below_value + leftover_s * (hi - lo - below_mass)
        # The split quantiles sit at the cap (a split needs the tokens ahead alone to
        # pass it), so leaving them out takes the cap's value off the band.
        split_part = np.clip(hi - np.maximum(lo, 1.0 - split_share[None, :]), 0.0, hi - lo)
        kept = (hi - lo) - split_part
        bands_s: FloatArray = np.divide(
            band_total - leftover_s * split_part,
            kept,
            out=np.broadcast_to(leftover_s, kept.shape).copy(),
            where=kept > 1e-15,
        )
        return bands_s, kept


@dataclass(frozen=True, kw_only=True)
class CoPackedFills:
    """What the prompts a worker takes at one boundary do to each class's one-chunk
    prompt that waited briefly (``_CoPacking.fills``)."""

    bands_s: FloatArray  # (bands, classes): the mean fill within each band, split left out
    band_mass: FloatArray  # (bands, classes): each band's probability, split left out
    split_share: FloatArray  # per class: P(the prompts ahead leave less than it needs)
    split_extra_s: FloatArray  # per class: the mean time a split adds to running alone


def _weighted_means(strata: Strata, values: FloatArray, weights: FloatArray) -> FloatArray:
    """Per class, the mean of ``values`` weighted by ``weights`` (0 where they sum to 0)."""
    total = strata.means(weights)
    result: FloatArray = np.divide(
        strata.means(values * weights), total, out=np.zeros_like(total), where=total > 0
    )
    return result


def _stream_terms(
    profile: IterationProfile, lengths: FloatArray, strata: Strata, token_budget: int
) -> _StreamTerms:
    tau = float(token_budget)
    # A class holds alike lengths, so its mean length stands for it.
    mean_lengths = strata.means(lengths)
    whole = np.floor(mean_lengths / tau)
    return _StreamTerms(
        whole=whole,
        fraction=mean_lengths / tau - whole,
        lengths=mean_lengths,
        attention_s=strata.means(profile.t_attn_s * lengths * (lengths + 1.0) / 2.0),
        t0_s=profile.t0_s,
        t_tok_s=profile.t_tok_s,
        tau=tau,
    )


def _ride_terms(
    profile: IterationProfile, lengths: FloatArray, strata: Strata, token_budget: int
) -> tuple[FloatArray, FloatArray, float]:
    """Per class, a prompt admitted at the start of another prompt's last chunk.

    The other prompt's last chunk has ``a`` tokens (the empirical last-chunk
    distribution of multi-chunk prompts, at 8 equal-mass points); the admitted prompt
    gets min(tau - a, L) tokens of that iteration and the rest after it. Returns its
    time from admission to first token (the iteration it shares counted in full),
    the fill of its last iteration, and the share of a lone worker's boundaries with
    budget to spare that are such starts (the others are ends of prompts).
    """
    tau = float(token_budget)
    chunks = np.ceil(lengths / tau)
    multi = chunks > 1
    service = prefill_service_s(profile, lengths, token_budget)
    if not multi.any():
        fresh_fill = profile.t_tok_s * (chunks * tau - lengths)
        return strata.means(service), strata.means(fresh_fill), 0.0
    last_chunks = lengths[multi] - (chunks[multi] - 1.0) * tau
    ahead = np.quantile(last_chunks, (np.arange(8) + 0.5) / 8)[None, :]
    first = np.minimum(tau - ahead, lengths[:, None])
    rest = lengths[:, None] - first
    after = np.ceil(rest / tau - 1e-12)
    base = (
        (after + 1.0) * profile.t0_s
        + profile.t_tok_s * (ahead + lengths[:, None])
        + (profile.t_attn_s * lengths * (lengths + 1.0) / 2.0)[:, None]
    )
    fill_tokens = np.where(rest > 0, after * tau - rest, tau - ahead - first)
    share = float(multi.mean() / np.minimum(chunks, 2.0).mean())
    return (
        strata.means(base.mean(axis=1)),
        strata.means(profile.t_tok_s * fill_tokens.mean(axis=1)),
        share,
    )


def _partial_fills(
    lengths: FloatArray, spare: FloatArray
) -> tuple[tuple[FloatArray, FloatArray], tuple[FloatArray, FloatArray]]:
    """For each spare budget s (integer tokens, 0 for none): the chance that one
    prompt of the mix, and that two, hold fewer than s tokens, and the mean of their
    tokens when they do — from the exact distribution of one length and of the sum
    of two (a convolution on a one-token grid, capped above the largest spare)."""
    cap = int(spare.max()) + 1
    n = len(lengths)
    one = np.bincount(np.minimum(lengths, cap).astype(np.int64), minlength=cap + 1) / n
    # The sum of two lengths: the pmf convolved with itself (by FFT, zero-padded).
    size = 2 * len(one)
    two = np.fft.irfft(np.fft.rfft(one, size) ** 2, size)[: cap + 1]
    grid = np.arange(cap + 1, dtype=np.float64)
    index = np.maximum(spare.astype(np.int64) - 1, 0)
    result = []
    for pmf in (one, two):
        below = np.cumsum(np.maximum(pmf, 0.0))[index]
        tokens = np.cumsum(np.maximum(pmf, 0.0) * grid)[index]
        share = np.where(spare >= 1, below, 0.0)
        mean = np.divide(tokens, share, out=np.zeros_like(share), where=share > 1e-12)
        result.append((share, mean))
    return result[0], result[1]


def _phi(x: float) -> float:
    """(1 - e^-x) / x, the mean of e^(-x u) for u uniform on [0, 1]."""
    return 1.0 if x == 0.0 else -math.expm1(-x) / x


def _fresh_start_wait_s(
    decay_rate_per_s: float, iteration_s: float, others_rate_per_s: float
) -> tuple[float, float]:
    """(Share of the waiting prompts admitted into a running stream, the mean wait of
    the others), for an exponential stream wait and a uniform offset in one iteration.

    With a = theta * D: the share is E[exp(-theta V)] = phi(a), phi(x) = (1 - e^-x) / x.
    The others (W_f < V) arrived while the iteration holding their stream position
    was running; its end comes x D later, x in (0, 1) with density proportional to
    1 - e^(-a x). Another worker that reaches a boundary with budget to spare first
    admits them sooner: those boundaries come at ``others_rate_per_s`` (Poisson, as a
    superposition of many workers' boundaries), b = that * D, so the mean wait is

        D * E[(1 - e^(-b x)) / b] = D (1 - phi(a) - phi(b) + phi(a + b)) / (b (1 - phi(a))),

    which for b -> 0 falls from 2D/3 (a -> 0) to D/2 (a -> infinity).
    """
    a = decay_rate_per_s * iteration_s
    b = others_rate_per_s * iteration_s
    if a < 1e-4:
        # First order in a, where 1 - phi(a) would lose its digits: the density of x
        # is then 2x (1 + a/3 - a x / 2), so E[h] = 2 E0[x h] + a (2 E0[x h] / 3 - E0[x^2 h])
        # with h(x) = (1 - e^(-b x)) / b and E0 over u on [0, 1].
        share = 1.0 - a / 2.0 + a * a / 6.0
        if b < 1e-3:
            return share, iteration_s * (2.0 / 3.0 - b / 4.0 + b * b / 15.0 - a / 36.0)
        e = math.exp(-b)
        x_h = (0.5 - (-math.expm1(-b) - b * e) / b**2) / b
        x2_h = (1.0 / 3.0 - (2.0 - e * (b * b + 2.0 * b + 2.0)) / b**3) / b
        return share, iteration_s * (2.0 * x_h + a * (2.0 * x_h / 3.0 - x2_h))
    share = _phi(a)
    others = 1.0 - share
    if b < 1e-6:
        return share, iteration_s * (1.0 + 1.0 / a - 1.0 / (2.0 * others))
    return share, iteration_s * (others - _phi(b) + _phi(a + b)) / (b * others)


# Grid points over one iteration for the brief wait's distribution (its bands' means
# move by well under 1 % of an iteration from 64 to 1,024 points).
_BRIEF_WAIT_POINTS = 129


def brief_wait_bands_s(
    decay_rate_per_s: float, iteration_s: float, others_rate_per_s: float
) -> FloatArray:
    """The brief wait's mean within each band of ``_FILL_BANDS`` (ascending).

    ``_fresh_start_wait_s`` gives the brief wait's mean; its law is
    P(W > x D) = P(X > x) e^(-b x) for x in [0, 1], X the end of the iteration in
    progress (density proportional to 1 - e^(-a x), a = theta * D) and e^(-b x) the
    chance that no other worker's boundary with budget to spare came first
    (b = that rate * D). Integrated, P(X > x) = ((1 - x) - (e^(-a x) - e^(-a)) / a)
    / (1 - phi(a)), which tends to 1 - x^2 as a -> 0. The waits spread over up to a
    whole iteration, and where the P99 falls among the prompts that waited briefly
    (bursts of prompts on a lightly loaded pool) their upper band, not the mean, sets
    it.
    """
    a = decay_rate_per_s * iteration_s
    b = others_rate_per_s * iteration_s
    x = np.linspace(0.0, 1.0, _BRIEF_WAIT_POINTS)
    if a < 1e-4:
        beyond = 1.0 - x * x
    else:
        beyond = ((1.0 - x) - (np.exp(-a * x) - math.exp(-a)) / a) / (1.0 - _phi(a))
    survival = beyond * np.exp(-b * x)
    cdf = 1.0 - survival[1:]
    below = 1.0 - survival[:-1]
    mid_s = 0.5 * (x[1:] + x[:-1]) * iteration_s
    result: FloatArray = (_band_shares(cdf, below) * mid_s).sum(axis=1) / _BAND_MASS
    return result


def pair_min_share(service_s: FloatArray) -> float:
    """kappa = E[min(S1, S2)] / E[S] of two independent draws of the samples:
    E[min] = integral of P(S > x)^2 dx, a step function over the sorted samples."""
    ordered = np.sort(np.asarray(service_s, dtype=np.float64))
    n = len(ordered)
    steps = np.diff(ordered, prepend=0.0)
    beyond = (n - np.arange(n)) / n  # P(S >= ordered[i]) = P(S > x) on that step
    return float((steps * beyond * beyond).sum() / ordered.mean())


def lone_iteration_s(
    profile: IterationProfile, prompt_tokens: FloatArray, token_budget: int
) -> float:
    """Length-biased mean iteration of prompts run alone: sum(I^2) / sum(I) over
    every chunk's iteration I (the mean length of the iteration that a random
    instant of such busy time falls into).

    A lone prompt of L tokens runs floor(L / tau) full chunks, chunk k after k*tau
    cached tokens costing A + B k (A = t0 + t_tok tau + t_attn tau (tau + 1) / 2,
    B = t_attn tau^2), then a last chunk of the r remaining tokens.
    """
    tau = float(token_budget)
    lengths = np.asarray(prompt_tokens, dtype=np.float64)
    n = np.floor(lengths / tau)
    r = lengths - n * tau
    a = profile.t0_s + profile.t_tok_s * tau + profile.t_attn_s * tau * (tau + 1.0) / 2.0
    b = profile.t_attn_s * tau * tau
    full_sum = n * a + b * n * (n - 1.0) / 2.0
    full_sq = n * a * a + a * b * n * (n - 1.0) + b * b * (n - 1.0) * n * (2.0 * n - 1.0) / 6.0
    last = np.where(
        r > 0,
        profile.t0_s + profile.t_tok_s * r + profile.t_attn_s * (r * n * tau + r * (r + 1.0) / 2.0),
        0.0,
    )
    return float((full_sq + last * last).sum() / (full_sum + last).sum())


_Key = TypeVar("_Key", bound=Hashable)
_Value = TypeVar("_Value")


def _kept(
    cache: dict[_Key, _Value], key: _Key, limit: int, compute: Callable[[], _Value]
) -> _Value:
    """``cache[key]``, computed on a miss. A full cache is emptied first: a model is
    asked again for the pool states of the solve in progress, not for old ones."""
    if key not in cache:
        if len(cache) >= limit:
            cache.clear()
        cache[key] = compute()
    return cache[key]


# TTFT atoms: values, weight without wait, weight with wait, and the wait's rate.
_Atoms = tuple[FloatArray, FloatArray, FloatArray, float]
# At most this many pool states' atoms are kept per model.
_ATOM_SETS_KEPT = 8


class UnstableQueueError(ValueError):
    """The offered load meets or exceeds the pool's capacity."""


@dataclass(frozen=True, kw_only=True, eq=False)
class PrefillModel:
    """The prefill pool's service-time distribution, reduced to sorted classes.

    ``service_s`` (ascending) and ``weights`` are the classes; ``mean_service_s``,
    ``packed_service_s`` and the SCVs are exact over all samples.
    """

    service_s: FloatArray
    packed_s: FloatArray  # per class, the packed time (the queue's service while it drains)
    fill_alone_s: FloatArray  # a lone multi-chunk prompt's last iteration filled
    fill_short_s: FloatArray  # ... in part, by one queued prompt: its mean fill
    fill_short_share: FloatArray  # the chance that one queued prompt leaves budget over
    fill_pair_s: FloatArray  # ... in part, by two queued prompts
    fill_pair_share: FloatArray
    fresh_fill_s: FloatArray  # the fill of a prompt's last iteration from a fresh start
    co_packing: _CoPacking  # ... when it waited briefly, with the prompts taken beside it
    stream: _StreamTerms
    ride_base_s: FloatArray  # admitted at the start of another prompt's last chunk
    ride_fill_s: FloatArray  # ... and the fill of its last iteration
    ride_share: float  # of the boundaries with budget to spare, last-chunk starts
    weights: FloatArray
    mean_service_s: float
    packed_service_s: float
    # E[S - t0]: what a prompt adds to an iteration its worker runs anyway (an
    # absorbed extra, riding beside the prompt that took a finished one's place).
    riding_service_s: float
    service_scv: float
    packed_scv: float
    iteration_s: float  # D: one full iteration of tau tokens
    lone_iteration_s: float  # length-biased mean iteration of prompts run alone
    spare_boundaries: float  # per prompt run alone: boundaries with budget to spare
    # The law of the prompts a busy worker admits from a long queue at the boundary
    # where it takes queued work (``queueing.absorption.admitted_pmf``): index k is
    # P(K = k).
    admitted: FloatArray
    one_chunk_share: float  # P(a prompt fits one iteration)
    pair_min_share: float  # E[min(S1, S2)] / E[S] of the solo times: 1/2 exponential, 1 equal
    token_budget: int
    _floors: dict[float, float] = field(default_factory=dict, repr=False, compare=False)
    # The exact one-worker P99 wait by arrival rate: a solve asks for it more than once.
    _exact_waits: dict[float, float | None] = field(default_factory=dict, repr=False, compare=False)
    _burst_factors: dict[tuple[int, float, float], float] = field(
        default_factory=dict, repr=False, compare=False
    )
    # The atoms of the last few pool states: a solve checks a pool size and then asks
    # for the P99 at the same one.
    _atom_sets: dict[tuple[int, float, float], _Atoms] = field(
        default_factory=dict, repr=False, compare=False
    )

    @classmethod
    def build(
        cls, samples: LengthSamples, profile: IterationProfile, *, token_budget: int
    ) -> PrefillModel:
        lengths = samples.prompt_tokens.astype(np.float64)
        service = prefill_service_s(profile, lengths, token_budget)
        strata = stratify(service)
        iterations = np.ceil(lengths / token_budget)
        fresh_fill = profile.t_tok_s * (iterations * token_budget - lengths)
        packed = service - profile.t0_s * (iterations - lengths / token_budget)
        mean = float(service.mean())
        packed_mean = float(packed.mean())
        ride_base, ride_fill, ride_share = _ride_terms(profile, lengths, strata, token_budget)
        # The budget a lone multi-chunk prompt leaves over in its last chunk is filled
        # with what is queued: the head of the queue, a prompt of the mix, when it is
        # shorter than the budget left (and nothing else is queued) fills it in part.
        multi = lengths > token_budget
        spare = np.where(multi, iterations * token_budget - lengths, 0.0)
        (one_share, one_mean), (two_share, two_mean) = _partial_fills(lengths, spare)
        return cls(
            service_s=strata.means(service),
            packed_s=strata.means(packed),
            fill_alone_s=strata.means(np.where(multi, fresh_fill, 0.0)),
            fill_short_s=_weighted_means(strata, profile.t_tok_s * one_mean, one_share),
            fill_short_share=strata.means(one_share),
            fill_pair_s=_weighted_means(strata, profile.t_tok_s * two_mean, two_share),
            fill_pair_share=strata.means(two_share),
            fresh_fill_s=strata.means(fresh_fill),
            co_packing=_CoPacking.build(profile, lengths, strata, token_budget),
            stream=_stream_terms(profile, lengths, strata, token_budget),
            ride_base_s=ride_base,
            ride_fill_s=ride_fill,
            ride_share=ride_share,
            weights=strata.weights,
            mean_service_s=mean,
            packed_service_s=packed_mean,
            riding_service_s=mean - profile.t0_s,
            service_scv=float(service.var() / (mean * mean)),
            packed_scv=float(packed.var() / (packed_mean * packed_mean)),
            iteration_s=profile.t0_s + profile.t_tok_s * token_budget,
            lone_iteration_s=lone_iteration_s(profile, lengths, token_budget),
            # A lone prompt leaves budget over at the start of its last chunk and at
            # its end: min(chunks, 2) boundaries.
            spare_boundaries=float(np.minimum(iterations, 2.0).mean()),
            # While prompts queue, a busy worker takes queued work once per prompt it
            # serves: at a one-chunk prompt's end, with the whole budget, and at a
            # multi-chunk prompt's last-chunk start, with what that chunk leaves (its
            # end then has no room: the prompt taken runs on).
            admitted=admitted_pmf(
                lengths, token_budget, room_tokens=np.where(multi, spare, float(token_budget))
            ),
            one_chunk_share=float(np.mean(~multi)),
            pair_min_share=pair_min_share(service),
            token_budget=token_budget,
        )

    def utilisation(self, *, workers: int, arrival_rate_rps: float, ca2: float = 1.0) -> float:
        """Busy fraction of a worker: lambda * (busy time per prompt) / N."""
        if arrival_rate_rps * self.packed_service_s >= workers:
            return arrival_rate_rps * self.packed_service_s / workers
        busy_s = self.busy_service_s(workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2)
        return arrival_rate_rps * busy_s / workers

    def departure_scv(self, *, workers: int, arrival_rate_rps: float, ca2: float) -> float:
        """The SCV of the gaps between prompts leaving the pool — the decode pool's
        arrivals — by the linking equation of Whitt's Queueing Network Analyzer
        (W. Whitt, Bell System Technical Journal 62, 1983):

            c_d² = 1 + (1 − ρ²)(c_a² − 1) + ρ²(c_s² − 1) / √N

        A busy pool releases prompts at its own pace whatever the arrivals' bursts:
        a share ρ² of the gaps takes the service's variability (averaged over N
        workers), the rest the arrivals'. A burst of bursty arrivals reaching a loaded
        pool leaves it as a queue drained at the service rate, so the decode pool
        sees a smoother stream than the router does. ρ is the solo-and-packed busy
        fraction (``utilisation``), at most 1 (an overloaded pool releases at its
        service rate alone)."""
        rho = self.utilisation(workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2)
        loaded = min(1.0, rho) ** 2
        service_part = loaded * (self.service_scv - 1.0) / math.sqrt(workers)
        return max(0.0, 1.0 + (1.0 - loaded) * (ca2 - 1.0) + service_part)

    def is_stable(self, *, workers: int, arrival_rate_rps: float) -> bool:
        return arrival_rate_rps * self.packed_service_s < workers

    def min_stable_workers(self, arrival_rate_rps: float) -> int:
        """The fewest workers that can keep up: lambda * E[S_packed] < N."""
        return max(1, math.floor(arrival_rate_rps * self.packed_service_s) + 1)

    def _stream_tail(self, *, workers: int, arrival_rate_rps: float, ca2: float) -> WaitTail:
        """The G/G/N tail at the packed times: how the queue drains while it is non-empty."""
        return ggc_wait_tail(
            arrival_rate_rps=arrival_rate_rps,
            mean_service_s=self.packed_service_s,
            servers=workers,
            ca2=ca2,
            cs2=self.packed_scv,
        )

    def busy_service_s(self, *, workers: int, arrival_rate_rps: float, ca2: float) -> float:
        """Mean busy time per prompt: packed + (1 - P_w) * (solo - packed).

        P_w is taken at the packed time: slightly high, so the busy time is slightly
        low, but solo and packed differ by at most one t0 per prompt, so the error is
        a small fraction of that. Near saturation the busy time is kept below
        N / lambda (there P_w -> 1 and it tends to packed anyway).
        """
        p_wait = self._stream_tail(
            workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2
        ).wait_probability
        return self._busy_s(workers=workers, arrival_rate_rps=arrival_rate_rps, p_wait=p_wait)

    def _busy_s(self, *, workers: int, arrival_rate_rps: float, p_wait: float) -> float:
        packed = self.packed_service_s
        busy_s = packed + (1.0 - p_wait) * (self.mean_service_s - packed)
        ceiling_s = packed + 0.5 * (workers / arrival_rate_rps - packed)
        return min(busy_s, ceiling_s)

    def wait_tail(self, *, workers: int, arrival_rate_rps: float, ca2: float) -> WaitTail:
        """Tail of the stream wait W_f: P_w of the absorbing chain (a prompt that
        finds an idle worker runs alone; one that finds none is absorbed by a busy
        worker at a boundary with budget to spare, ``queueing.absorption``), the rate
        at the packed times. Raises ``UnstableQueueError`` when overloaded."""
        if not self.is_stable(workers=workers, arrival_rate_rps=arrival_rate_rps):
            raise UnstableQueueError(
                f"prefill_workers: {workers} workers cannot serve "
                f"{arrival_rate_rps:.4g} req/s of {self.packed_service_s:.4g} s prompts"
            )
        stream = self._stream_tail(workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2)
        # GI/M/N at the solo time (a worker that takes a prompt while others are idle
        # runs it alone) needs lambda * solo < N, so a solo load at the pool's size is
        # held just below it, and never below the packed time, which the stability
        # check keeps under N / lambda.
        alone_s = min(
            self.mean_service_s,
            max(self.packed_service_s, _SOLO_LOAD_HELD * workers / arrival_rate_rps),
        )
        p_wait = ggc_wait_tail(
            arrival_rate_rps=arrival_rate_rps,
            mean_service_s=alone_s,
            servers=workers,
            ca2=ca2,
            cs2=self.service_scv,
        ).wait_probability
        p_wait = min(1.0, p_wait * self._burst_factor(workers, arrival_rate_rps, alone_s, ca2))
        # Queued prompts are absorbed by busy workers at their boundaries with budget
        # to spare (``queueing.absorption``): for Poisson arrivals P_w is that chain's
        # all-busy probability, and it scales the GI/M/N value of other arrivals by
        # its ratio to Erlang C. (A queue drained as a shared token stream, the chain
        # used before, put seed 2026 #6's P_w at 0.052 against 0.035 simulated, and
        # 0.142 against 0.106 on 29 of its workers.)
        p_wait *= self._absorption_factor(workers, arrival_rate_rps, alone_s)
        return WaitTail(wait_probability=min(1.0, p_wait), decay_rate_per_s=stream.decay_rate_per_s)

    def _absorption_factor(self, workers: int, arrival_rate_rps: float, alone_s: float) -> float:
        """P(every worker busy) of the absorbing pool over Erlang C at ``alone_s``:
        exactly the absorbing chain's P_w for Poisson arrivals."""
        if workers == 1:
            # One worker: Poisson arrivals find it busy for the fraction of time it is
            # (PASTA), lambda times its busy time per prompt, which is the solo time
            # for a prompt that found it idle and the packed time for one it absorbed:
            # P = lambda (S_p + (1 - P)(S - S_p)), so P = A / (1 + A - rho_p).
            solo_load = arrival_rate_rps * self.mean_service_s
            packed_load = arrival_rate_rps * self.packed_service_s
            absorbing = solo_load / (1.0 + solo_load - packed_load)
        else:
            excursion = self.excursion(workers=workers, arrival_rate_rps=arrival_rate_rps)
            # An excursion's head takes a finished prompt's place. At a one-chunk prompt's
            # end the prompts queued behind the head ride beside it on that worker, as a
            # batch (``excursion_extras``), each adding its solo time less the t0 of the
            # iteration it shares; a multi-chunk prompt's worker takes its next prompt at
            # its last chunk's start, one iteration before its end, and that prompt too
            # runs in the finished one's place: for the pool's all-busy time it is an
            # M/G/N worker's next prompt, taken early. (Counting one extra of a packed
            # time per excursion instead, whatever its length, put seed 2027 #30's P_w
            # at 0.220 on 21 workers against 0.259 simulated, and 0.090 on 24 against
            # 0.090: too flat in the load.)
            some, batch = excursion_extras(excursion=excursion, admitted=self.admitted)
            absorbing = all_busy_probability(
                workers=workers,
                arrival_rate_rps=arrival_rate_rps,
                solo_s=self.mean_service_s,
                packed_s=self.packed_service_s,
                absorbed_s=batch * self.riding_service_s,
                excursion=excursion,
                extra_share=self.one_chunk_share * some,
            )
        poisson = erlang_c(workers, arrival_rate_rps * alone_s)
        if poisson == 0.0:
            # A load so light that Erlang C is below the smallest float (1e-9 req/s on
            # 64 workers): the chain's value underflows too, and their ratio is 0/0.
            # The GI/M/N value is left unscaled (at such a load it is about zero too).
            return 1.0
        return absorbing / poisson

    def excursion(self, *, workers: int, arrival_rate_rps: float) -> float:
        """X: the all-busy time with prompts queued over the all-busy time without
        (``queueing.absorption.excursion_ratio``). A busy worker takes queued work once
        per prompt it serves, so while every worker is busy such boundaries come at
        N / E[S], each admitting K prompts (``admitted``)."""
        return excursion_ratio(
            arrival_rate_rps=arrival_rate_rps,
            boundary_rate_per_s=workers / self.mean_service_s,
            admitted=self.admitted,
        )

    @property
    def _synchrony_weight(self) -> float:
        """w = 2 kappa - 1 in [0, 1]: how far the solo times are from exponential
        (0) towards equal (1), by kappa = E[min(S1, S2)] / E[S] (``_burst_factor``)."""
        return min(1.0, max(0.0, 2.0 * self.pair_min_share - 1.0))

    def _burst_factor(
        self, workers: int, arrival_rate_rps: float, alone_s: float, ca2: float
    ) -> float:
        """How much more often a burst makes prompts wait on workers of alike solo
        times than on exponential ones, beyond what Poisson arrivals see.

        A burst that finds every worker busy finds them busy with its own earlier
        members when the solo times are alike, so none frees early: at equal service
        times customer n waits for customer n - N, and GI/D/N is exact
        (``gid_wait``), where GI/M/N lets an exponential clock free a worker at once.
        For Gamma arrivals of SCV 4 on 8 workers at rho = 0.12 the chance of waiting
        is twice GI/M/N's (0.024 against 0.012); for Poisson arrivals the two differ
        by 2 % (at light load the chance of waiting is the arrival counts'). The
        factor is the GI/D/N over GI/M/N ratio at the arrivals' SCV over the same
        ratio at SCV 1 — so Poisson arrivals, for which the two-rate chain is
        calibrated, keep their answer, and the factor is continuous in a measured
        SCV — raised to the weight w = 2 kappa - 1 of the solo times' regularity
        (kappa = E[min(S1, S2)] / E[S]: 1/2 exponential, 1 equal, so w runs from 0
        to 1; with many servers the busy count is an infinite-server queue's, whose
        variance over mean is 1 + (ca2 - 1) kappa, so kappa is the statistic that
        sets how a burst piles up). The wait of those who wait keeps its rate: its
        GI/D/N over GI/M/N ratio is the same on one server at the same load, so it
        is the service's shape, which the rate already carries, not the burst's.
        """
        weight = self._synchrony_weight
        if weight == 0.0 or ca2 == 1.0:
            return 1.0
        key = (workers, arrival_rate_rps, ca2)  # alone_s follows from the first two

        def ratio(scv: float) -> float:
            equal = gid_wait(
                arrival_rate_rps=arrival_rate_rps, service_s=alone_s, servers=workers, ca2=scv
            ).wait_probability
            exponential = ggc_wait_tail(
                arrival_rate_rps=arrival_rate_rps,
                mean_service_s=alone_s,
                servers=workers,
                ca2=scv,
                cs2=1.0,
            ).wait_probability
            # GI/D/N's chance falls below what its sums resolve well before GI/M/N's
            # (for smooth arrivals, many decades): the ratio is then ~0, not 1 (which
            # made P_w jump up a hundredfold as a worker was added).
            return max(equal, 0.0) / exponential if exponential > 1e-12 else 1.0

        return _kept(
            self._burst_factors,
            key,
            _EXACT_WAITS_KEPT,
            lambda: (ratio(ca2) / ratio(1.0)) ** weight,
        )

    def _one_worker_tail(self, arrival_rate_rps: float, tail: WaitTail, *, ca2: float) -> WaitTail:
        """One worker: the exponential tail matched to the exact wait of Poisson arrivals.

        The two-moment rate gives the Pollaczek-Khinchine mean wait, but the wait's
        shape is the residual service's compounded: for a heavy-tailed mix its P99 lies
        well above the exponential's of that mean (seed 2026 #57, Pareto prompts at
        rho = 0.7: 6.6 s against 5.2 s). Here the wait is computed exactly — an M/G/1
        queue at the packed times, whose wait is (1 - rho) sum_k rho^k R^{*k} with R the
        residual service (Benes; one FFT on a grid, ``mg1_wait_quantile_s``) — and the
        tail's rate is set so that its P99 is that one (the atoms' closed forms keep
        an exponential wait). For other arrivals no exact wait is at hand; the two-moment
        rate is scaled by the Poisson match's factor (the service mix's tail shapes the
        wait whatever the arrivals), which keeps the prediction continuous in ca2 (a
        measured ca2 is never exactly 1). Where the exact tail is the lighter one the
        exponential stays, the safe side (bursty arrivals on one worker are predicted
        well by it: seed 2026 #0, #8, #34, #49, #59 within -3 to +11 %).
        """
        quantile = TAIL_MATCH_QUANTILE
        poisson = (
            tail
            if ca2 == 1.0
            else self.wait_tail(workers=1, arrival_rate_rps=arrival_rate_rps, ca2=1.0)
        )
        if poisson.wait_probability <= 1.0 - quantile:
            return tail
        exact_s = _kept(
            self._exact_waits,
            arrival_rate_rps,
            _EXACT_WAITS_KEPT,
            lambda: mg1_wait_quantile_s(
                self.packed_s, self.weights, arrival_rate_rps=arrival_rate_rps, quantile=quantile
            ),
        )
        if exact_s is None or exact_s <= 0.0:
            return tail
        matched = math.log(poisson.wait_probability / (1.0 - quantile)) / exact_s
        factor = min(1.0, matched / poisson.decay_rate_per_s)
        return WaitTail(
            wait_probability=tail.wait_probability, decay_rate_per_s=tail.decay_rate_per_s * factor
        )

    def _atoms(self, *, workers: int, arrival_rate_rps: float, ca2: float) -> _Atoms:
        """``_build_atoms``, kept for the last few pool states (read-only arrays)."""

        def build() -> _Atoms:
            atoms = self._build_atoms(workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2)
            for array in atoms[:3]:
                array.flags.writeable = False
            return atoms

        return _kept(self._atom_sets, (workers, arrival_rate_rps, ca2), _ATOM_SETS_KEPT, build)

    def _build_atoms(self, *, workers: int, arrival_rate_rps: float, ca2: float) -> _Atoms:
        """TTFT atoms: values, weight without wait, weight with wait, and the wait's rate.

        Groups per class: alone; alone with its last iteration filled by work queued
        at the start of its last chunk (in full, or in part by one or two queued
        prompts); queued briefly (an atom at the mean short wait), then started fresh
        (one group per band of the co-packed prompts' fill), or riding in another
        prompt's last chunk when another worker's boundary admitted it; and queued
        into the stream, ending after one or two extra iterations, plus the
        exponential admission wait.
        """
        tail = self.wait_tail(workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2)
        if workers == 1:
            tail = self._one_worker_tail(arrival_rate_rps, tail, ca2=ca2)
        pw = tail.wait_probability
        theta = tail.decay_rate_per_s
        # The other busy workers' boundaries with budget to spare, E[min(n, 2)] per S.
        # Workers that a burst started together reach them together: with alike
        # solo times they come in clusters of about ca2 (the arrival counts' index
        # of dispersion), so as a stream of independent boundaries they are ca2
        # times fewer (``_synchrony_weight``; none fewer for exponential times, whose
        # residuals forget when they started). Arrivals smoother than Poisson are
        # taken as Poisson here: they bring no clusters, and a wait left as long is
        # the safe side.
        others_per_s = (
            (workers - 1)
            * self.spare_boundaries
            / self.mean_service_s
            / max(1.0, ca2) ** self._synchrony_weight
        )
        share, _ = _fresh_start_wait_s(theta, self.iteration_s, others_per_s)
        # A prompt that waits briefly waits for the iteration in progress to end. That
        # iteration is full (D) when work was queued at its start, which happens with
        # probability P_w; otherwise the worker runs the chunks of the prompts it
        # holds alone, much shorter than D when prompts are short. Its length as seen
        # from a random instant of busy time is the length-biased mean.
        in_progress_s = pw * self.iteration_s + (1.0 - pw) * self.lone_iteration_s
        _, short_wait_s = _fresh_start_wait_s(theta, in_progress_s, others_per_s)
        # Another worker admits it first with probability b E[(1 - e^-bx) / b] =
        # others_per_s * short_wait_s; at the start of a last chunk in ride_share of cases.
        rides = min(1.0, others_per_s * short_wait_s) * self.ride_share
        # Waiting prompts are taken at boundaries with budget to spare, one each, so
        # such a boundary finds work queued with probability P_w / E[min(n, 2)]. The
        # queue it finds holds Q >= 1 prompts, geometric with ratio rho_p (the
        # two-rate chain above N); one or two that leave budget over fill it in part.
        filled = pw / self.spare_boundaries
        rho_p = min(1.0, arrival_rate_rps * self.packed_service_s / workers)
        by_one = self.fill_short_share * (1.0 - rho_p)
        by_two = self.fill_pair_share * (1.0 - rho_p) * rho_p
        # A prompt that waited has behind it whatever arrived during its wait.
        stream_filled = arrival_rate_rps / (arrival_rate_rps + theta)
        # A one-chunk prompt that waited briefly shares its fresh iteration with the
        # prompts taken at the same boundary (``_CoPacking``); the boundaries that take
        # queued work come at N E[min(chunks, 2)] / E[S] while all workers are busy,
        # their gaps as variable as the solo service's on one worker and tending to
        # a Poisson stream's over many (the superposition's SCV, as Whitt's QNA
        # merges streams: 1 + (c_s^2 - 1) / N).
        co = self.co_packing
        co_packed = co.fills(
            boundary_rate_per_s=workers * self.spare_boundaries / self.mean_service_s,
            boundary_scv=1.0 + (self.service_scv - 1.0) / workers,
            arrival_rate_rps=arrival_rate_rps,
            ca2=ca2,
            leftover_s=self.fresh_fill_s,
            queued_at_boundary=filled,
        )
        # A prompt that waited briefly: its wait by band (``brief_wait_bands_s``) and,
        # independently, the co-packed prompts' fill by band, one group per pair (the
        # fill counts the prompts that arrived before the boundary as well as during
        # the wait, so the two are nearly independent; taking them as comonotone put
        # a loaded Pareto pool 10 % higher, seed 2026 #17); or, when the prompts ahead
        # of it at that boundary leave too little of the budget, split over two
        # iterations (in bursts the queue a boundary takes is long).
        wait_bands = brief_wait_bands_s(theta, in_progress_s, others_per_s)
        w = self.weights
        # The stream's offset in the iteration that admits a prompt: the queue ahead
        # of it modulo the budget, which N workers take N times as fast
        # (``_StreamTerms.at``).
        one_base, one_fill, two_base, two_fill, two_share = self.stream.at(
            theta * self.iteration_s / workers
        )
        queued = w * pw
        briefly = queued * (1.0 - share)
        # A multi-chunk class keeps the mean fill in every fill band.
        fills = np.where(co.one_chunk, co_packed.bands_s, pw * self.fresh_fill_s)
        band_values = (self.service_s + fills)[None, :, :] + wait_bands[:, None, None]
        # A multi-chunk class's fill bands hold one value, so its mass goes to the
        # first (the others, empty, are left out before the sort).
        fill_mass = np.where(co.one_chunk, co_packed.band_mass, _FIRST_BAND[:, None])
        band_mass = _BAND_MASS[:, None, None] * fill_mass[None, :, :]
        split_values = (self.service_s + co_packed.split_extra_s)[None, :] + wait_bands[:, None]
        split_mass = _BAND_MASS[:, None] * co_packed.split_share[None, :]
        values = np.concatenate(
            [
                self.service_s,
                self.service_s + self.fill_alone_s,
                self.service_s + self.fill_short_s,
                self.service_s + self.fill_pair_s,
                band_values.ravel(),
                split_values.ravel(),
                self.ride_base_s + short_wait_s + pw * self.ride_fill_s,
                one_base + stream_filled * one_fill,
                two_base + stream_filled * two_fill,
            ]
        )
        no_wait = np.concatenate(
            [
                w * (1.0 - pw) * (1.0 - filled),
                w * (1.0 - pw) * filled * (1.0 - by_one - by_two),
                w * (1.0 - pw) * filled * by_one,
                w * (1.0 - pw) * filled * by_two,
                (band_mass * (briefly * (1.0 - rides))).ravel(),
                (split_mass * (briefly * (1.0 - rides))).ravel(),
                briefly * rides,
                np.zeros(2 * len(w)),
            ]
        )
        in_stream = queued * share
        with_wait = np.concatenate(
            [
                np.zeros(len(values) - 2 * len(w)),
                in_stream * (1.0 - two_share),
                in_stream * two_share,
            ]
        )
        return values, no_wait, with_wait, theta

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
        # Atoms without mass (groups a pool's state leaves empty) only slow the sort.
        held = np.flatnonzero(no_wait + with_wait > 0.0)
        order = held[np.argsort(values[held], kind="stable")]
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


# The most solo load, over the pool's size, at which the GI/M/N chance of waiting is
# taken (it is 1 at the pool's size; the two-rate chain goes on beyond).
_SOLO_LOAD_HELD = 0.999
# The level at which a one-worker pool's wait tail is matched to the exact wait (the
# SLO's percentile: the P99 is what the solver sizes for).
TAIL_MATCH_QUANTILE = 0.99
# Grid points of the wait's distribution (an FFT of twice as many).
_MG1_GRID = 4096
# At most this many arrival rates' exact waits are kept per model.
_EXACT_WAITS_KEPT = 64


def mg1_wait_quantile_s(
    service_s: FloatArray, weights: FloatArray, *, arrival_rate_rps: float, quantile: float
) -> float | None:
    """The ``quantile`` of the FCFS wait of an M/G/1 queue whose service takes
    ``service_s`` with probabilities ``weights``; None when unstable.

    The wait is (1 - rho) sum_k rho^k R^{*k}, R the equilibrium residual service of
    density P(S > x) / E[S] (Pollaczek-Khinchine / Benes): on a grid its transform is
    (1 - rho) / (1 - rho R^), one FFT and its inverse, zero-padded against
    wrap-around. Cell j holds R's exact mass around j h, from
    G(x) = E[min(S, x)] = integral of P(S > u) over [0, x], so a sum of residuals lands
    on its cell without drift. The grid spans 20 mean waits and twice the longest
    service (doubled while the quantile lies beyond it) in 4096 cells.
    """
    mean_s = float(np.dot(weights, service_s))
    rho = arrival_rate_rps * mean_s
    if not 0.0 < rho < 1.0:
        return None
    mean_wait_s = arrival_rate_rps * float(np.dot(weights, service_s**2)) / (2.0 * (1.0 - rho))
    order = np.argsort(service_s)
    sorted_s, sorted_w = service_s[order], weights[order]
    # G(x) = sum of w s over classes at or below x + x * the weight above x.
    below_ws = np.concatenate([[0.0], np.cumsum(sorted_w * sorted_s)])
    above_w = 1.0 - np.concatenate([[0.0], np.cumsum(sorted_w)])

    def truncated_mean(x: FloatArray) -> FloatArray:
        i = np.searchsorted(sorted_s, x, side="right")
        result: FloatArray = below_ws[i] + x * np.maximum(above_w[i], 0.0)
        return result

    span_s = max(20.0 * max(mean_wait_s, mean_s), 2.0 * float(sorted_s[-1]))
    for _ in range(6):
        cell_s = span_s / _MG1_GRID
        edges = np.maximum((np.arange(_MG1_GRID + 1) - 0.5) * cell_s, 0.0)
        residual = np.diff(truncated_mean(edges)) / mean_s
        transform = np.fft.rfft(residual, 2 * _MG1_GRID)
        density = np.fft.irfft((1.0 - rho) / (1.0 - rho * transform), 2 * _MG1_GRID)
        cdf = np.cumsum(density[:_MG1_GRID])
        k = int(np.searchsorted(cdf, quantile))
        if k < _MG1_GRID:
            return float(k * cell_s)
        span_s *= 2.0
    return None


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
    # have equal masses) from jumping between neighbouring atoms on rounding noise,
    # and on masses too small to mean anything for a quantile (a chance of waiting of
    # 1e-10, which the GI/M/N sums do not resolve monotonically in N, flipped a P99
    # between two atoms as workers were added).
    tolerance = 1e-9
    k = int(np.argmax(right_end <= p + tolerance))  # the last segment always qualifies
    gap = p - float(mass_above[k])
    if gap <= tolerance or log_e[k] == -math.inf:
        return float(values_s[k])
    crossing = (float(log_e[k]) - math.log(gap)) / theta
    return max(float(values_s[k]), crossing)
