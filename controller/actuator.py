"""The interface every actuator implements (local processes, Kubernetes, advisory).

An actuator reports each pool's replicas and applies targets. Failures are
exceptions that say whether trying again may help: ``ActuatorRetryableError``
(conflict, timeout, 5xx — the loop retries next tick) or ``ActuatorError``
(missing Deployment, forbidden — reported in status until fixed).
"""

from __future__ import annotations

from typing import Protocol

from controller.observation import PoolObservation
from queueing.pools import Pool


class ActuatorError(RuntimeError):
    """A permanent failure: retrying without a change will not help."""


class ActuatorRetryableError(ActuatorError):
    """A transient failure: the next attempt may succeed."""


class Actuator(Protocol):
    def observe(self, pool: Pool) -> PoolObservation:
        """The pool's current and ready replicas."""
        ...

    def scale(self, pool: Pool, replicas: int) -> None:
        """Set the pool's desired replicas (idempotent)."""
        ...
