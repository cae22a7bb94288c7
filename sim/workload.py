"""Generating and transforming workloads: arrival processes, length sampling, rate
scaling, slicing and summary statistics.

Pure: no I/O, and randomness comes only from the ``np.random.Generator`` passed in,
so a caller that seeds its generator gets the same workload back. Argument errors
raise ``ValueError`` naming the argument; a bad trace raises ``TraceError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from sim.lengths import LengthSamples
from sim.trace import FloatArray, IntArray, Trace, TraceError

__all__ = [
    "TraceStats",
    "diurnal_arrivals",
    "gamma_arrivals",
    "poisson_arrivals",
    "scale_rate",
    "summarize",
    "synthesize",
    "time_slice",
]

# Bisection steps to invert the cumulative rate: each halves the bracket, whose
# width starts below duration_s, so 64 steps reach float64 resolution.
_INVERSION_STEPS = 64
_MINUTE_S = 60.0


def _require_positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name}: must be > 0, got {value!r}")
    return float(value)


# --- arrival processes ---------------------------------------------------------------


def poisson_arrivals(*, rate_rps: float, duration_s: float, rng: np.random.Generator) -> FloatArray:
    """Sorted arrival times in [0, duration_s) of a Poisson process of ``rate_rps``.

    Drawn as a Poisson(rate_rps * duration_s) count of independent uniform times,
    which is exactly a Poisson process conditioned on its count.
    """
    rate_rps = _require_positive("rate_rps", rate_rps)
    duration_s = _require_positive("duration_s", duration_s)
    count = rng.poisson(rate_rps * duration_s)
    return np.sort(rng.uniform(0.0, duration_s, size=count))


def gamma_arrivals(
    *, rate_rps: float, ca2: float, duration_s: float, rng: np.random.Generator
) -> FloatArray:
    """Sorted arrival times in [0, duration_s) of a stationary Gamma renewal process.

    The gaps are Gamma with mean ``1 / rate_rps`` and squared coefficient of
    variation ``ca2`` (shape ``1 / ca2``): ``ca2 == 1`` is a Poisson process,
    ``ca2 > 1`` bursty (clusters of short gaps between long silences), ``ca2 < 1``
    smoother than Poisson. The process is started in equilibrium, so the expected
    count in any window of length w is exactly ``rate_rps * w``.
    """
    rate_rps = _require_positive("rate_rps", rate_rps)
    ca2 = _require_positive("ca2", ca2)
    duration_s = _require_positive("duration_s", duration_s)
    return _stationary_renewal(rate_rps=rate_rps, ca2=ca2, horizon_s=duration_s, rng=rng)


def diurnal_arrivals(
    *,
    mean_rate_rps: float,
    peak_to_trough: float,
    period_s: float,
    duration_s: float,
    ca2: float,
    rng: np.random.Generator,
) -> FloatArray:
    """Sorted arrival times in [0, duration_s) whose rate follows a daily cycle.

    The rate is the sinusoid ``lambda(t) = mean_rate_rps * (1 - a * cos(2 pi t /
    period_s))`` with ``a = (peak_to_trough - 1) / (peak_to_trough + 1)``, so the
    trough (at t = 0, and every period after) is ``peak_to_trough`` times lower
    than the peak (at half a period), and the average over a period is
    ``mean_rate_rps``. ``peak_to_trough == 1`` is a constant rate.

    Construction: a time change. A stationary Gamma renewal process of rate 1 and
    gap SCV ``ca2`` is drawn on [0, Lambda(duration_s)), where ``Lambda(t)`` is the
    cumulative rate (the integral of lambda from 0 to t), and each of its points s
    is mapped to ``Lambda^-1(s)``. The count in [t1, t2) then has mean exactly
    ``Lambda(t2) - Lambda(t1)``, and over spans where the rate changes little
    compared with a gap the process looks like a Gamma renewal process of rate
    ``lambda(t)`` and SCV ``ca2``: burstiness is kept while the rate drifts.
    """
    mean_rate_rps = _require_positive("mean_rate_rps", mean_rate_rps)
    peak_to_trough = _require_positive("peak_to_trough", peak_to_trough)
    if peak_to_trough < 1:
        raise ValueError(f"peak_to_trough: must be >= 1 (peak over trough), got {peak_to_trough}")
    period_s = _require_positive("period_s", period_s)
    duration_s = _require_positive("duration_s", duration_s)
    ca2 = _require_positive("ca2", ca2)

    amplitude = (peak_to_trough - 1.0) / (peak_to_trough + 1.0)
    omega = 2.0 * math.pi / period_s

    def cumulative(t: FloatArray) -> FloatArray:
        return mean_rate_rps * (t - amplitude / omega * np.sin(omega * t))

    horizon = float(cumulative(np.array([duration_s]))[0])
    operational = _stationary_renewal(rate_rps=1.0, ca2=ca2, horizon_s=horizon, rng=rng)
    # Lambda is strictly increasing (its slope, the rate, is at least the trough
    # mean_rate_rps * (1 - a) > 0), and lambda stays within mean * (1 -/+ a), which
    # brackets each inverse; bisection is then safe for any peak_to_trough.
    lo = np.minimum(operational / (mean_rate_rps * (1.0 + amplitude)), duration_s)
    hi = np.minimum(operational / (mean_rate_rps * (1.0 - amplitude)), duration_s)
    for _ in range(_INVERSION_STEPS):
        mid = 0.5 * (lo + hi)
        below = cumulative(mid) < operational
        lo = np.where(below, mid, lo)
        hi = np.where(below, hi, mid)
    times = 0.5 * (lo + hi)
    # Rounding in the last bisection step can swap neighbours a few ulps apart, or
    # land a point that belongs just below duration_s on it.
    times = np.sort(times)
    return times[times < duration_s]


def _stationary_renewal(
    *, rate_rps: float, ca2: float, horizon_s: float, rng: np.random.Generator
) -> FloatArray:
    shape = 1.0 / ca2
    scale = ca2 / rate_rps
    # The first arrival is the forward recurrence time of a renewal process in
    # equilibrium, not an ordinary gap: the gap that straddles t = 0 is
    # length-biased, Gamma(shape + 1, scale), and t = 0 falls uniformly inside it.
    # Starting with an ordinary gap instead would bias counts near t = 0.
    first = rng.uniform() * rng.gamma(shape + 1.0, scale)
    chunks = [np.array([first])]
    last = first
    # Draw gaps in batches large enough to cover the horizon in one go with high
    # probability (mean count plus six standard deviations), looping if not.
    expected = rate_rps * horizon_s
    batch = int(expected + 6.0 * math.sqrt(expected * max(ca2, 1.0)) + 16)
    while last < horizon_s:
        times = last + np.cumsum(rng.gamma(shape, scale, size=batch))
        chunks.append(times)
        last = float(times[-1])
    arrivals = np.concatenate(chunks)
    return arrivals[arrivals < horizon_s]


# --- lengths -------------------------------------------------------------------------


def synthesize(
    *, arrival_s: FloatArray, lengths: LengthSamples, rng: np.random.Generator, source: str
) -> Trace:
    """A trace with the given arrival times and lengths drawn from ``lengths``.

    Each request gets one row of ``lengths`` drawn uniformly with replacement: its
    prompt and output lengths stay paired, so their joint distribution (and their
    correlation) is the sample's. ``arrival_s`` must be sorted.
    """
    arrival_s = np.asarray(arrival_s, dtype=np.float64)
    if arrival_s.ndim != 1:
        raise ValueError(f"arrival_s: expected a 1-D array, got {arrival_s.ndim} dimensions")
    rows = rng.integers(0, len(lengths), size=len(arrival_s))
    return Trace(
        arrival_s=arrival_s.copy(),
        prompt_tokens=lengths.prompt_tokens[rows].astype(np.int64),
        output_tokens=lengths.output_tokens[rows].astype(np.int64),
        source=source,
    )


# --- transforming traces -------------------------------------------------------------


def scale_rate(trace: Trace, factor: float, rng: np.random.Generator) -> Trace:
    """The trace with its arrival rate multiplied by ``factor``, on the same time axis.

    ``factor < 1`` thins: each request is kept independently with probability
    ``factor`` (a thinned Poisson process is Poisson; a thinned renewal process
    with gap SCV c2 has SCV ``factor * c2 + 1 - factor``).

    ``factor >= 1`` copies: each request is kept ``floor(factor)`` times, plus once
    more with probability ``frac(factor)``. The original stays at its own time; each
    extra copy goes to a uniformly random time in the gap up to the next arrival
    (the last request, having no next, uses the gap before it). Why there: where
    the original traffic is dense the gaps are short, so the copies land where the
    originals are; the rate's shape over time is kept down to the time scale of the
    gaps, and no copy falls outside the original span. Copying at the same instant
    would instead turn every request into a simultaneous burst, and compressing time
    would change the duration. Copies keep the original's lengths. The within-gap
    placement is uniform, so the fine-grained burstiness (the gap SCV) is not
    preserved: it moves towards that of the copies' uniform spread.
    """
    factor = _require_positive("factor", factor)
    source = f"{trace.source} (rate x{factor:g})"
    n = len(trace)
    if n == 0:
        return _take(trace, np.arange(0), trace.arrival_s, source)
    if factor < 1:
        kept = np.flatnonzero(rng.random(n) < factor)
        return _take(trace, kept, trace.arrival_s[kept], source)

    whole = math.floor(factor)
    extra = (whole - 1) + (rng.random(n) < factor - whole).astype(np.int64)
    t = trace.arrival_s
    gap_start = t.copy()
    gap_end = np.append(t[1:], t[-1])
    if n >= 2:
        gap_start[-1], gap_end[-1] = t[-2], t[-1]
    copied = np.repeat(np.arange(n), extra)
    copy_s = gap_start[copied] + rng.random(len(copied)) * (gap_end - gap_start)[copied]
    rows = np.concatenate([np.arange(n), copied])
    times = np.concatenate([t, copy_s])
    order = np.argsort(times, kind="stable")
    return _take(trace, rows[order], times[order], source)


def time_slice(trace: Trace, *, start_s: float, end_s: float) -> Trace:
    """The requests arriving in [start_s, end_s), their times shifted by ``-start_s``.

    A request at ``start_s`` arrives at 0 in the slice; quiet time at the start of
    the window is kept. A window with no request in it gives an empty trace.
    Raises ``ValueError`` naming the bound when ``start_s`` is negative or past the
    last arrival, or ``end_s`` is not after ``start_s``.
    """
    for name, value in (("start_s", start_s), ("end_s", end_s)):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name}: expected a number of seconds, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{name}: expected a finite number of seconds, got {value!r}")
    if start_s < 0:
        raise ValueError(f"start_s: must be >= 0, got {start_s}")
    if end_s <= start_s:
        raise ValueError(f"end_s: must be > start_s = {start_s}, got {end_s}")
    if len(trace) and start_s > trace.arrival_s[-1]:
        raise ValueError(
            f"start_s: {start_s} is after the last arrival of {trace.source} "
            f"at {trace.arrival_s[-1]:.6g} s"
        )
    lo, hi = np.searchsorted(trace.arrival_s, [start_s, end_s], side="left")
    rows = np.arange(lo, hi)
    source = f"{trace.source} [{start_s:g} s, {end_s:g} s)"
    return _take(trace, rows, trace.arrival_s[rows] - start_s, source)


def _take(trace: Trace, rows: IntArray, arrival_s: FloatArray, source: str) -> Trace:
    return Trace(
        arrival_s=np.array(arrival_s, dtype=np.float64),
        prompt_tokens=trace.prompt_tokens[rows],
        output_tokens=trace.output_tokens[rows],
        source=source,
    )


# --- statistics ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TraceStats:
    """What a trace looks like to a capacity planner.

    ``mean_rate_rps`` is (requests - 1) / duration_s, None when every request
    arrives at one instant; ``interarrival_scv`` is None with fewer than three
    requests or no time between them. ``busiest_minute_rps`` is the most requests
    in any 60-s window starting at an arrival, divided by 60 (for a trace shorter
    than a minute, its whole count over 60). Length percentiles interpolate
    linearly between order statistics.
    """

    requests: int
    duration_s: float
    mean_rate_rps: float | None
    interarrival_scv: float | None
    busiest_minute_rps: float
    prompt_mean_tokens: float
    prompt_p50_tokens: float
    prompt_p99_tokens: float
    output_mean_tokens: float
    output_p50_tokens: float
    output_p99_tokens: float

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError(f"requests: must be >= 1, got {self.requests}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "requests" or value is None:
                continue
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{f.name}: expected a finite number >= 0, got {value!r}")


def summarize(trace: Trace) -> TraceStats:
    """Summary statistics of a non-empty trace (``TraceError`` if it is empty)."""
    n = len(trace)
    if n == 0:
        raise TraceError(f"summarize: {trace.source} has no requests")
    t = trace.arrival_s
    gaps = np.diff(t)
    mean_gap = float(gaps.mean()) if n >= 2 else 0.0
    in_window = np.searchsorted(t, t + _MINUTE_S, side="left") - np.arange(n)
    prompt = trace.prompt_tokens
    output = trace.output_tokens
    return TraceStats(
        requests=n,
        duration_s=trace.duration_s,
        mean_rate_rps=trace.mean_rate_rps if trace.duration_s > 0 else None,
        interarrival_scv=trace.interarrival_scv if n >= 3 and mean_gap > 0 else None,
        busiest_minute_rps=float(in_window.max()) / _MINUTE_S,
        prompt_mean_tokens=float(prompt.mean()),
        prompt_p50_tokens=float(np.percentile(prompt, 50)),
        prompt_p99_tokens=float(np.percentile(prompt, 99)),
        output_mean_tokens=float(output.mean()),
        output_p50_tokens=float(np.percentile(output, 50)),
        output_p99_tokens=float(np.percentile(output, 99)),
    )
