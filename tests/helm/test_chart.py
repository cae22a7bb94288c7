"""The Helm chart: it lints, renders valid Kubernetes 1.35 objects for every value set,
locks every pod down, grants the operator only what it uses, and rejects bad values
with a message that names the key."""

from __future__ import annotations

import base64
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.helm.conftest import (
    CHART,
    FETCH,
    HELM,
    KUBE_VERSION,
    NAMESPACE,
    REPO,
    HelmFailed,
    Render,
    run_helm,
    values_file,
)

MONITORING_API = "monitoring.coreos.com/v1"
RUN_AS_USER = 10001

# Kinds kubernetes-validate has no schema for (custom resources): each is checked
# by a test of its own below.
CUSTOM_KINDS = {"SLOAutoscaler", "ServiceMonitor", "PodMonitor", "PrometheusRule", "KopfPeering"}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob"}


@dataclass(frozen=True, kw_only=True)
class ValueSet:
    values: tuple[str, ...] = ()
    api_versions: tuple[str, ...] = ()


VALUE_SETS = {
    "default": ValueSet(),
    "external-redis-monitoring": ValueSet(
        values=("external-redis-monitoring.yaml",), api_versions=(MONITORING_API,)
    ),
    "pvc-token-advisory": ValueSet(values=("pvc-token-advisory.yaml",)),
    "external-secret-custom-gpu": ValueSet(values=("external-secret-custom-gpu.yaml",)),
    "peering-cpu": ValueSet(values=("peering-cpu.yaml",)),
    # The chart's own vLLM values file (an absolute path: values_file keeps it as is).
    "vllm": ValueSet(values=(str(CHART / "values-vllm.yaml"),), api_versions=(MONITORING_API,)),
    "scale-targets": ValueSet(values=("scale-targets.yaml",)),
}


def render_set(render: Render, name: str) -> list[dict[str, Any]]:
    case = VALUE_SETS[name]
    return render(values=case.values, api_versions=case.api_versions)


def of_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, got {len(found)}"
    return found[0]


