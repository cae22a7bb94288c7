"""The SLOAutoscaler resource: its CRD schema, the spec <-> config conversion, its status.

The schema is checked with jsonschema (draft 4, the dialect of OpenAPI v3 schemas);
jsonschema cannot run the CEL rules (``x-kubernetes-validations``), so the cross-field
rules are checked on the Python conversion, which applies them everywhere.
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import yaml

from controller import crd, schema
from controller.config import (
    CUSTOM_QUERY_FIELDS,
    CalibrationConfig,
    ConfigError,
    ControllerConfig,
    ForecastConfig,
    LeadTimeConfig,
    MetricsConfig,
    MetricsFlavor,
    Mode,
    PoolLimits,
    SloConfig,
    _camel,
)
from controller.crd import openapi
from controller.observation import Observation, PoolObservation
from controller.policy import CapacityModels, ControllerState, decide
from controller.store import config_version
from controller.tick import TickRecord
from queueing.catalog import builtin_profiles
from queueing.lengths import LengthSamples
from queueing.pools import Pool

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "helm/sara/crds/sloautoscalers.sara.io.yaml"
EXAMPLE_PATH = ROOT / "helm/sara/examples/sloautoscaler.yaml"


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


CRD = load(CRD_PATH)
(VERSION,) = CRD["spec"]["versions"]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
SPEC_SCHEMA = SCHEMA["properties"]["spec"]
EXAMPLE = load(EXAMPLE_PATH)


def schema_errors(
    document: Any, schema: dict[str, Any] = SCHEMA
) -> list[jsonschema.ValidationError]:
    return list(jsonschema.Draft4Validator(schema).iter_errors(document))


def schema_at(path: str) -> dict[str, Any]:
    node: dict[str, Any] = SPEC_SCHEMA
    for part in path.split("."):
        node = node["properties"][part]
    return node


def leaves(schema: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for name, node in schema["properties"].items():
        if node.get("type") == "object" and "properties" in node:
            out |= leaves(node, f"{prefix}{name}.")
        else:
            out.add(f"{prefix}{name}")
    return out


def dotted(data: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        data = data[part]
    return data


# -- the CRD ----------------------------------------------------------------------------


def test_the_crd_names_the_resource_as_the_operator_serves_it() -> None:
    assert CRD["metadata"]["name"] == f"{crd.PLURAL}.{crd.GROUP}"
    assert CRD["spec"]["group"] == crd.GROUP
    assert CRD["spec"]["scope"] == "Namespaced"
    names = CRD["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (crd.KIND, crd.PLURAL, ["sla"])
    assert VERSION["name"] == crd.VERSION and VERSION["served"] and VERSION["storage"]
    assert VERSION["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in VERSION["additionalPrinterColumns"]}
    assert columns["Prefill"] == ".status.prefill.currentReplicas"
    assert columns["Decode"] == ".status.decode.currentReplicas"
    assert columns["TTFT-P99"] == ".status.observed.ttftP99Seconds"
    assert columns["TPOT-P99"] == ".status.observed.tpotP99Seconds"
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Age"] == ".metadata.creationTimestamp"


def test_the_spec_schema_has_exactly_the_fields_the_conversion_reads() -> None:
    expected = {spec for spec, _ in crd.KNOBS} | set(crd.TARGET_FIELDS)
    assert leaves(SPEC_SCHEMA) == expected


def test_the_knobs_cover_every_field_of_the_controller_config() -> None:
    config_leaves = set(_flatten(ControllerConfig().to_dict()))
    assert {config for _, config in crd.KNOBS} == config_leaves


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_every_schema_field_is_described() -> None:
    def walk(node: dict[str, Any], where: str) -> None:
        assert node.get("description"), f"{where} has no description"
        for name, child in node.get("properties", {}).items():
            walk(child, f"{where}.{name}")
        if "items" in node:
            for name, child in node["items"].get("properties", {}).items():
                walk(child, f"{where}[].{name}")

    walk(SPEC_SCHEMA, "spec")
    walk(SCHEMA["properties"]["status"], "status")


def test_the_schema_defaults_are_the_controller_defaults() -> None:
    defaults = _flatten(ControllerConfig().to_dict())
    for spec_path, config_path in crd.KNOBS:
        node = schema_at(spec_path)
        if defaults[config_path] is None or spec_path in crd.REQUIRED_FIELDS:
            # gpuBudget: absent means unlimited; the SLOs must be written out.
            assert "default" not in node, spec_path
        else:
            expected = defaults[config_path]
            expected = expected.value if isinstance(expected, Mode) else expected
            assert node["default"] == expected, spec_path


def test_the_committed_crd_is_the_one_generated_from_the_config() -> None:
    text = CRD_PATH.read_text(encoding="utf-8")
    assert schema.render_crd(text) == text, "run python -m controller.schema --write"


def test_the_generated_spec_schema_is_the_committed_one() -> None:
    assert openapi.spec_schema() == SPEC_SCHEMA


def test_the_spec_names_are_the_config_names_in_camel_case_with_seconds_spelt_out() -> None:
    knobs = dict(crd.KNOBS)
    assert knobs["slo.ttftP99Seconds"] == "slo.ttft_p99_s"
    assert knobs["scaleDownStabilisationSeconds"] == "scale_down_stabilisation_s"
    assert knobs["kvLinkGbps"] == "kv_link_gbps"
    assert knobs["forecast.minTStat"] == "forecast.min_t_stat"


def test_the_profile_enum_is_the_builtin_catalogue() -> None:
    assert schema_at("profile")["enum"] == list(builtin_profiles())


def test_min_and_max_replicas_are_tied_by_a_cel_rule_on_each_pool() -> None:
    for pool in ("prefill", "decode"):
        (rule,) = schema_at(pool)["x-kubernetes-validations"]
        assert "self.minReplicas <= self.maxReplicas" in rule["rule"]
        targets = schema_at(pool)["oneOf"]
        assert targets == [{"required": ["deployment"]}, {"required": ["scaleTargetRef"]}]


# -- the example against the schema -----------------------------------------------------


def test_the_example_is_a_valid_resource() -> None:
    assert EXAMPLE["apiVersion"] == crd.API_VERSION and EXAMPLE["kind"] == crd.KIND
    assert schema_errors(EXAMPLE) == []


# The custom flavour's templates are refused with any other flavour: the example,
# which uses the sara flavour, cannot set them (a test below parses them).
CUSTOM_ONLY = {f"metrics.{_camel(name)}" for name in CUSTOM_QUERY_FIELDS}
# A pool names a deployment or a scaleTargetRef, not both: the example names Deployments.
SCALE_TARGET_REFS = {
    f"{pool}.scaleTargetRef.{key}"
    for pool in ("prefill", "decode")
    for key in ("apiVersion", "kind", "name")
}


def test_the_example_sets_every_field_and_parses() -> None:
    assert leaves(SPEC_SCHEMA) - CUSTOM_ONLY - SCALE_TARGET_REFS <= set(_flatten(EXAMPLE["spec"]))
    spec = crd.parse_spec(EXAMPLE["spec"])
    assert spec.prefill_target == crd.ScaleTargetRef.deployment("llama3-8b-prefill")
    assert spec.config.slo.ttft_p99_s == 1.5 and spec.config.gpu_budget == 48


def test_a_pool_names_any_scalable_kind_by_scale_target_ref_or_a_deployment_by_name() -> None:
    resource = copy.deepcopy(EXAMPLE)
    del resource["spec"]["decode"]["deployment"]
    resource["spec"]["decode"]["scaleTargetRef"] = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "llama3-8b-decode",
    }
    assert schema_errors(resource) == []
    spec = crd.parse_spec(resource["spec"])
    assert spec.decode_target == crd.ScaleTargetRef(
        api_version="leaderworkerset.x-k8s.io/v1", kind="LeaderWorkerSet", name="llama3-8b-decode"
    )
    assert spec.decode_target.group == "leaderworkerset.x-k8s.io"
    assert spec.prefill_target.is_deployment and spec.prefill_target.name == "llama3-8b-prefill"
    # The spec it writes back parses to the same targets.
    assert crd.parse_spec(spec.to_spec()) == spec
    resource["spec"]["decode"]["deployment"] = "also-a-deployment"
    with pytest.raises(ConfigError, match=r"^spec\.decode\.deployment: give exactly one"):
        crd.parse_spec(resource["spec"])
    del resource["spec"]["decode"]["deployment"]
    resource["spec"]["decode"]["scaleTargetRef"]["apiVersion"] = "v1"
    with pytest.raises(ConfigError, match=r"^spec\.decode\.scaleTargetRef\.apiVersion: must be"):
        crd.parse_spec(resource["spec"])
    assert schema_errors(resource) != []


def test_a_custom_flavour_takes_its_templates_from_the_spec_and_needs_them_all() -> None:
    resource = copy.deepcopy(EXAMPLE)
    templates = {_camel(name): f"sum(metric_{i})" for i, name in enumerate(CUSTOM_QUERY_FIELDS)}
    resource["spec"]["metrics"].update(flavor="custom", **templates)
    assert schema_errors(resource) == []
    metrics = crd.parse_spec(resource["spec"]).config.metrics
    assert metrics.flavor is MetricsFlavor.CUSTOM
    assert metrics.ttft_p99_query == templates["ttftP99Query"]
    del resource["spec"]["metrics"]["kvUsageQuery"]
    with pytest.raises(ConfigError, match=r"^spec\.metrics\.kvUsageQuery: required with flavor"):
        crd.parse_spec(resource["spec"])
    resource["spec"]["metrics"]["flavor"] = "vllm"
    with pytest.raises(ConfigError, match=r"^spec\.metrics\.arrivalRateQuery: only with flavor"):
        crd.parse_spec(resource["spec"])


def without(path: str) -> Any:
    resource = copy.deepcopy(EXAMPLE)
    *parents, leaf = path.split(".")
    node = resource["spec"]
    for parent in parents:
        node = node[parent]
    del node[leaf]
    return resource


def with_value(path: str, value: Any) -> Any:
    resource = copy.deepcopy(EXAMPLE)
    *parents, leaf = path.split(".")
    node = resource["spec"]
    for parent in parents:
        node = node[parent]
    node[leaf] = value
    return resource


# (what is broken, the resource, where the schema reports it, the conversion's field)
BROKEN: list[tuple[str, Any, list[Any], str]] = [
    (
        "missing prefill deployment",
        without("prefill.deployment"),
        ["spec", "prefill"],
        "spec.prefill.deployment",
    ),
    (
        "missing decode deployment",
        without("decode.deployment"),
        ["spec", "decode"],
        "spec.decode.deployment",
    ),
    ("missing SLO", without("slo"), ["spec"], "spec.slo.ttftP99Seconds"),
    (
        "missing Prometheus URL",
        without("metrics.prometheusUrl"),
        ["spec", "metrics"],
        "spec.metrics.prometheusUrl",
    ),
    (
        "negative TTFT SLO",
        with_value("slo.ttftP99Seconds", -1.0),
        ["spec", "slo", "ttftP99Seconds"],
        "spec.slo.ttftP99Seconds",
    ),
    (
        "zero TPOT SLO",
        with_value("slo.tpotP99Seconds", 0),
        ["spec", "slo", "tpotP99Seconds"],
        "spec.slo.tpotP99Seconds",
    ),
    ("unknown mode", with_value("mode", "aggressive"), ["spec", "mode"], "spec.mode"),
    ("unknown profile", with_value("profile", "gpt-5@tpu"), ["spec", "profile"], "spec.profile"),
    (
        "replicas as a string",
        with_value("prefill.minReplicas", "two"),
        ["spec", "prefill", "minReplicas"],
        "spec.prefill.minReplicas",
    ),
    (
        "fractional replicas",
        with_value("decode.maxReplicas", 2.5),
        ["spec", "decode", "maxReplicas"],
        "spec.decode.maxReplicas",
    ),
    (
        "negative replicas",
        with_value("decode.minReplicas", -1),
        ["spec", "decode", "minReplicas"],
        "spec.decode.minReplicas",
    ),
    (
        "SLO as a string",
        with_value("slo.ttftP99Seconds", "1.5s"),
        ["spec", "slo", "ttftP99Seconds"],
        "spec.slo.ttftP99Seconds",
    ),
    (
        "calibration switch as a string",
        with_value("calibration.enabled", "yes"),
        ["spec", "calibration", "enabled"],
        "spec.calibration.enabled",
    ),
    ("zero smoothing weight", with_value("emaWeight", 0), ["spec", "emaWeight"], "spec.emaWeight"),
    ("dead band of one", with_value("deadBand", 1.0), ["spec", "deadBand"], "spec.deadBand"),
    ("burst ratio of one", with_value("burstRatio", 1), ["spec", "burstRatio"], "spec.burstRatio"),
    ("zero GPU budget", with_value("gpuBudget", 0), ["spec", "gpuBudget"], "spec.gpuBudget"),
    (
        "negative cooldown",
        with_value("scaleDownCooldownSeconds", -5),
        ["spec", "scaleDownCooldownSeconds"],
        "spec.scaleDownCooldownSeconds",
    ),
    (
        "a Deployment name with capitals",
        with_value("prefill.deployment", "Prefill"),
        ["spec", "prefill", "deployment"],
        "spec.prefill.deployment",
    ),
    (
        "a selector with braces",
        with_value("metrics.selector", '{namespace="llm"}'),
        ["spec", "metrics", "selector"],
        "spec.metrics.selector",
    ),
    (
        "a URL without a scheme",
        with_value("metrics.prometheusUrl", "prometheus:9090"),
        ["spec", "metrics", "prometheusUrl"],
        "spec.metrics.prometheusUrl",
    ),
]


@pytest.mark.parametrize(
    ("resource", "schema_path"),
    [(resource, path) for _, resource, path, _ in BROKEN],
    ids=[case[0] for case in BROKEN],
)
def test_the_schema_rejects_a_broken_resource_at_the_broken_field(
    resource: Any, schema_path: list[Any]
) -> None:
    errors = schema_errors(resource)
    assert errors, "accepted"
    assert [list(e.absolute_path) for e in errors] == [schema_path]


@pytest.mark.parametrize(
    ("resource", "field"),
    [(resource, field) for _, resource, _, field in BROKEN],
    ids=[case[0] for case in BROKEN],
)
def test_the_conversion_rejects_the_same_resource_naming_the_spec_field(
    resource: Any, field: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        crd.parse_spec(resource["spec"])
    assert str(caught.value).startswith(f"{field}: ")


def test_a_missing_deployment_is_reported_as_required() -> None:
    with pytest.raises(ConfigError, match=r"^spec\.decode\.deployment: required \(or scaleTarget"):
        crd.parse_spec(without("decode.deployment")["spec"])


# -- what only the conversion can check -------------------------------------------------


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("prefill.minReplicas", 30, r"^spec\.prefill\.minReplicas: 30 > maxReplicas 24$"),
        ("decode.minReplicas", 40, r"^spec\.decode\.minReplicas: 40 > maxReplicas 32$"),
        ("staleAfterSeconds", 10, r"^spec\.staleAfterSeconds: 10 must be >= windowSeconds 30"),
        (
            "forecast.binSeconds",
            200,
            r"^spec\.forecast\.trendWindowSeconds: 300 holds 1\.5 bins of binSeconds 200; "
            r"a trend needs at least 3$",
        ),
        (
            "gpuBudget",
            3,
            r"^spec\.gpuBudget: 3 is below prefill\.minReplicas \+ "
            r"decode\.minReplicas = 4",
        ),
    ],
)
def test_cross_field_rules_the_schema_leaves_to_cel_are_enforced_by_the_conversion(
    path: str, value: Any, message: str
) -> None:
    resource = with_value(path, value)
    assert schema_errors(resource) == []  # only CEL would catch it at the API server
    with pytest.raises(ConfigError, match=message):
        crd.parse_spec(resource["spec"])


def test_min_equal_to_max_is_allowed() -> None:
    spec = crd.parse_spec(with_value("prefill.minReplicas", 24)["spec"])
    assert spec.config.prefill.min_replicas == spec.config.prefill.max_replicas == 24


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({**EXAMPLE["spec"], "replicas": 3}, r"^spec\.replicas: unknown field$"),
        (
            {**EXAMPLE["spec"], "slo": {"ttftP99Seconds": 1, "tpotP99Seconds": 0.1, "p50": 1}},
            r"^spec\.slo\.p50: unknown field$",
        ),
        ({**EXAMPLE["spec"], "prefill": "prefill"}, r"^spec\.prefill: must be an object"),
        ([], r"^spec: must be an object"),
    ],
)
def test_unknown_fields_and_non_objects_are_rejected(spec: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        crd.parse_spec(spec)


# -- round trips ------------------------------------------------------------------------

EVERYTHING_CHANGED = ControllerConfig(
    mode=Mode.ADVISORY,
    profile="llama-2-70b-tp4@h200",
    slo=SloConfig(ttft_p99_s=0.75, tpot_p99_s=0.05),
    headroom=0.2,
    interval_s=10.0,
    window_s=20.0,
    stale_after_s=60.0,
    ema_weight=0.5,
    burst_window_s=2.5,
    burst_ratio=2.0,
    dead_band=0.05,
    max_step_fraction=1.0,
    scale_up_cooldown_s=15.0,
    scale_down_cooldown_s=240.0,
    scale_down_stabilisation_s=600.0,
    kv_link_gbps=200.0,
    prefill=PoolLimits(min_replicas=3, max_replicas=9),
    decode=PoolLimits(min_replicas=0, max_replicas=12),
    gpu_budget=80,
    calibration=CalibrationConfig(enabled=False, ema_weight=0.1, min_factor=0.8, max_factor=1.5),
    forecast=ForecastConfig(
        enabled=True,
        horizon_s=90.0,
        trend_window_s=600.0,
        bin_s=60.0,
        min_t_stat=3.0,
        min_rise=0.1,
        period_s=604800.0,
        seasonal_smoothing_s=600.0,
        max_level_ratio=1.5,
    ),
    lead_time=LeadTimeConfig(
        enabled=False, startup_prior_s=60.0, startup_ema_weight=0.5, history_s=900.0, pool_s=120.0
    ),
    metrics=MetricsConfig(
        flavor=MetricsFlavor.CUSTOM,
        prefill_selector='role="prefill"',
        decode_selector='role="decode"',
        **{name: f"sum(metric_{i}{{$selector}})" for i, name in enumerate(CUSTOM_QUERY_FIELDS)},
    ),
)


def test_the_changed_config_really_changes_every_field() -> None:
    default = _flatten(ControllerConfig().to_dict())
    changed = _flatten(EVERYTHING_CHANGED.to_dict())
    assert [k for k in default if default[k] == changed[k]] == []


@pytest.mark.parametrize(
    "config", [ControllerConfig(), EVERYTHING_CHANGED], ids=["defaults", "all"]
)
def test_config_to_spec_and_back_is_exact(config: ControllerConfig) -> None:
    spec = crd.AutoscalerSpec(
        config=config,
        prefill_target=crd.ScaleTargetRef.deployment("p"),
        decode_target=crd.ScaleTargetRef.deployment("d"),
        metrics=crd.MetricsSpec(prometheus_url="http://prom:9090", selector='job="sara"'),
    )
    document = spec.to_spec()
    assert schema_errors(document, SPEC_SCHEMA) == []
    again = crd.parse_spec(document)
    assert again == spec
    assert again.to_spec() == document
    assert config_version(again.config) == config_version(config)


def test_the_example_spec_round_trips_exactly() -> None:
    assert crd.parse_spec(EXAMPLE["spec"]).to_spec() == EXAMPLE["spec"]


def test_a_minimal_spec_takes_the_controller_defaults() -> None:
    minimal = {
        "prefill": {"deployment": "p"},
        "decode": {"deployment": "d"},
        "slo": {"ttftP99Seconds": 2.0, "tpotP99Seconds": 0.1},
        "metrics": {"prometheusUrl": "http://prometheus:9090"},
    }
    assert schema_errors(minimal, SPEC_SCHEMA) == []
    spec = crd.parse_spec(minimal)
    assert spec.config == ControllerConfig()
    assert spec.metrics.selector == ""


def test_a_spec_patch_sets_every_knob_keeps_the_targets_and_clears_an_old_budget() -> None:
    base = crd.parse_spec(EXAMPLE["spec"])
    assert base.config.gpu_budget == 48
    patch = crd.spec_patch_for(ControllerConfig())
    assert patch["gpuBudget"] is None
    # The metrics object holds knobs (the flavour) beside the targets: only the knobs.
    assert "deployment" not in patch["prefill"]
    assert not {"prometheusUrl", "selector"} & set(patch["metrics"])
    patched = _merge(EXAMPLE["spec"], patch)
    again = crd.parse_spec(patched)
    assert again.config == ControllerConfig()
    assert again.prefill_target == base.prefill_target
    assert again.metrics == base.metrics


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386, as the API server applies a merge patch."""
    out = dict(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict):
            old = out.get(key)
            out[key] = _merge(old if isinstance(old, dict) else {}, value)
        else:
            out[key] = value
    return out


