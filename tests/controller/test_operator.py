"""The operator, end to end: real kopf and the real Kubernetes client against kmock.

The harness (``tests.controller.operator_harness``: the emulated API server, kopf
embedded, the scripted observation source) and its fixtures (``conftest.py``) are
apart, so that this file reads as the tests.
The test of the ``sara operator`` command runs the real Prometheus source with no
Prometheus behind it. Expected worker counts are computed independently of the
controller's solve path: a scan over worker counts of the model's predicted P99s
(``queueing.solver.evaluate_pool``) against the SLOs / (1 + headroom).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from kubernetes import client

from controller import crd
from controller.config import ConfigError, ControllerConfig, SloConfig
from controller.operator import (
    AutoscalerRunner,
    CustomResourceConfigStore,
    OperatorRuntime,
    ResourceUnavailableError,
    create_operator_app,
    prometheus_source,
)
from controller.store import VersionConflictError, config_version
from queueing.catalog import resolve_profile
from queueing.pools import Pool
from queueing.solver import CapacityModel, KvLink, evaluate_pool
from tests.cli.cli_runner import run_cli
from tests.controller.operator_harness import (
    HEADROOM,
    INTERVAL_S,
    KV_LINK_GBPS,
    LENGTHS,
    NAME,
    NAMESPACE,
    PREFILL,
    PROFILE,
    TOKEN,
    Cluster,
    Kube,
    Operator,
    ScriptedSource,
    eventually,
    free_port,
    race,
    runner_for,
    spec,
)


def expected_replicas(
    rate_rps: float, ttft_p99_s: float, tpot_p99_s: float = 0.1
) -> tuple[int, int]:
    """The fewest workers of each pool whose predicted P99 meets its SLO / (1 + headroom)
    at the scripted load, found by trying 1, 2, 3, ... workers (not the solver's search).

    The scripted source reports Poisson arrivals (SCV 1) and no observed P99s, so
    calibration has nothing to correct; the spec turns smoothing, the dead band, the
    cooldowns and the step limit off, so a tick's targets are these counts.
    """
    model = CapacityModel.build(
        LENGTHS,
        resolve_profile(PROFILE),
        tpot_slo_s=tpot_p99_s,
        link=KvLink(bytes_per_s=KV_LINK_GBPS * 1e9 / 8),
    )
    targets = {Pool.PREFILL: ttft_p99_s, Pool.DECODE: tpot_p99_s}

    def fewest(pool: Pool, ca2: float) -> int:
        for workers in itertools.count(1):
            prediction = evaluate_pool(
                model,
                pool,
                workers=workers,
                arrival_rate_rps=rate_rps,
                ca2=ca2,
                target_s=targets[pool] / (1.0 + HEADROOM),
            )
            if prediction.meets_slo:
                return workers
            assert workers < 1000, f"{pool.value}: no worker count meets the SLO"
        raise AssertionError("unreachable")

    prefill = fewest(Pool.PREFILL, 1.0)
    # The decode pool's arrivals are the prefill pool's departures.
    decode_ca2 = model.arrival_scv(
        Pool.DECODE, prefill_workers=prefill, arrival_rate_rps=rate_rps, ca2=1.0
    )
    return prefill, fewest(Pool.DECODE, decode_ca2)


# -- scenarios ------------------------------------------------------------------------------


def test_creating_a_resource_scales_both_deployments_to_the_solvers_answer(
    operator: Operator, kube: Kube, source: ScriptedSource
) -> None:
    expected = expected_replicas(120.0, ttft_p99_s=2.0)
    assert expected > (1, 1)
    kube.create(spec())
    eventually(lambda: kube.replicas() == expected, f"Deployments at {expected}")
    # ... through the scale subresource, with the spec's metrics wired to the source.
    assert kube.scale_patches() >= 1
    assert source.specs[0].metrics == crd.MetricsSpec(
        prometheus_url="http://prometheus.monitoring:9090", selector='namespace="llm"'
    )
    status = eventually(
        lambda: (
            (s := kube.get().get("status", {})).get("prefill", {}).get("currentReplicas")
            == expected[0]
            and s
        ),
        "the status to show the new replicas",
    )
    assert status["prefill"]["desiredReplicas"] == expected[0]
    assert status["decode"] == {"currentReplicas": expected[1], "desiredReplicas": expected[1]}
    assert status["arrivalRateRps"] == pytest.approx(120.0)
    assert status["observedGeneration"] == 1
    ready = kube.condition("Ready")
    assert ready is not None and (ready["status"], ready["reason"]) == ("True", "Decided")
    stale = kube.condition("MetricsStale")
    assert stale is not None and stale["status"] == "False"
    scaled = eventually(
        lambda: [e for e in kube.events() if e["reason"] == "ScaledUp"], "ScaledUp events"
    )
    assert {e["message"].split(":")[0] for e in scaled} == {"prefill pool", "decode pool"}
    assert all(e["type"] == "Normal" for e in scaled)


def test_a_statefulset_and_a_custom_scalable_kind_are_scaled_like_deployments(
    operator: Operator, kube: Kube
) -> None:
    expected = expected_replicas(120.0, ttft_p99_s=2.0)
    for (group, version, plural), name in (
        (("serving.example.com", "v1alpha1", "enginepools"), "prefill-engines"),
        (("apps", "v1", "statefulsets"), "decode-set"),
    ):
        kube.objects.create_namespaced_custom_object(
            group,
            version,
            NAMESPACE,
            plural,
            {
                "apiVersion": f"{group}/{version}",
                "kind": "Object",
                "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"replicas": 1},
            },
        )
    kube.create(
        spec(
            prefill={
                "deployment": None,
                "scaleTargetRef": {
                    "apiVersion": "serving.example.com/v1alpha1",
                    "kind": "EnginePool",
                    "name": "prefill-engines",
                },
            },
            decode={
                "deployment": None,
                "scaleTargetRef": {
                    "apiVersion": "apps/v1",
                    "kind": "StatefulSet",
                    "name": "decode-set",
                },
            },
        )
    )

    def replicas() -> tuple[int, int]:
        pools = kube.objects.get_namespaced_custom_object(
            "serving.example.com", "v1alpha1", NAMESPACE, "enginepools", "prefill-engines"
        )
        sets = kube.objects.get_namespaced_custom_object(
            "apps", "v1", NAMESPACE, "statefulsets", "decode-set"
        )
        return int(pools["spec"]["replicas"]), int(sets["spec"]["replicas"])

    eventually(lambda: replicas() == expected, f"EnginePool and StatefulSet at {expected}")
    assert kube.replicas() == (1, 1)  # the Deployments are not this resource's pools


def test_a_tighter_slo_re_decides_with_more_replicas(operator: Operator, kube: Kube) -> None:
    before = expected_replicas(120.0, ttft_p99_s=2.0)
    after = expected_replicas(120.0, ttft_p99_s=0.2)
    assert after[0] > before[0]
    kube.create(spec())
    eventually(lambda: kube.replicas() == before, f"Deployments at {before}")
    kube.patch_spec({"slo": {"ttftP99Seconds": 0.2}})
    eventually(lambda: kube.replicas() == after, f"Deployments at {after} after the SLO change")
    eventually(
        lambda: kube.get()["status"].get("observedGeneration") == 2,
        "the status to report the new generation",
    )


def test_stale_metrics_set_metrics_stale_and_never_scale_down(
    operator: Operator, kube: Kube, source: ScriptedSource
) -> None:
    busy = expected_replicas(120.0, ttft_p99_s=2.0)
    quiet = expected_replicas(20.0, ttft_p99_s=2.0)
    assert quiet < busy  # what a fresh measurement of the low rate would lead to
    kube.create(spec())
    eventually(lambda: kube.replicas() == busy, f"Deployments at {busy}")
    source.stale = True
    source.rate_rps = 20.0
    condition = eventually(
        lambda: kube.condition("MetricsStale", "True"),
        "MetricsStale=True",
    )
    assert condition["reason"] == "MetricsStale" and "old" in condition["message"]
    patches, calls = kube.scale_patches(), source.calls
    eventually(lambda: source.calls >= calls + 5, "five more ticks on stale metrics")
    assert kube.replicas() == busy
    assert kube.scale_patches() == patches
    warnings = [e for e in kube.events() if e["type"] == "Warning"]
    assert "MetricsStale" in {e["reason"] for e in warnings}
    # The same low rate, measured fresh again, does scale down: the hold was the staleness.
    source.stale = False
    eventually(lambda: kube.replicas() == quiet, f"Deployments at {quiet} on fresh metrics")
    fresh = eventually(
        lambda: kube.condition("MetricsStale", "False"),
        "MetricsStale=False",
    )
    assert fresh["reason"] == "MetricsFresh"


def test_deleting_the_resource_stops_its_loop(
    operator: Operator, kube: Kube, source: ScriptedSource
) -> None:
    expected = expected_replicas(120.0, ttft_p99_s=2.0)
    kube.create(spec())
    eventually(lambda: kube.replicas() == expected, f"Deployments at {expected}")
    assert kube.get()["metadata"]["finalizers"] == ["sara.io/operator"]
    kube.delete()
    eventually(kube.gone, "the resource to be released by the operator and removed")
    assert operator.runtime.get(NAMESPACE, NAME) is None
    calls = source.calls
    writes = len(kube.cluster.requests(lambda r: r.method == "PATCH"))
    time.sleep(10 * INTERVAL_S)
    assert source.calls == calls, "a tick ran after the resource was deleted"
    assert len(kube.cluster.requests(lambda r: r.method == "PATCH")) == writes
    # Someone scaling by hand afterwards is left alone.
    kube.apps.patch_namespaced_deployment_scale(PREFILL, NAMESPACE, {"spec": {"replicas": 9}})
    time.sleep(5 * INTERVAL_S)
    assert kube.replicas()[0] == 9


def test_a_rest_patch_changes_the_spec_and_the_next_decision_follows_it(
    operator: Operator, kube: Kube
) -> None:
    before = expected_replicas(120.0, ttft_p99_s=2.0)
    after = expected_replicas(120.0, ttft_p99_s=0.15)
    assert after[0] > before[0]
    kube.create(spec())
    eventually(lambda: kube.replicas() == before, f"Deployments at {before}")
    api = TestClient(
        create_operator_app(operator.runtime, resource=(NAMESPACE, NAME), api_token=TOKEN)
    )
    shown = api.get("/v1/config")
    assert shown.status_code == 200
    assert shown.json() == crd.parse_spec(spec()).config.to_dict()
    etag = shown.headers["etag"]
    headers = {
        "Authorization": f"Bearer {TOKEN}",
        "Content-Type": "application/merge-patch+json",
    }
    patched = api.patch(
        "/v1/config", headers={**headers, "If-Match": etag}, json={"slo": {"ttft_p99_s": 0.15}}
    )
    assert patched.status_code == 200, patched.text
    assert patched.json()["slo"]["ttft_p99_s"] == 0.15
    resource = kube.get()
    assert resource["spec"]["slo"] == {"ttftP99Seconds": 0.15, "tpotP99Seconds": 0.1}
    assert resource["spec"]["prefill"]["deployment"] == PREFILL  # the targets stay
    # The metrics object keeps its targets; the knobs beside them are written out.
    assert resource["spec"]["metrics"].items() >= spec()["metrics"].items()
    eventually(lambda: kube.replicas() == after, f"Deployments at {after} after the REST edit")
    # The old ETag no longer matches: refused, and the spec stays as it is.
    stale = api.patch(
        "/v1/config", headers={**headers, "If-Match": etag}, json={"slo": {"ttft_p99_s": 1.0}}
    )
    assert stale.status_code == 409
    assert kube.get()["spec"]["slo"]["ttftP99Seconds"] == 0.15
    assert api.get("/v1/status").json()["resource"] == f"{NAMESPACE}/{NAME}"
    assert api.get("/readyz").status_code == 200


def test_an_invalid_spec_is_reported_and_nothing_is_scaled(
    operator: Operator, kube: Kube, source: ScriptedSource
) -> None:
    # The emulator runs no CEL rules, like an API server older than 1.25.
    kube.create(spec(prefill={"minReplicas": 5, "maxReplicas": 3}))
    ready = eventually(
        lambda: kube.condition("Ready", "False"),
        "Ready=False",
    )
    assert ready["reason"] == "InvalidSpec"
    assert ready["message"].startswith("spec.prefill.minReplicas: 5 > maxReplicas 3")
    warnings = eventually(
        lambda: [e for e in kube.events() if e["reason"] == "InvalidSpec"], "an InvalidSpec event"
    )
    assert warnings[0]["type"] == "Warning"
    assert kube.replicas() == (1, 1) and kube.scale_patches() == 0 and source.calls == 0
    # Fixed, it runs.
    kube.patch_spec({"prefill": {"minReplicas": 1, "maxReplicas": 20}})
    expected = expected_replicas(120.0, ttft_p99_s=2.0)
    eventually(lambda: kube.replicas() == expected, f"Deployments at {expected} once fixed")


# -- one tick, without kopf -------------------------------------------------------------------


def test_a_tpot_target_below_one_decode_step_is_reported_as_infeasible(
    kube: Kube, source: ScriptedSource
) -> None:
    kube.create(spec(slo={"tpotP99Seconds": 0.0001}))
    outcome = runner_for(kube, source).tick(kube.get())
    ready = {c["type"]: c for c in outcome.status["conditions"]}["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "SLOInfeasible")
    infeasible = kube.condition("SLOInfeasible", "True")
    assert infeasible is not None and "cannot be met" in infeasible["message"]
    assert kube.replicas() == (1, 1)


def test_a_missing_deployment_makes_ready_false_naming_it(
    kube: Kube, source: ScriptedSource
) -> None:
    kube.create(spec(decode={"deployment": "no-such-decode"}))
    outcome = runner_for(kube, source).tick(kube.get())
    assert outcome.record is not None and outcome.record.decision is None
    ready = kube.condition("Ready", "False")
    assert ready is not None and ready["reason"] == "ActuatorError"
    assert "Deployment llm/no-such-decode" in ready["message"] and "not found" in ready["message"]
    assert [n.type for n in outcome.notices if n.reason == "ActuatorError"] == [
        crd.EventType.WARNING
    ]
    assert kube.scale_patches() == 0


# -- the config store over the spec, without kopf ------------------------------------------


@pytest.fixture
def store(kube: Kube) -> CustomResourceConfigStore:
    kube.create(spec())
    return CustomResourceConfigStore(api=kube.objects, namespace=NAMESPACE, name=NAME)


def test_the_store_reads_the_config_from_the_spec(store: CustomResourceConfigStore) -> None:
    current = store.load()
    assert current.config == crd.parse_spec(spec()).config
    assert current.version == config_version(current.config)


def test_a_stale_expected_version_is_a_conflict_and_nothing_is_written(
    store: CustomResourceConfigStore, kube: Kube
) -> None:
    read = store.load()
    kube.patch_spec({"headroom": 0.3})  # someone else's edit
    tighter = read.config.merged({"slo": {"ttft_p99_s": 0.5}})
    patches = len(kube.cluster.requests(lambda r: r.method == "PATCH"))
    with pytest.raises(VersionConflictError):
        store.replace(tighter, expected_version=read.version)
    assert len(kube.cluster.requests(lambda r: r.method == "PATCH")) == patches
    assert kube.get()["spec"]["slo"]["ttftP99Seconds"] == 2.0


def test_a_concurrent_spec_change_between_read_and_write_is_a_conflict(
    store: CustomResourceConfigStore, kube: Kube
) -> None:
    read = store.load()
    race(kube.cluster, {"spec": {"headroom": 0.3}})
    with pytest.raises(VersionConflictError):
        store.replace(
            read.config.merged({"slo": {"ttft_p99_s": 0.5}}), expected_version=read.version
        )
    refused = kube.cluster.requests(lambda r: r.method == "PATCH")
    assert refused, "the write was attempted with the resourceVersion it read"
    assert kube.get()["spec"]["headroom"] == 0.3
    assert kube.get()["spec"]["slo"]["ttftP99Seconds"] == 2.0


def test_a_status_update_between_read_and_write_does_not_lose_the_edit(
    store: CustomResourceConfigStore, kube: Kube
) -> None:
    read = store.load()
    race(kube.cluster, {"status": {"observedGeneration": 1}})
    written = store.replace(
        read.config.merged({"slo": {"ttft_p99_s": 0.5}}), expected_version=read.version
    )
    assert written.config.slo.ttft_p99_s == 0.5
    assert kube.get()["spec"]["slo"]["ttftP99Seconds"] == 0.5
    # The first write was refused (409: stale resourceVersion), the second landed.
    assert len(kube.cluster.requests(lambda r: r.method == "PATCH")) == 2


def test_a_budget_removed_through_the_store_is_removed_from_the_spec(
    kube: Kube,
) -> None:
    kube.create(spec(gpuBudget=12))
    store = CustomResourceConfigStore(api=kube.objects, namespace=NAMESPACE, name=NAME)
    read = store.load()
    assert read.config.gpu_budget == 12
    store.replace(read.config.merged({"gpu_budget": None}), expected_version=read.version)
    assert "gpuBudget" not in kube.get()["spec"]


def test_a_missing_resource_is_unavailable_and_the_api_answers_503(kube: Kube) -> None:
    store = CustomResourceConfigStore(api=kube.objects, namespace=NAMESPACE, name="nobody")
    with pytest.raises(ResourceUnavailableError, match=r"SLOAutoscaler llm/nobody.*404"):
        store.load()
    runtime = OperatorRuntime(configuration=kube.objects.api_client.configuration)
    api = TestClient(create_operator_app(runtime, resource=(NAMESPACE, "nobody"), api_token=TOKEN))
    answer = api.get("/v1/config")
    assert answer.status_code == 503 and "llm/nobody" in answer.json()["detail"]
    runtime.close()


def test_without_a_named_resource_the_api_needs_exactly_one(kube: Kube) -> None:
    runtime = OperatorRuntime(configuration=kube.objects.api_client.configuration)
    api = TestClient(create_operator_app(runtime, api_token=TOKEN))
    none = api.get("/v1/config")
    assert none.status_code == 503 and "--api-resource" in none.json()["detail"]
    assert api.get("/readyz").status_code == 503  # kopf has not started
    runtime.close()


def test_a_profile_file_cannot_be_put_into_a_spec(
    store: CustomResourceConfigStore, kube: Kube
) -> None:
    read = store.load()
    with pytest.raises(ConfigError, match=r"^profile: must be a built-in profile"):
        store.replace(
            ControllerConfig(profile="/etc/sara/profile.json", slo=SloConfig()),
            expected_version=read.version,
        )


# -- the production adapters ----------------------------------------------------------------


def test_the_production_source_queries_with_the_specs_selector_and_windows() -> None:
    parsed = crd.parse_spec(spec(windowSeconds=45, burstWindowSeconds=3))
    source = prometheus_source(parsed)
    try:
        queries = source.queries  # type: ignore[attr-defined]
        assert queries["arrival_rate_rps"] == (
            'sum(rate(sara_requests_total{namespace="llm"}[45s]))'
        )
        assert queries["burst_arrival_rate_rps"].endswith("[3s]))")
    finally:
        source.close()  # type: ignore[attr-defined]


def test_kopf_logs_in_with_the_clients_credentials() -> None:
    from controller.operator import connection_info

    configuration = client.Configuration(host="https://k8s.example:6443")
    configuration.api_key = {"BearerToken": "abc"}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    configuration.verify_ssl = True
    info = connection_info(configuration)
    assert (info.server, info.scheme, info.token, info.insecure) == (
        "https://k8s.example:6443",
        "Bearer",
        "abc",
        False,
    )


# -- the command ------------------------------------------------------------------------------


def test_sara_operator_runs_loops_serves_the_api_and_stops_on_sigterm(
    cluster: Cluster, kube: Kube, tmp_path: Path
) -> None:
    # No Prometheus answers at the spec's URL: the loop must hold and say the metrics are stale.
    nobody = f"http://127.0.0.1:{free_port()}"
    kube.create(spec(metrics={"prometheusUrl": nobody, "selector": ""}))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: emulated\n"
        f"clusters:\n- name: emulated\n  cluster:\n    server: {cluster.url}\n"
        "users:\n- name: operator\n  user:\n    token: operator-token\n"
        "contexts:\n- name: emulated\n  context:\n    cluster: emulated\n    user: operator\n"
    )
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    command = [
        sys.executable,
        "-c",
        "from cli.__main__ import main; raise SystemExit(main())",
        "operator",
        "--standalone",
        "--namespace",
        NAMESPACE,
        "--kubeconfig",
        str(kubeconfig),
        "--api-listen",
        f"127.0.0.1:{port}",
        "--api-token-file",
        str(token_file),
    ]
    env = {k: v for k, v in os.environ.items() if k != "SARA_API_TOKEN"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    api = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            try:
                return httpx.get(f"{api}/readyz", timeout=2).status_code == 200
            except httpx.TransportError:
                assert process.poll() is None, process.stdout.read() if process.stdout else ""
                return False

        eventually(ready, "the operator's API to be ready", deadline_s=60)
        stale = eventually(
            lambda: kube.condition("MetricsStale", "True"),
            "MetricsStale=True without Prometheus",
        )
        assert "arrival rate is None" in stale["message"]
        assert kube.replicas() == (1, 1)
        shown = httpx.get(f"{api}/v1/config", timeout=5)
        assert shown.json()["slo"] == {"ttft_p99_s": 2.0, "tpot_p99_s": 0.1}
        changed = httpx.patch(
            f"{api}/v1/config",
            headers={
                "Authorization": f"Bearer {TOKEN}",
                "Content-Type": "application/merge-patch+json",
            },
            content=json.dumps({"mode": "advisory"}),
            timeout=5,
        )
        assert changed.status_code == 200, changed.text
        assert kube.get()["spec"]["mode"] == "advisory"
        # kopf logged in with the kubeconfig's credentials.
        watches = kube.cluster.requests(lambda r: r.params.get("watch") == "true")
        assert watches and watches[0].headers.get("Authorization") == "Bearer operator-token"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
    assert process.returncode == 0, output


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--namespace: name the namespaces to serve"),
        (["--namespace", NAMESPACE, "--standalone", "--peering", "p"], "--peering: --standalone"),
        (
            ["--namespace", NAMESPACE, "--api-resource", "llm/x"],
            "--api-resource: needs --api-listen",
        ),
        (
            ["--namespace", NAMESPACE, "--api-listen", ":8080", "--api-resource", "other/x"],
            "--api-resource: namespace 'other' is not served",
        ),
        (["--namespace", NAMESPACE, "--api-listen", "8080"], "--api-listen: expected HOST:PORT"),
        (["--namespace", "Not_A_Namespace"], "--namespace: not a namespace name"),
        (["--namespace", NAMESPACE, "--liveness", "8081"], "--liveness: expected a URL"),
    ],
)
def test_bad_arguments_are_usage_errors_that_name_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _, err = run_cli(capsys, "operator", *argv)
    assert code == 2
    assert err.startswith(f"sara: {message}")


def test_a_restarted_operator_resumes_the_loops_memory_from_the_status(
    kube: Kube, source: ScriptedSource
) -> None:
    kube.create(spec(emaWeight=0.5, scaleDownCooldownSeconds=600))
    first = runner_for(kube, source)
    first.tick(kube.get())  # 120 req/s: the EMA starts there, both pools scale up
    scaled = kube.replicas()
    assert scaled == expected_replicas(120.0, ttft_p99_s=2.0)
    assert json.loads(kube.get()["status"]["policyState"])["smoothed_rate_rps"] == 120.0
    first.close()

    changed_at = {
        pool: json.loads(kube.get()["status"]["policyState"])[pool]["last_change_s"]
        for pool in ("prefill", "decode")
    }
    # A small drop, within the window's counting noise: smoothed, not taken as a shift.
    source.rate_rps = 116.0
    restarted = runner_for(kube, source)  # a new operator process: nothing in memory
    outcome = restarted.tick(kube.get())
    # The EMA carries on from 120 (a fresh loop would start at 116), and the pools'
    # last changes, which start their cooldowns, are the first process's.
    assert outcome.status["arrivalRateRps"] == pytest.approx(0.5 * 120.0 + 0.5 * 116.0)
    resumed = json.loads(kube.get()["status"]["policyState"])
    assert {pool: resumed[pool]["last_change_s"] for pool in changed_at} == changed_at
    assert kube.replicas() == scaled


def test_an_unreadable_policy_state_starts_fresh(kube: Kube, source: ScriptedSource) -> None:
    kube.create(spec(emaWeight=0.5))
    runner_for(kube, source).tick(kube.get())
    body = kube.get()
    body["status"]["policyState"] = "{not json"
    source.rate_rps = 40.0
    outcome = runner_for(kube, source).tick(body)
    assert outcome.status["arrivalRateRps"] == pytest.approx(40.0)


class _RampWithHistory(ScriptedSource):
    """A source that keeps history, as Prometheus does: ``arrival_history`` answers a
    ``query_range`` of the arrival rate, here of a linear ramp over the last
    ``ramp_s`` (each step's value is the mean rate over the window ending there, the
    ramp's value at the window's middle). The calls are recorded."""

    def __init__(self, *, now_s: float, start_rps: float, slope_rps_per_s: float) -> None:
        super().__init__(rate_rps=0.0)
        self.now_s = now_s
        self.start_rps = start_rps
        self.slope = slope_rps_per_s
        self.ramp_s = 600.0
        self.history_calls: list[tuple[float, float, float]] = []

    def rate_at(self, t_s: float) -> float:
        return self.start_rps + self.slope * (t_s - (self.now_s - self.ramp_s))

    def arrival_history(
        self, *, start_s: float, end_s: float, step_s: float
    ) -> list[tuple[float, float]]:
        self.history_calls.append((start_s, end_s, step_s))
        first = max(start_s, self.now_s - self.ramp_s + step_s)
        ends = np.arange(end_s, first - 1e-9, -step_s)[::-1]
        return [(float(t), self.rate_at(float(t) - step_s / 2)) for t in ends]


def test_the_operator_warm_starts_the_forecaster_from_the_sources_history(kube: Kube) -> None:
    # A fresh operator whose source keeps history: its loop asks for the last day at
    # the measurement window's step before its first tick, so the forecaster's trend
    # is there at once. On a linear ramp the least-squares line through the window
    # means is exact, so the forecast is the ramp's value a lead time ahead (the
    # start-up prior plus one tick: no start-up measured yet).
    now_s = 1_000_000.0
    window_s = 30.0
    source = _RampWithHistory(now_s=now_s, start_rps=20.0, slope_rps_per_s=0.1)
    source.rate_rps = source.rate_at(now_s - window_s / 2)  # this window's mean
    kube.create(spec(forecast={"enabled": True}))
    runner = AutoscalerRunner(
        namespace=NAMESPACE,
        name=NAME,
        api_client=kube.objects.api_client,
        source_factory=source.build,
        clock=lambda: now_s,
    )
    outcome = runner.tick(kube.get())
    config = ControllerConfig()
    (start_s, end_s, step_s), *_ = source.history_calls
    assert step_s == window_s and end_s == now_s
    assert now_s - start_s >= config.forecast.period_s  # a day: the cycle's history too
    assert outcome.record is not None and outcome.record.decision is not None
    lead_s = config.lead_time.startup_prior_s + INTERVAL_S
    forecast = outcome.record.decision.forecast_rate_rps
    assert forecast == pytest.approx(source.rate_at(now_s + lead_s), rel=1e-6)
    assert forecast > source.rate_rps
    runner.close()


def test_a_new_metrics_binding_warm_starts_the_forecaster_again(kube: Kube) -> None:
    # Another Prometheus (or selector) is another series: the record of the old one
    # is dropped and the new source's history read, before the next tick plans on it.
    now_s = 1_000_000.0
    old = _RampWithHistory(now_s=now_s, start_rps=20.0, slope_rps_per_s=0.1)
    new = _RampWithHistory(now_s=now_s, start_rps=60.0, slope_rps_per_s=0.05)
    for s in (old, new):
        s.rate_rps = s.rate_at(now_s - 15.0)
    sources = iter((old, new))
    kube.create(spec(forecast={"enabled": True}))
    runner = AutoscalerRunner(
        namespace=NAMESPACE,
        name=NAME,
        api_client=kube.objects.api_client,
        source_factory=lambda spec_: next(sources).build(spec_),
        clock=lambda: now_s,
    )
    runner.tick(kube.get())
    kube.patch_spec({"metrics": {"prometheusUrl": "http://other-prometheus.monitoring:9090"}})
    outcome = runner.tick(kube.get())
    assert len(new.history_calls) == 1
    assert outcome.record is not None and outcome.record.decision is not None
    lead_s = ControllerConfig().lead_time.startup_prior_s + INTERVAL_S
    assert outcome.record.decision.forecast_rate_rps == pytest.approx(
        new.rate_at(now_s + lead_s), rel=1e-6
    )
    runner.close()