def pod_specs(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    specs = []
    for o in objs:
        if o["kind"] in WORKLOAD_KINDS:
            template = o["spec"]["template"]
            if o["kind"] == "CronJob":
                template = o["spec"]["jobTemplate"]["spec"]["template"]
            specs.append((f"{o['kind']}/{o['metadata']['name']}", template["spec"]))
    return specs


def volume(spec: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [v for v in spec["volumes"] if v["name"] == name]
    return found


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


# ----------------------------------------------------------------- values.yaml and schema


def test_values_yaml_first_line_points_at_the_schema() -> None:
    first = (CHART / "values.yaml").read_text(encoding="utf-8").splitlines()[0]
    assert first == "# yaml-language-server: $schema=values.schema.json"


KEY_LINE = re.compile(r"^(?P<indent>\s*)(?:-\s+)?(?P<key>[\"']?[A-Za-z0-9_./-]+[\"']?):(\s|$)")


def test_every_key_in_values_yaml_has_a_comment() -> None:
    lines = (CHART / "values.yaml").read_text(encoding="utf-8").splitlines()
    missing = []
    for number, line in enumerate(lines, start=1):
        if not KEY_LINE.match(line) or line.lstrip().startswith("#"):
            continue
        above = lines[number - 2].strip() if number > 1 else ""
        if not above.startswith("#") and " # " not in line:
            missing.append(f"values.yaml:{number}: {line.strip()}")
    assert not missing, "keys without a comment:\n" + "\n".join(missing)


def test_the_schema_is_draft_07_and_accepts_the_defaults() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    jsonschema.Draft7Validator(schema).validate(defaults)
    assert schema["additionalProperties"] is False


def leaf_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        paths = []
        for key, value in node.items():
            paths += leaf_paths(value, f"{prefix}.{key}" if prefix else str(key))
        return paths
    return [prefix]


def test_the_docs_list_every_value() -> None:
    docs = (REPO / "docs" / "helm.md").read_text(encoding="utf-8")
    defaults = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    missing = [p for p in leaf_paths(defaults) if f"`{p}`" not in docs]
    assert not missing, f"docs/helm.md does not list: {missing}"


# ------------------------------------------------------------------------- helm itself


def test_fetch_helm_is_idempotent_and_prints_the_path(helm: Path) -> None:
    proc = subprocess.run(
        ["bash", str(FETCH), str(HELM.parent)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(HELM)
    assert "downloading" not in proc.stderr


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint_strict_passes(helm: Path, name: str) -> None:
    args: list[str | Path] = ["lint", "--strict", CHART, "--namespace", NAMESPACE]
    args += ["--kube-version", KUBE_VERSION]
    for values in VALUE_SETS[name].values:
        args += ["--values", values_file(values)]
    out = run_helm(helm, *args)
    assert "0 chart(s) failed" in out


def test_an_older_kubernetes_is_refused(helm: Path) -> None:
    with pytest.raises(HelmFailed, match="kubeVersion"):
        run_helm(helm, "template", "sara", CHART, "--kube-version", "1.28.0")


# ------------------------------------------------------------- rendered objects are valid


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_objects_are_valid_kubernetes_1_35(render: Render, name: str) -> None:
    objs = render_set(render, name)
    assert objs
    for obj in objs:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {where}: {exc.message} at {list(exc.path)}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            pytest.fail(f"{name}: {where}: {exc.message}")


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_object_is_labelled_and_in_the_release_namespace(render: Render, name: str) -> None:
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding"}
    for obj in render_set(render, name):
        meta = obj["metadata"]
        labels = meta.get("labels", {})
        assert labels.get("app.kubernetes.io/instance") == "sara", meta["name"]
        assert labels.get("app.kubernetes.io/managed-by") == "Helm", meta["name"]
        assert len(meta["name"]) <= 63, meta["name"]
        if obj["kind"] not in cluster_scoped and obj["kind"] != "ConfigMap":
            assert meta["namespace"] == NAMESPACE, meta["name"]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_pod_runs_locked_down(render: Render, name: str) -> None:
    specs = pod_specs(render_set(render, name))
    assert specs
    for where, spec in specs:
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True, where
        assert pod["runAsUser"] == RUN_AS_USER, where
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, where
        tmp = [v for v in spec["volumes"] if v["name"] == "tmp"]
        assert tmp and "emptyDir" in tmp[0], f"{where}: no emptyDir for /tmp"
        for c in spec["containers"] + spec.get("initContainers", []):
            ctx = c["securityContext"]
            who = f"{where}: container {c['name']}"
            assert ctx["runAsNonRoot"] is True, who
            assert ctx.get("runAsUser", RUN_AS_USER) == RUN_AS_USER, who
            assert ctx["readOnlyRootFilesystem"] is True, who
            assert ctx["allowPrivilegeEscalation"] is False, who
            assert ctx["capabilities"]["drop"] == ["ALL"], who
            assert "add" not in ctx["capabilities"], who
            assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, who
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert mounts.get("/tmp") == "tmp", f"{who}: /tmp is not the emptyDir"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_only_the_operator_gets_an_api_token(render: Render, name: str) -> None:
    for where, spec in pod_specs(render_set(render, name)):
        wants_token = where.endswith("-operator")
        assert spec["automountServiceAccountToken"] is wants_token, where


# ------------------------------------------------------------------------------- RBAC

DEFAULT_RULES = {
    ("apps", "deployments"): {"get", "list", "watch"},
    ("apps", "deployments/scale"): {"get", "patch", "update"},
    ("sara.io", "sloautoscalers"): {"get", "list", "watch", "patch", "update"},
    ("sara.io", "sloautoscalers/status"): {"get", "patch", "update"},
    ("", "events"): {"create", "patch"},
    ("events.k8s.io", "events"): {"create", "patch"},
}
PEERING_RULES = {("kopf.dev", "kopfpeerings"): {"get", "list", "watch", "patch"}}
WORKER_KINDS = {"deployments", "deployments/scale"}


def rule_table(rules: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    table: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule, rule
        for group in rule["apiGroups"]:
            assert group != "*", rule
            for resource in rule["resources"]:
                table.setdefault((group, resource), set()).update(rule["verbs"])
    return table


SCALE_TARGET_RULES = {
    key: verbs for key, verbs in DEFAULT_RULES.items() if key[1] not in WORKER_KINDS
} | {
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): {"get", "list", "watch"},
    ("leaderworkerset.x-k8s.io", "leaderworkersets/scale"): {"get", "patch", "update"},
    ("apps", "statefulsets"): {"get", "list", "watch"},
    ("apps", "statefulsets/scale"): {"get", "patch", "update"},
}


def test_the_role_grants_exactly_the_configured_scale_target_kinds(render: Render) -> None:
    (role,) = of_kind(render_set(render, "scale-targets"), "Role")
    assert rule_table(role["rules"]) == SCALE_TARGET_RULES
    (scaler,) = of_kind(render_set(render, "scale-targets"), "SLOAutoscaler")
    assert scaler["spec"]["prefill"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "llama-prefill",
    }
    assert "deployment" not in scaler["spec"]["decode"]
    assert scaler["spec"]["decode"]["scaleTargetRef"]["kind"] == "StatefulSet"


def test_the_vllm_values_deploy_engine_pools_a_proxy_and_an_autoscaler_over_them(
    render: Render,
) -> None:
    objs = render_set(render, "vllm")
    names = {o["metadata"]["name"] for o in of_kind(objs, "Deployment")}
    assert names == {
        "sara-operator",
        "sara-engine-prefill",
        "sara-engine-decode",
        "sara-engine-proxy",
    }
    assert not of_kind(objs, "StatefulSet")  # no Redis, no SARA workers or router
    for pool in ("prefill", "decode"):
        pod = one(objs, "Deployment", f"sara-engine-{pool}")["spec"]["template"]
        assert pod["metadata"]["labels"]["sara.io/pool"] == pool
        (engine,) = pod["spec"]["containers"]
        assert engine["image"] == "vllm/vllm-openai:v0.12.0"
        config = engine["args"][engine["args"].index("--kv-transfer-config") + 1]
        assert json.loads(config) == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert engine["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    proxy = one(objs, "Deployment", "sara-engine-proxy")["spec"]["template"]["spec"]
    args = proxy["containers"][0]["args"]
    assert args[args.index("--prefiller-hosts") + 1] == "sara-engine-prefill"
    (scaler,) = of_kind(objs, "SLOAutoscaler")
    assert scaler["spec"]["prefill"]["deployment"] == "sara-engine-prefill"
    assert scaler["spec"]["metrics"]["flavor"] == "vllm"
    (role,) = of_kind(objs, "Role")
    assert rule_table(role["rules"]) == DEFAULT_RULES
    # The engines' series get their pool label from the pod's sara.io/pool label.
    (monitor,) = of_kind(objs, "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["relabelings"] == [
        {"sourceLabels": ["__meta_kubernetes_pod_label_sara_io_pool"], "targetLabel": "pool"}
    ]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("default", DEFAULT_RULES),
        ("pvc-token-advisory", DEFAULT_RULES),
        ("peering-cpu", DEFAULT_RULES | PEERING_RULES),
    ],
)
def test_the_operator_role_grants_exactly_what_it_uses(
    render: Render, name: str, expected: dict[tuple[str, str], set[str]]
) -> None:
    objs = render_set(render, name)
    (role,) = of_kind(objs, "Role")
    table = rule_table(role["rules"])
    assert table == expected
    assert table[("apps", "deployments/scale")] == {"get", "patch", "update"}
    (binding,) = of_kind(objs, "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    (account,) = of_kind(objs, "ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    operator = deployment(objs, "operator")
    assert operator["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]


@pytest.mark.parametrize("name", ["default", "pvc-token-advisory", "external-secret-custom-gpu"])
def test_nothing_is_cluster_wide_by_default(render: Render, name: str) -> None:
    objs = render_set(render, name)
    assert not of_kind(objs, "ClusterRole")
    assert not of_kind(objs, "ClusterRoleBinding")


def test_crd_scanning_adds_only_a_read_of_crds(render: Render) -> None:
    objs = render_set(render, "peering-cpu")
    (cluster_role,) = of_kind(objs, "ClusterRole")
    assert rule_table(cluster_role["rules"]) == {
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"}
    }
    (binding,) = of_kind(objs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    assert [s["namespace"] for s in binding["subjects"]] == [NAMESPACE]


# ------------------------------------------------------------------------ bad values

BAD_VALUES = [
    (["prefill.replicas=-1"], "/prefill/replicas"),
    (["decode.gpu.count=-2"], "/decode/gpu/count"),
    (["router.replicaz=2"], "replicaz"),
    (["nonsense=1"], "nonsense"),
    (["redis.external.url=redis://cache:6379/0"], "/redis/external/url"),
    (["redis.external.existingSecret=shared"], "/redis/external/existingSecret"),
    (["redis.enabled=false"], "/redis/external"),
    (["redis.enabled=false", "redis.external.url=http://cache"], "/redis/external/url"),
    (["autoscaler.mode=sometimes"], "/autoscaler/mode"),
    (["autoscaler.slo.ttftP99Seconds=0"], "/autoscaler/slo/ttftP99Seconds"),
    (['autoscaler.metrics.selector={namespace="x"}'], "/autoscaler/metrics/selector"),
    (["securityContext.runAsUser=0"], "/securityContext/runAsUser"),
    (["model.volume.type=nfs"], "/model/volume/type"),
    (["model.volume.type=persistentVolumeClaim"], "/model/volume/claimName"),
    (["model.volume.type=hostPath"], "/model/volume/hostPath"),
    (["operator.replicas=2"], "/operator/replicas"),
    (["workers.device=tpu"], "/workers/device"),
    (["prefill.terminationGracePeriodSeconds=0"], "/prefill/terminationGracePeriodSeconds"),
    (["monitoring.serviceMonitor.interval=often"], "/monitoring/serviceMonitor/interval"),
    (["image.pullPolicy=Sometimes"], "/image/pullPolicy"),
]


@pytest.mark.parametrize(("sets", "key"), BAD_VALUES, ids=[k for _, k in BAD_VALUES])
def test_bad_values_are_rejected_naming_the_key(helm: Path, sets: list[str], key: str) -> None:
    args: list[str | Path] = ["template", "sara", CHART, "--namespace", NAMESPACE]
    for item in sets:
        args += ["--set", item]
    with pytest.raises(HelmFailed) as failure:
        run_helm(helm, *args)
    assert key in str(failure.value)


@pytest.mark.parametrize(
    ("sets", "key"), [BAD_VALUES[0], BAD_VALUES[2], BAD_VALUES[4]], ids=["replicas", "key", "redis"]
)
def test_helm_lint_rejects_bad_values(helm: Path, sets: list[str], key: str) -> None:
    args: list[str | Path] = ["lint", "--strict", CHART]
    for item in sets:
        args += ["--set", item]
    with pytest.raises(HelmFailed) as failure:
        run_helm(helm, *args)
    assert key in str(failure.value)


TEMPLATE_CHECKS = [
    (
        ["autoscaler.decode.minReplicas=9", "autoscaler.decode.maxReplicas=3"],
        r"autoscaler\.decode\.minReplicas \(9\) must be <= autoscaler\.decode\.maxReplicas",
    ),
    (
        ["operator.serviceAccount.create=false"],
        r"operator\.serviceAccount\.name is required",
    ),
]


@pytest.mark.parametrize(("sets", "message"), TEMPLATE_CHECKS, ids=["bounds", "account"])
def test_inconsistent_values_fail_the_render(helm: Path, sets: list[str], message: str) -> None:
    args: list[str | Path] = ["template", "sara", CHART]
    for item in sets:
        args += ["--set", item]
    with pytest.raises(HelmFailed, match=message):
        run_helm(helm, *args)


def test_without_the_operator_nothing_of_it_renders(render: Render) -> None:
    objs = render(sets=("operator.enabled=false",))
    components = {o["metadata"]["labels"]["app.kubernetes.io/component"] for o in objs}
    assert "operator" not in components
    assert {o["kind"] for o in objs}.isdisjoint({"Role", "RoleBinding", "ServiceAccount"})


# -------------------------------------------------------------------- the components


def deployment(objs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    found = [
        o
        for o in of_kind(objs, "Deployment")
        if o["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    assert len(found) == 1, component
    return found[0]


def container(dep: dict[str, Any]) -> dict[str, Any]:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def test_the_operator_serves_the_release_namespace_with_a_token_file(render: Render) -> None:
    objs = render_set(render, "default")
    op = deployment(objs, "operator")
    c = container(op)
    assert c["args"][:7] == [
        "operator",
        "--namespace",
        NAMESPACE,
        "--api-listen",
        "0.0.0.0:8080",
        "--api-token-file",
        "/var/run/secrets/sara/api-token/token",
    ]
    assert "--standalone" in c["args"]
    assert op["spec"]["replicas"] == 1 and op["spec"]["strategy"]["type"] == "Recreate"
    volumes = {v["name"]: v for v in op["spec"]["template"]["spec"]["volumes"]}
    token = volumes["api-token"]["secret"]
    secret = one(objs, "Secret", token["secretName"])
    assert token["items"] == [{"key": "token", "path": "token"}]
    assert len(secret["data"]["token"]) > 40
    service = one(objs, "Service", op["metadata"]["name"])
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [("http", 8080)]


def test_an_existing_token_secret_is_mounted_and_none_generated(render: Render) -> None:
    objs = render_set(render, "pvc-token-advisory")
    token = volume(deployment(objs, "operator")["spec"]["template"]["spec"], "api-token")["secret"]
    assert token["secretName"] == "sara-api-token"
    assert token["items"] == [{"key": "api-token", "path": "token"}]
    assert not [s for s in of_kind(objs, "Secret") if s["metadata"]["name"].endswith("api-token")]


def test_peering_runs_a_hot_standby(render: Render) -> None:
    objs = render_set(render, "peering-cpu")
    op = deployment(objs, "operator")
    args = container(op)["args"]
    assert args[args.index("--peering") + 1] == "sara-llm" and "--standalone" not in args
    assert op["spec"]["replicas"] == 2
    (peering,) = of_kind(objs, "KopfPeering")
    assert peering["apiVersion"] == "kopf.dev/v1"
    assert peering["metadata"] == peering["metadata"] | {"name": "sara-llm", "namespace": NAMESPACE}


def test_the_router_listens_and_reads_redis_from_the_secret(render: Render) -> None:
    objs = render_set(render, "default")
    router = deployment(objs, "router")
    c = container(router)
    assert c["args"] == [
        "router",
        "--listen",
        "0.0.0.0:8000",
        "--redis",
        "$(REDIS_URL)",
        "--model",
        "/models/llama-3-8b",
        "--health-listen",
        "0.0.0.0:8001",
    ]
    # The probes go to the health listener, which an overload of the API cannot delay.
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "health": 8001}
    ref = env_of(c)["REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert one(objs, "Secret", ref["name"])["data"][ref["key"]]
    service = one(objs, "Service", router["metadata"]["name"])
    pod_labels = router["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_workers_get_their_pool_gpus_probes_and_drain_time(render: Render, pool: str) -> None:
    objs = render_set(render, "default")
    dep = deployment(objs, pool)
    spec = dep["spec"]["template"]["spec"]
    c = container(dep)
    assert c["args"] == [
        "worker",
        pool,
        "--redis",
        "$(REDIS_URL)",
        "--model",
        "/models/llama-3-8b",
        "--device",
        "cuda",
        "--metrics-listen",
        "0.0.0.0:9400",
        "--kv-transport",
        "redis",
    ]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert [p["containerPort"] for p in c["ports"]] == [9400]
    assert spec["terminationGracePeriodSeconds"] == 120
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert any(m["mountPath"] == "/models" and m["readOnly"] for m in c["volumeMounts"])


def test_custom_gpus_placement_and_images(render: Render) -> None:
    objs = render_set(render, "external-secret-custom-gpu")
    prefill, decode = deployment(objs, "prefill"), deployment(objs, "decode")
    p, d = container(prefill), container(decode)
    assert p["resources"]["limits"] == {"memory": "96Gi", "nvidia.com/mig-3g.40gb": 1}
    assert p["resources"]["requests"] == {
        "cpu": "8",
        "memory": "48Gi",
        "nvidia.com/mig-3g.40gb": 1,
    }
    assert "nvidia.com/gpu" not in p["resources"]["limits"]
    assert d["resources"]["limits"]["nvidia.com/gpu"] == 2
    pspec, dspec = prefill["spec"]["template"]["spec"], decode["spec"]["template"]["spec"]
    assert pspec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pspec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "podAntiAffinity" in dspec["affinity"]
    assert p["image"] == "registry.example.com/sara-cuda:0.1.0-cu128"
    assert container(deployment(objs, "router"))["image"] == "registry.example.com/sara:0.1.0"
    assert pspec["imagePullSecrets"] == [{"name": "regcred"}]
    model = volume(pspec, "model")
    assert model["hostPath"] == {"path": "/var/lib/models", "type": "Directory"}
    assert p["args"][p["args"].index("--model") + 1] == "/mnt/models/llama-3-8b"
    shm = volume(dspec, "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}


def test_cpu_workers_ask_for_no_gpu(render: Render) -> None:
    objs = render_set(render, "peering-cpu")
    for pool in ("prefill", "decode"):
        c = container(deployment(objs, pool))
        assert not any("gpu" in k for k in c["resources"].get("limits", {})), pool
        assert c["args"][c["args"].index("--device") + 1] == "cpu"
        assert c["args"][c["args"].index("--model") + 1] == "/models/tinyllama-1.1b"


def test_a_pvc_holds_the_model_read_only(render: Render) -> None:
    objs = render_set(render, "pvc-token-advisory")
    for component in ("router", "prefill", "decode"):
        spec = deployment(objs, component)["spec"]["template"]["spec"]
        model = volume(spec, "model")
        assert model["persistentVolumeClaim"] == {"claimName": "models-rox", "readOnly": True}


@pytest.mark.parametrize(
    ("name", "owned"),
    [("default", True), ("pvc-token-advisory", False), ("peering-cpu", True)],
)
def test_worker_replicas_are_left_to_the_autoscaler_when_it_scales(
    render: Render, name: str, owned: bool
) -> None:
    """Active mode (or replicas: null): helm upgrade must not undo a scaling decision."""
    objs = render_set(render, name)
    for pool in ("prefill", "decode"):
        spec = deployment(objs, pool)["spec"]
        assert ("replicas" not in spec) is owned, pool
    if not owned:
        assert deployment(objs, "prefill")["spec"]["replicas"] == 2
        assert deployment(objs, "decode")["spec"]["replicas"] == 4


# ------------------------------------------------------------------------------ Redis


def test_the_in_chart_redis_is_private_and_password_protected(render: Render) -> None:
    objs = render_set(render, "default")
    redis = deployment(objs, "redis")
    c = container(redis)
    assert c["image"].startswith("docker.io/library/redis:")
    assert c["args"][c["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    volumes = {v["name"]: v for v in redis["spec"]["template"]["spec"]["volumes"]}
    assert volumes["data"] == {"name": "data", "emptyDir": {}}
    assert {"name": "data", "mountPath": "/data"} in c["volumeMounts"]
    service = one(objs, "Service", redis["metadata"]["name"])
    assert service["spec"]["type"] == "ClusterIP"
    secret = one(objs, "Secret", f"{redis['metadata']['name']}")
    url = base64.b64decode(secret["data"]["redis-url"]).decode()
    password = base64.b64decode(secret["data"]["password"]).decode()
    assert url == f"redis://:{password}@{service['metadata']['name']}:6379/0"


def test_an_external_redis_url_replaces_the_in_chart_one(render: Render) -> None:
    objs = render_set(render, "external-redis-monitoring")
    assert not [
        o
        for o in objs
        if o["metadata"]["labels"]["app.kubernetes.io/component"] == "redis"
        and o["kind"] in ("Deployment", "Service")
    ]
    ref = env_of(container(deployment(objs, "decode")))["REDIS_URL"]["valueFrom"]["secretKeyRef"]
    secret = one(objs, "Secret", ref["name"])
    assert base64.b64decode(secret["data"][ref["key"]]).decode() == (
        "redis://:s3cret@redis.data.svc:6379/0"
    )


def test_an_existing_redis_secret_is_referenced_and_none_generated(render: Render) -> None:
    objs = render_set(render, "external-secret-custom-gpu")
    assert [s["metadata"]["name"] for s in of_kind(objs, "Secret")] == ["sara-api-token"]
    for component in ("router", "prefill", "decode"):
        ref = env_of(container(deployment(objs, component)))["REDIS_URL"]["valueFrom"]
        assert ref["secretKeyRef"] == {"name": "shared-redis", "key": "url"}


# ------------------------------------------------------------------------- monitoring

MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


@pytest.mark.parametrize(
    ("sets", "api_versions", "expected"),
    [
        ([], [], set()),
        ([], [MONITORING_API], set()),
        (
            ["monitoring.serviceMonitor.enabled=true", "monitoring.prometheusRule.enabled=true"],
            [],
            set(),
        ),
        (
            ["monitoring.serviceMonitor.enabled=true"],
            [MONITORING_API],
            {"ServiceMonitor", "PodMonitor"},
        ),
        (["monitoring.prometheusRule.enabled=true"], [MONITORING_API], {"PrometheusRule"}),
        (
            ["monitoring.serviceMonitor.enabled=true", "monitoring.prometheusRule.enabled=true"],
            [MONITORING_API],
            MONITORING_KINDS,
        ),
    ],
    ids=["off", "off-api", "on-no-api", "sm", "rule", "both"],
)
def test_monitoring_objects_render_only_when_enabled_and_served(
    render: Render, sets: list[str], api_versions: list[str], expected: set[str]
) -> None:
    objs = render(sets=tuple(sets), api_versions=tuple(api_versions))
    assert {o["kind"] for o in objs} & MONITORING_KINDS == expected


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector["matchLabels"].items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def test_the_service_monitor_scrapes_the_router_and_the_operator(render: Render) -> None:
    objs = render_set(render, "external-redis-monitoring")
    (monitor,) = of_kind(objs, "ServiceMonitor")
    assert monitor["apiVersion"] == MONITORING_API
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    scraped = [
        s
        for s in of_kind(objs, "Service")
        if selects(monitor["spec"]["selector"], s["metadata"]["labels"])
    ]
    assert sorted(s["metadata"]["labels"]["app.kubernetes.io/component"] for s in scraped) == [
        "operator",
        "router",
    ]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {
        "port": "http",
        "path": "/metrics",
        "interval": "30s",
        "scrapeTimeout": "10s",
    }
    for service in scraped:
        assert "http" in [p["name"] for p in service["spec"]["ports"]]


def test_the_pod_monitor_scrapes_both_worker_pools(render: Render) -> None:
    objs = render_set(render, "external-redis-monitoring")
    (monitor,) = of_kind(objs, "PodMonitor")
    scraped = [
        d
        for d in of_kind(objs, "Deployment")
        if selects(monitor["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
    ]
    assert sorted(d["metadata"]["labels"]["app.kubernetes.io/component"] for d in scraped) == [
        "decode",
        "prefill",
    ]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    for dep in scraped:
        assert "metrics" in [p["name"] for p in container(dep)["ports"]]


def test_the_prometheus_rule_carries_the_rules_file(render: Render) -> None:
    objs = render_set(render, "external-redis-monitoring")
    (rule,) = of_kind(objs, "PrometheusRule")
    assert rule["apiVersion"] == MONITORING_API
    rules_file = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text("utf-8"))
    assert rule["spec"] == {"groups": rules_file["groups"]}
    assert rule["spec"]["groups"]
    for group in rule["spec"]["groups"]:
        assert group["name"] and group["rules"], group
        for r in group["rules"]:
            assert ("record" in r) != ("alert" in r), r
            assert isinstance(r["expr"], str | int) and str(r["expr"]).strip(), r


# -------------------------------------------------------------------------- dashboard


def test_the_dashboard_is_a_labelled_configmap_of_the_json(render: Render) -> None:
    objs = render_set(render, "external-redis-monitoring")
    cm = one(objs, "ConfigMap", "sara-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "SARA"}
    expected = json.loads((CHART / "files" / "sara-slo.json").read_text(encoding="utf-8"))
    assert json.loads(cm["data"]["sara-slo.json"]) == expected


def test_the_dashboard_label_is_configurable_and_can_be_off(render: Render) -> None:
    objs = render(sets=("dashboard.labelKey=grafana.io/dashboard", "dashboard.labelValue=sara"))
    cm = one(objs, "ConfigMap", "sara-dashboard")
    assert cm["metadata"]["labels"]["grafana.io/dashboard"] == "sara"
    assert not of_kind(render_set(render, "external-secret-custom-gpu"), "ConfigMap")


# ---------------------------------------------------------------------- SLOAutoscaler

CRD = CHART / "crds" / "sloautoscalers.sara.io.yaml"


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text(encoding="utf-8"))
    assert crd["spec"]["group"] == "sara.io"
    assert crd["spec"]["names"]["kind"] == "SLOAutoscaler"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return version["schema"]["openAPIV3Schema"]


def undeclared_fields(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    """Fields the structural schema does not declare (the API server would drop them)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found: list[str] = []
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if props is not None and key in props:
                found += undeclared_fields(item, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                found += undeclared_fields(item, extra, f"{path}.{key}")
            elif props is not None or extra is False:
                found.append(f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for n, item in enumerate(value):
            found += undeclared_fields(item, schema["items"], f"{path}[{n}]")
    return found


@pytest.mark.parametrize(
    "name", ["default", "pvc-token-advisory", "external-redis-monitoring", "vllm", "scale-targets"]
)
def test_the_slo_autoscaler_matches_the_crd(render: Render, name: str) -> None:
    schema = crd_schema()
    (scaler,) = of_kind(render_set(render, name), "SLOAutoscaler")
    assert scaler["apiVersion"] == "sara.io/v1alpha1"
    # OpenAPI v3.0 schemas are draft-4 style (boolean exclusiveMinimum).
    jsonschema.Draft4Validator(schema).validate(scaler)
    assert undeclared_fields(scaler["spec"], schema["properties"]["spec"], "spec") == []


def test_the_slo_autoscaler_names_the_worker_deployments(render: Render) -> None:
    objs = render_set(render, "pvc-token-advisory")
    (scaler,) = of_kind(objs, "SLOAutoscaler")
    spec = scaler["spec"]
    assert spec["prefill"] == {
        "deployment": deployment(objs, "prefill")["metadata"]["name"],
        "minReplicas": 2,
        "maxReplicas": 8,
    }
    assert spec["decode"] == {
        "deployment": deployment(objs, "decode")["metadata"]["name"],
        "minReplicas": 4,
        "maxReplicas": 32,
    }
    assert spec["slo"] == {"ttftP99Seconds": 1.5, "tpotP99Seconds": 0.08}
    assert (spec["mode"], spec["profile"], spec["intervalSeconds"]) == (
        "advisory",
        "llama-2-70b-tp4@h100-sxm",
        15,
    )
    # extraSpec passes the other knobs through as they are.
    assert (spec["headroom"], spec["gpuBudget"], spec["calibration"]) == (
        0.2,
        48,
        {"enabled": False},
    )
    assert spec["metrics"] == {
        "prometheusUrl": "http://prometheus.monitoring.svc:9090",
        "selector": 'namespace="llm",cluster="gpu-a"',
        "flavor": "sara",
    }


def test_the_metrics_selector_defaults_to_the_release_namespace(render: Render) -> None:
    (scaler,) = of_kind(render_set(render, "default"), "SLOAutoscaler")
    assert scaler["spec"]["metrics"]["selector"] == f'namespace="{NAMESPACE}"'
    assert not of_kind(render_set(render, "peering-cpu"), "SLOAutoscaler")


def test_torch_kv_transport_advertises_the_pod_ip_to_the_peers(render: Render) -> None:
    objs = render_set(render, "external-secret-custom-gpu")
    for pool in ("prefill", "decode"):
        c = container(deployment(objs, pool))
        args = c["args"]
        assert args[args.index("--kv-transport") + 1] == "torch"
        assert args[args.index("--advertise-host") + 1] == "$(POD_IP)"
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_container_command_is_one_the_sara_cli_accepts(render: Render, name: str) -> None:
    """The chart and the CLI must agree: each sara container's args parse with the real
    parser (a flag the CLI lacks exits with status 2)."""
    from cli.__main__ import build_parser

    parser = build_parser()
    checked = 0
    for dep in of_kind(render_set(render, name), "Deployment"):
        component = dep["metadata"]["labels"]["app.kubernetes.io/component"]
        if component not in ("operator", "router", "prefill", "decode"):
            continue
        args = [str(a) for a in container(dep)["args"]]
        parsed = parser.parse_args(args)
        assert parsed.func is not None, (component, args)
        checked += 1
    # With an engine's pools only the operator runs SARA.
    assert checked >= (1 if name == "vllm" else 3)


@pytest.mark.parametrize("path", sorted((CHART / "crds").glob("*.yaml")), ids=lambda p: p.name)
def test_every_crd_the_chart_ships_is_a_valid_kubernetes_object(path: Path) -> None:
    crd = yaml.safe_load(path.read_text(encoding="utf-8"))
    kubernetes_validate.validate(crd, KUBE_VERSION, strict=True)
    assert crd["metadata"]["name"] == f"{crd['spec']['names']['plural']}.{crd['spec']['group']}"
