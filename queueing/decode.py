"""Decode pool: the P99 TPOT of M workers with continuous batching (DESIGN §3.3).

A request with ``out`` output tokens gets its first token from the prefill worker,
its KV cache crosses the link (handoff ``h``), it joins a decode worker at that
worker's next iteration boundary (residual ``R``), and then needs ``n = out - 1``
iterations, each of which gives every member of the batch one token:

    TPOT = (t_last - t_first) / n = (h + R) / n + mean over its n iterations of T

One iteration of a batch costs T = t0 + sum over members of u, with
u = t_tok + t_kv * context (the member's KV entries read, growing by one per step).

Load enters through the other members of the batch:

* Little's law per worker: the mean number of members B satisfies
  B = lambda_w * E[n] * (t0 + a * (B + 1)), with a = E[u] weighted by time in decode
  and lambda_w the decode arrival rate per worker — a fixed point that is linear in
  B, so it has a closed form, and none when lambda_w * E[n] * a >= 1 (unstable).
* Fluctuation: with requests spread over workers as they pull work, the members of
  a worker form an infinite-server population, Poisson in number (its variance is
  scaled by 1 + (ca2 - 1) * kappa for non-Poisson arrivals, the heavy-traffic
  infinite-server result of Whitt, "On the heavy-traffic limit theorem for GI/G/inf
  queues", 1982, with kappa = E[min(S1, S2)] / E[S]). A request averages the batch
  cost over its own life, which shrinks the variance by
  g(x) = 2 (x - 1 + e^-x) / x^2, x = life / correlation time, as for a process with
  exponentially decaying autocorrelation whose correlation time is the infinite-server
  mean residual sojourn E[S^2] / (2 E[S]).

Each request class then has a normal TPOT given its (prompt, output) lengths, and the
P(TPOT > x) of the pool is the mixture over classes. Requests with a single output
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
from queueing.prefill import UnstableQueueError
from queueing.profile import IterationProfile


@dataclass(frozen=True, kw_only=True)
class DecodeLoad:
    """The state of one decode worker at a given pool size and arrival rate."""

    mean_batch: float
    iteration_s: float
    batch_p99: float
    kv_blocks_p99: float
    kv_utilisation: float


@dataclass(frozen=True, kw_only=True, eq=False)
class DecodeModel:
    """Per-class load-independent TPOT parts plus the pool's time-weighted moments."""

    weights: FloatArray
    fixed_tpot_s: FloatArray  # t0 + own cost + handoff / n, per class
    fixed_var_s2: FloatArray  # within-class variance of the fixed part
    inv_steps: FloatArray  # mean of 1 / n per class
    inv_steps_sq: FloatArray  # mean of 1 / n^2 per class
    averaging: FloatArray  # variance kept when a class averages the batch over its life
    decode_fraction: float
    mean_steps: float
    mean_steps_sq: float
    member_cost_s: float  # a = time-weighted E[u]
    member_cost_sq_s2: float  # time-weighted E[u^2]
    reserved_blocks: float  # time-weighted E[blocks reserved by a member]
    reserved_blocks_sq: float
    kappa: float
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
        kv_link_bytes_per_s: float,
        kv_link_latency_s: float = 0.0,
        block_size_tokens: int = 16,
    ) -> DecodeModel:
        if max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {max_batch!r}")
        if not (math.isfinite(kv_link_bytes_per_s) and kv_link_bytes_per_s > 0):
            raise ValueError(f"kv_link_bytes_per_s: must be > 0, got {kv_link_bytes_per_s!r}")
        decoding = samples.output_tokens >= 2
        if not np.any(decoding):
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
        blocks = np.ceil((prompt + out) / block_size_tokens)

        handoff = kv_link_latency_s + prompt * profile.kv_bytes_per_token / kv_link_bytes_per_s
        own_cost = t_tok + t_kv * (prompt + (n + 1.0) / 2.0)
        fixed = profile.t0_s + own_cost + handoff / n
        strata = stratify(fixed)

        # E[min(n1, n2)] = sum_k P(n >= k)^2 for iid integer n >= 1.
        counts = np.bincount(n.astype(np.int64))
        at_least = 1.0 - np.concatenate([[0.0], np.cumsum(counts)[:-1]]) / len(n)
        kappa = float((at_least[1:] ** 2).sum()) / float(n.mean())

        return cls(
            weights=strata.weights,
            fixed_tpot_s=strata.means(fixed),
            fixed_var_s2=strata.variances(fixed),
            inv_steps=strata.means(1.0 / n),
            inv_steps_sq=strata.means(1.0 / n**2),
            averaging=_life_averaging(strata.means(n), n),
            decode_fraction=float(decoding.mean()),
            mean_steps=float(n.mean()),
            mean_steps_sq=float((n * n).mean()),
            member_cost_s=member_cost,
            member_cost_sq_s2=member_cost_sq,
            reserved_blocks=float((n * blocks).sum()) / total_steps,
            reserved_blocks_sq=float((n * blocks**2).sum()) / total_steps,
            kappa=min(1.0, kappa),
            t0_s=profile.t0_s,
            max_batch=max_batch,
            kv_capacity_blocks=profile.kv_capacity_tokens // block_size_tokens,
        )

    def _per_worker_rate(self, workers: int, arrival_rate_rps: float) -> float:
        return arrival_rate_rps * self.decode_fraction / workers

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
        mean_batch = demand * (self.t0_s + self.member_cost_s) / (1.0 - demand * self.member_cost_s)
        z = float(special.ndtri(quantile))
        spread = self._dispersion(ca2)
        batch_p99 = mean_batch + z * math.sqrt(mean_batch * spread)
        kv_p99 = mean_batch * self.reserved_blocks + z * math.sqrt(
            mean_batch * self.reserved_blocks_sq * spread
        )
        return DecodeLoad(
            mean_batch=mean_batch,
            iteration_s=self.t0_s + self.member_cost_s * (mean_batch + 1.0),
            batch_p99=batch_p99,
            kv_blocks_p99=kv_p99,
            kv_utilisation=mean_batch * self.reserved_blocks / self.kv_capacity_blocks,
        )

    def _dispersion(self, ca2: float) -> float:
        return max(1e-9, 1.0 + (ca2 - 1.0) * self.kappa)

    def _moments(
        self, *, workers: int, arrival_rate_rps: float, ca2: float
    ) -> tuple[FloatArray, FloatArray]:
        """Per-class mean and standard deviation of TPOT."""
        state = self.load(workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2, quantile=0.5)
        b = state.mean_batch
        t_iter = state.iteration_s
        busy = 1.0 - math.exp(-b)  # an idle worker takes a new member at once
        mean = self.fixed_tpot_s + self.member_cost_s * b + 0.5 * t_iter * busy * self.inv_steps
        var_inst = b * self.member_cost_sq_s2 * self._dispersion(ca2)
        var = (
            self.fixed_var_s2
            + var_inst * self.averaging
            + (t_iter * busy) ** 2 / 12.0 * self.inv_steps_sq
        )
        return mean, np.sqrt(np.maximum(var, 1e-30))

    def _floor_moments(self) -> tuple[FloatArray, FloatArray]:
        return self.fixed_tpot_s, np.sqrt(np.maximum(self.fixed_var_s2, 1e-30))

    def tpot_survival(
        self, *, workers: int, arrival_rate_rps: float, ca2: float, tpot_s: float
    ) -> float:
        """P(TPOT > tpot_s) over requests that have a TPOT."""
        mean, sd = self._moments(workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2)
        return float((self.weights * special.ndtr((mean - tpot_s) / sd)).sum())

    def tpot_quantile_s(
        self, *, workers: int, arrival_rate_rps: float, ca2: float, quantile: float
    ) -> float:
        mean, sd = self._moments(workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2)
        return _mixture_quantile(self.weights, mean, sd, quantile)

    def floor_quantile_s(self, quantile: float) -> float:
        """The TPOT quantile with unlimited workers (every batch holds one request)."""
        # Load-independent, so computed once per quantile (the solver asks every solve).
        cached = self._floors.get(quantile)
        if cached is None:
            mean, sd = self._floor_moments()
            cached = _mixture_quantile(self.weights, mean, sd, quantile)
            self._floors[quantile] = cached
        return cached


