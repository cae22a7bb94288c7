"""The arrival rate a worker started now will serve: a trend and a daily cycle.

A new worker serves only after its startup, so the rate that matters for a scale-up
is the one ``horizon_s`` ahead (the worker startup time plus one tick). The forecast
is the larger of

- the recent trend: a least-squares line through the arrival counts of the last
  ``trend_window_s`` in ``bin_s`` bins, extrapolated to the horizon, used only when
  its slope is significant (more than ``min_t_stat`` standard errors above zero)
  and adds at least ``min_rise`` over the horizon, and only once a whole window has
  been seen (before, empty bins would read as a steep rise);
- the daily cycle, once more than one period has been seen: the rate one period
  before the horizon, scaled by how today's current rate compares with the same
  time yesterday (bounded by ``max_level_ratio``).

``decide`` plans for the larger of its smoothed rate and the forecast (it raises
the planning rate and nothing else). The arrivals come from an ``ArrivalHistory``:
the simulator knows every arrival; a live controller records the rates it measured
(``RecordedArrivals``), or a source that keeps history could answer from it.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from controller.config import ForecastConfig
from controller.observation import Observation, usable
from queueing.lengths import FloatArray


class ArrivalHistory(Protocol):
    """Arrival counts over past intervals of the controller's clock."""

    @property
    def since_s(self) -> float:
        """The earliest time the history covers."""
        ...

    @property
    def until_s(self) -> float:
        """The latest time the history covers (a record of counter samples ends at the
        newest sample, a little before the tick)."""
        ...

    def note(self, observation: Observation, *, window_s: float, burst_window_s: float) -> None:
        """Record what a tick measured over ``window_s`` and, at its end, over the short
        ``burst_window_s`` (a history that knows every arrival ignores it)."""
        ...

    def counts_in_bins(self, edges_s: FloatArray) -> FloatArray | None:
        """Arrivals in each bin between consecutive edges; None where not covered."""
        ...

    def count_between(self, start_s: float, end_s: float) -> float | None:
        """Arrivals in [start_s, end_s); None where not covered."""
        ...


def trend_forecast(
    history: ArrivalHistory,
    *,
    now_s: float,
    window_s: float,
    bin_s: float,
    horizon_s: float,
    min_t_stat: float,
    min_rise: float = 0.05,
) -> float | None:
    """The arrival rate ``horizon_s`` ahead on the trend of the last ``window_s``, or None
    when the rise is not significant (slope under ``min_t_stat`` standard errors, or
    under ``min_rise`` of the current level over the horizon) or there are too few
    bins to tell."""
    # Whole bins back from the latest time the history covers: the tick, or the
    # newest counter sample just before it; the line is extrapolated from there.
    bins = math.floor(window_s / bin_s + 1e-9)
    if bins < 3:
        return None
    end_s = min(now_s, history.until_s)
    edges: FloatArray = end_s - bin_s * np.arange(bins, -1, -1, dtype=np.float64)
    counted = history.counts_in_bins(edges)
    if counted is None:
        return None
    counts = counted.astype(np.float64) / bin_s
    horizon_s += now_s - end_s
    centres = 0.5 * (edges[:-1] + edges[1:]) - end_s
    slope, intercept = np.polyfit(centres, counts, 1)
    residual = counts - (intercept + slope * centres)
    spread = float(np.sum((centres - centres.mean()) ** 2))
    dof = bins - 2
    stderr = math.sqrt(float(np.sum(residual**2)) / dof / spread) if spread > 0 else math.inf
    if slope <= 0 or (stderr > 0 and slope / stderr < min_t_stat):
        return None
    if slope * horizon_s < min_rise * max(float(intercept), 0.0):
        return None
    return float(intercept + slope * horizon_s)


def seasonal_forecast(
    history: ArrivalHistory,
    *,
    now_s: float,
    period_s: float,
    horizon_s: float,
    width_s: float,
    max_level_ratio: float,
) -> float | None:
    """The rate one period before the horizon, scaled by today's level against
    yesterday's; None until more than one period has been seen."""
    if now_s < period_s + width_s:
        return None
    then = history.count_between(now_s - period_s - width_s, now_s - period_s)
    today = history.count_between(now_s - width_s, now_s)
    ahead_s = now_s - period_s + horizon_s
    around = history.count_between(ahead_s - width_s / 2, ahead_s + width_s / 2)
    if then is None or today is None or around is None or then <= 0:
        return None
    level = min(max((today / width_s) / (then / width_s), 1.0 / max_level_ratio), max_level_ratio)
    return around / width_s * level


def forecast_rate_rps(
    history: ArrivalHistory, *, now_s: float, config: ForecastConfig
) -> float | None:
    """The larger of the two forecasts for ``config.horizon_s`` ahead, or None when
    neither has one (or forecasting is disabled)."""
    if not config.enabled:
        return None
    candidates: list[float | None] = []
    if now_s - config.trend_window_s >= history.since_s:
        candidates.append(
            trend_forecast(
                history,
                now_s=now_s,
                window_s=config.trend_window_s,
                bin_s=config.bin_s,
                horizon_s=config.horizon_s,
                min_t_stat=config.min_t_stat,
                min_rise=config.min_rise,
            )
        )
    if now_s - config.period_s - config.seasonal_smoothing_s >= history.since_s:
        candidates.append(
            seasonal_forecast(
                history,
                now_s=now_s,
                period_s=config.period_s,
                horizon_s=config.horizon_s,
                width_s=config.seasonal_smoothing_s,
                max_level_ratio=config.max_level_ratio,
            )
        )
    return max((c for c in candidates if c is not None), default=None)


@dataclass(frozen=True, kw_only=True)
class _Window:
    start_s: float
    end_s: float
    rate_rps: float


