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

A change of the rate is no dispersion: a window that holds the start of a burst after a
silent minute has sub-window counts of 0 and 125, whose variance over their mean reads
as a ca² of 50 where the arrivals of either level are Poisson. The controller follows
a level that lasts a measurement window (its shift test acts once a window), so what the
queue must absorb *about that rate* is the dispersion of the sub-window counts about
the window's level, with a level that changes inside a window split at the change
(``level_robust_dispersion``). A cluster of simultaneous requests that lasts seconds is
dispersion (it is over before the controller could follow it); a level that lasts a
window is not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

CounterSample = tuple[float, float]  # (time in seconds, counter value)

MIN_INTERVALS = 3  # sub-windows needed for a dispersion estimate with 2 degrees of freedom
# A change of level is accepted when a burst of the rate's own noise would make one as
# large at most once in a hundred spans (the SLO's P99 risk), shared by the positions
# tried (Bonferroni).
LEVEL_TEST_RISK = 0.01


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


def level_robust_dispersion(
    counts: npt.ArrayLike, durations_s: npt.ArrayLike, *, window_intervals: int
) -> float | None:
    """The index of dispersion of consecutive sub-window counts (oldest first) about
    the levels the controller follows, robust to a change of the rate.

    The counts are cut at every ``window_intervals`` back from the newest (the
    measurement windows: each is judged about its own level, as the controller plans
    each window's rate) and at the changes of level found by binary segmentation: the
    split that most reduces the squared deviations is accepted when that reduction,
    over the noise the fitted dispersion implies (its chi-square with one degree of
    freedom), is beyond ``LEVEL_TEST_RISK`` shared by the positions tried; a level
    must last at least a window, except the newest (it may have just begun) and the
    oldest (it began before the counts). The sub-window in which a change falls holds
    a part of each level: only a count outside the two is a deviation. Without a
    change this is ``dispersion_index`` of the windows pooled; ``None`` where that is.
    """
    c = np.asarray(counts, dtype=np.float64)
    d = np.asarray(durations_s, dtype=np.float64)
    if c.shape != d.shape:
        raise ValueError(f"durations_s: {d.shape} values for {c.shape} counts")
    if window_intervals < 1:
        raise ValueError(f"window_intervals: must be >= 1, got {window_intervals!r}")
    keep = d > 0
    c, d = c[keep], d[keep]
    n = len(c)
    if n < MIN_INTERVALS or not np.all(np.isfinite(c)) or float(c.sum()) <= 0:
        return None
    windows = frozenset(range(n - window_intervals, 0, -window_intervals))
    changes: list[int] = []  # the first sub-window of each level after the oldest
    fit = _LevelFit(c, d, windows)
    while True:
        best = _best_split(fit, changes, n, window_intervals)
        if best is None:
            break
        k, (num, den) = best
        before, before_den = fit.deviations(changes)
        a = max((x for x in changes if x < k), default=0)
        b = min((x for x in changes if x > k), default=n)
        # The noise is the dispersion fitted after the split (robust to the change it
        # tests); where the split leaves no degree of freedom, the one fitted without it
        # (the null's own, conservative under a change); with neither, nothing to judge.
        if den > 0:
            phi = num / den
        elif before_den > 0:
            phi = before / before_den
        else:
            break
        level_rate = float(c[a:b].sum() / d[a:b].sum())
        noise = max(phi * level_rate * float(d[a:b].mean()), 1e-12)
        positions = n - len(changes)
        threshold = NormalDist().inv_cdf(1.0 - LEVEL_TEST_RISK / (2.0 * positions)) ** 2
        if (before - num) / noise <= threshold:
            break
        changes = sorted([*changes, k])
    num, den = fit.deviations(changes)
    return num / den if den > 0 else None