def test_a_profile_path_is_refused_for_a_cluster_naming_the_config_field() -> None:
    config = ControllerConfig(profile="/etc/sara/profile.json")
    with pytest.raises(ConfigError, match=r"^profile: must be a built-in profile"):
        crd.check_config_for_spec(config)


# -- status ------------------------------------------------------------------------------

STATUS_SCHEMA = SCHEMA["properties"]["status"]
rng = np.random.default_rng(11)
LENGTHS = LengthSamples(
    prompt_tokens=np.clip(rng.lognormal(np.log(800), 0.6, 600), 8, 6000).astype(np.int64),
    output_tokens=np.clip(rng.lognormal(np.log(150), 0.7, 600), 2, 1200).astype(np.int64),
    source="lognormal",
)
T0 = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)


def tick(
    config: ControllerConfig,
    *,
    rate: float | None,
    replicas: tuple[int, int] = (1, 1),
    age_s: float = 0.0,
    error: str | None = None,
    applied: bool = True,
) -> TickRecord:
    now_s = T0.timestamp()
    observation = Observation(
        time_s=now_s - age_s,
        prefill=PoolObservation(current_replicas=replicas[0], ready_replicas=replicas[0]),
        decode=PoolObservation(current_replicas=replicas[1], ready_replicas=replicas[1]),
        arrival_rate_rps=rate,
        burst_arrival_rate_rps=rate,
        interarrival_scv=1.0,
        lengths=LENGTHS,
        ttft_p99_s=0.4,
        tpot_p99_s=None,
    )
    decision = decide(observation, ControllerState(), config, now_s=now_s, models=CapacityModels())
    return TickRecord(
        time_s=now_s,
        config_version=config_version(config),
        decision=decision,
        applied=applied and decision.actuate,
        error=error,
    )


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_a_scaling_tick_becomes_a_status_the_schema_accepts() -> None:
    record = tick(ControllerConfig(), rate=200.0)
    decision = record.decision
    assert decision is not None and decision.target(Pool.PREFILL) > 1
    status = crd.build_status(record, generation=4, previous=None, now=T0)
    assert schema_errors(_without_nulls(status), STATUS_SCHEMA) == []
    assert status["observedGeneration"] == 4
    desired = decision.target(Pool.PREFILL)
    assert status["prefill"] == {"currentReplicas": 1, "desiredReplicas": desired}
    assert status["arrivalRateRps"] == pytest.approx(200.0)
    assert status["observed"] == {"ttftP99Seconds": 0.4, "tpotP99Seconds": None}
    assert status["predicted"]["ttftP99Seconds"] == decision.pools.prefill.predicted_p99_s
    assert status["lastDecision"]["time"] == "2025-03-01T12:00:00Z"
    assert status["lastDecision"]["applied"] is True
    assert "scale_up" in [r["reason"] for r in status["lastDecision"]["reasons"]]
    assert status["lastDecision"]["message"].startswith(f"prefill 1 -> {desired}")
    found = conditions(status)
    assert (found["Ready"]["status"], found["Ready"]["reason"]) == ("True", "Decided")
    assert (found["MetricsStale"]["status"], found["SLOInfeasible"]["status"]) == (
        "False",
        "False",
    )
    assert all(c["lastTransitionTime"] == "2025-03-01T12:00:00Z" for c in found.values())
    assert all(c["observedGeneration"] == 4 for c in found.values())


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def test_stale_metrics_hold_and_say_so_in_the_conditions() -> None:
    record = tick(ControllerConfig(), rate=200.0, replicas=(5, 5), age_s=1000.0)
    assert record.decision is not None and not record.decision.actuate
    status = crd.build_status(record, generation=1, previous=None, now=T0)
    found = conditions(status)
    assert found["MetricsStale"]["status"] == "True"
    assert found["MetricsStale"]["reason"] == "MetricsStale"
    assert "1000 s old" in found["MetricsStale"]["message"]
    assert found["SLOInfeasible"]["status"] == "Unknown"
    assert status["prefill"] == {"currentReplicas": 5, "desiredReplicas": 5}


