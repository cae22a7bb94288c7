"""The live controller's record of arrivals describes when they came, as the simulator's does.

A tick measures the rate over its window and over the short burst window at the end.
On a linear ramp λ(t) = a + b·t every window mean has a closed form, so the record
can be checked against the integral of λ, and the trend forecast read from it against
λ at the horizon: the record must not lag the ramp by half a window.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from controller.config import ControllerConfig, ForecastConfig
from controller.counters import cumulative_arrivals
from controller.observation import Observation, PoolObservation
from controller.policy import ControllerState
from controller.policy.forecast import RecordedArrivals, forecast_rate_rps, trend_forecast
from controller.tick import forecast_config

A_RPS, B_RPS_PER_S = 1.0, 0.05  # a ramp: 1 req/s rising by 3 req/s a minute
WINDOW_S, BURST_S, TICK_S = 30.0, 4.0, 4.0


def rate_at(t_s: float) -> float:
    return A_RPS + B_RPS_PER_S * t_s


def mean_rate(start_s: float, end_s: float) -> float:
    """The exact mean of the ramp over [start, end): its value at the midpoint."""
    return rate_at(0.5 * (start_s + end_s))


def observation(now_s: float, *, burst: bool = True) -> Observation:
    pool = PoolObservation(current_replicas=1, ready_replicas=1)
    return Observation(
        time_s=now_s,
        prefill=pool,
        decode=pool,
        arrival_rate_rps=mean_rate(now_s - WINDOW_S, now_s),
        burst_arrival_rate_rps=mean_rate(now_s - BURST_S, now_s) if burst else None,
    )


def recorded(until_s: float, *, burst: bool = True, tick_s: float = TICK_S) -> RecordedArrivals:
    record = RecordedArrivals(keep_s=3600.0)
    for now_s in np.arange(until_s, WINDOW_S - 1e-9, -tick_s)[::-1]:  # the last at until_s
        record.note(observation(float(now_s), burst=burst), window_s=WINDOW_S,
                    burst_window_s=BURST_S)  # fmt: skip
    return record


def test_each_tick_interval_holds_the_arrivals_the_ramp_sent_in_it() -> None:
    record = recorded(300.0)
    for end_s in np.arange(100.0, 300.0 + 1e-9, TICK_S):
        count = record.count_between(end_s - TICK_S, end_s)
        assert count == pytest.approx(mean_rate(end_s - TICK_S, end_s) * TICK_S, rel=1e-9)


def test_ticks_longer_than_the_burst_window_keep_each_window_count_whole() -> None:
    # Ticks every 8 s: the last 4 s at the burst rate, the 4 s before from what is
    # left of the window's count — the window's own span over those 8 s is exact.
    tick_s = 8.0
    record = recorded(300.0, tick_s=tick_s)
    end_s = 300.0
    last = record.count_between(end_s - BURST_S, end_s)
    assert last == pytest.approx(mean_rate(end_s - BURST_S, end_s) * BURST_S, rel=1e-9)
    earlier_rate = mean_rate(end_s - WINDOW_S, end_s - BURST_S)  # the rest of the window
    before = record.count_between(end_s - tick_s, end_s - BURST_S)
    assert before == pytest.approx(earlier_rate * (tick_s - BURST_S), rel=1e-9)


def test_without_a_burst_measurement_the_window_rate_stands_for_the_latest_seconds() -> None:
    record = recorded(300.0, burst=False)
    count = record.count_between(300.0 - TICK_S, 300.0)
    assert count == pytest.approx(mean_rate(300.0 - WINDOW_S, 300.0) * TICK_S, rel=1e-9)


def test_the_trend_forecast_from_the_record_reaches_the_ramp_at_the_horizon() -> None:
    horizon_s = 10.0
    # No minimum rise: the record, not the gate on small rises, is what is tested.
    config = ForecastConfig(
        enabled=True, horizon_s=horizon_s, trend_window_s=30.0, bin_s=2.0, min_rise=0.0
    )
    now_s = 300.0
    truth = rate_at(now_s + horizon_s)
    with_burst = forecast_rate_rps(recorded(now_s), now_s=now_s, config=config)
    window_only = forecast_rate_rps(recorded(now_s, burst=False), now_s=now_s, config=config)
    assert with_burst is not None and window_only is not None
    # The record holds 4-s means on 2-s bins: a staircase within b·2 s of the ramp.
    assert abs(with_burst - truth) <= B_RPS_PER_S * config.bin_s
    # The window's rate alone lags by half a window less half a tick.
    lag_s = (WINDOW_S - TICK_S) / 2
    assert truth - window_only == pytest.approx(B_RPS_PER_S * lag_s, rel=0.2)


def test_under_a_flat_rate_the_trend_alarms_at_its_t_tests_level_when_bins_are_ticks() -> None:
    # A live record holds one measured rate per tick. Bins of half a tick would split
    # each measurement in two and the t-test would count both halves: measured here,
    # false alarms then come at 2-3 times the level. forecast_config keeps the bins at
    # least a tick long, where the level is the t distribution's.
    config = ControllerConfig(
        interval_s=TICK_S,
        window_s=WINDOW_S,
        forecast=ForecastConfig(enabled=True, trend_window_s=30.0, bin_s=2.0, min_rise=0.0),
    )
    forecast = forecast_config(config, ControllerState())
    assert forecast.bin_s == TICK_S
    bins = int(forecast.trend_window_s // forecast.bin_s)
    level = float(stats.t.sf(forecast.min_t_stat, bins - 2))
    rng = np.random.default_rng(7)
    trials, now_s = 2000, 64.0

    def alarms(bin_s: float) -> int:
        count = 0
        for _ in range(trials):
            record = RecordedArrivals(keep_s=3600.0)
            for k in range(int(now_s / TICK_S)):  # Poisson counts of 6 req/s per tick
                rate = rng.poisson(6.0 * TICK_S) / TICK_S
                record.record(end_s=TICK_S * (k + 1), window_s=TICK_S, rate_rps=rate)
            rise = trend_forecast(
                record,
                now_s=now_s,
                window_s=forecast.trend_window_s,
                bin_s=bin_s,
                horizon_s=10.0,
                min_t_stat=forecast.min_t_stat,
                min_rise=0.0,
            )
            count += rise is not None
        return count

    noise = 4.0 * np.sqrt(level * (1 - level) / trials)  # four binomial s.d.
    assert abs(alarms(forecast.bin_s) / trials - level) <= noise
    assert alarms(TICK_S / 2) / trials > 2 * level


class KnownArrivals:
    """The history the simulator has: every arrival time."""

    def __init__(self, arrival_s: np.ndarray, *, until_s: float) -> None:
        self.arrival_s = np.sort(arrival_s)
        self.since_s, self.until_s = 0.0, until_s

    def counts_in_bins(self, edges_s: np.ndarray) -> np.ndarray:
        return np.histogram(self.arrival_s, bins=edges_s)[0].astype(np.float64)


def counted(
    arrival_s: np.ndarray, *, scrapes_s: np.ndarray, ticks_s: np.ndarray
) -> RecordedArrivals:
    """The record a controller keeps when each tick reads the request counter's samples
    (scraped at ``scrapes_s``) over its window."""
    record = RecordedArrivals(keep_s=3600.0)
    pool = PoolObservation(current_replicas=1, ready_replicas=1)
    for now_s in ticks_s:
        seen = scrapes_s[(scrapes_s > now_s - WINDOW_S) & (scrapes_s <= now_s)]
        samples = [(float(t), float(np.searchsorted(arrival_s, t, side="right"))) for t in seen]
        observed = Observation(
            time_s=float(now_s),
            prefill=pool,
            decode=pool,
            arrival_rate_rps=len(seen) / WINDOW_S,  # what a rate says; the counts win
            arrival_counts=cumulative_arrivals([samples]),
        )
        record.note(observed, window_s=WINDOW_S, burst_window_s=BURST_S)
    return record


def ramp_arrivals(seed: int, until_s: float, *, slope: float = B_RPS_PER_S) -> np.ndarray:
    """Poisson arrivals at A + slope t, by thinning a stream at the ramp's last rate."""
    rng = np.random.default_rng(seed)
    top_rps = A_RPS + slope * until_s
    times = np.cumsum(rng.exponential(1 / top_rps, size=int(top_rps * until_s * 1.2)))
    times = times[times < until_s]
    return times[rng.random(len(times)) < (A_RPS + slope * times) / top_rps]


