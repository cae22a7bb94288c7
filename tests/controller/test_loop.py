"""The control loop around decide(): config from the store, state that survives a
restart, actuator failures reported, history and metrics published."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from controller.actuator import ActuatorError
from controller.config import ControllerConfig, Mode, SloConfig
from controller.loop import ControlLoop
from controller.metrics import ControllerMetrics
from controller.observation import Observation, PoolObservation
from controller.policy import Reason
from controller.store import MemoryConfigStore
from queueing.lengths import LengthSamples
from queueing.pools import Pool

CONFIG = ControllerConfig(
    profile="llama-2-70b-tp4@h100-sxm", slo=SloConfig(ttft_p99_s=1.0, tpot_p99_s=0.1)
)
rng = np.random.default_rng(3)
LENGTHS = LengthSamples(
    prompt_tokens=np.clip(rng.lognormal(np.log(1000), 0.7, 800), 8, 8000).astype(np.int64),
    output_tokens=np.clip(rng.lognormal(np.log(150), 0.8, 800), 2, 1500).astype(np.int64),
    source="lognormal",
)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class FixedRateSource:
    """A source reporting a settable rate: the loop's own behaviour is under test here."""

    def __init__(self, clock: Clock, rate: float) -> None:
        self.clock = clock
        self.rate: float | None = rate

    def observe(self, *, now_s: float, replicas: Mapping[Pool, PoolObservation]) -> Observation:
        return Observation(
            time_s=now_s,
            prefill=replicas[Pool.PREFILL],
            decode=replicas[Pool.DECODE],
            arrival_rate_rps=self.rate,
            burst_arrival_rate_rps=self.rate,
            interarrival_scv=1.0,
            lengths=LENGTHS,
        )


class IdealActuator:
    def __init__(self, prefill: int, decode: int) -> None:
        self.replicas = {Pool.PREFILL: prefill, Pool.DECODE: decode}
        self.calls: list[tuple[Pool, int]] = []
        self.fail: ActuatorError | None = None

    def observe(self, pool: Pool) -> PoolObservation:
        n = self.replicas[pool]
        return PoolObservation(current_replicas=n, ready_replicas=n)

    def scale(self, pool: Pool, replicas: int) -> None:
        if self.fail is not None:
            raise self.fail
        self.calls.append((pool, replicas))
        self.replicas[pool] = replicas


def make_loop(
    tmp_path: Path,
    clock: Clock,
    source: FixedRateSource,
    actuator: IdealActuator,
    store: MemoryConfigStore | None = None,
) -> ControlLoop:
    return ControlLoop(
        store=store or MemoryConfigStore(CONFIG),
        source=source,
        actuator=actuator,
        metrics=ControllerMetrics(),
        clock=clock,
        state_dir=tmp_path,
    )


def test_a_tick_scales_up_an_undersized_pool_and_records_why(tmp_path: Path) -> None:
    clock = Clock()
    actuator = IdealActuator(1, 1)
    loop = make_loop(tmp_path, clock, FixedRateSource(clock, 40.0), actuator)
    record = loop.tick()
    assert record.applied and record.error is None
    assert actuator.replicas[Pool.PREFILL] > 1
    assert loop.decisions(10)[0]["reasons"]
    assert loop.ready()
    status = loop.status()
    assert status["desired"]["prefill"] == actuator.replicas[Pool.PREFILL]


def test_a_restarted_loop_resumes_without_a_burst_of_changes(tmp_path: Path) -> None:
    clock = Clock()
    actuator = IdealActuator(1, 1)
    source = FixedRateSource(clock, 40.0)
    loop = make_loop(tmp_path, clock, source, actuator)
    for _ in range(20):
        loop.tick()
        clock.now += 30
    settled = dict(actuator.replicas)
    # The load drops; the first loop starts its stabilisation window, then "crashes".
    source.rate = 5.0
    for _ in range(4):
        loop.tick()
        clock.now += 30
    assert actuator.replicas == settled
    restarted = make_loop(tmp_path, clock, source, actuator)
    assert restarted.state.pools.prefill.below_since_s is not None  # the window survived
    restarted.tick()
    assert actuator.replicas == settled  # still inside the 300 s stabilisation window
    clock.now += 200
    restarted.tick()
    assert actuator.replicas[Pool.PREFILL] < settled[Pool.PREFILL]  # window held: scales down


