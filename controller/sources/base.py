"""What every observation source promises, and the pieces they share.

A source turns metrics into an ``Observation`` once per tick. Measurement problems
(no data yet, NaN, an unreachable Prometheus or exporter, a timeout) are normal
inputs, not errors: the affected field is ``None`` and the policy holds. Only
programming errors (a missing pool in ``replicas``, a clock that runs backwards)
raise.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from controller.observation import PoolObservation
from queueing.pools import Pool


class MeasurementUnavailable(Exception):
    """One measurement could not be made this tick; its field becomes ``None``.

    The message says why in a few stable words ("empty result", "timed out",
    "HTTP 503: ..."), so that the same failure logs the same line.
    """


def pool_replicas(
    replicas: Mapping[Pool, PoolObservation],
) -> tuple[PoolObservation, PoolObservation]:
    """The (prefill, decode) entries; a missing pool is the caller's bug."""
    missing = [pool.value for pool in Pool if pool not in replicas]
    if missing:
        raise ValueError(f"replicas: no entry for pool(s) {missing}")
    return replicas[Pool.PREFILL], replicas[Pool.DECODE]


class FailureLog:
    """Logs each failure episode once: a warning when a key starts failing (or fails
    differently), debug while the same failure repeats, info when it recovers.

    A source polls every tick; logging every tick would bury the one line that
    matters. The key is what failed (a PromQL query, a scrape URL).
    """

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._failing: dict[str, str] = {}

    def failed(self, key: str, reason: str) -> None:
        if self._failing.get(key) == reason:
            self._logger.debug("still unavailable (%s): %s", reason, key)
            return
        self._failing[key] = reason
        self._logger.warning("measurement unavailable (%s): %s", reason, key)

    def succeeded(self, key: str) -> None:
        if self._failing.pop(key, None) is not None:
            self._logger.info("measurement available again: %s", key)

    @property
    def failing(self) -> Mapping[str, str]:
        """What is failing now, and why (for status pages and tests)."""
        return dict(self._failing)
