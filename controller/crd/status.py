"""The ``SLOAutoscaler`` status as plain data: its conditions, the document, its events.

Pure: no Kubernetes client and no clock here (``now`` is passed in). The operator
(``controller.operator``) writes back what ``build_status`` returns after each tick
and posts the events ``notices_for`` lists.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from controller.config import ConfigError
from controller.policy import Decision, Reason, ReasonEntry
from controller.tick import TickRecord
from queueing.pools import Pool

# --------------------------------------------------------------------------------------
# Conditions
# --------------------------------------------------------------------------------------


class ConditionType(enum.Enum):
    READY = "Ready"  # the last tick decided (and, in active mode, scaled) without error
    METRICS_STALE = "MetricsStale"  # the last tick held: missing, NaN or old measurements
    SLO_INFEASIBLE = "SLOInfeasible"  # no worker count meets an SLO at the observed load
    SCALING_LIMITED = "ScalingLimited"  # a target was cut by a bound, the budget or the step


class ConditionStatus(enum.Enum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class ConditionReason(enum.Enum):
    # Ready
    DECIDED = "Decided"
    ADVISORY = "Advisory"
    INVALID_SPEC = "InvalidSpec"
    ACTUATOR_ERROR = "ActuatorError"
    SCALE_FAILED = "ScaleFailed"
    PROFILE_ERROR = "ProfileError"
    TICK_FAILED = "TickFailed"
    # MetricsStale
    METRICS_STALE = "MetricsStale"
    METRICS_FRESH = "MetricsFresh"
    # SLOInfeasible
    SLO_INFEASIBLE = "SLOInfeasible"
    SLO_FEASIBLE = "SLOFeasible"
    # ScalingLimited
    TOO_MANY_REPLICAS = "TooManyReplicas"
    TOO_FEW_REPLICAS = "TooFewReplicas"
    GPU_BUDGET = "GPUBudget"
    SCALE_STEP_LIMITED = "ScaleStepLimited"
    DESIRED_WITHIN_RANGE = "DesiredWithinRange"
    # any condition the last tick could not judge
    NO_DECISION = "NoDecision"


@dataclass(frozen=True, kw_only=True)
class Condition:
    type: ConditionType
    status: ConditionStatus
    reason: ConditionReason
    message: str

    def __post_init__(self) -> None:
        for name, kind in (
            ("type", ConditionType),
            ("status", ConditionStatus),
            ("reason", ConditionReason),
        ):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name}: must be a {kind.__name__}, got {getattr(self, name)!r}")


# Scaling limits in the order they are reported, with the reason each one gives.
_LIMITS: tuple[tuple[Reason, ConditionReason], ...] = (
    (Reason.CLAMPED_MAX, ConditionReason.TOO_MANY_REPLICAS),
    (Reason.CLAMPED_MIN, ConditionReason.TOO_FEW_REPLICAS),
    (Reason.GPU_BUDGET, ConditionReason.GPU_BUDGET),
    (Reason.RATE_LIMITED, ConditionReason.SCALE_STEP_LIMITED),
)
# A tick's error says what failed in its prefix ("actuator: ...", "profile: ...");
# the operator adds "slo: ..." for a TPOT target below one decode step.
_FAILURES: dict[str, ConditionReason] = {
    "actuator": ConditionReason.ACTUATOR_ERROR,
    "actuator (will retry)": ConditionReason.ACTUATOR_ERROR,
    "profile": ConditionReason.PROFILE_ERROR,
    "slo": ConditionReason.SLO_INFEASIBLE,
}


def conditions_for(record: TickRecord) -> tuple[Condition, ...]:
    """The four conditions that one tick establishes."""
    decision = record.decision
    failure = None
    if record.error is not None:
        kind = record.error.partition(": ")[0]
        failure = _FAILURES.get(kind, ConditionReason.TICK_FAILED)
        if decision is not None and failure is ConditionReason.ACTUATOR_ERROR:
            failure = ConditionReason.SCALE_FAILED  # decided, then could not apply it
    if failure is not None:
        ready = Condition(
            type=ConditionType.READY,
            status=ConditionStatus.FALSE,
            reason=failure,
            message=str(record.error),
        )
    elif decision is not None and _has(decision, Reason.ADVISORY):
        ready = Condition(
            type=ConditionType.READY,
            status=ConditionStatus.TRUE,
            reason=ConditionReason.ADVISORY,
            message="advisory mode: deciding and publishing, not scaling",
        )
    else:
        ready = Condition(
            type=ConditionType.READY,
            status=ConditionStatus.TRUE,
            reason=ConditionReason.DECIDED,
            message=summary(decision) if decision is not None else "decided",
        )
    if decision is None:
        unknown = ConditionReason.NO_DECISION
        why = f"no decision this tick: {record.error}"
        if failure is ConditionReason.SLO_INFEASIBLE:
            infeasible = Condition(
                type=ConditionType.SLO_INFEASIBLE,
                status=ConditionStatus.TRUE,
                reason=ConditionReason.SLO_INFEASIBLE,
                message=str(record.error).partition(": ")[2],
            )
        else:
            infeasible = _unknown(ConditionType.SLO_INFEASIBLE, unknown, why)
        return (
            ready,
            _unknown(ConditionType.METRICS_STALE, unknown, why),
            infeasible,
            _unknown(ConditionType.SCALING_LIMITED, unknown, why),
        )
    return (ready, _staleness(decision), _feasibility(decision), _limits(decision))


def _unknown(kind: ConditionType, reason: ConditionReason, message: str) -> Condition:
    return Condition(type=kind, status=ConditionStatus.UNKNOWN, reason=reason, message=message)


def _has(decision: Decision, reason: Reason) -> bool:
    return any(entry.reason is reason for entry in decision.reasons)


def _entries(decision: Decision, reason: Reason) -> list[ReasonEntry]:
    return [entry for entry in decision.reasons if entry.reason is reason]


def _staleness(decision: Decision) -> Condition:
    stale = _entries(decision, Reason.METRICS_STALE)
    if stale:
        return Condition(
            type=ConditionType.METRICS_STALE,
            status=ConditionStatus.TRUE,
            reason=ConditionReason.METRICS_STALE,
            message=stale[0].detail,
        )
    return Condition(
        type=ConditionType.METRICS_STALE,
        status=ConditionStatus.FALSE,
        reason=ConditionReason.METRICS_FRESH,
        message="measurements usable",
    )


def _feasibility(decision: Decision) -> Condition:
    infeasible = _entries(decision, Reason.SLO_INFEASIBLE)
    if infeasible:
        return Condition(
            type=ConditionType.SLO_INFEASIBLE,
            status=ConditionStatus.TRUE,
            reason=ConditionReason.SLO_INFEASIBLE,
            message=infeasible[0].detail,
        )
    if _has(decision, Reason.METRICS_STALE):
        # A held tick ran no solver: it cannot say whether the SLOs are within reach.
        return _unknown(
            ConditionType.SLO_INFEASIBLE,
            ConditionReason.NO_DECISION,
            "holding on stale metrics: no capacity solve this tick",
        )
    return Condition(
        type=ConditionType.SLO_INFEASIBLE,
        status=ConditionStatus.FALSE,
        reason=ConditionReason.SLO_FEASIBLE,
        message="the solver found worker counts that meet both SLOs",
    )


def _limits(decision: Decision) -> Condition:
    for reason, condition_reason in _LIMITS:
        entries = _entries(decision, reason)
        if entries:
            return Condition(
                type=ConditionType.SCALING_LIMITED,
                status=ConditionStatus.TRUE,
                reason=condition_reason,
                message="; ".join(_pool_detail(entry) for entry in entries),
            )
    return Condition(
        type=ConditionType.SCALING_LIMITED,
        status=ConditionStatus.FALSE,
        reason=ConditionReason.DESIRED_WITHIN_RANGE,
        message="the desired replicas are within the bounds, the budget and the step",
    )


def _pool_detail(entry: ReasonEntry) -> str:
    return f"{entry.pool.value}: {entry.detail}" if entry.pool else entry.detail


def merge_conditions(
    previous: Sequence[Mapping[str, Any]] | None,
    current: Iterable[Condition],
    *,
    now: datetime,
    generation: int | None,
) -> list[dict[str, Any]]:
    """``current`` as status conditions; a condition whose status did not change keeps
    its ``lastTransitionTime`` (Kubernetes API conventions), a new or changed one
    gets ``now``. Conditions of other types in ``previous`` are kept as they were."""
    before = {str(c.get("type")): c for c in previous or () if isinstance(c, Mapping)}
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for condition in current:
        kind = condition.type.value
        seen.add(kind)
        old = before.get(kind)
        unchanged = old is not None and old.get("status") == condition.status.value
        since = old.get("lastTransitionTime") if unchanged and old is not None else None
        entry: dict[str, Any] = {
            "type": kind,
            "status": condition.status.value,
            "reason": condition.reason.value,
            "message": condition.message,
            "lastTransitionTime": since or rfc3339(now),
        }
        if generation is not None:
            entry["observedGeneration"] = generation
        out.append(entry)
    out.extend(dict(c) for kind, c in before.items() if kind not in seen)
    return out


def rfc3339(moment: datetime) -> str:
    """``2024-05-01T12:00:00Z``: whole seconds in UTC, as Kubernetes writes times."""
    if moment.tzinfo is None:
        raise ValueError(f"moment: must be timezone-aware, got {moment!r}")
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------------------
# The document
# --------------------------------------------------------------------------------------


def summary(decision: Decision) -> str:
    """One line per decision: ``prefill 2 -> 4 (scale_up); decode stays at 3 (no_change)``."""
    parts = []
    for pool, outcome in decision.pools.items():
        current, target = outcome.current, outcome.target
        what = f"{current} -> {target}" if target != current else f"stays at {current}"
        parts.append(f"{pool.value} {what} ({outcome.outcome.value})")
    text = "; ".join(parts)
    return text + (" [advisory: not applied]" if _has(decision, Reason.ADVISORY) else "")


def build_status(
    record: TickRecord,
    *,
    generation: int | None,
    previous: Mapping[str, Any] | None,
    now: datetime,
) -> dict[str, Any]:
    """The resource's status after ``record``, as a JSON merge patch of ``status``.

    Values a tick could not know (no observed P99, an unstable prediction, every
    number when it made no decision) are ``null``, which a merge patch turns into
    "absent": a stale number must not stay on show. ``previous`` is the status before
    this tick (for transition times).
    """
    previous_conditions = (previous or {}).get("conditions")
    conditions = merge_conditions(
        previous_conditions if isinstance(previous_conditions, list) else None,
        conditions_for(record),
        now=now,
        generation=generation,
    )
    decision = record.decision
    last: dict[str, Any] = {
        "time": rfc3339(datetime.fromtimestamp(record.time_s, UTC)),
        "applied": record.applied,
        "configVersion": record.config_version,
        "reasons": [] if decision is None else [_reason(entry) for entry in decision.reasons],
        "message": summary(decision) if decision is not None else f"no decision: {record.error}",
        "error": record.error,
    }
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": conditions,
        "lastDecision": last,
        # Without a decision nothing below is known: null removes the last tick's numbers.
        "prefill": None,
        "decode": None,
        "arrivalRateRps": None,
        "predicted": None,
        "observed": None,
        "modelErrorRatio": None,
    }
    if decision is not None:
        status.update(
            **{
                pool.value: {"currentReplicas": p.current, "desiredReplicas": p.target}
                for pool, p in decision.pools.items()
            },
            arrivalRateRps=_finite(decision.smoothed_rate_rps),
            predicted={
                f"{pool.latency}P99Seconds": _finite(p.predicted_p99_s)
                for pool, p in decision.pools.items()
            },
            observed={
                f"{pool.latency}P99Seconds": _finite(p.observed_p99_s)
                for pool, p in decision.pools.items()
            },
            modelErrorRatio=decision.pools.map(lambda p: _finite(p.model_error)).as_dict(),
        )
    return status


def invalid_spec_status(
    error: ConfigError,
    *,
    generation: int | None,
    previous: Mapping[str, Any] | None,
    now: datetime,
) -> dict[str, Any]:
    """The status of a resource whose spec cannot be used: Ready=False, InvalidSpec.

    The other conditions and numbers stay as the last good tick left them; the loop
    does not tick until the spec is fixed.
    """
    previous_conditions = (previous or {}).get("conditions")
    ready = Condition(
        type=ConditionType.READY,
        status=ConditionStatus.FALSE,
        reason=ConditionReason.INVALID_SPEC,
        message=str(error),
    )
    return {
        "observedGeneration": generation,
        "conditions": merge_conditions(
            previous_conditions if isinstance(previous_conditions, list) else None,
            [ready],
            now=now,
            generation=generation,
        ),
    }


def _reason(entry: ReasonEntry) -> dict[str, Any]:
    out = {"stage": entry.stage.value, "reason": entry.reason.value, "detail": entry.detail}
    if entry.pool is not None:
        out["pool"] = entry.pool.value
    return out


def _finite(value: float | None) -> float | None:
    # JSON cannot carry NaN or infinities; an unknown number is absent, not a sentinel.
    if value is None or not math.isfinite(value):
        return None
    return float(value)


# --------------------------------------------------------------------------------------
# Events
# --------------------------------------------------------------------------------------


class EventType(enum.Enum):
    NORMAL = "Normal"
    WARNING = "Warning"


@dataclass(frozen=True, kw_only=True)
class Notice:
    """A Kubernetes Event to post on the resource."""

    type: EventType
    reason: str
    message: str

    def __post_init__(self) -> None:
        if not isinstance(self.type, EventType):
            raise ValueError(f"type: must be an EventType, got {self.type!r}")
        if not isinstance(self.reason, str) or not self.reason:
            raise ValueError(f"reason: must be a non-empty string, got {self.reason!r}")


# The condition states that need someone's attention; every other change is Normal.
_TROUBLE = {
    (ConditionType.READY.value, ConditionStatus.FALSE.value),
    (ConditionType.METRICS_STALE.value, ConditionStatus.TRUE.value),
    (ConditionType.SLO_INFEASIBLE.value, ConditionStatus.TRUE.value),
}


def notices_for(
    record: TickRecord | None,
    previous_conditions: Sequence[Mapping[str, Any]] | None,
    conditions: Sequence[Mapping[str, Any]],
) -> list[Notice]:
    """One event per pool the tick scaled, and one per condition whose status changed."""
    notices: list[Notice] = []
    decision = record.decision if record is not None else None
    if record is not None and decision is not None and record.applied:
        for pool, outcome in decision.pools.items():
            current, target = outcome.current, outcome.target
            if target != current:
                notices.append(
                    Notice(
                        type=EventType.NORMAL,
                        reason="ScaledUp" if target > current else "ScaledDown",
                        message=f"{pool.value} pool: {current} -> {target} replicas "
                        f"({_why(decision, pool)})",
                    )
                )
    before = {str(c.get("type")): c.get("status") for c in previous_conditions or ()}
    for condition in conditions:
        kind, status = str(condition["type"]), str(condition["status"])
        if before.get(kind) == status:
            continue
        if status == ConditionStatus.UNKNOWN.value and kind not in before:
            continue  # nothing known before, nothing known now: no news
        trouble = (kind, status) in _TROUBLE
        notices.append(
            Notice(
                type=EventType.WARNING if trouble else EventType.NORMAL,
                reason=str(condition["reason"]),
                message=f"{kind} is {status}: {condition['message']}",
            )
        )
    return notices


def _why(decision: Decision, pool: Pool) -> str:
    """The recommendation behind a change, e.g. the solver's answer or the burst."""
    planning = (Reason.RECOMMENDED, Reason.SLO_INFEASIBLE, Reason.BURST_DETECTED)
    for entry in decision.reasons:
        if entry.reason in planning and entry.concerns(pool):
            return entry.detail
    return decision.reason_for(pool).value