def test_from_the_counters_samples_the_record_holds_the_very_arrivals_between_them() -> None:
    arrival_s = ramp_arrivals(1, 200.0)
    scrapes_s = np.arange(0.25, 200.0, 1.0)  # a 1-s scrape, out of phase with the ticks
    record = counted(arrival_s, scrapes_s=scrapes_s, ticks_s=np.arange(TICK_S, 200.0, TICK_S))
    edges = np.arange(40.25, 193.25 + 1e-9, 3.0)  # any edges on sample times
    exact = np.histogram(arrival_s, bins=edges)[0]
    assert record.counts_in_bins(edges) == pytest.approx(exact.astype(float), abs=1e-9)
    assert record.until_s == pytest.approx(195.25)  # the newest sample before the last tick


def test_the_trend_from_the_counters_is_the_trend_of_the_arrivals_themselves() -> None:
    # With ticks between scrapes, the trend ends at the newest sample and extrapolates
    # from there: the forecast is the one the arrivals give for the same bins.
    decisions = 0
    for seed in range(40):
        arrival_s = ramp_arrivals(seed, 80.0, slope=0.2)  # 5 to 17 req/s
        scrapes_s = np.arange(0.6, 80.0, 1.0)
        ticks_s = np.arange(TICK_S, 80.0 + 1e-9, TICK_S)
        record = counted(arrival_s, scrapes_s=scrapes_s, ticks_s=ticks_s)
        now_s, newest_s = float(ticks_s[-1]), float(scrapes_s[scrapes_s <= ticks_s[-1]][-1])
        kwargs = {"window_s": 30.0, "bin_s": TICK_S, "min_t_stat": 2.0, "min_rise": 0.0}
        live = trend_forecast(record, now_s=now_s, horizon_s=10.0, **kwargs)
        known = KnownArrivals(arrival_s, until_s=newest_s)
        exact = trend_forecast(known, now_s=newest_s, horizon_s=10.0 + now_s - newest_s, **kwargs)
        assert (live is None) == (exact is None)
        if live is not None:
            assert live == pytest.approx(exact, rel=1e-9)
            decisions += 1
    assert 10 < decisions < 40  # both answers are compared, on most draws a rise