def test_a_bound_that_cuts_the_target_sets_scaling_limited() -> None:
    capped = ControllerConfig(prefill=PoolLimits(max_replicas=2))
    status = crd.build_status(
        tick(capped, rate=200.0, replicas=(2, 2)), generation=1, previous=None, now=T0
    )
    limited = conditions(status)["ScalingLimited"]
    assert (limited["status"], limited["reason"]) == ("True", "TooManyReplicas")
    assert limited["message"].startswith("prefill: ")


def test_an_impossible_slo_sets_slo_infeasible() -> None:
    strict = ControllerConfig(slo=SloConfig(ttft_p99_s=0.001))
    status = crd.build_status(tick(strict, rate=10.0), generation=1, previous=None, now=T0)
    infeasible = conditions(status)["SLOInfeasible"]
    assert (infeasible["status"], infeasible["reason"]) == ("True", "SLOInfeasible")
    assert "cannot be met" in infeasible["message"]


@pytest.mark.parametrize(
    ("error", "decided", "reason"),
    [
        ("actuator: Deployment llm/p not found", False, "ActuatorError"),
        ("actuator (will retry): HTTP 503", True, "ScaleFailed"),
        ("profile: unknown profile 'x'", False, "ProfileError"),
        ("slo: tpot_p99: target 0.001 s cannot be met", False, "SLOInfeasible"),
    ],
)
def test_a_failed_tick_makes_ready_false_with_what_failed(
    error: str, decided: bool, reason: str
) -> None:
    record = tick(ControllerConfig(), rate=200.0, error=error, applied=False)
    if not decided:
        record = TickRecord(
            time_s=record.time_s,
            config_version=record.config_version,
            decision=None,
            applied=False,
            error=error,
        )
    status = crd.build_status(record, generation=2, previous=None, now=T0)
    assert schema_errors(_without_nulls(status), STATUS_SCHEMA) == []
    ready = conditions(status)["Ready"]
    assert (ready["status"], ready["reason"], ready["message"]) == ("False", reason, error)
    assert status["lastDecision"]["error"] == error


