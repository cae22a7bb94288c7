"""The CRD's OpenAPI v3 schema of the ``SLOAutoscaler`` spec, generated.

Every knob's type, default, bounds and description come from the config's field
metadata (``controller.config.knob``); what only the resource has (the Deployments,
the metrics, the built-in profile list, which fields are required) comes from
``controller.crd.spec``. The CEL rules below restate the config's cross-field rules
in spec names, for API servers that run them (1.25+); ``parse_spec`` checks the same
rules everywhere. ``controller.schema`` writes this into the committed CRD YAML.

OpenAPI v3.0 is JSON Schema draft 4 here: ``exclusiveMinimum`` is a boolean.
"""

from __future__ import annotations

import enum
import json
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from controller.config import ControllerConfig, KnobField, knob_fields
from controller.crd.spec import (
    DEPLOYMENT_NAME,
    DEPLOYMENT_NAME_MAX_LENGTH,
    GROUP_VERSION,
    KIND_NAME,
    KNOBS,
    PROMETHEUS_URL,
    REQUIRED_FIELDS,
    SELECTOR,
    spec_names_in,
)
from queueing.catalog import builtin_profiles
from queueing.pools import Pool

SPEC_DESCRIPTION = (
    "What to scale, to which SLOs, and how. Every field but the pools' scale targets, "
    "the SLOs and the Prometheus URL has a default."
)

# The config's cross-field rules in spec names, by the object they are attached to
# ("" is the spec itself). They mirror ControllerConfig.validate, PoolLimits.validate
# and ForecastConfig.validate; has() guards keep them true where a field is absent.
_CEL_RULES: dict[str, list[dict[str, str]]] = {
    "": [
        {
            "rule": "!has(self.staleAfterSeconds) || !has(self.windowSeconds) || "
            "self.staleAfterSeconds >= self.windowSeconds",
            "message": "staleAfterSeconds must be >= windowSeconds",
        },
        {
            "rule": "!has(self.gpuBudget) || self.gpuBudget >= "
            "(has(self.prefill.minReplicas) ? self.prefill.minReplicas : 1) + "
            "(has(self.decode.minReplicas) ? self.decode.minReplicas : 1)",
            "message": "gpuBudget must cover prefill.minReplicas + decode.minReplicas",
        },
    ],
    **{
        pool.value: [
            {
                "rule": "!has(self.minReplicas) || !has(self.maxReplicas) || "
                "self.minReplicas <= self.maxReplicas",
                "message": "minReplicas must be <= maxReplicas",
            }
        ]
        for pool in Pool
    },
    "forecast": [
        {
            "rule": "!has(self.trendWindowSeconds) || !has(self.binSeconds) || "
            "self.trendWindowSeconds >= 3.0 * self.binSeconds",
            "message": "trendWindowSeconds must hold at least 3 bins of binSeconds",
        }
    ],
}


def _deployment(pool: Pool) -> dict[str, Any]:
    return {
        "type": "string",
        "description": f"Name of the {pool.value} Deployment, in the resource's namespace; "
        "scaled through its scale subresource. Give this or scaleTargetRef.",
        "minLength": 1,
        "maxLength": DEPLOYMENT_NAME_MAX_LENGTH,
        "pattern": f"^{DEPLOYMENT_NAME.pattern}$",
    }


def _scale_target_ref(pool: Pool) -> dict[str, Any]:
    return {
        "type": "object",
        "description": f"The {pool.value} pool as any resource with a scale subresource in "
        "the resource's namespace (a StatefulSet, a LeaderWorkerSet, an engine operator's "
        "kind), as an HPA names it. Give this or deployment.",
        "required": ["apiVersion", "kind", "name"],
        "properties": {
            "apiVersion": {
                "type": "string",
                "description": "GROUP/VERSION of the kind, e.g. apps/v1.",
                "pattern": f"^{GROUP_VERSION.pattern}$",
            },
            "kind": {
                "type": "string",
                "description": "The kind, e.g. StatefulSet.",
                "pattern": f"^{KIND_NAME.pattern}$",
            },
            "name": {
                "type": "string",
                "description": "The resource's name.",
                "minLength": 1,
                "maxLength": DEPLOYMENT_NAME_MAX_LENGTH,
                "pattern": f"^{DEPLOYMENT_NAME.pattern}$",
            },
        },
    }


