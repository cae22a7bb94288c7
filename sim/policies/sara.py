"""``sara``: the production controller's tick, ``controller.tick.run_tick``, in the loop.

The adapter measures the cluster with the simulator's source (``sim.control``: the
same windows, the same ``Observation``), keeps the controller state and its
capacity-model cache between ticks, and returns the decision's targets when it
actuates. There is no second copy of the policy or of the tick here: every stage
(smoothing, forecast, solver, dead-band, stabilisation, cooldowns, rate limit,
clamp) is the production code's.

``sara-forecast`` is the same controller with its forecaster enabled
(``ControllerConfig.forecast``; see ``controller.policy.forecast``), looking as far
ahead as the pools' measured start-up plus one tick: the configuration a user
would deploy, not a simulator-only policy. The simulator answers the
forecaster from every arrival (``sim.control.SimulatedArrivals``).
"""

from __future__ import annotations

import time
from dataclasses import replace

from controller.actuator import ActuatorError
from controller.config import ControllerConfig
from controller.observation import PoolObservation
from controller.policy import CapacityModels, ControllerState, Decision, Reason
from controller.tick import run_tick
from queueing.pools import Pool
from sim.control import SimulatedArrivals, SimulatedSource, replicas_of
from sim.policies.base import Allocation, ClusterView, Scenario


def forecasting(scenario: Scenario, config: ControllerConfig) -> ControllerConfig:
    """``config`` with the forecaster on. Its horizon is the controller's own: with
    lead-time planning (the default) the pools' measured start-up plus one tick
    (``controller.tick.forecast_config``), which is what a deployed controller sees;
    with it off, this scenario's worker start-up plus one tick."""
    if config.lead_time.enabled:
        return replace(config, forecast=replace(config.forecast, enabled=True))
    horizon_s = scenario.worker_startup_s + config.interval_s
    return replace(config, forecast=replace(config.forecast, enabled=True, horizon_s=horizon_s))


class _TargetRecorder:
    """The actuator of a back-test policy: it reports the view's pools and keeps the
    targets it is asked for (the runner applies them, as for every policy)."""

    def __init__(self, view: ClusterView) -> None:
        self.view = view
        self.scaled: dict[Pool, int] = {}

    def observe(self, pool: Pool) -> PoolObservation:
        return replicas_of(self.view.snapshot(window_s=1.0))[pool]

    def scale(self, pool: Pool, replicas: int) -> None:
        if replicas < 1:
            raise ActuatorError(f"{pool.value}: a simulated pool needs at least one worker")
        self.scaled[pool] = replicas


class SaraPolicy:
    """The production tick with the simulator's source and actuator."""

    def __init__(
        self,
        scenario: Scenario,
        initial: Allocation,
        *,
        config: ControllerConfig | None = None,
    ) -> None:
        self.config = config or scenario.controller_config
        self.name = "sara-forecast" if self.config.forecast.enabled else "sara"
        self.initial = initial
        self.interval_s = self.config.interval_s
        self._scenario = scenario
        self._state = ControllerState()
        self._models = CapacityModels()
        self.decisions: list[Decision] = []
        self.forecasts = 0  # ticks on which the forecast raised the planning rate

    def tick(self, view: ClusterView) -> Allocation | None:
        cfg = self.config
        actuator = _TargetRecorder(view)
        done = run_tick(
            now_s=view.now_s,
            config=cfg,
            config_version="backtest",
            state=self._state,
            source=SimulatedSource(
                view,
                window_s=cfg.window_s,
                burst_window_s=cfg.burst_window_s,
                scv_span_s=cfg.lead_time.pool_s,
            ),
            actuator=actuator,
            load_profile=lambda _spec: self._scenario.profile,
            models=self._models,
            history=SimulatedArrivals(view),
            timer=time.perf_counter,
        )
        decision = done.record.decision
        assert decision is not None  # the recorder observes without failing
        self._state = done.state
        self.decisions.append(decision)
        if any(r.reason is Reason.FORECAST_RAISED for r in decision.reasons):
            self.forecasts += 1
        if not done.record.applied:
            return None
        return Allocation(
            prefill=decision.target(Pool.PREFILL), decode=decision.target(Pool.DECODE)
        )