def test_a_config_change_in_the_store_applies_on_the_next_tick(tmp_path: Path) -> None:
    clock = Clock()
    actuator = IdealActuator(1, 1)
    store = MemoryConfigStore(CONFIG)
    loop = make_loop(tmp_path, clock, FixedRateSource(clock, 40.0), actuator, store)
    loop.tick()
    current = store.load()
    store.replace(
        current.config.merged({"prefill": {"max_replicas": 1}}), expected_version=current.version
    )
    clock.now += 600
    loop.tick()
    assert actuator.replicas[Pool.PREFILL] == 1


def test_advisory_mode_never_calls_the_actuator(tmp_path: Path) -> None:
    clock = Clock()
    actuator = IdealActuator(1, 1)
    store = MemoryConfigStore(CONFIG.with_mode(Mode.ADVISORY))
    loop = make_loop(tmp_path, clock, FixedRateSource(clock, 40.0), actuator, store)
    record = loop.tick()
    assert actuator.calls == []
    assert record.decision is not None and record.decision.target(Pool.PREFILL) > 1


def test_an_actuator_failure_is_reported_and_the_loop_carries_on(tmp_path: Path) -> None:
    clock = Clock()
    actuator = IdealActuator(1, 1)
    actuator.fail = ActuatorError("deployment default/prefill not found")
    loop = make_loop(tmp_path, clock, FixedRateSource(clock, 40.0), actuator)
    record = loop.tick()
    assert not record.applied
    assert record.error is not None and "not found" in record.error
    assert loop.status()["last_error"] == record.error


def test_missing_metrics_hold_and_publish_the_reason(tmp_path: Path) -> None:
    clock = Clock()
    actuator = IdealActuator(3, 2)
    source = FixedRateSource(clock, 40.0)
    source.rate = None
    loop = make_loop(tmp_path, clock, source, actuator)
    loop.tick()
    assert actuator.calls == []
    text = loop.metrics.exposition().decode()
    assert 'reason="metrics_stale"' in text


class RampSource(FixedRateSource):
    """A rate rising by ``slope`` req/s every second of the loop's clock."""

    def __init__(self, clock: Clock, *, rate0: float, slope: float) -> None:
        super().__init__(clock, rate0)
        self.start_s = clock.now
        self.rate0 = rate0
        self.slope = slope

    def observe(self, *, now_s: float, replicas: Mapping[Pool, PoolObservation]) -> Observation:
        # The mean rate over the 30-s window ending now (the window's centre).
        self.rate = self.rate0 + self.slope * (now_s - 15.0 - self.start_s)
        return super().observe(now_s=now_s, replicas=replicas)


def test_a_configured_forecaster_raises_the_planning_rate_on_a_rising_trend(
    tmp_path: Path,
) -> None:
    # Lead-time planning off: the forecaster alone, at its configured 130-s horizon
    # (with it on, the horizon is the measured lead time: test_same_config).
    forecast = replace(CONFIG.forecast, enabled=True, horizon_s=130.0)
    lead_time = replace(CONFIG.lead_time, enabled=False)
    store = MemoryConfigStore(replace(CONFIG, forecast=forecast, lead_time=lead_time))
    clock = Clock()
    source = RampSource(clock, rate0=5.0, slope=0.02)
    loop = make_loop(tmp_path, clock, source, IdealActuator(1, 1), store)
    records = []
    for _ in range(14):  # seven minutes: the trend needs a whole five-minute window
        records.append(loop.tick())
        clock.now += 30
    decisions = [r.decision for r in records if r.decision is not None]
    assert len(decisions) == 14
    # Before ten 30-s windows cover the five-minute trend window there is no trend.
    assert all(d.forecast_rate_rps is None for d in decisions[:9])
    assert all(d.forecast_rate_rps is not None for d in decisions[9:])
    last = decisions[-1]
    assert any(r.reason is Reason.FORECAST_RAISED for r in last.reasons)
    # The trend line of a linear ramp extrapolates it: the rate 130 s after now.
    now_s = records[-1].time_s
    expected = 5.0 + 0.02 * (now_s - source.start_s + 130.0)
    assert last.forecast_rate_rps == pytest.approx(expected, rel=0.02)
    assert last.planning_rate_rps == last.forecast_rate_rps
    assert last.smoothed_rate_rps is not None and last.smoothed_rate_rps < expected


