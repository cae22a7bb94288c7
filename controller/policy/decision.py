"""What a tick decided: per pool, the target and what explains it.

A ``Decision`` is the contract between ``decide`` and everything that shows or
applies it — the actuator, the metrics, the REST API, the CRD status, the logs.
Each reads ``decision.pools[pool]``; ``as_dict`` is the one JSON shape of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controller.policy.state import ControllerState
from controller.policy.vocabulary import Reason, ReasonEntry
from queueing.pools import PerPool, Pool


@dataclass(frozen=True, kw_only=True)
class PoolDecision:
    """One pool's outcome. Latencies are the pool's own: TTFT (prefill), TPOT (decode)."""

    target: int
    current: int
    outcome: Reason  # the one reason that best explains it (``vocabulary.outcome``)
    reasons: tuple[ReasonEntry, ...]  # the entries that concern this pool, in order
    recommended: int | None = None  # the solver's answer before normalisation
    predicted_p99_s: float | None = None  # at the target and the planning rate
    observed_p99_s: float | None = None
    model_error: float | None = None  # observed / predicted P99 - 1, at the last tick

    @property
    def changed(self) -> bool:
        return self.target != self.current


@dataclass(frozen=True, kw_only=True)
class Decision:
    """Both pools' outcomes, the next state, and the reasons that explain them."""

    pools: PerPool[PoolDecision]
    actuate: bool  # False in advisory mode, when nothing changes, or on stale data
    state: ControllerState
    reasons: tuple[ReasonEntry, ...]
    raw_rate_rps: float | None = None
    smoothed_rate_rps: float | None = None
    forecast_rate_rps: float | None = None
    planning_rate_rps: float | None = None  # what the solver sized the pools for

    def target(self, pool: Pool) -> int:
        return self.pools[pool].target

    def reason_for(self, pool: Pool) -> Reason:
        return self.pools[pool].outcome

    @property
    def changed(self) -> bool:
        return any(p.changed for _, p in self.pools.items())

    def as_dict(self) -> dict[str, Any]:
        pools = list(self.pools.items())
        recommended = [p.recommended for _, p in pools]
        return {
            **{f"{pool.value}_target": p.target for pool, p in pools},
            **{f"{pool.value}_current": p.current for pool, p in pools},
            "actuate": self.actuate,
            "raw_rate_rps": self.raw_rate_rps,
            "smoothed_rate_rps": self.smoothed_rate_rps,
            "forecast_rate_rps": self.forecast_rate_rps,
            "planning_rate_rps": self.planning_rate_rps,
            "recommended": None if None in recommended else recommended,
            **{f"predicted_{pool.latency}_p99_s": p.predicted_p99_s for pool, p in pools},
            **{f"observed_{pool.latency}_p99_s": p.observed_p99_s for pool, p in pools},
            "model_error": {pool.value: p.model_error for pool, p in pools},
            "reasons": [r.as_dict() for r in self.reasons],
        }
