"""Decode pool: the P99 TPOT of M workers with continuous batching (DESIGN §3.3).

A request with ``out`` output tokens gets its first token from the prefill worker,
its KV cache crosses the link (handoff ``h``), it joins the first decode worker to
reach an iteration boundary (residual ``R``, ``first_boundary_residual``), and then
needs ``n = out - 1`` iterations, each of which gives every member of the batch one
token:

    TPOT = (t_last - t_first) / n = (h + R) / n + mean over its n iterations of T

One iteration of a batch costs T = t0 + sum over members of u, with
u = t_tok + t_kv * context (the member's KV entries read, growing by one per step).

Load enters through the other members of the batch:

* Little's law per worker: the mean number of members B satisfies
  B = lambda_w * E[n] * (t0 + a * (B + 1)), with a = E[u] weighted by time in decode
  and lambda_w the decode arrival rate per worker — a fixed point that is linear in
  B, so it has a closed form, and none when lambda_w * E[n] * a >= 1 (unstable).
* Fluctuation: counted in its own iterations, a worker is an infinite-server queue
  (every member gets one token per iteration), Poisson in number, its variance scaled
  by 1 + (ca2 - 1) * kappa for non-Poisson arrivals (the heavy-traffic infinite-server
  result of Whitt, "On the heavy-traffic limit theorem for GI/G/inf queues", 1982,
  with kappa = E[min(S1, S2)] / E[S]). In seconds it is not: an iteration lasts
  t0 + a * B, so a fuller pool serves every member more slowly, members stay longer
  and the batch drifts further up — a generalised processor-sharing queue (Cohen,
  1979) whose departure rate B / (E[n] (t0 + a B)) saturates. Its birth-death
  stationary law is negative binomial, pi(B) ~ C(B + c, B) rho^B, c = t0 / a,
  rho = lambda E[n] a: mean rho (c + 1) / (1 - rho) (the Little fixed point above)
  and variance mean / (1 - rho), insensitive to the distribution of n. The feedback
  acts through the pool's total (workers take arrivals at their iteration
  boundaries, so in iteration time every worker sees the same arrival rate and the
  workers' differences are Poisson): of a worker's variance, a share 1 - 1/M is
  Poisson — but for the clusters of bursty arrivals that one worker takes whole
  (every request since the pool's previous boundary, ``DecodeModel._clustered_pairs``)
  — and 1/M is the pool-wide mode, amplified by 1 / (1 - rho), which also
  stretches that mode's correlation time by 1 / (1 - rho) (a diffusion's variance
  is its noise times its relaxation time; the noise is unchanged).
* Averaging over a life L. The workers' own share is an infinite-server queue in
  iteration time, whose autocorrelation at lag t is exactly E[(S - t)+] / E[S]; its
  life average keeps V(L) = 2 / L^2 int_0^L (L - t) E[(S - t)+] / E[S] dt of the
  variance (``_infinite_server_averaging``). The pool-wide mode relaxes like a
  diffusion and keeps g(x) = 2 (x - 1 + e^-x) / x^2, x = L over the infinite-server
  mean residual sojourn E[S^2] / (2 E[S]) stretched by 1 / (1 - rho).
* Skewness. The batch cost is a compound sum of the members' costs u; its life
  average's third cumulant is E[B] E[u^3] W3(L), scaled by the spread as the
  variance is, W3 the third-cumulant share (``_infinite_server_third_averaging``).
  Costs that grow with the context, heavy-tailed prompts and batches of a few dozen
  skew a class's TPOT by 0.1-0.3, which puts its P99 0.2-0.3 standard deviations
  above a normal's.

Each request class then has a TPOT given its (prompt, output) lengths, the shifted
gamma of its mean, variance and skewness (evaluated by Wilson–Hilferty's cube root),
and the P(TPOT > x) of the pool is the mixture over classes. Requests with a single output
token have no TPOT and are left out, as the simulator and the router do.

Admission: a worker admits at most ``max_batch`` members and reserves KV blocks for a
member's prompt + output. The model is valid while the P99 of the per-worker batch and
of its reserved blocks stay inside those limits; the solver adds workers until they do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy import special

from queueing.lengths import FloatArray, LengthSamples, stratify
from queueing.prefill import UnstableQueueError, prefill_service_s
from queueing.profile import IterationProfile


@dataclass(frozen=True, kw_only=True)
class DecodeLoad:
    """The state of one decode worker at a given pool size and arrival rate."""

    mean_batch: float
    iteration_s: float
    batch_p99: float
    kv_blocks_p99: float
    kv_utilisation: float
    rho: float  # the share of an iteration spent on member costs
    own_spread: float  # the batch's variance over mean: the workers' own share
    pooled_spread: float  # ... and the pool-wide mode's


@dataclass(frozen=True, kw_only=True, eq=False)
class DecodeModel:
    """Per-class load-independent TPOT parts plus the pool's time-weighted moments."""

    weights: FloatArray
    fixed_tpot_s: FloatArray  # t0 + own cost + handoff / n, per class
    fixed_var_s2: FloatArray  # within-class variance of the fixed part
    inv_steps: FloatArray  # mean of 1 / n per class
    inv_steps_sq: FloatArray  # mean of 1 / n^2 per class
    life_over_correlation: FloatArray  # a class's life over the batch's correlation time
    own_averaging: FloatArray  # what a class's life keeps of the workers' own share
    own_third_averaging: FloatArray  # ... and of its third cumulant
    decode_fraction: float
    mean_steps: float
    mean_steps_sq: float
    member_cost_s: float  # a = time-weighted E[u]
    member_cost_sq_s2: float  # time-weighted E[u^2]
    member_cost_cube_s3: float  # time-weighted E[u^3]
    reserved_blocks: float  # time-weighted E[blocks reserved by a member]
    reserved_blocks_sq: float
    kappa: float
    # |D1 - D2| of pairs of requests, D = solo prefill + handoff, and the pairs' weights:
    # how far apart two requests that arrive together reach the decode pool.
    delay_gaps_s: FloatArray
    delay_gap_weights: FloatArray
    t0_s: float
    max_batch: int
    kv_capacity_blocks: int
    _floors: dict[float, float] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        samples: LengthSamples,
        profile: IterationProfile,
        *,
        max_batch: int,
        prefill_token_budget: int,
        kv_link_bytes_per_s: float,
        kv_link_latency_s: float = 0.0,
        block_size_tokens: int = 16,
    ) -> DecodeModel:
        if max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {max_batch!r}")
        if not (math.isfinite(kv_link_bytes_per_s) and kv_link_bytes_per_s > 0):
            raise ValueError(f"kv_link_bytes_per_s: must be > 0, got {kv_link_bytes_per_s!r}")
        decoding = samples.decoding
        if not decoding.any():
            raise ValueError("output_tokens: no request has more than one output token")
        prompt = samples.prompt_tokens[decoding].astype(np.float64)
        out = samples.output_tokens[decoding].astype(np.float64)
        n = out - 1.0
        t_tok, t_kv = profile.t_tok_s, profile.t_kv_s

        # Context read by a member at its k-th decode step is prompt + k, k = 1..n.
        sum_ctx = n * prompt + n * (n + 1.0) / 2.0
        sum_ctx_sq = n * prompt**2 + prompt * n * (n + 1.0) + n * (n + 1.0) * (2 * n + 1.0) / 6.0
        total_steps = float(n.sum())
        member_cost = float((n * t_tok + t_kv * sum_ctx).sum()) / total_steps
        member_cost_sq = (
            float((n * t_tok**2 + 2 * t_tok * t_kv * sum_ctx + t_kv**2 * sum_ctx_sq).sum())
            / total_steps
        )
        # sum over k = 1..n of (c + t_kv k)^3, c = t_tok + t_kv prompt, by power sums.
        c = t_tok + t_kv * prompt
        sum_k, sum_k2 = n * (n + 1.0) / 2.0, n * (n + 1.0) * (2 * n + 1.0) / 6.0
        sum_cube = (
            n * c**3 + 3.0 * c**2 * t_kv * sum_k + 3.0 * c * t_kv**2 * sum_k2 + t_kv**3 * sum_k**2
        )
        member_cost_cube = float(sum_cube.sum()) / total_steps
        blocks = np.ceil((prompt + out) / block_size_tokens)

        handoff = kv_link_latency_s + prompt * profile.kv_bytes_per_token / kv_link_bytes_per_s
        own_cost = t_tok + t_kv * (prompt + (n + 1.0) / 2.0)
        fixed = profile.t0_s + own_cost + handoff / n
        strata = stratify(fixed)

        # E[min(n1, n2)] = sum_k P(n >= k)^2 for iid integer n >= 1.
        counts = np.bincount(n.astype(np.int64))
        at_least = 1.0 - np.concatenate([[0.0], np.cumsum(counts)[:-1]]) / len(n)
        kappa = float((at_least[1:] ** 2).sum()) / float(n.mean())
        gaps, gap_weights = _delay_gaps(
            prefill_service_s(profile, prompt, prefill_token_budget) + handoff
        )

        return cls(
            weights=strata.weights,
            fixed_tpot_s=strata.means(fixed),
            fixed_var_s2=strata.variances(fixed),
            inv_steps=strata.means(1.0 / n),
            inv_steps_sq=strata.means(1.0 / n**2),
            life_over_correlation=_life_over_correlation(strata.means(n), n),
            own_averaging=strata.means(_infinite_server_averaging(n, at=n)),
            own_third_averaging=strata.means(_infinite_server_third_averaging(n, at=n)),
            decode_fraction=float(decoding.mean()),
            mean_steps=float(n.mean()),
            mean_steps_sq=float((n * n).mean()),
            member_cost_s=member_cost,
            member_cost_sq_s2=member_cost_sq,
            member_cost_cube_s3=member_cost_cube,
            reserved_blocks=float((n * blocks).sum()) / total_steps,
            reserved_blocks_sq=float((n * blocks**2).sum()) / total_steps,
            kappa=min(1.0, kappa),
            delay_gaps_s=gaps,
            delay_gap_weights=gap_weights,
            t0_s=profile.t0_s,
            max_batch=max_batch,
            kv_capacity_blocks=profile.kv_capacity_tokens // block_size_tokens,
        )

    def _per_worker_rate(self, workers: int, arrival_rate_rps: float) -> float:
        return arrival_rate_rps * self.decode_fraction / workers

    def _rho(self, workers: int, arrival_rate_rps: float) -> float:
        """rho = lambda_w E[n] a: the share of a worker's time spent on member costs."""
        rate = self._per_worker_rate(workers, arrival_rate_rps)
        return rate * self.mean_steps * self.member_cost_s

    def min_stable_workers(self, arrival_rate_rps: float) -> int:
        """The fewest workers whose per-token work fits in the iterations they run."""
        load = arrival_rate_rps * self.decode_fraction * self.mean_steps * self.member_cost_s
        return max(1, math.floor(load) + 1)

    def is_stable(self, *, workers: int, arrival_rate_rps: float) -> bool:
        rate = self._per_worker_rate(workers, arrival_rate_rps)
        return rate * self.mean_steps * self.member_cost_s < 1.0

    def load(
        self, *, workers: int, arrival_rate_rps: float, ca2: float, quantile: float
    ) -> DecodeLoad:
        """Mean batch and the ``quantile`` of batch and reserved KV on one worker."""
        rate = self._per_worker_rate(workers, arrival_rate_rps)
        demand = rate * self.mean_steps
        if demand * self.member_cost_s >= 1.0:
            raise UnstableQueueError(
                f"decode_workers: {workers} workers cannot keep up with "
                f"{arrival_rate_rps:.4g} req/s (per-token work exceeds the iteration time)"
            )
        rho = demand * self.member_cost_s
        own, pooled = self._shares(rho=rho, workers=workers, ca2=ca2, rate_w=rate)
        spread = own + pooled
        # lambda E[n] = E[B / T(B)] (members' steps per second); to second order in the
        # batch's variance spread * B this gives the mean batch below, which is the
        # negative binomial's mean exactly at one worker with Poisson arrivals.
        mean_batch = demand * self.t0_s / (1.0 - rho) + rho * spread
        z = float(special.ndtri(quantile))
        batch_p99 = mean_batch + z * math.sqrt(mean_batch * spread)
        kv_p99 = mean_batch * self.reserved_blocks + z * math.sqrt(
            mean_batch * self.reserved_blocks_sq * spread
        )
        return DecodeLoad(
            mean_batch=mean_batch,
            # What a member's step lasts on average: Little's law, B / (lambda E[n]).
            iteration_s=self.t0_s / (1.0 - rho) + self.member_cost_s * spread,
            batch_p99=batch_p99,
            kv_blocks_p99=kv_p99,
            kv_utilisation=mean_batch * self.reserved_blocks / self.kv_capacity_blocks,
            rho=rho,
            own_spread=own,
            pooled_spread=pooled,
        )

    def relaxation_s(self, *, workers: int, arrival_rate_rps: float) -> float:
        """Relaxation time of the pool-wide batch: the mean life E[n] (t0 + a (B + 1))
        stretched by 1 / (1 - rho) (module docstring); a deviation from the steady
        batch decays like e^(-t / this)."""
        state = self.load(workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=1.0, quantile=0.5)
        rho = self._rho(workers, arrival_rate_rps)
        return self.mean_steps * state.iteration_s / (1.0 - rho)

    def _dispersion(self, ca2: float) -> float:
        return max(1e-9, 1.0 + (ca2 - 1.0) * self.kappa)

    def _shares(
        self, *, rho: float, workers: int, ca2: float, rate_w: float
    ) -> tuple[float, float]:
        """A worker's batch variance over its mean, as its own share and the pool-wide
        mode's. The workers' differences, a share 1 - 1/M, are Poisson but for the
        arrivals' clusters that one worker takes whole; the pool-wide mode, a share
        1/M, carries the arrivals' dispersion (Whitt's GI/G/inf factor) amplified by
        1 / (1 - rho) (module docstring)."""
        pooled = self._dispersion(ca2) / (workers * (1.0 - rho))
        own = 1.0 - 1.0 / workers
        if own > 0.0 and ca2 != 1.0:
            own *= max(
                1e-9,
                1.0
                + 2.0
                * self.kappa
                * self._clustered_pairs(
                    workers=workers,
                    ca2=ca2,
                    rate_w=rate_w,
                    iteration_s=(self.t0_s / (1.0 - rho) + self.member_cost_s * (own + pooled)),
                ),
            )
        return own, pooled

    def _clustered_pairs(
        self, *, workers: int, ca2: float, rate_w: float, iteration_s: float
    ) -> float:
        """Pairs of decode arrivals, per arrival and beyond Poisson's, that one worker
        takes together.

        A worker at its boundary takes every request that reached the pool since the
        previous boundary of any worker: a window of about T / M. Two requests a time
        tau apart share a window with probability ~ e^(-sigma tau), sigma = M / T, so
        the excess pairs one worker takes whole are the arrivals' pair correlation
        weighted so: J = int e^(-sigma tau) (h(tau) - lambda) dtau, h the renewal
        density. Each such pair adds 2 kappa to the worker's variance over mean (the
        members of a pair are present together for E[min(n1, n2)] of the E[n] steps),
        as in Whitt's GI/G/inf result, which is the limit M = 1 (J -> (ca2 - 1) / 2).
        Requests arriving together reach the decode pool |D1 - D2| apart, D their solo
        prefill and handoff, which keeps e^(-sigma |D1 - D2|) of a pair's weight.
        """
        pool_rate = rate_w * workers
        sigma = workers / iteration_s
        kept = float(np.dot(self.delay_gap_weights, np.exp(-sigma * self.delay_gaps_s)))
        return _gamma_pair_excess(x=pool_rate / sigma, ca2=ca2) * kept

    def _averaged_spread(self, state: DecodeLoad) -> FloatArray:
        """Per class, what a request keeps of the spread when it averages the batch
        cost over its life: the workers' own share with the infinite-server queue's
        exact autocorrelation, the pool-wide share as a relaxation at the
        infinite-server correlation time stretched by 1 / (1 - rho)."""
        x = self.life_over_correlation
        averaged: FloatArray = state.own_spread * self.own_averaging + state.pooled_spread * (
            _averaging(x * (1.0 - state.rho))
        )
        return averaged

    def _moments(
        self, *, workers: int, arrival_rate_rps: float, ca2: float
    ) -> tuple[FloatArray, FloatArray, FloatArray]:
        """Per-class mean, standard deviation and skewness of TPOT."""
        state = self.load(workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2, quantile=0.5)
        b = state.mean_batch
        t_iter = state.iteration_s
        residual_mean_s, residual_var_s2 = first_boundary_residual(
            workers=workers, iteration_s=t_iter, busy=1.0 - math.exp(-b)
        )
        # The others' share of a member's step: the mean step less t0 and its own cost.
        others_s = t_iter - self.t0_s - self.member_cost_s
        mean = self.fixed_tpot_s + others_s + residual_mean_s * self.inv_steps
        var_inst = b * self.member_cost_sq_s2
        var = (
            self.fixed_var_s2
            + var_inst * self._averaged_spread(state)
            + residual_var_s2 * self.inv_steps_sq
        )
        sd = np.sqrt(np.maximum(var, 1e-30))
        # The batch cost is a compound infinite-server sum of the members' costs,
        # whose life average has the third cumulant E[B] E[u^3] W3 (module docstring),
        # scaled by the spread as its variance is.
        spread = state.own_spread + state.pooled_spread
        third = spread * b * self.member_cost_cube_s3 * self.own_third_averaging
        return mean, sd, np.minimum(third / sd**3, _SKEW_MAX)

    def _survival(self, mean: FloatArray, sd: FloatArray, skew: FloatArray, x: float) -> float:
        return float(np.dot(self.weights, _class_survival(mean, sd, skew, x)))

    def _floor_moments(self) -> tuple[FloatArray, FloatArray, FloatArray]:
        sd = np.sqrt(np.maximum(self.fixed_var_s2, 1e-30))
        return self.fixed_tpot_s, sd, np.zeros_like(sd)

    def tpot_survival(
        self, *, workers: int, arrival_rate_rps: float, ca2: float, tpot_s: float
    ) -> float:
        """P(TPOT > tpot_s) over requests that have a TPOT."""
        mean, sd, skew = self._moments(workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2)
        return self._survival(mean, sd, skew, tpot_s)

    def tpot_quantile_s(
        self, *, workers: int, arrival_rate_rps: float, ca2: float, quantile: float
    ) -> float:
        mean, sd, skew = self._moments(workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2)
        return _mixture_quantile(self.weights, mean, sd, skew, quantile)

    def floor_quantile_s(self, quantile: float) -> float:
        """The TPOT quantile with unlimited workers (every batch holds one request)."""
        # Load-independent, so computed once per quantile (the solver asks every solve).
        cached = self._floors.get(quantile)
        if cached is None:
            mean, sd, skew = self._floor_moments()
            cached = _mixture_quantile(self.weights, mean, sd, skew, quantile)
            self._floors[quantile] = cached
        return cached