def test_without_a_configured_forecaster_the_loop_never_forecasts(tmp_path: Path) -> None:
    clock = Clock()
    source = RampSource(clock, rate0=5.0, slope=0.02)
    loop = make_loop(tmp_path, clock, source, IdealActuator(1, 1))
    for _ in range(14):
        record = loop.tick()
        clock.now += 30
        assert record.decision is not None and record.decision.forecast_rate_rps is None


def metric(loop: ControlLoop, name: str) -> float:
    value = loop.metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


def test_a_failed_tick_makes_the_loop_not_ready_with_its_reason_and_raises_the_alert(
    tmp_path: Path,
) -> None:
    clock = Clock()
    actuator = IdealActuator(1, 1)
    store = MemoryConfigStore(CONFIG)
    loop = make_loop(tmp_path, clock, FixedRateSource(clock, 40.0), actuator, store)
    assert loop.readiness() == (False, "no control tick has completed yet")
    loop.tick()
    assert loop.readiness() == (True, "ready")
    assert metric(loop, "sara_controller_tick_failing") == 0
    # A profile file that went bad after it was admitted: the very next tick says so.
    bad = tmp_path / "profile.json"
    bad.write_text("{not json", encoding="utf-8")
    store.replace(replace(CONFIG, profile=str(bad)), expected_version=None)
    clock.now += 30
    loop.tick()
    ready, reason = loop.readiness()
    assert not ready and reason.startswith("the latest tick failed: profile: ")
    assert metric(loop, "sara_controller_tick_failing") == 1
    assert metric(loop, "sara_controller_tick_failures_total") == 1
    store.replace(CONFIG, expected_version=None)
    clock.now += 30
    loop.tick()
    assert loop.readiness() == (True, "ready")
    assert metric(loop, "sara_controller_tick_failing") == 0


def test_a_tick_that_raises_is_recorded_as_failed_and_the_loop_goes_on(tmp_path: Path) -> None:
    clock = Clock()

    class Broken(FixedRateSource):
        def observe(self, **kwargs: object) -> Observation:
            raise RuntimeError("the source fell over")

    loop = make_loop(tmp_path, clock, Broken(clock, 1.0), IdealActuator(1, 1))
    stop = threading.Event()
    thread = threading.Thread(target=loop.run, args=(stop,))
    thread.start()
    try:
        while not loop.decisions(1):
            pass
    finally:
        stop.set()
        thread.join(timeout=10)
    ready, reason = loop.readiness()
    assert not ready and "RuntimeError: the source fell over" in reason
    assert metric(loop, "sara_controller_tick_failing") == 1


def test_a_restarted_loop_keeps_the_forecasters_record_of_rates(tmp_path: Path) -> None:
    clock = Clock()
    actuator = IdealActuator(1, 1)
    source = FixedRateSource(clock, 12.0)
    loop = make_loop(tmp_path, clock, source, actuator)
    assert loop.arrivals_source == "none"
    for _ in range(10):
        loop.tick()
        clock.now += 30
    restarted = make_loop(tmp_path, clock, source, actuator)
    assert restarted.arrivals_source == "state"
    # Nine 30-s windows back to back at 12 req/s: 12 x 270 arrivals.
    last = clock.now - 30
    assert restarted.arrivals.count_between(last - 270, last) == pytest.approx(12.0 * 270)


class HistorySource(FixedRateSource):
    """A source that keeps its own history of the rate (as Prometheus does)."""

    def arrival_history(
        self, *, start_s: float, end_s: float, step_s: float
    ) -> list[tuple[float, float]]:
        self.asked = (start_s, end_s, step_s)
        steps = int((end_s - start_s) // step_s)
        return [(start_s + (k + 1) * step_s, 7.0) for k in range(steps)]


def test_a_loop_warm_starts_the_record_from_a_source_that_keeps_history(tmp_path: Path) -> None:
    clock = Clock()
    source = HistorySource(clock, 7.0)
    loop = make_loop(tmp_path, clock, source, IdealActuator(1, 1))
    assert loop.arrivals_source == "metrics"
    # A day and a smoothing window back, at the measurement window's step.
    start_s, end_s, step_s = source.asked
    assert end_s == clock.now and step_s == CONFIG.window_s
    assert end_s - start_s == loop.arrivals.keep_s
    assert loop.arrivals.count_between(clock.now - 3600, clock.now) == pytest.approx(7.0 * 3600)
