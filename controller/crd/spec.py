"""The ``SLOAutoscaler`` custom resource as plain data: its spec, its status, its events.

Pure: no Kubernetes client and no clock here. The operator (``controller.operator``)
reads a resource, hands its ``spec`` to ``parse_spec`` and writes back what
``build_status`` returns; ``controller.operator.CustomResourceConfigStore`` turns a
REST edit of the config document into a patch of the spec with ``spec_patch_for``.

The spec speaks Kubernetes (camelCase, ``Seconds`` suffixes) and maps 1:1 onto
``ControllerConfig`` (``KNOBS`` is the whole mapping), plus what only a cluster needs:
the two Deployments and where the metrics are. Every check of ``ControllerConfig``
applies, and an error names the field by its spec path (``spec.prefill.minReplicas``),
because that is what the user wrote. The CRD's OpenAPI schema
(``helm/sara/crds/sloautoscalers.sara.io.yaml``) rejects most bad specs at the API
server already; the checks here are the ones it cannot make everywhere (CEL rules
need Kubernetes 1.25+) and the guard for specs that never went through it.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from controller.config import ConfigError, ControllerConfig
from controller.policy import POOLS, Decision, Reason, ReasonEntry
from queueing.catalog import builtin_profiles

GROUP = "sara.io"
VERSION = "v1alpha1"
PLURAL = "sloautoscalers"
KIND = "SLOAutoscaler"
API_VERSION = f"{GROUP}/{VERSION}"

# (spec path, config path) of every ControllerConfig knob. Knobs left out of a spec take
# the ControllerConfig default (the CRD's schema declares the same defaults).
KNOBS: tuple[tuple[str, str], ...] = (
    ("mode", "mode"),
    ("profile", "profile"),
    ("slo.ttftP99Seconds", "slo.ttft_p99_s"),
    ("slo.tpotP99Seconds", "slo.tpot_p99_s"),
    ("headroom", "headroom"),
    ("intervalSeconds", "interval_s"),
    ("windowSeconds", "window_s"),
    ("staleAfterSeconds", "stale_after_s"),
    ("emaWeight", "ema_weight"),
    ("burstWindowSeconds", "burst_window_s"),
    ("burstRatio", "burst_ratio"),
    ("deadBand", "dead_band"),
    ("maxStepFraction", "max_step_fraction"),
    ("scaleUpCooldownSeconds", "scale_up_cooldown_s"),
    ("scaleDownCooldownSeconds", "scale_down_cooldown_s"),
    ("scaleDownStabilisationSeconds", "scale_down_stabilisation_s"),
    ("kvLinkGbps", "kv_link_gbps"),
    ("prefill.minReplicas", "prefill.min_replicas"),
    ("prefill.maxReplicas", "prefill.max_replicas"),
    ("decode.minReplicas", "decode.min_replicas"),
    ("decode.maxReplicas", "decode.max_replicas"),
    ("gpuBudget", "gpu_budget"),
    ("calibration.enabled", "calibration.enabled"),
    ("calibration.emaWeight", "calibration.ema_weight"),
    ("calibration.minFactor", "calibration.min_factor"),
    ("calibration.maxFactor", "calibration.max_factor"),
)
# Fields only the resource has: what to scale and where its metrics are.
TARGET_FIELDS: tuple[str, ...] = (
    "prefill.deployment",
    "decode.deployment",
    "metrics.prometheusUrl",
    "metrics.selector",
)
REQUIRED_FIELDS: tuple[str, ...] = (
    "prefill.deployment",
    "decode.deployment",
    "slo.ttftP99Seconds",
    "slo.tpotP99Seconds",
    "metrics.prometheusUrl",
)
_SPEC_TO_CONFIG = dict(KNOBS)
_CONFIG_TO_SPEC = {config: spec for spec, config in KNOBS}
# A Deployment name is a DNS-1123 subdomain.
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_URL = re.compile(r"https?://[^\s/]+(/\S*)?")


def _shape(paths: Iterable[str]) -> dict[str, Any]:
    """The nested field names that ``paths`` spell: {"slo": {"ttftP99Seconds": None}, ...}."""
    shape: dict[str, Any] = {}
    for path in paths:
        *parents, leaf = path.split(".")
        node = shape
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = None
    return shape


_SPEC_SHAPE = _shape([spec for spec, _ in KNOBS] + list(TARGET_FIELDS))


# --------------------------------------------------------------------------------------
# Spec
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MetricsSpec:
    """Where the operator reads a resource's metrics.

    ``selector`` is extra PromQL label matchers without braces (``namespace="llm"``)
    that every query of ``controller.sources.prometheus`` adds; empty selects all series.
    """

    prometheus_url: str
    selector: str = ""

    def __post_init__(self) -> None:
        url = self.prometheus_url
        if not isinstance(url, str) or not _URL.fullmatch(url):
            raise ConfigError(
                f"spec.metrics.prometheusUrl: must be an http:// or https:// URL, got {url!r}"
            )
        if not isinstance(self.selector, str):
            raise ConfigError(f"spec.metrics.selector: must be a string, got {self.selector!r}")
        if "{" in self.selector or "}" in self.selector:
            raise ConfigError(
                'spec.metrics.selector: label matchers without braces (namespace="llm"), '
                f"got {self.selector!r}"
            )


@dataclass(frozen=True, kw_only=True)
class AutoscalerSpec:
    """One ``SLOAutoscaler`` spec: the controller's config and what it scales."""

    config: ControllerConfig
    prefill_deployment: str
    decode_deployment: str
    metrics: MetricsSpec

    def __post_init__(self) -> None:
        if not isinstance(self.config, ControllerConfig):
            raise ConfigError(f"config: must be a ControllerConfig, got {self.config!r}")
        for pool in POOLS:
            name = getattr(self, f"{pool}_deployment")
            if not isinstance(name, str) or len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
                raise ConfigError(
                    f"spec.{pool}.deployment: must be a Deployment name (a DNS-1123 "
                    f"subdomain: lower-case letters, digits, '-' and '.'), got {name!r}"
                )
        check_config_for_spec(self.config, prefix="spec.")

    def to_spec(self) -> dict[str, Any]:
        """The whole spec, every knob written out (``gpuBudget`` only when set)."""
        spec = config_to_spec(self.config)
        spec["prefill"]["deployment"] = self.prefill_deployment
        spec["decode"]["deployment"] = self.decode_deployment
        spec["metrics"] = {
            "prometheusUrl": self.metrics.prometheus_url,
            "selector": self.metrics.selector,
        }
        return spec