def first_boundary_residual(
    *, workers: int, iteration_s: float, busy: float
) -> tuple[float, float]:
    """Mean and variance of R, the wait of a request at the decode queue's head for a
    worker to take it: at once when a worker is idle, else at the first of the M
    workers' next iteration boundaries: the decode pool is one shared queue whose
    head any worker with room takes at its boundary (``sim.cluster``, and the
    decode workers of ``workers.decode_worker``).

    A worker that is busy with probability ``busy`` (independently of the others) is
    met in a uniform phase of its iteration T, so with all M busy R is the least of
    M uniforms on (0, T): E[R] = T / (M + 1), E[R^2] = 2 T^2 / ((M + 1)(M + 2)).
    Spread over a request's n tokens, R matters for short outputs.
    """
    m = float(workers)
    all_busy = busy**workers
    mean_s = all_busy * iteration_s / (m + 1.0)
    second_s2 = all_busy * 2.0 * iteration_s**2 / ((m + 1.0) * (m + 2.0))
    return mean_s, max(second_s2 - mean_s**2, 0.0)


def _gamma_pair_excess(*, x: float, ca2: float) -> float:
    """J = int_0^inf e^(-sigma tau) (h(tau) - lambda) dtau for the stationary Gamma
    renewal process of SCV ``ca2`` (the arrivals' representation, ``queueing.ggc``),
    with x = lambda / sigma. The renewal density's Laplace transform is A / (1 - A),
    A = (1 + ca2 / x)^(-1 / ca2) the gaps' (e^(-1 / x) for evenly spaced arrivals), so
    J = A / (1 - A) - x: 0 for Poisson, (ca2 - 1) / 2 as x grows."""
    if x <= 0.0:
        return 0.0
    a = math.exp(-1.0 / x) if ca2 <= 1e-9 else math.exp(-math.log1p(ca2 / x) / ca2)
    return a / (1.0 - a) - x


