"""What a simulation run produced: per-request times and pool statistics.

Times are seconds on the trace's clock. A request that never got a first token or
never finished has NaN there (the summary counts it as lost and as missing the
SLOs). TPOT is NaN for a request with a single output token: it has no decode
stage, so it is left out of the TPOT percentiles and counts as meeting the TPOT SLO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sim.trace import FloatArray, IntArray

BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, kw_only=True)
class SimSummary:
    """Headline numbers of a run against a pair of SLOs.

    Percentiles use numpy's default (linear interpolation) over the requests that
    have the quantity; ``None`` when none has it. ``rejected_requests`` are those
    longer than the model's context: answered at once with an error, as the router
    answers them, and never served — a property of the request, not of the pools,
    so they count neither as lost nor in the attainment. ``slo_attainment`` is the
    fraction of the admitted requests that met both SLOs (a lost request did not);
    ``lost_requests`` the admitted ones that never finished.
    ``prefill_utilisation`` is busy time over serving time (from the end of startup
    to retirement or the end of the run) of the prefill workers;
    ``decode_utilisation`` the same for the decode workers; ``decode_mean_batch``
    the mean batch over all decode iterations.
    """

    requests: int
    completed: int
    lost_requests: int
    rejected_requests: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p90_s: float | None
    tpot_p99_s: float | None
    ttft_slo_s: float
    tpot_slo_s: float
    slo_attainment: float | None
    prefill_utilisation: float | None
    decode_utilisation: float | None
    decode_mean_batch: float | None
    prefill_queue_max: int
    decode_queue_max: int
    gpu_hours: float

    def __post_init__(self) -> None:
        if not 0 <= self.rejected_requests <= self.requests:
            raise ValueError(f"rejected_requests: must be in [0, requests={self.requests}]")
        admitted = self.requests - self.rejected_requests
        if not 0 <= self.completed <= admitted:
            raise ValueError(f"completed: must be in [0, admitted requests={admitted}]")
        if self.lost_requests != admitted - self.completed:
            raise ValueError("lost_requests: must equal requests - rejected_requests - completed")
        if self.slo_attainment is not None and not 0 <= self.slo_attainment <= 1:
            raise ValueError(f"slo_attainment: must be in [0, 1], got {self.slo_attainment}")


@dataclass(frozen=True, kw_only=True, eq=False)
class SimResults:
    """Per-request arrays (index = request, in trace order) and pool totals.

    ``kv_ready_s`` is when the KV handoff finished (NaN without a decode stage),
    ``decode_start_s`` when a decode worker took the request; ``rejected`` marks the
    requests refused at arrival (beyond the model's context). ``token_times_s``
    (only when the run recorded them) holds, per request, the times of its decode
    tokens (the second token onwards).
    """

    arrival_s: FloatArray
    prompt_tokens: IntArray
    output_tokens: IntArray
    first_token_s: FloatArray
    kv_ready_s: FloatArray
    decode_start_s: FloatArray
    finish_s: FloatArray
    rejected: BoolArray
    end_s: float
    prefill_busy_s: float
    prefill_serving_s: float
    decode_busy_s: float
    decode_serving_s: float
    decode_iterations: int
    decode_batch_token_total: int
    prefill_queue_max: int
    decode_queue_max: int
    gpu_seconds: float
    token_times_s: tuple[FloatArray, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        for name in (
            "prompt_tokens",
            "output_tokens",
            "first_token_s",
            "kv_ready_s",
            "decode_start_s",
            "finish_s",
            "rejected",
        ):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name}: length {len(getattr(self, name))} != {n} requests")
        if self.token_times_s is not None and len(self.token_times_s) != n:
            raise ValueError(f"token_times_s: {len(self.token_times_s)} entries != {n} requests")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def ttft_s(self) -> FloatArray:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> FloatArray:
        """Mean seconds per output token after the first; NaN for single-token outputs."""
        decodes = (self.output_tokens - 1).astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            tpot = (self.finish_s - self.first_token_s) / decodes
        return np.where(self.output_tokens > 1, tpot, np.nan)

    @property
    def completed(self) -> int:
        return int(np.count_nonzero(np.isfinite(self.finish_s)))

    def summary(self, *, ttft_slo_s: float, tpot_slo_s: float) -> SimSummary:
        """Percentiles, SLO attainment and pool statistics; SLOs in seconds, > 0."""
        for name, value in (("ttft_slo_s", ttft_slo_s), ("tpot_slo_s", tpot_slo_s)):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
        ttft = self.ttft_s
        tpot = self.tpot_s
        done = np.isfinite(self.finish_s)
        ttft_ok = np.isfinite(ttft) & (ttft <= ttft_slo_s)
        tpot_ok = (self.output_tokens == 1) | (np.isfinite(tpot) & (tpot <= tpot_slo_s))
        admitted = ~self.rejected
        met = done & ttft_ok & tpot_ok & admitted
        n = len(self)
        rejected = int(np.count_nonzero(self.rejected))
        completed = int(np.count_nonzero(done & admitted))
        ttft_q = _percentiles(ttft[np.isfinite(ttft)])
        tpot_q = _percentiles(tpot[np.isfinite(tpot)])
        return SimSummary(
            requests=n,
            completed=completed,
            lost_requests=n - rejected - completed,
            rejected_requests=rejected,
            ttft_p50_s=ttft_q[0],
            ttft_p90_s=ttft_q[1],
            ttft_p99_s=ttft_q[2],
            tpot_p50_s=tpot_q[0],
            tpot_p90_s=tpot_q[1],
            tpot_p99_s=tpot_q[2],
            ttft_slo_s=ttft_slo_s,
            tpot_slo_s=tpot_slo_s,
            slo_attainment=float(np.count_nonzero(met)) / (n - rejected) if n > rejected else None,
            prefill_utilisation=_ratio(self.prefill_busy_s, self.prefill_serving_s),
            decode_utilisation=_ratio(self.decode_busy_s, self.decode_serving_s),
            decode_mean_batch=_ratio(float(self.decode_batch_token_total), self.decode_iterations),
            prefill_queue_max=self.prefill_queue_max,
            decode_queue_max=self.decode_queue_max,
            gpu_hours=self.gpu_seconds / 3600.0,
        )


def _percentiles(values: FloatArray) -> tuple[float | None, float | None, float | None]:
    if len(values) == 0:
        return None, None, None
    p50, p90, p99 = np.percentile(values, [50.0, 90.0, 99.0])
    return float(p50), float(p90), float(p99)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None