def check_config_for_spec(config: ControllerConfig, *, prefix: str = "") -> None:
    """What a spec allows beyond ``ControllerConfig``'s own checks: a built-in profile.

    A cluster has no profile files to read, so a path (which ``sara controller``
    accepts) is refused. ``prefix`` is ``"spec."`` for spec errors; without it the
    error names the config document's field (for the REST API).
    """
    if config.profile not in builtin_profiles():
        field = f"{prefix}profile" if prefix else "profile"
        raise ConfigError(
            f"{field}: must be a built-in profile (see `sara profiles`), got "
            f"{config.profile!r}; known: {', '.join(builtin_profiles())}"
        )


def parse_spec(spec: Any) -> AutoscalerSpec:
    """A resource's ``spec`` as an ``AutoscalerSpec``, validated whole.

    Raises ``ConfigError`` whose message starts with the spec path of the first bad
    field (``spec.slo.ttftP99Seconds: must be > 0, got -1``).
    """
    if not isinstance(spec, Mapping):
        raise ConfigError(f"spec: must be an object, got {type(spec).__name__}")
    _check_known(spec, _SPEC_SHAPE, "spec")
    for path in REQUIRED_FIELDS:
        if _get(spec, path) is None:
            raise ConfigError(f"spec.{path}: required")
    document: dict[str, Any] = {}
    for spec_path, config_path in KNOBS:
        value = _get(spec, spec_path)
        if value is not None:
            _put(document, config_path, value)
    try:
        config = ControllerConfig.from_dict(document)
    except ConfigError as exc:
        raise ConfigError(spec_error_message(str(exc))) from None
    except OverflowError as exc:  # an integer too large for a float-valued field
        raise ConfigError(f"spec: a number is out of range: {exc}") from None
    metrics = spec["metrics"]
    return AutoscalerSpec(
        config=config,
        prefill_deployment=spec["prefill"]["deployment"],
        decode_deployment=spec["decode"]["deployment"],
        metrics=MetricsSpec(
            prometheus_url=metrics["prometheusUrl"], selector=metrics.get("selector", "")
        ),
    )


def config_to_spec(config: ControllerConfig) -> dict[str, Any]:
    """Every knob of ``config`` as the spec writes it (nested, camelCase).

    ``gpuBudget`` is left out when the config has none (the spec's way of saying
    unlimited); ``spec_patch_for`` writes it as ``null`` to remove an old one.
    """
    document = config.to_dict()
    spec: dict[str, Any] = {}
    for spec_path, config_path in KNOBS:
        value = _get(document, config_path)
        if value is not None:
            _put(spec, spec_path, value)
    return spec


def spec_patch_for(config: ControllerConfig) -> dict[str, Any]:
    """A JSON merge patch of a spec that makes its knobs ``config``'s, leaving the
    Deployments and the metrics as they are."""
    patch = config_to_spec(config)
    if config.gpu_budget is None:
        patch["gpuBudget"] = None  # RFC 7386: null removes the key
    return patch