# Quantiles of the decode arrivals' delay whose pairwise gaps stand for all pairs'.
_DELAY_POINTS = 32


def _delay_gaps(delay_s: FloatArray) -> tuple[FloatArray, FloatArray]:
    """|D_i - D_j| over pairs of ``_DELAY_POINTS`` mid-quantiles of the delays (each
    unordered pair once, with the weight of both orders; a point with itself at 0)."""
    points = np.quantile(delay_s, (np.arange(_DELAY_POINTS) + 0.5) / _DELAY_POINTS)
    i, j = np.triu_indices(_DELAY_POINTS)
    weights = np.where(i == j, 1.0, 2.0) / _DELAY_POINTS**2
    gaps: FloatArray = np.abs(points[i] - points[j])
    return gaps, weights.astype(np.float64)


def _life_over_correlation(class_steps: FloatArray, steps: FloatArray) -> FloatArray:
    """x = a class's life over the batch's correlation time (E[n^2] / (2 E[n])
    iterations). Both scale with the iteration time, so x does not depend on the load
    and is computed once."""
    correlation_steps = float((steps * steps).mean()) / (2.0 * float(steps.mean()))
    result: FloatArray = np.maximum(class_steps / correlation_steps, 1e-9)
    return result


def _infinite_server_averaging(lives: FloatArray, *, at: FloatArray) -> FloatArray:
    """At each life in ``at``, the share of the batch's variance that the mean over its own life
    keeps, for the workers' own share: in iteration time each worker's batch is an
    infinite-server queue (no feedback acts on the workers' differences), whose
    autocorrelation at lag t is exactly E[(S - t)+] / E[S] for lives S (the members
    present at both times are those whose residual life exceeds t). The mean over a
    life L keeps V(L) = 2 / L^2 int_0^L (L - t) E[(S - t)+] / E[S] dt of the variance,
    which is E[f(L, S)] 2 / (L^2 E[S]) with f = L^2 S / 2 - L^3 / 6 for S >= L and
    L S^2 / 2 - S^3 / 6 below. Lives of alike lengths decorrelate more slowly at first
    than an exponential of the same correlation time (deterministic lives keep 2/3 over
    one life where the exponential keeps 0.57), so a request's life averages away less
    of the others' noise."""
    lives = np.sort(lives)
    steps = at
    count = len(lives)
    # Sums over the lives below each L, for f's two branches.
    cum_s = np.concatenate([[0.0], np.cumsum(lives)])
    cum_s2 = np.concatenate([[0.0], np.cumsum(lives**2)])
    cum_s3 = np.concatenate([[0.0], np.cumsum(lives**3)])
    below = np.searchsorted(lives, steps, side="left")
    above_sum = cum_s[-1] - cum_s[below]
    above_count = count - below
    f_sum = (
        steps**2 / 2.0 * above_sum
        - steps**3 / 6.0 * above_count
        + steps / 2.0 * cum_s2[below]
        - cum_s3[below] / 6.0
    )
    result: FloatArray = np.clip(2.0 * f_sum / (count * steps**2 * lives.mean()), 0.0, 1.0)
    return result


