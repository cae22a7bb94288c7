"""One control tick, and its record.

Pure: ``run_tick`` does no I/O of its own — the source, the actuator, the profile
loader, the arrival history and the timer are passed in — so the production loop,
the simulator and the tests run the same tick. The record is plain data that the
loop, the REST API, the operator's status and the logs all read, so none of them
needs its own copy of its shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from controller.actuator import Actuator, ActuatorError, ActuatorRetryableError
from controller.config import ControllerConfig, ForecastConfig
from controller.observation import ObservationSource
from controller.policy import CapacityModels, ControllerState, Decision, decide
from controller.policy.forecast import ArrivalHistory, forecast_rate_rps
from controller.policy.leadtime import forecast_horizon_s
from queueing.pools import Pool
from queueing.profile import IterationProfile, ProfileError


@dataclass(frozen=True, kw_only=True)
class TickRecord:
    """One tick as the REST API and the logs show it."""

    time_s: float
    config_version: str
    decision: Decision | None
    applied: bool
    error: str | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "time_s": self.time_s,
            "config_version": self.config_version,
            "applied": self.applied,
            "error": self.error,
            **(self.decision.as_dict() if self.decision else {}),
        }


@dataclass(frozen=True, kw_only=True)
class Tick:
    """What one ``run_tick`` did: its record, the state to carry on, and how long
    ``decide`` took (for the solve-time histogram)."""

    record: TickRecord
    state: ControllerState
    decide_s: float | None  # None: no decision ran (actuator or profile error)


def forecast_config(config: ControllerConfig, state: ControllerState) -> ForecastConfig:
    """The forecaster's configuration for this tick: with lead-time planning on, its
    horizon is the longer of the pools' measured lead times (start-up + tick), so it
    looks as far ahead as a worker started now takes to serve; otherwise the
    configured ``forecast.horizon_s``.

    Its trend bins are at least one tick long: a live controller measures the rate
    once a tick (``RecordedArrivals``), so a shorter bin splits one measurement over
    several bins, which the trend's t-test would take for independent evidence (a
    spurious rise read from one noisy tick); the back-test bins as the live
    controller can, though the simulator knows every arrival."""
    forecast = replace(config.forecast, bin_s=max(config.forecast.bin_s, config.interval_s))
    return replace(forecast, horizon_s=forecast_horizon_s(state.pools, config))


def run_tick(
    *,
    now_s: float,
    config: ControllerConfig,
    config_version: str,
    state: ControllerState,
    source: ObservationSource,
    actuator: Actuator,
    load_profile: Callable[[str], IterationProfile],
    models: CapacityModels,
    history: ArrivalHistory,
    timer: Callable[[], float],
) -> Tick:
    """One control tick: observe -> forecast (when configured) -> decide -> actuate.

    The production loop, the simulator's controlled runs, the back-test policy and
    the tests all call this one function; what differs between them is only what
    they pass in (the source, the actuator, the history, the clock). An actuator
    or profile failure yields a record with its error and no decision; a failed
    scale keeps the decided state (the next tick observes the real replicas and
    decides again, and cooldowns stay honest).
    """

    def failed(error: str) -> Tick:
        record = TickRecord(
            time_s=now_s,
            config_version=config_version,
            decision=None,
            applied=False,
            error=error,
        )
        return Tick(record=record, state=state, decide_s=None)

    try:
        replicas = {pool: actuator.observe(pool) for pool in Pool}
    except ActuatorError as exc:
        return failed(f"actuator: {exc}")
    try:
        profile = load_profile(config.profile)
    except (OSError, ProfileError) as exc:
        return failed(f"profile: {exc}")
    observation = source.observe(now_s=now_s, replicas=replicas)
    history.note(observation, window_s=config.window_s, burst_window_s=config.burst_window_s)
    forecast = forecast_rate_rps(history, now_s=now_s, config=forecast_config(config, state))
    started = timer()
    decision = decide(
        observation,
        state,
        config,
        now_s=now_s,
        models=models,
        profile=profile,
        forecast_rate_rps=forecast,
    )
    decide_s = max(0.0, timer() - started)
    error = None
    applied = False
    if decision.actuate:
        try:
            for pool, seen in replicas.items():
                target = decision.target(pool)
                if target != seen.current_replicas:
                    actuator.scale(pool, target)
            applied = True
        except ActuatorRetryableError as exc:
            error = f"actuator (will retry): {exc}"
        except ActuatorError as exc:
            error = f"actuator: {exc}"
    record = TickRecord(
        time_s=now_s,
        config_version=config_version,
        decision=decision,
        applied=applied,
        error=error,
    )
    return Tick(record=record, state=decision.state, decide_s=decide_s)
