"""The ``SLOAutoscaler`` custom resource as plain data.

``controller.crd.spec`` converts a resource's spec to and from ``ControllerConfig``;
``controller.crd.status`` builds its status (conditions, numbers) and its events from
a tick; ``controller.crd.openapi`` generates the CRD's schema of the spec from the
config's field metadata. All pure: the Kubernetes I/O is ``controller.operator``'s.
The names below are the package's whole public surface, so that an importer writes
``crd.parse_spec`` or ``crd.build_status`` without knowing which half holds it.
"""

from __future__ import annotations

from controller.crd.spec import (
    KNOBS,
    REQUIRED_FIELDS,
    TARGET_FIELDS,
    AutoscalerSpec,
    MetricsSpec,
    ScaleTargetRef,
    check_config_for_spec,
    config_from_spec,
    config_to_spec,
    parse_spec,
    spec_error_message,
    spec_patch_for,
)
from controller.crd.status import (
    Condition,
    ConditionReason,
    ConditionStatus,
    ConditionType,
    EventType,
    Notice,
    build_status,
    conditions_for,
    invalid_spec_status,
    merge_conditions,
    notices_for,
    rfc3339,
    summary,
)

GROUP = "sara.io"
VERSION = "v1alpha1"
PLURAL = "sloautoscalers"
KIND = "SLOAutoscaler"
API_VERSION = f"{GROUP}/{VERSION}"

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "KNOBS",
    "PLURAL",
    "REQUIRED_FIELDS",
    "TARGET_FIELDS",
    "VERSION",
    "AutoscalerSpec",
    "Condition",
    "ConditionReason",
    "ConditionStatus",
    "ConditionType",
    "EventType",
    "MetricsSpec",
    "Notice",
    "ScaleTargetRef",
    "build_status",
    "check_config_for_spec",
    "conditions_for",
    "config_from_spec",
    "config_to_spec",
    "invalid_spec_status",
    "merge_conditions",
    "notices_for",
    "parse_spec",
    "rfc3339",
    "spec_error_message",
    "spec_patch_for",
    "summary",
]
