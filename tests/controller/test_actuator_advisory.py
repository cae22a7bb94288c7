"""The advisory actuator records every target and never changes what it reports."""

from __future__ import annotations

from typing import Any

import pytest

from controller.actuator import Actuator, ActuatorError
from controller.actuators import AdvisoryActuator
from controller.observation import PoolObservation
from queueing.pools import Pool


def test_it_reports_its_initial_replicas_as_current_and_ready() -> None:
    actuator: Actuator = AdvisoryActuator({Pool.PREFILL: 2, Pool.DECODE: 5})
    assert actuator.observe(Pool.PREFILL) == PoolObservation(current_replicas=2, ready_replicas=2)
    assert actuator.observe(Pool.DECODE) == PoolObservation(current_replicas=5, ready_replicas=5)


def test_scale_is_recorded_in_order_and_changes_nothing() -> None:
    actuator = AdvisoryActuator({Pool.PREFILL: 2, Pool.DECODE: 5})
    actuator.scale(Pool.PREFILL, 4)
    actuator.scale(Pool.DECODE, 3)
    actuator.scale(Pool.PREFILL, 4)
    assert actuator.requests == [(Pool.PREFILL, 4), (Pool.DECODE, 3), (Pool.PREFILL, 4)]
    assert actuator.observe(Pool.PREFILL).current_replicas == 2
    assert actuator.observe(Pool.DECODE).current_replicas == 5


def test_the_record_is_a_copy() -> None:
    actuator = AdvisoryActuator({Pool.PREFILL: 1})
    actuator.scale(Pool.PREFILL, 2)
    actuator.requests.clear()
    assert actuator.requests == [(Pool.PREFILL, 2)]


def test_set_current_changes_what_observe_reports() -> None:
    actuator = AdvisoryActuator({Pool.PREFILL: 1})
    actuator.set_current(Pool.PREFILL, 6, ready_replicas=4)
    assert actuator.observe(Pool.PREFILL) == PoolObservation(current_replicas=6, ready_replicas=4)
    actuator.set_current(Pool.DECODE, 3)
    assert actuator.observe(Pool.DECODE) == PoolObservation(current_replicas=3, ready_replicas=3)


def test_a_pool_it_was_not_given_is_a_permanent_error() -> None:
    actuator = AdvisoryActuator({Pool.PREFILL: 1})
    with pytest.raises(ActuatorError, match="decode"):
        actuator.observe(Pool.DECODE)
    with pytest.raises(ActuatorError, match="decode"):
        actuator.scale(Pool.DECODE, 1)
    assert actuator.requests == []


@pytest.mark.parametrize(
    ("initial", "field"),
    [
        ({Pool.PREFILL: -1}, "initial\\[prefill\\]"),
        ({Pool.DECODE: True}, "initial\\[decode\\]"),
        ({Pool.DECODE: 1.0}, "initial\\[decode\\]"),
        ({"prefill": 1}, "initial"),
    ],
)
def test_invalid_initial_replicas_are_rejected_naming_the_pool(initial: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        AdvisoryActuator(initial)


@pytest.mark.parametrize("bad", [-1, True, 2.5])
def test_an_invalid_target_is_rejected_and_not_recorded(bad: Any) -> None:
    actuator = AdvisoryActuator({Pool.PREFILL: 1})
    with pytest.raises(ValueError, match="replicas"):
        actuator.scale(Pool.PREFILL, bad)
    assert actuator.requests == []
