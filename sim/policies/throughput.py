"""``throughput``: an SLA planner in the style of NVIDIA Dynamo's throughput-based
scaling (docs/backtesting.md lists the sources). Written from its documentation.

Every adjustment interval (180 s):

1. measure the interval: request count, mean prompt (ISL) and output (OSL) lengths,
   mean TTFT and mean inter-token latency (our TPOT);
2. correction factors: observed / expected mean TTFT (expected: the lone-prompt
   prefill time at the mean ISL, what a batch-1 profile gives) and observed /
   expected mean ITL (expected: the decode iteration time at the per-worker
   concurrency Little's law gives, ``rate / workers * OSL * ITL``, and a context of
   ISL + OSL / 2);
3. predict the next interval's request count, ISL and OSL (constant: the last
   interval's; trend: a least-squares line through the last few intervals, one
   step ahead, never below 0);
4. prefill replicas = ceil(predicted prompt tokens/s * min(1, prefill correction) /
   per-worker prefill throughput at the predicted ISL); decode replicas =
   ceil(predicted output tokens/s / per-worker decode throughput at the ITL SLO
   divided by the decode correction, context ISL + OSL / 2);
5. scale both pools to those counts (within 1 and the replica cap).

The "profile" it interpolates is the iteration-time profile the simulator runs:
prefill throughput = ISL / lone-prompt prefill time (chunked by the token budget);
decode throughput = the largest batch whose iteration meets the ITL target and
whose reserved KV (prompt + output per sequence) fits, over that iteration time.
An interval without requests or without latency samples holds the pools.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np

from queueing.prefill import prefill_service_s
from queueing.profile import IterationProfile
from sim.policies.base import Allocation, ClusterView, Scenario


class Predictor(enum.Enum):
    CONSTANT = "constant"
    TREND = "trend"


TREND_POINTS = 4  # intervals the trend line is fitted to


def predict(history: list[float], predictor: Predictor) -> float:
    """The next value of a series (seconds-free: one step ahead)."""
    if not history:
        raise ValueError("history: needs at least one value")
    if predictor is Predictor.CONSTANT or len(history) < 2:
        return history[-1]
    ys = np.asarray(history[-TREND_POINTS:], dtype=np.float64)
    xs = np.arange(len(ys), dtype=np.float64)
    slope, intercept = np.polyfit(xs, ys, 1)
    return max(0.0, float(intercept + slope * len(ys)))


def prefill_throughput_tps(profile: IterationProfile, isl_tokens: float, budget: int) -> float:
    """Prompt tokens per second one worker prefills, one prompt of ``isl_tokens`` at a time."""
    isl = max(1.0, isl_tokens)
    return isl / float(prefill_service_s(profile, np.array([isl]), budget)[0])


def decode_itl_s(profile: IterationProfile, batch: float, context_tokens: float) -> float:
    """One decode iteration of ``batch`` sequences of mean context ``context_tokens``."""
    return profile.iteration_s(n_tokens=batch, n_kv_read=batch * context_tokens)


def decode_throughput_tps(
    profile: IterationProfile,
    *,
    itl_target_s: float,
    context_tokens: float,
    reserved_tokens: float,
    max_batch: int,
) -> float:
    """Output tokens per second of one worker at the largest batch meeting ``itl_target_s``.

    At least one sequence (whose throughput is 1 / its iteration time) even when a
    lone sequence misses the target: the planner still needs a finite answer.
    """
    per_seq_s = profile.t_tok_s + profile.t_kv_s * context_tokens
    by_itl = (itl_target_s - profile.t0_s) / per_seq_s if per_seq_s > 0 else math.inf
    by_kv = profile.kv_capacity_tokens / max(1.0, reserved_tokens)
    batch = max(1, min(max_batch, math.floor(by_itl), math.floor(by_kv)))
    return batch / decode_itl_s(profile, batch, context_tokens)


@dataclass(frozen=True, kw_only=True)
class _Interval:
    requests: int
    isl: float
    osl: float


class ThroughputPolicy:
    """The Dynamo-style planner; ``predictor`` picks constant or trend forecasting."""

    def __init__(
        self,
        scenario: Scenario,
        initial: Allocation,
        *,
        predictor: Predictor = Predictor.CONSTANT,
        interval_s: float = 180.0,
    ) -> None:
        self.name = "throughput" if predictor is Predictor.CONSTANT else "throughput-trend"
        self.initial = initial
        self.interval_s = interval_s
        self.predictor = predictor
        self._scenario = scenario
        self._budget = scenario.token_budget
        self._history: list[_Interval] = []
        self.prefill_correction = 1.0
        self.decode_correction = 1.0

    def tick(self, view: ClusterView) -> Allocation | None:
        snap = view.snapshot(window_s=self.interval_s)
        profile = self._scenario.profile
        if snap.window_arrivals == 0 or len(snap.window_output_tokens) == 0:
            return None
        isl = float(snap.window_prompt_tokens.mean())
        osl = float(snap.window_output_tokens.mean())
        self._history.append(_Interval(requests=snap.window_arrivals, isl=isl, osl=osl))

        ttft = snap.window_ttft_s[np.isfinite(snap.window_ttft_s)]
        if len(ttft):
            expected_ttft = isl / prefill_throughput_tps(profile, isl, self._budget)
            self.prefill_correction = float(ttft.mean()) / expected_ttft
        itl = snap.window_tpot_s[np.isfinite(snap.window_tpot_s)]
        serving = max(1, snap.decode.serving)
        if len(itl):
            mean_itl = float(itl.mean())
            concurrency = snap.window_arrivals / self.interval_s / serving * osl * mean_itl
            expected_itl = decode_itl_s(profile, max(1.0, concurrency), isl + osl / 2.0)
            self.decode_correction = mean_itl / expected_itl

        return self.plan()

    def plan(self) -> Allocation:
        """Replicas for the predicted next interval with the current corrections."""
        profile = self._scenario.profile
        requests = predict([float(h.requests) for h in self._history], self.predictor)
        isl = max(1.0, predict([h.isl for h in self._history], self.predictor))
        osl = max(1.0, predict([h.osl for h in self._history], self.predictor))
        prompt_tps = requests * isl / self.interval_s * min(1.0, self.prefill_correction)
        prefill = math.ceil(prompt_tps / prefill_throughput_tps(profile, isl, self._budget))
        itl_target = self._scenario.slo.tpot_p99_s / self.decode_correction
        per_worker = decode_throughput_tps(
            profile,
            itl_target_s=itl_target,
            context_tokens=isl + osl / 2.0,
            reserved_tokens=isl + osl,
            max_batch=self._budget,
        )
        decode = math.ceil(requests * osl / self.interval_s / per_worker)
        return Allocation(
            prefill=self._scenario.clamp(prefill), decode=self._scenario.clamp(decode)
        )
