"""``sara``: the production controller, ``controller.policy.decide``, in the loop.

The adapter measures the cluster the way ``sim.control.SimulatedSource`` does (the
same windows, the same ``Observation``), keeps the controller state between ticks,
and returns the decision's targets when it actuates. There is no second copy of
the policy here: every stage (smoothing, solver, dead-band, stabilisation,
cooldowns, rate limit, clamp) is ``decide``'s.

``sara-forecast`` adds cold-start-aware forecasting on the sim side, passed to
``decide`` as its separate forecast input (``forecast_rate_rps``): a new worker
serves only ``startup_s`` after the decision, so the rate that matters is the one
``startup_s + interval_s`` ahead. The forecast is the larger of

- the recent trend: a least-squares line through the arrival counts of the last
  five minutes in 30-s bins, extrapolated to the horizon, used only when its
  slope is significant (more than two standard errors above zero) and adds at
  least 5 % over the horizon, and only once five minutes have been seen (before,
  the empty bins before the start would read as a steep rise);
- the daily cycle, once more than one period (a day by default) has been seen:
  the rate one period before the horizon, scaled by how today's current rate
  compares with the same time yesterday.

``decide`` plans for the larger of its smoothed rate and the forecast; the
observation stays what was measured, so calibration (observed against predicted
P99 at the measured rate) and the scale-down safety check are not biased by it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from controller.config import ControllerConfig
from controller.policy import ControllerState, Decision, Reason, decide
from sim.control import observation_from, replicas_of
from sim.policies.base import Allocation, ClusterView, Scenario
from sim.trace import FloatArray

DAY_S = 86_400.0


@dataclass(frozen=True, kw_only=True)
class ForecastSettings:
    """``horizon_s`` defaults to the scenario's startup delay plus one controller tick."""

    horizon_s: float | None = None
    trend_window_s: float = 300.0
    bin_s: float = 30.0
    min_t_stat: float = 2.0
    min_rise: float = 0.05  # a trend must add at least 5 % over the horizon to count
    period_s: float = DAY_S
    seasonal_smoothing_s: float = 300.0  # width of the window a past rate is read over
    max_level_ratio: float = 2.0  # bound on today / yesterday when scaling the cycle


def trend_forecast(
    arrival_s: FloatArray,
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
    bins = round(window_s / bin_s)
    if bins < 3:
        return None
    edges = now_s - window_s + bin_s * np.arange(bins + 1)
    counts = np.histogram(arrival_s, bins=edges)[0].astype(np.float64) / bin_s
    centres = 0.5 * (edges[:-1] + edges[1:]) - now_s
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
    arrival_s: FloatArray,
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

    def rate_around(t_s: float) -> float:
        lo, hi = np.searchsorted(arrival_s, [t_s - width_s / 2, t_s + width_s / 2])
        return float(hi - lo) / width_s

    def rate_before(t_s: float) -> float:
        lo, hi = np.searchsorted(arrival_s, [t_s - width_s, t_s])
        return float(hi - lo) / width_s

    then = rate_before(now_s - period_s)
    if then <= 0:
        return None
    level = min(max(rate_before(now_s) / then, 1.0 / max_level_ratio), max_level_ratio)
    return rate_around(now_s - period_s + horizon_s) * level


class SaraPolicy:
    """``decide`` with the simulator's source; optionally with the rate forecaster."""

    def __init__(
        self,
        scenario: Scenario,
        initial: Allocation,
        *,
        config: ControllerConfig | None = None,
        forecast: ForecastSettings | None = None,
    ) -> None:
        self.config = config or scenario.controller_config
        self.forecast = forecast
        self.name = "sara" if forecast is None else "sara-forecast"
        self.initial = initial
        self.interval_s = self.config.interval_s
        self._scenario = scenario
        self._state = ControllerState()
        self.decisions: list[Decision] = []
        self.forecasts = 0  # ticks on which the forecast raised the planning rate

    def tick(self, view: ClusterView) -> Allocation | None:
        cfg = self.config
        now = view.now_s
        snap = view.snapshot(window_s=cfg.window_s)
        burst = view.snapshot(window_s=cfg.burst_window_s)
        observation = observation_from(snap, burst, now_s=now, replicas=replicas_of(snap))
        forecast = None if self.forecast is None else self._forecast(view)
        decision = decide(
            observation,
            self._state,
            cfg,
            now_s=now,
            profile=self._scenario.profile,
            forecast_rate_rps=forecast,
        )
        self._state = decision.state
        self.decisions.append(decision)
        if any(r.reason is Reason.FORECAST_RAISED for r in decision.reasons):
            self.forecasts += 1
        if not decision.actuate:
            return None
        return Allocation(prefill=decision.prefill_target, decode=decision.decode_target)

    def _forecast(self, view: ClusterView) -> float | None:
        """The rate forecast for the horizon, or None when neither forecaster has one."""
        f = self.forecast
        assert f is not None
        now = view.now_s
        horizon = (
            self._scenario.worker_startup_s + self.interval_s
            if f.horizon_s is None
            else f.horizon_s
        )
        candidates: list[float | None] = []
        # The run starts at 0: before a whole trend window has been seen, the empty
        # bins before the start would read as a steep rise.
        if now >= f.trend_window_s:
            history = view.snapshot(window_s=f.trend_window_s).window_arrival_s
            candidates.append(
                trend_forecast(
                    history,
                    now_s=now,
                    window_s=f.trend_window_s,
                    bin_s=f.bin_s,
                    horizon_s=horizon,
                    min_t_stat=f.min_t_stat,
                    min_rise=f.min_rise,
                )
            )
        if now >= f.period_s + f.seasonal_smoothing_s:
            day = view.snapshot(window_s=f.period_s + f.seasonal_smoothing_s).window_arrival_s
            candidates.append(
                seasonal_forecast(
                    day,
                    now_s=now,
                    period_s=f.period_s,
                    horizon_s=horizon,
                    width_s=f.seasonal_smoothing_s,
                    max_level_ratio=f.max_level_ratio,
                )
            )
        return max((c for c in candidates if c is not None), default=None)