# The fields only the resource has, by spec path, and how the docs' table words what
# each allows.
TARGETS: dict[str, tuple[dict[str, Any], str]] = {
    **{f"{pool.value}.deployment": (_deployment(pool), "a Deployment name") for pool in Pool},
    **{
        f"{pool.value}.scaleTargetRef": (_scale_target_ref(pool), "apiVersion, kind, name")
        for pool in Pool
    },
    "metrics.prometheusUrl": (
        {
            "type": "string",
            "description": "Base URL of the Prometheus HTTP API (the operator queries "
            "/api/v1/query).",
            "pattern": f"^{PROMETHEUS_URL.pattern}$",
        },
        "`http://` or `https://` URL",
    ),
    "metrics.selector": (
        {
            "type": "string",
            "description": "PromQL label matchers without braces added to every query, "
            'selecting this deployment\'s series, e.g. namespace="llm"; empty selects all.',
            "default": "",
            "pattern": f"^{SELECTOR.pattern}$",
        },
        "no braces",
    ),
}
_METRICS_DESCRIPTION = (
    "Where the operator reads the pools' metrics, and whose metric names they are."
)
# A cluster has no profile files: the spec takes a built-in name (check_config_for_spec).
_ENUMS: dict[str, list[str]] = {"profile": list(builtin_profiles())}


def spec_schema() -> dict[str, Any]:
    """The ``spec`` property of the CRD's ``openAPIV3Schema``."""
    node = _object(ControllerConfig, "", SPEC_DESCRIPTION)
    # The config's metrics block (the flavour) and the resource's own metrics fields
    # (where Prometheus is) share the spec's one ``metrics`` object.
    node["properties"]["metrics"]["description"] = _METRICS_DESCRIPTION
    targets: dict[str, dict[str, Any]] = {}
    for path, (schema, _) in TARGETS.items():
        parent, _, leaf = path.partition(".")
        targets.setdefault(parent, {})[leaf] = schema
    for parent, fields in targets.items():
        # The target fields come first in their object, before the knobs.
        parent_node = node["properties"][parent]
        parent_node["properties"] = {**fields, **parent_node["properties"]}
    # Each pool names its target by exactly one of deployment and scaleTargetRef: a
    # oneOf of required fields alone, which a structural schema allows (no CEL needed).
    node["required"] = [pool.value for pool in Pool]
    for pool in Pool:
        node["properties"][pool.value]["oneOf"] = [
            {"required": ["deployment"]},
            {"required": ["scaleTargetRef"]},
        ]
    _add_required(node, "")
    return node


def _object(cls: type, spec_prefix: str, description: str) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "object", "description": description}
    rules = _CEL_RULES.get(spec_prefix.rstrip("."))
    if rules:
        node["x-kubernetes-validations"] = rules
    properties: dict[str, Any] = {}
    for item in knob_fields(cls):
        path = f"{spec_prefix}{item.spec_name}"
        if item.block is not None:
            properties[item.spec_name] = _object(
                item.block, f"{path}.", spec_names_in(item.knob.doc)
            )
        else:
            properties[item.spec_name] = _leaf(item, path)
    node["properties"] = properties
    return node


