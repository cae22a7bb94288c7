"""An actuator that only records what it was asked to do (advisory mode, tests, demos).

It never changes anything real: ``scale`` appends ``(pool, replicas)`` to
``requests`` and ``observe`` reports the replicas it was given (``initial``, or
whatever ``set_current`` set last), so a controller in advisory mode computes and
publishes its targets while the pools stay as they are.
"""

from __future__ import annotations

from collections.abc import Mapping

from controller.actuator import ActuatorError
from controller.observation import PoolObservation
from queueing.pools import Pool


def _replicas(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: must be an integer >= 0, got {value!r}")
    return value


class AdvisoryActuator:
    """Records every requested scale; reports fixed (or test-settable) replicas.

    ``initial`` maps each pool to its current replicas (reported as ready too);
    a pool missing from it raises ``ActuatorError`` on ``observe`` and ``scale``.
    """

    def __init__(self, initial: Mapping[Pool, int]) -> None:
        self._current: dict[Pool, PoolObservation] = {}
        for pool, replicas in initial.items():
            if not isinstance(pool, Pool):
                raise ValueError(f"initial: keys must be Pool members, got {pool!r}")
            value = _replicas(f"initial[{pool.value}]", replicas)
            self._current[pool] = PoolObservation(current_replicas=value, ready_replicas=value)
        self._requests: list[tuple[Pool, int]] = []

    @property
    def requests(self) -> list[tuple[Pool, int]]:
        """Every ``scale`` call so far, oldest first (a copy)."""
        return list(self._requests)

    def set_current(self, pool: Pool, replicas: int, *, ready_replicas: int | None = None) -> None:
        """What ``observe`` reports from now on (``ready_replicas`` defaults to ``replicas``)."""
        current = _replicas("replicas", replicas)
        ready = current if ready_replicas is None else _replicas("ready_replicas", ready_replicas)
        self._current[pool] = PoolObservation(current_replicas=current, ready_replicas=ready)

    def observe(self, pool: Pool) -> PoolObservation:
        return self._known(pool)

    def scale(self, pool: Pool, replicas: int) -> None:
        self._known(pool)
        self._requests.append((pool, _replicas("replicas", replicas)))

    def _known(self, pool: Pool) -> PoolObservation:
        try:
            return self._current[pool]
        except KeyError:
            raise ActuatorError(
                f"advisory actuator: no replicas given for pool {pool.value}"
            ) from None