def config_from_spec(spec: Any) -> ControllerConfig:
    return parse_spec(spec).config


def spec_error_message(message: str) -> str:
    """A ``ConfigError`` message of the config document, in the spec's names.

    ``prefill.min_replicas: 5 > max_replicas 3`` becomes
    ``spec.prefill.minReplicas: 5 > maxReplicas 3``.
    """
    field, sep, rest = message.partition(": ")
    if not sep or " " in field:
        return f"spec: {message}"
    spec_field = _CONFIG_TO_SPEC.get(field, field if field != "config" else "")
    return f"spec{'.' + spec_field if spec_field else ''}: {_rename(rest)}"


# Config names, dotted and bare, to spec names; longest first, so that a dotted path is
# renamed whole before its leaf could be.
_NAMES = sorted(
    {
        **_CONFIG_TO_SPEC,
        **{c.rpartition(".")[2]: s.rpartition(".")[2] for s, c in KNOBS},
    }.items(),
    key=lambda item: -len(item[0]),
)
_NAME_PATTERN = re.compile(
    r"(?<![\w.])(" + "|".join(re.escape(name) for name, _ in _NAMES) + r")(?![\w])"
)


def _rename(text: str) -> str:
    names = dict(_NAMES)
    return _NAME_PATTERN.sub(lambda match: names[match.group(1)], text)


def _check_known(value: Mapping[str, Any], shape: Mapping[str, Any], where: str) -> None:
    for key, item in value.items():
        if key not in shape:
            raise ConfigError(f"{where}.{key}: unknown field")
        nested = shape[key]
        if nested is not None:
            if not isinstance(item, Mapping):
                raise ConfigError(f"{where}.{key}: must be an object, got {type(item).__name__}")
            _check_known(item, nested, f"{where}.{key}")


def _get(data: Mapping[str, Any], path: str) -> Any:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _put(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = data
    for parent in parents:
        node = node.setdefault(parent, {})
    node[leaf] = value


# --------------------------------------------------------------------------------------
# Status: conditions
# --------------------------------------------------------------------------------------


class TickRecord(Protocol):
    """What the status is built from: ``controller.loop.TickRecord`` (named by its shape
    so that this module stays among the pure ones)."""

    @property
    def time_s(self) -> float: ...
    @property
    def config_version(self) -> str: ...
    @property
    def decision(self) -> Decision | None: ...
    @property
    def applied(self) -> bool: ...
    @property
    def error(self) -> str | None: ...


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
    return f"{entry.pool}: {entry.detail}" if entry.pool else entry.detail


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
# Status: the document
# --------------------------------------------------------------------------------------


def summary(decision: Decision) -> str:
    """One line per decision: ``prefill 2 -> 4 (scale_up); decode stays at 3 (no_change)``."""
    parts = []
    for pool in POOLS:
        current = decision.prefill_current if pool == "prefill" else decision.decode_current
        target = decision.target(pool)
        what = f"{current} -> {target}" if target != current else f"stays at {current}"
        parts.append(f"{pool} {what} ({decision.reason_for(pool).value})")
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
            prefill={
                "currentReplicas": decision.prefill_current,
                "desiredReplicas": decision.prefill_target,
            },
            decode={
                "currentReplicas": decision.decode_current,
                "desiredReplicas": decision.decode_target,
            },
            arrivalRateRps=_finite(decision.smoothed_rate_rps),
            predicted={
                "ttftP99Seconds": _finite(decision.predicted_ttft_p99_s),
                "tpotP99Seconds": _finite(decision.predicted_tpot_p99_s),
            },
            observed={
                "ttftP99Seconds": _finite(decision.observed_ttft_p99_s),
                "tpotP99Seconds": _finite(decision.observed_tpot_p99_s),
            },
            modelErrorRatio={pool: _finite(decision.model_error.get(pool)) for pool in POOLS},
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
        out["pool"] = entry.pool
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
        for pool in POOLS:
            current = decision.prefill_current if pool == "prefill" else decision.decode_current
            target = decision.target(pool)
            if target != current:
                notices.append(
                    Notice(
                        type=EventType.NORMAL,
                        reason="ScaledUp" if target > current else "ScaledDown",
                        message=f"{pool} pool: {current} -> {target} replicas "
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


def _why(decision: Decision, pool: str) -> str:
    """The recommendation behind a change, e.g. the solver's answer or the burst."""
    planning = (Reason.RECOMMENDED, Reason.SLO_INFEASIBLE, Reason.BURST_DETECTED)
    for entry in decision.reasons:
        if entry.reason in planning and entry.pool in (pool, None):
            return entry.detail
    return decision.reason_for(pool).value