def _leaf(item: KnobField, path: str) -> dict[str, Any]:
    kind, meta = item.type, item.knob
    members = [m for m in typing.get_args(kind) if m is not type(None)]
    if members:  # optional: absent means "not set"
        (kind,) = members
    node: dict[str, Any] = {"type": _TYPES.get(kind, "string")}
    node["description"] = spec_names_in(meta.doc)
    default = item.default
    if default is not None and path not in REQUIRED_FIELDS:
        node["default"] = default.value if isinstance(default, enum.Enum) else default
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        node["enum"] = [member.value for member in kind]
    elif path in _ENUMS:
        node["enum"] = _ENUMS[path]
    elif meta.min_length is not None:
        node["minLength"] = meta.min_length
    if meta.lower is not None:
        node["minimum"] = meta.lower
        if meta.gt is not None:
            node["exclusiveMinimum"] = True
    if meta.upper is not None:
        node["maximum"] = meta.upper
        if meta.lt is not None:
            node["exclusiveMaximum"] = True
    return node


_TYPES: dict[Any, str] = {bool: "boolean", int: "integer", float: "number", str: "string"}


def _add_required(node: dict[str, Any], prefix: str) -> None:
    """``required`` on every object from ``REQUIRED_FIELDS``; an object none of whose
    fields is required defaults to ``{}``, so that its fields' defaults apply."""
    own = set(node.get("required", ()))  # a target object's, or the pools on the spec
    required = sorted(
        own
        | {
            path[len(prefix) :].split(".")[0] for path in REQUIRED_FIELDS if path.startswith(prefix)
        },
        key=list(node["properties"]).index,
    )
    if required:
        node["required"] = required
    elif prefix:
        node["default"] = {}
    for name, child in node["properties"].items():
        # A target object (scaleTargetRef) has no defaults: its absence means something.
        if child.get("type") == "object" and f"{prefix}{name}" not in TARGETS:
            _add_required(child, f"{prefix}{name}.")
    if required or prefix:
        # Keep the keys in the order people read a schema: type, description, then the
        # constraints, the default and the properties.
        ordered: dict[str, Any] = {key: node[key] for key in ("type", "description") if key in node}
        for key in ("default", "required", "x-kubernetes-validations"):
            if key in node:
                ordered[key] = node[key]
        ordered.update((key, value) for key, value in node.items() if key not in ordered)
        node.clear()
        node.update(ordered)


# --------------------------------------------------------------------------------------
# The spec table of docs/operator.md
# --------------------------------------------------------------------------------------


def _leaves(node: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    for name, child in node["properties"].items():
        if child.get("type") == "object" and "properties" in child:
            yield from _leaves(child, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", child


_POOLS = {pool.value for pool in Pool}
_POOL_TARGETS = {"deployment", "scaleTargetRef"}


def spec_fields_markdown() -> str:
    """The table of every spec field: type, default, range, config field, meaning."""
    config_path = dict(KNOBS)
    lines = [
        "| spec field | type | default | allowed | config field | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for path, node in _leaves(spec_schema()):
        if path in REQUIRED_FIELDS:
            default = "required"
        elif path.split(".")[0] in _POOLS and path.split(".")[1] in _POOL_TARGETS:
            default = "required: `deployment` or `scaleTargetRef`"
        elif "default" in node:
            default = f"`{json.dumps(node['default'])}`"
        else:
            default = "absent (unlimited)" if node["type"] != "string" else "absent"
        if path in TARGETS:
            allowed = TARGETS[path][1]
        elif "enum" in node and path in _ENUMS:
            allowed = "a built-in profile"
        elif "enum" in node:
            allowed = " \\| ".join(f"`{value}`" for value in node["enum"])
        else:
            allowed = _range(node)
        config = f"`{config_path[path]}`" if path in config_path else "—"
        meaning = str(node["description"]).replace("|", r"\|")
        lines.append(
            f"| `{path}` | {node['type']} | {default} | {allowed} | {config} | {meaning} |"
        )
    return "\n".join(lines) + "\n"


def _range(node: Mapping[str, Any]) -> str:
    parts = []
    if "minimum" in node:
        symbol = ">" if node.get("exclusiveMinimum") else "≥"
        parts.append(f"{symbol} {node['minimum']:g}")
    if "maximum" in node:
        symbol = "<" if node.get("exclusiveMaximum") else "≤"
        parts.append(f"{symbol} {node['maximum']:g}")
    return ", ".join(parts) or "—"