class RecordedArrivals:
    """An ``ArrivalHistory`` from what a live controller measured, tick by tick.

    Where the source read the request counters' samples (``arrival_counts``), each
    interval between two samples is recorded with its exact count: the record is
    then the arrivals themselves at the scrape resolution, as the simulator's
    history is at every arrival. Otherwise each tick's window contributes
    ``rate x overlap`` arrivals to the intervals it overlaps (arrivals are taken as
    spread evenly over a window, which is all a rate says). An interval less than
    99 % covered by recorded windows is not answered, so a missed tick or a restart
    withholds the forecast instead of reading as a drop. The record is kept for
    ``keep_s`` (a day and a smoothing window by default, for the daily cycle); a
    restarted controller warm-starts it from
    Prometheus (``seed`` with ``PrometheusSource.arrival_history``) or from the
    record it persisted (``to_list`` / ``restore``).
    """

    def __init__(self, *, keep_s: float) -> None:
        if not (math.isfinite(keep_s) and keep_s > 0):
            raise ValueError(f"keep_s: must be a finite number > 0, got {keep_s!r}")
        self.keep_s = keep_s
        self._windows: deque[_Window] = deque()

    @property
    def since_s(self) -> float:
        return self._windows[0].start_s if self._windows else math.inf

    @property
    def until_s(self) -> float:
        return self._windows[-1].end_s if self._windows else -math.inf

    def note(self, observation: Observation, *, window_s: float, burst_window_s: float) -> None:
        """Record the tick's window, its last ``burst_window_s`` at the short window's rate.

        A window's rate is its mean: recorded as the rate of the seconds just before
        the tick, it describes the middle of the window instead, so on a rising rate
        the record — and the trend read from it — lags by half a window (13 s behind
        with a 30-s window and 4-s ticks), where a history of the arrivals
        themselves does not. The short window at the end says what the latest
        seconds held; the rest of the window holds what is left of its count:
        ``(rate x window - burst x burst window) / (window - burst window)``,
        an exact split of the window's arrivals, not an estimate fed back on itself.

        With the counters' samples none of that is needed: each interval between
        consecutive samples is recorded at its own count (those the record already
        holds are clipped away, as overlapping windows are).
        """
        if observation.arrival_counts is not None:
            for (t0, n0), (t1, n1) in itertools.pairwise(observation.arrival_counts):
                self.record(end_s=t1, window_s=t1 - t0, rate_rps=(n1 - n0) / (t1 - t0))
            return
        rate = observation.arrival_rate_rps
        if rate is None or not usable(rate):
            return
        end_s, rate = observation.time_s, float(rate)
        burst = observation.burst_arrival_rate_rps
        if burst is None or not usable(burst) or not 0 < burst_window_s < window_s:
            self.record(end_s=end_s, window_s=window_s, rate_rps=rate)
            return
        burst = float(burst)
        earlier = max(rate * window_s - burst * burst_window_s, 0.0) / (window_s - burst_window_s)
        self.record(
            end_s=end_s - burst_window_s, window_s=window_s - burst_window_s, rate_rps=earlier
        )
        self.record(end_s=end_s, window_s=burst_window_s, rate_rps=burst)

    def seed(self, points: Iterable[tuple[float, float]], *, window_s: float) -> int:
        """Record past (end of window, req/s) measurements in time order — a metrics
        store's history, or a persisted record — as if ticks had measured them;
        returns how many were kept."""
        kept = 0
        for end_s, rate in sorted(points):
            if usable(rate) and math.isfinite(end_s):
                before = len(self._windows)
                self.record(end_s=float(end_s), window_s=window_s, rate_rps=float(rate))
                kept += len(self._windows) > before
        return kept

    def to_list(self) -> list[list[float]]:
        """The record as [start_s, end_s, rate] triples (the loop persists it)."""
        return [[w.start_s, w.end_s, w.rate_rps] for w in self._windows]

    def restore(self, rows: Iterable[Iterable[float]]) -> None:
        """Replace the record by ``to_list``'s triples (in time order)."""
        windows = [_Window(start_s=a, end_s=b, rate_rps=r) for a, b, r in rows]
        if any(w.end_s <= w.start_s or not usable(w.rate_rps) for w in windows):
            raise ValueError("rows: each needs start_s < end_s and a rate >= 0")
        self._windows = deque(sorted(windows, key=lambda w: w.start_s))

    def record(self, *, end_s: float, window_s: float, rate_rps: float) -> None:
        """One window's rate ending at ``end_s``."""
        rate = rate_rps
        start_s = end_s - window_s
        # Windows that overlap the previous one (ticks faster than the window) are
        # clipped, so no interval counts its arrivals twice.
        if self._windows and start_s < self._windows[-1].end_s:
            start_s = self._windows[-1].end_s
        if end_s <= start_s:
            return
        self._windows.append(_Window(start_s=start_s, end_s=end_s, rate_rps=rate))
        while self._windows and self._windows[0].end_s < end_s - self.keep_s:
            self._windows.popleft()

    def count_between(self, start_s: float, end_s: float) -> float | None:
        count = 0.0
        covered_s = 0.0
        for w in self._windows:
            overlap = min(end_s, w.end_s) - max(start_s, w.start_s)
            if overlap > 0:
                count += w.rate_rps * overlap
                covered_s += overlap
        if covered_s < 0.99 * (end_s - start_s):
            return None
        return count

    def counts_in_bins(self, edges_s: FloatArray) -> FloatArray | None:
        counts = []
        for a, b in itertools.pairwise(edges_s):
            c = self.count_between(float(a), float(b))
            if c is None:
                return None
            counts.append(c)
        return np.asarray(counts, dtype=np.float64)