def _life_averaging(class_steps: FloatArray, steps: FloatArray) -> FloatArray:
    """g(x) = 2 (x - 1 + e^-x) / x^2 with x = a class's life over the correlation time.

    Both the life (n iterations) and the correlation time
    (E[n^2] / (2 E[n]) iterations) scale with the iteration time, so x, and the
    factor, do not depend on the load and are computed once.
    """
    correlation_steps = float((steps * steps).mean()) / (2.0 * float(steps.mean()))
    x = np.maximum(class_steps / correlation_steps, 1e-9)
    result: FloatArray = 2.0 * (x - 1.0 + np.exp(-x)) / (x * x)
    return result


def _mixture_quantile(
    weights: FloatArray, mean: FloatArray, sd: FloatArray, quantile: float
) -> float:
    """Quantile of a normal mixture: Newton's method on the log-survival, bracketed.

    The log-survival of a normal mixture is close to linear in its upper tail, so
    Newton on it converges in a handful of steps from the start used here (the same
    quantile of each class's own upper quantile); a step that leaves the bracket is
    replaced by bisection.
    """
    if not (0.0 < quantile < 1.0):
        raise ValueError(f"quantile: must be in (0, 1), got {quantile!r}")
    p = 1.0 - quantile
    log_p = math.log(p)
    lo = float((mean - 9.0 * sd).min())
    hi = float((mean + 9.0 * sd).max())
    upper = mean + float(special.ndtri(quantile)) * sd
    order = np.argsort(upper)
    x = float(np.interp(quantile, np.cumsum(weights[order]), upper[order]))
    sqrt_2pi = math.sqrt(2.0 * math.pi)
    for _ in range(100):
        z = (mean - x) / sd
        survival = float(np.dot(weights, special.ndtr(z)))
        if survival > p:
            lo = x
        else:
            hi = x
        density = float(np.dot(weights, np.exp(-0.5 * z * z) / sd)) / sqrt_2pi
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
