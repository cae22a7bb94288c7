"""Counters over time: reset-corrected increases and the inter-arrival SCV estimate.

A counter sample is ``(time_s, value)``. A value lower than the one before means the
process restarted and its counter began again at zero: as in Prometheus's
``rate``/``increase``, the increase across that pair is the new value itself.

The inter-arrival SCV (ca²) cannot be read from a counter directly. For a renewal
process the index of dispersion of counts, Var[N(t)] / E[N(t)], tends to ca² as the
counting interval t grows (Cox, *Renewal Theory*; Whitt's ``I_c``), and it is exactly
1 for Poisson arrivals at any t. So the window is cut into sub-windows of about
``step_s``, the arrivals in each are counted, and their dispersion is the estimate.
It is noisy: with k sub-windows it is roughly ca² · χ²(k-1)/(k-1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

import numpy as np
import numpy.typing as npt

CounterSample = tuple[float, float]  # (time in seconds, counter value)

MIN_INTERVALS = 3  # sub-windows needed for a dispersion estimate with 2 degrees of freedom


def corrected_increase(values: Sequence[float]) -> float:
    """The increase over consecutive samples of one counter, across restarts."""
    return sum(cur - prev if cur >= prev else cur for prev, cur in pairwise(values))


def dispersion_index(counts: npt.ArrayLike, durations_s: npt.ArrayLike) -> float | None:
    """Var/mean of arrival counts in intervals of (possibly unequal) lengths.

    With rate estimate r = sum(c) / sum(d), the estimator
    ``sum((c_i - r d_i)^2) / (r (D - sum(d_i^2) / D))`` is unbiased for independent
    counts whose variance is proportional to the interval; with equal intervals it is
    the sample variance (ddof=1) over the mean. ``None`` without arrivals (the SCV of
    nothing is undefined) or with fewer than ``MIN_INTERVALS`` intervals.
    """
    c = np.asarray(counts, dtype=np.float64)
    d = np.asarray(durations_s, dtype=np.float64)
    if c.shape != d.shape:
        raise ValueError(f"durations_s: {d.shape} values for {c.shape} counts")
    keep = d > 0
    c, d = c[keep], d[keep]
    total_d = float(d.sum())
    if len(c) < MIN_INTERVALS or not np.all(np.isfinite(c)) or total_d <= 0:
        return None
    rate = float(c.sum()) / total_d
    effective_d = total_d - float((d * d).sum()) / total_d
    if rate <= 0 or effective_d <= 0:
        return None
    return float(((c - rate * d) ** 2).sum()) / (rate * effective_d)


def interarrival_scv(series: Sequence[Sequence[CounterSample]], *, step_s: float) -> float | None:
    """ca² of the arrivals counted by one or more counters (e.g. one per router).

    The counters are read on a common grid ``T, T - step, T - 2 step, ...`` back from
    the newest sample T, as Prometheus reads a series at a time: the last sample at or
    before it. Only grid points that every counter already covers are used. Each
    interval's count is the sum over counters of their reset-corrected increase; its
    length is the time between the samples actually read (the longest over counters;
    exact for one counter),
    so a step that is not a multiple of the scrape interval does not inflate the
    variance. Steps shorter than the scrape interval give empty intervals, which are
    dropped. ``None`` where ``dispersion_index`` is.
    """
    if not step_s > 0:
        raise ValueError(f"step_s: must be > 0, got {step_s!r}")
    prepared = _cumulative_per_counter(series)
    if not prepared:
        return None
    newest = max(times[-1] for times, _ in prepared)
    oldest = max(times[0] for times, _ in prepared)
    k = math.floor((newest - oldest) / step_s + 1e-9)
    if k < MIN_INTERVALS:
        return None
    grid = newest - step_s * np.arange(k + 1, dtype=np.float64)  # newest first
    counts = np.zeros(k)
    durations = np.zeros(k)
    for times, cumulative in prepared:
        # The last sample at or before each grid point (every counter has one: see k).
        at = np.maximum(np.searchsorted(times, grid + 1e-9, side="right") - 1, 0)
        counts += cumulative[at[:-1]] - cumulative[at[1:]]
        # A counter that stopped (its router died) spans nothing; the live ones agree.
        durations = np.maximum(durations, times[at[:-1]] - times[at[1:]])
    return dispersion_index(counts, durations)


def cumulative_arrivals(
    series: Sequence[Sequence[CounterSample]],
) -> tuple[CounterSample, ...] | None:
    """The arrivals counted by one or more counters, as ``(time, arrivals since the
    first time)`` at every sample time that all counters cover.

    Each counter is read as Prometheus reads a series: its last sample at or before
    the time, reset-corrected. So the count between two of these times is exact for
    one counter (its own increments), and for several it is exact up to where each
    counter's samples fall between the times. ``None`` with fewer than two such
    times, or a non-finite value.
    """
    prepared = _cumulative_per_counter(series)
    if not prepared:
        return None
    oldest = max(times[0] for times, _ in prepared)
    grid = np.unique(np.concatenate([times[times >= oldest] for times, _ in prepared]))
    if len(grid) < 2:
        return None
    total = np.zeros(len(grid))
    for times, cumulative in prepared:
        at = np.searchsorted(times, grid + 1e-9, side="right") - 1
        total += cumulative[at] - cumulative[at[0]]
    return tuple((float(t), float(n)) for t, n in zip(grid, total, strict=True))


def _cumulative_per_counter(
    series: Sequence[Sequence[CounterSample]],
) -> list[tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]]:
    """Each non-empty counter's sample times (sorted) and its reset-corrected count
    since its first sample; empty when any value is not finite."""
    prepared: list[tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]] = []
    for samples in series:
        if not samples:
            continue
        ordered = sorted(samples)
        times = np.array([t for t, _ in ordered], dtype=np.float64)
        values = [v for _, v in ordered]
        if not all(math.isfinite(v) for v in values):
            return []
        steps = [cur - prev if cur >= prev else cur for prev, cur in pairwise(values)]
        prepared.append((times, np.concatenate([[0.0], np.cumsum(steps)])))
    return prepared