def test_transition_times_move_only_when_a_status_changes() -> None:
    fresh = tick(ControllerConfig(), rate=200.0)
    stale = tick(ControllerConfig(), rate=200.0, age_s=1000.0)
    first = crd.build_status(fresh, generation=1, previous=None, now=T0)
    later = T0 + timedelta(minutes=5)
    second = crd.build_status(fresh, generation=1, previous=first, now=later)
    assert second["conditions"] == first["conditions"]
    third = crd.build_status(stale, generation=1, previous=second, now=later)
    found = conditions(third)
    assert found["MetricsStale"]["lastTransitionTime"] == "2025-03-01T12:05:00Z"
    assert found["Ready"]["lastTransitionTime"] == "2025-03-01T12:00:00Z"  # still True


def test_an_invalid_spec_turns_ready_false_and_keeps_the_rest() -> None:
    good = crd.build_status(
        tick(ControllerConfig(), rate=200.0), generation=1, previous=None, now=T0
    )
    error = ConfigError("spec.prefill.minReplicas: 30 > maxReplicas 24")
    bad = crd.invalid_spec_status(error, generation=2, previous=good, now=T0 + timedelta(hours=1))
    found = conditions(bad)
    assert (found["Ready"]["status"], found["Ready"]["reason"]) == ("False", "InvalidSpec")
    assert found["Ready"]["message"] == str(error)
    assert found["MetricsStale"] == conditions(good)["MetricsStale"]
    assert bad["observedGeneration"] == 2