def _infinite_server_third_averaging(lives: FloatArray, *, at: FloatArray) -> FloatArray:
    """At each life in ``at``, the share of the batch cost's third cumulant that its
    mean over that life keeps, for the workers' own share (Poisson in iteration time).

    A compound infinite-server sum's life average over [0, L] is a sum over members
    of u times their overlap with [0, L], over L; with Poisson arrivals its r-th
    cumulant is lambda E[u^r] int E[overlap^r] ds / L^r. The overlap of a life S
    rises to min(S, L), holds, and falls again, so for r = 3 the integral is
    L^3 S - L^4 / 2 for S >= L and L S^3 - S^4 / 2 below; over the instantaneous
    cumulant lambda E[u^3] E[S] that keeps W3(L) = E[I3(L, S)] / (L^3 E[S]) (1 at
    L -> 0; with ``_infinite_server_averaging``'s r = 2 the same construction gives
    the variance's share).
    """
    lives = np.sort(lives)
    count = len(lives)
    cum_s = np.concatenate([[0.0], np.cumsum(lives)])
    cum_s3 = np.concatenate([[0.0], np.cumsum(lives**3)])
    cum_s4 = np.concatenate([[0.0], np.cumsum(lives**4)])
    below = np.searchsorted(lives, at, side="left")
    integral = (
        at**3 * (cum_s[-1] - cum_s[below])
        - at**4 / 2.0 * (count - below)
        + at * cum_s3[below]
        - cum_s4[below] / 2.0
    )
    result: FloatArray = np.clip(integral / (count * at**3 * lives.mean()), 0.0, 1.0)
    return result


