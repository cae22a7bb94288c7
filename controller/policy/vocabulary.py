"""The words a decision is explained in: the stages of a tick and their reasons.

Every stage returns its value and, when it did something, a ``ReasonEntry``; the
ordered entries are the decision's explanation (in the REST API, the logs, the
CRD's events), and the enums are what metrics and tests match on, never free text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from queueing.pools import Pool


class Stage(enum.Enum):
    VALIDATE = "validate"
    SMOOTH = "smooth"
    CALIBRATE = "calibrate"
    RECOMMEND = "recommend"
    SAFETY = "safety"
    DEAD_BAND = "dead_band"
    STABILISE = "stabilise"
    COOLDOWN = "cooldown"
    RATE_LIMIT = "rate_limit"
    CLAMP = "clamp"
    ACTUATE = "actuate"


class Reason(enum.Enum):
    METRICS_STALE = "metrics_stale"
    METRICS_OK = "metrics_ok"
    RATE_INITIALISED = "rate_initialised"
    RATE_SMOOTHED = "rate_smoothed"
    BURST_DETECTED = "burst_detected"
    RATE_SHIFTED = "rate_shifted"
    LEAD_TIME_PLANNED = "lead_time_planned"
    STARTUP_MEASURED = "startup_measured"
    OVERLOAD_DETECTED = "overload_detected"
    QUEUE_DRAIN = "queue_drain"
    LENGTHS_UPDATED = "lengths_updated"
    LENGTHS_SHIFTED = "lengths_shifted"
    LENGTHS_KEPT = "lengths_kept"
    CALIBRATED = "calibrated"
    FORECAST_RAISED = "forecast_raised"
    CALIBRATION_SKIPPED = "calibration_skipped"
    CALIBRATION_FROZEN = "calibration_frozen"
    RECOMMENDED = "recommended"
    SLO_INFEASIBLE = "slo_infeasible"
    SCALE_DOWN_SAFE = "scale_down_safe"
    SCALE_DOWN_UNSAFE = "scale_down_unsafe"
    WITHIN_DEAD_BAND = "within_dead_band"
    STABILISING = "stabilising"
    STABILISED = "stabilised"
    DRAINED = "drained"
    SURGE_HELD = "surge_held"
    COOLDOWN_UP = "cooldown_up"
    COOLDOWN_DOWN = "cooldown_down"
    RATE_LIMITED = "rate_limited"
    CLAMPED_MIN = "clamped_min"
    CLAMPED_MAX = "clamped_max"
    GPU_BUDGET = "gpu_budget"
    SCALE_UP = "scale_up"
    SCALE_DOWN = "scale_down"
    NO_CHANGE = "no_change"
    ADVISORY = "advisory"


@dataclass(frozen=True, kw_only=True)
class ReasonEntry:
    stage: Stage
    reason: Reason
    pool: Pool | None  # None: the entry concerns both pools
    detail: str

    def concerns(self, pool: Pool) -> bool:
        return self.pool is None or self.pool is pool

    def as_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage.value,
            "reason": self.reason.value,
            "pool": None if self.pool is None else self.pool.value,
            "detail": self.detail,
        }


# Stages whose entry explains why a pool kept its size (for ``outcome``).
_HOLDING = (Stage.SAFETY, Stage.DEAD_BAND, Stage.STABILISE, Stage.COOLDOWN, Stage.CLAMP)


def outcome(reasons: tuple[ReasonEntry, ...], pool: Pool) -> Reason:
    """The one reason that best explains a pool's outcome (for metric labels).

    Stale data explains everything; a change is SCALE_UP/SCALE_DOWN; no change is
    explained by the last stage that held the pool (dead-band, stabilisation,
    cooldown, unsafe scale-down, clamp), else NO_CHANGE.
    """
    if reasons and reasons[0].reason is Reason.METRICS_STALE:
        return Reason.METRICS_STALE
    verdict = Reason.NO_CHANGE
    for entry in reasons:
        if (
            entry.stage is Stage.ACTUATE
            and entry.concerns(pool)
            and entry.reason is not Reason.ADVISORY  # the mode, not the outcome
        ):
            verdict = entry.reason
    if verdict is not Reason.NO_CHANGE:
        return verdict
    for entry in reversed(reasons):
        if (
            entry.stage in _HOLDING
            and entry.concerns(pool)
            and entry.reason is not Reason.SCALE_DOWN_SAFE
        ):
            return entry.reason
    return Reason.NO_CHANGE