def test_events_name_each_scaled_pool_and_each_condition_change() -> None:
    record = tick(ControllerConfig(), rate=200.0)
    decision = record.decision
    assert decision is not None
    status = crd.build_status(record, generation=1, previous=None, now=T0)
    notices = crd.notices_for(record, None, status["conditions"])
    scaled = [n for n in notices if n.reason == "ScaledUp"]
    assert [n.message.split(":")[0] for n in scaled] == ["prefill pool", "decode pool"][
        : len(scaled)
    ]
    assert f"1 -> {decision.target(Pool.PREFILL)} replicas" in scaled[0].message
    assert {n.reason for n in notices} >= {"Decided", "MetricsFresh", "SLOFeasible"}
    assert all(n.type is crd.EventType.NORMAL for n in notices)
    # The same conditions again: nothing new to say, and an advisory tick scaled nothing.
    quiet = crd.notices_for(
        tick(ControllerConfig(mode=Mode.ADVISORY), rate=200.0),
        status["conditions"],
        status["conditions"],
    )
    assert quiet == []


def test_going_stale_is_a_warning_event() -> None:
    fresh = crd.build_status(
        tick(ControllerConfig(), rate=200.0), generation=1, previous=None, now=T0
    )
    stale_record = tick(ControllerConfig(), rate=200.0, age_s=1000.0)
    stale = crd.build_status(stale_record, generation=1, previous=fresh, now=T0)
    notices = crd.notices_for(stale_record, fresh["conditions"], stale["conditions"])
    warnings = [n for n in notices if n.type is crd.EventType.WARNING]
    assert [n.reason for n in warnings] == ["MetricsStale"]
    assert warnings[0].message.startswith("MetricsStale is True: ")