# Above this skewness the batch holds too few members for a three-moment fit (its
# others' cost is then a rare-event sum, mostly nobody, whose P99 neither the normal
# nor the gamma describes, and whose fitted skewness grows like 1 / sqrt(E[B]) as
# the batch empties, so a fit would let the P99 creep up as workers are added); at
# 1 the gamma's shape is 4, its support starting two standard deviations below the
# mean.
_SKEW_MAX = 1.0


def _cube_root_normal(
    mean: FloatArray, sd: FloatArray, skew: FloatArray, x: float
) -> tuple[FloatArray, FloatArray]:
    """Wilson–Hilferty's cube-root normal for the shifted gamma of each class's mean,
    standard deviation and skewness: (t, dt/dx), P(TPOT > x) = Phi(-t).

    The gamma is the standardised Gamma(k), k = 4 / skew^2 (the three-moment fit that
    stays a distribution, unlike a Cornish–Fisher series); with y = k + z sqrt(k) its
    tail is Phi(-t), t = 3 sqrt(k) ((y / k)^(1/3) - 1 + 1 / (9 k)) (E. B. Wilson and
    M. M. Hilferty, "The distribution of chi-square", PNAS 17, 1931): at k >= 4
    (skewness <= 1) its 1 % tail is within about 1 % of the gamma's (its P99 within
    a part in a thousand), and it is exactly the normal as the skewness vanishes. A
    cube root costs a fraction of an incomplete gamma function, and the solver
    evaluates the mixture often.
    """
    z = (x - mean) / sd
    # Skewness 0 is k -> infinity, where the cube root below tends to z itself.
    root_k = 2.0 / np.maximum(skew, 1e-9)
    ratio = z / root_k  # y / k - 1; y <= 0 lies below the gamma's support
    inside = ratio > -1.0
    # (1 + ratio)^(1/3) - 1 through log1p: exact to the last digit as ratio -> 0.
    cube = np.expm1(np.log1p(np.maximum(ratio, -1.0 + 1e-15)) / 3.0)
    t = np.where(inside, 3.0 * root_k * cube + 1.0 / (3.0 * root_k), -np.inf)
    slope = np.where(inside, (1.0 + cube) ** -2 / sd, 0.0)  # dt/dx = (y / k)^(-2/3) / sd
    return t, slope