class _LevelFit:
    """Squared deviations of counts about piecewise-constant levels (the sums of
    ``dispersion_index``, added over pieces): the levels start at ``changes`` and are
    cut further at the window boundaries. Prefix sums make each piece O(1)."""

    def __init__(self, c: np.ndarray, d: np.ndarray, windows: frozenset[int]) -> None:
        self.c, self.d = c, d
        zero = np.zeros(1)
        self.p_c, self.p_d, self.p_cc, self.p_cd, self.p_dd = (
            np.concatenate([zero, np.cumsum(v)]) for v in (c, d, c * c, c * d, d * d)
        )
        self.bounds = np.array(sorted(windows), dtype=np.int64)
        full = [self._piece(int(x), int(y)) for x, y in pairwise(self.bounds)]
        self.q_num = np.concatenate([zero, np.cumsum([f[0] for f in full])])
        self.q_den = np.concatenate([zero, np.cumsum([f[1] for f in full])])

    def rate(self, a: int, b: int) -> float:
        span = self.p_d[b] - self.p_d[a]
        return float((self.p_c[b] - self.p_c[a]) / span) if span > 0 else 0.0

    def _piece(self, x: int, y: int) -> tuple[float, float]:
        """One piece about its own rate: sum((c - r d)^2) and its expectation's r x
        (D - sum(d^2) / D); nothing below two sub-windows (no degree of freedom)."""
        if y - x < 2:
            return 0.0, 0.0
        total = self.p_d[y] - self.p_d[x]
        r = (self.p_c[y] - self.p_c[x]) / total
        cc, cd, dd = (p[y] - p[x] for p in (self.p_cc, self.p_cd, self.p_dd))
        return float(max(cc - 2.0 * r * cd + r * r * dd, 0.0)), float(r * (total - dd / total))

    def _span(self, x: int, y: int) -> tuple[float, float]:
        """The pieces of [x, y) cut at the window boundaries inside it."""
        i = int(np.searchsorted(self.bounds, x, side="right"))
        j = int(np.searchsorted(self.bounds, y, side="left")) - 1
        if i > j:
            return self._piece(x, y)
        head = self._piece(x, int(self.bounds[i]))
        tail = self._piece(int(self.bounds[j]), y)
        return (
            head[0] + float(self.q_num[j] - self.q_num[i]) + tail[0],
            head[1] + float(self.q_den[j] - self.q_den[i]) + tail[1],
        )

    def deviations(self, changes: Sequence[int]) -> tuple[float, float]:
        c, d = self.c, self.d
        num = den = 0.0
        previous: float | None = None
        for a, b in pairwise([0, *changes, len(c)]):
            start = a + 1 if a > 0 else a  # a change's own sub-window holds both levels
            rate = self.rate(start, b) if b > start else self.rate(a, b)
            if previous is not None:
                lo, hi = sorted((previous * d[a], rate * d[a]))
                num += max(lo - c[a], c[a] - hi, 0.0) ** 2
            piece_num, piece_den = self._span(start, b)
            num, den = num + piece_num, den + piece_den
            previous = rate
        return num, den


def _best_split(
    fit: _LevelFit, changes: list[int], n: int, window: int
) -> tuple[int, tuple[float, float]] | None:
    best: tuple[int, tuple[float, float]] | None = None
    for a, b in pairwise([0, *changes, n]):
        head = window if a > 0 else 1  # the oldest level began before the counts
        tail = window if b < n else 1  # the newest may have just begun
        for k in range(a + head, b - tail + 1):
            trial = fit.deviations(sorted([*changes, k]))
            if best is None or trial[0] < best[1][0]:
                best = (k, trial)
    return best


def interarrival_scv(
    series: Sequence[Sequence[CounterSample]], *, step_s: float, window_s: float
) -> float | None:
    """ca² of the arrivals counted by one or more counters (e.g. one per router).

    The counters are read on a common grid ``T, T - step, T - 2 step, ...`` back from
    the newest sample T, as Prometheus reads a series at a time: the last sample at or
    before it. Only grid points that every counter already covers are used. Each
    interval's count is the sum over counters of their reset-corrected increase; its
    length is the time between the samples actually read (the longest over counters;
    exact for one counter),
    so a step that is not a multiple of the scrape interval does not inflate the
    variance. Steps shorter than the scrape interval give empty intervals, which are
    dropped. The counts are judged about the levels of the measurement windows of
    ``window_s`` and the changes of level between (``level_robust_dispersion``); the
    counters' samples may reach further back than one window, to tell a level from a
    burst. ``None`` where ``dispersion_index`` is.
    """
    if not step_s > 0:
        raise ValueError(f"step_s: must be > 0, got {step_s!r}")
    if not window_s > 0:
        raise ValueError(f"window_s: must be > 0, got {window_s!r}")
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
    # Oldest first, and only the intervals a new sample opened (see the docstring).
    counts, durations = counts[::-1], durations[::-1]
    keep = durations > 0
    return level_robust_dispersion(
        counts[keep], durations[keep], window_intervals=max(1, round(window_s / step_s))
    )


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