def test_the_operator_docs_list_every_spec_field_status_field_and_condition_reason() -> None:
    docs = (ROOT / "docs/operator.md").read_text(encoding="utf-8")
    assert openapi.spec_fields_markdown() in docs, "run python -m controller.schema --write"
    for path in leaves(SPEC_SCHEMA):
        assert f"| `{path}` |" in docs, path
    for name in SCHEMA["properties"]["status"]["properties"]:
        assert f"`{name}" in docs, name
    for reason in crd.ConditionReason:
        assert f"`{reason.value}`" in docs, reason
    for kind in crd.ConditionType:
        assert f"| `{kind.value}`" in docs, kind


def test_merge_patching_the_status_drops_what_a_tick_did_not_know() -> None:
    good = tick(ControllerConfig(), rate=200.0)
    failed = TickRecord(
        time_s=good.time_s,
        config_version=good.config_version,
        decision=None,
        applied=False,
        error="actuator: Deployment llm/p not found",
    )
    stored = _merge({}, crd.build_status(good, generation=1, previous=None, now=T0))
    assert "prefill" in stored and "error" not in stored["lastDecision"]
    stored = _merge(stored, crd.build_status(failed, generation=1, previous=stored, now=T0))
    assert not {"prefill", "decode", "predicted", "observed", "arrivalRateRps"} & set(stored)
    assert stored["lastDecision"]["error"] == failed.error
    stored = _merge(stored, crd.build_status(good, generation=1, previous=stored, now=T0))
    assert stored["prefill"]["desiredReplicas"] > 1
    assert "error" not in stored["lastDecision"]
    assert schema_errors(stored, STATUS_SCHEMA) == []