def _class_survival(mean: FloatArray, sd: FloatArray, skew: FloatArray, x: float) -> FloatArray:
    """Per class, P(TPOT > x) under ``_cube_root_normal``."""
    t, _ = _cube_root_normal(mean, sd, skew, x)
    result: FloatArray = special.ndtr(-t)
    return result


_SQRT_2PI = math.sqrt(2.0 * math.pi)


def _density(t: FloatArray, slope: FloatArray) -> FloatArray:
    """The density phi(t) dt/dx of P(TPOT > x) = Phi(-t), from ``_cube_root_normal``."""
    with np.errstate(under="ignore"):
        result: FloatArray = np.exp(-0.5 * t * t) * slope / _SQRT_2PI
    return result


def _class_density(mean: FloatArray, sd: FloatArray, skew: FloatArray, x: float) -> FloatArray:
    """The density of ``_class_survival``'s distributions at x."""
    return _density(*_cube_root_normal(mean, sd, skew, x))


def _averaging(x: FloatArray) -> FloatArray:
    """g(x) = 2 (x - 1 + e^-x) / x^2: the share of a stationary process's variance (with
    exponentially decaying autocorrelation) that its mean over x correlation times keeps."""
    safe = np.maximum(x, 1e-3)
    exact = 2.0 * (safe + np.expm1(-safe)) / (safe * safe)
    # Below 1e-3 the difference cancels; the series 1 - x/3 + x^2/12 is exact to 1e-12.
    result: FloatArray = np.where(x < 1e-3, 1.0 - x / 3.0 + x * x / 12.0, exact)
    return result


def _mixture_quantile(
    weights: FloatArray, mean: FloatArray, sd: FloatArray, skew: FloatArray, quantile: float
) -> float:
    """Quantile of a mixture of ``_class_survival``'s distributions: Newton's method on
    the log-survival, bracketed.

    The log-survival of such a mixture is close to linear in its upper tail, so
    Newton on it converges in a handful of steps from the start used here (the same
    quantile of each class's own upper quantile); a step that leaves the bracket is
    replaced by bisection.
    """
    if not (0.0 < quantile < 1.0):
        raise ValueError(f"quantile: must be in (0, 1), got {quantile!r}")
    p = 1.0 - quantile
    log_p = math.log(p)
    lo = float((mean - 9.0 * sd).min())
    # A skewed class reaches further up than a normal one (its tail is a gamma's).
    hi = float((mean + 9.0 * sd * (1.0 + np.maximum(skew, 0.0))).max())
    upper = mean + float(special.ndtri(quantile)) * sd
    order = np.argsort(upper)
    x = float(np.interp(quantile, np.cumsum(weights[order]), upper[order]))
    for _ in range(100):
        t, slope = _cube_root_normal(mean, sd, skew, x)
        survival = float(np.dot(weights, special.ndtr(-t)))
        if survival > p:
            lo = x
        else:
            hi = x
        density = float(np.dot(weights, _density(t, slope)))
        if survival > 0 and density > 0:
            step = x + (math.log(survival) - log_p) * survival / density
        else:
            step = math.nan
        if abs(step - x) <= 1e-10 * abs(x):
            return step
        x = step if lo < step < hi else 0.5 * (lo + hi)
        if hi - lo <= 1e-12 * abs(x):
            break
    return x
