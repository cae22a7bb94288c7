"""The operator, end to end: real kopf and the real Kubernetes client against kmock.

No cluster: ``ApiServer`` is kmock's Kubernetes emulator, served on a loopback port
from its own thread, with the API server's bookkeeping that kopf and optimistic
concurrency rely on added (resourceVersion, generation, uid, generateName, a 409 for
a stale resourceVersion, a 422 for a failed JSON-patch test). kopf runs embedded
(``kopf.operator`` with stop and ready flags) in another thread, standalone and with
cluster scanning disabled; the operator's runners talk to the emulator with the
official client, exactly as in a cluster.

The one edge that is scripted is the observation source: the tests decide what
Prometheus would report (Prometheus is not what is under test here); the test of the
``sara operator`` command runs the real Prometheus source with no Prometheus behind
it. Expected replica counts are computed independently with ``queueing.solver``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar, cast

import attrs
import httpx
import jsonpatch
import kmock
import kopf
import numpy as np
import pytest
from fastapi.testclient import TestClient
from kubernetes import client

from controller import crd
from controller.config import ConfigError, ControllerConfig, SloConfig
from controller.observation import Observation, PoolObservation
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
from queueing.lengths import LengthSamples
from queueing.pools import Pool
from queueing.solver import CapacityModel, KvLink, SloTargets, solve
from tests.cli.cli_runner import run_cli

T = TypeVar("T")
NAMESPACE = "llm"
NAME = "llama"
PREFILL, DECODE = "llama-prefill", "llama-decode"
DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
AUTOSCALERS = kmock.resource(crd.GROUP, crd.VERSION, crd.PLURAL)
INTERVAL_S = 0.3
DEADLINE_S = 20.0
TOKEN = "test-token"

rng = np.random.default_rng(5)
LENGTHS = LengthSamples(
    prompt_tokens=np.clip(rng.lognormal(np.log(800), 0.6, 600), 8, 6000).astype(np.int64),
    output_tokens=np.clip(rng.lognormal(np.log(150), 0.7, 600), 2, 1200).astype(np.int64),
    source="lognormal",
)


# -- the API server -----------------------------------------------------------------------


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """kmock's emulator plus the bookkeeping of a real API server.

    Each write gets a new ``metadata.resourceVersion``; a spec change bumps
    ``metadata.generation``; creation assigns ``uid``, ``creationTimestamp`` and a
    name from ``generateName``. A merge patch that names a resourceVersion other than
    the current one is refused with 409 Conflict, and a JSON patch whose ``test``
    fails with 422, as the API server does. (The emulator stores a write before the
    reactions answer it, so the bookkeeping goes into the request it stores.)
    """

    _versions: Iterator[int] = attrs.field(factory=lambda: itertools.count(1), init=False)

    async def _handle(self, request: kmock.Request) -> Any:
        # The request is kmock's record of what the client sent, and reactions match it by
        # identity, so the bookkeeping goes into its data in place.
        if request.resource is not None and request.action is kmock.action.CREATE:
            self._create(request.namespace, request.data)
        elif request.resource is not None and request.action is kmock.action.UPDATE:
            key = (request.resource, request.namespace, request.name or "")
            if key in self.objects and not self.objects[key].deleted:
                self._update(self.objects[key].raw, request.data, request.subresource)
        return await super()._handle(request)

    def _create(self, namespace: str | None, data: dict[str, Any]) -> None:
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta.setdefault("namespace", namespace)
        meta.update(
            uid=str(uuid.uuid4()),
            resourceVersion=self.next_version(),
            generation=1,
            creationTimestamp=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )

    def _update(self, current: Mapping[str, Any], patch: Any, subresource: str | None) -> None:
        meta = current.get("metadata", {})
        if isinstance(patch, list):  # JSON patch
            try:
                new = jsonpatch.apply_patch(dict(current), patch, in_place=False)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from exc
        else:  # merge patch
            wanted = (patch.get("metadata") or {}).get("resourceVersion")
            if wanted is not None and wanted != meta.get("resourceVersion"):
                raise kmock.KubernetesError(
                    status=409,
                    reason="Conflict",
                    message="the object has been modified; please apply your changes to "
                    "the latest version and try again",
                )
            new = _merged(copy.deepcopy(dict(current)), patch)
        generation = int(meta.get("generation", 1))
        if subresource is None and new.get("spec") != current.get("spec"):
            generation += 1
        stamp = {"resourceVersion": self.next_version(), "generation": generation}
        if isinstance(patch, list):
            patch.extend(
                {"op": "add", "path": f"/metadata/{key}", "value": value}
                for key, value in stamp.items()
            )
        else:
            patch.setdefault("metadata", {}).update(stamp)

    def next_version(self) -> str:
        return str(next(self._versions))


def _merged(target: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


class Cluster:
    """``ApiServer`` on 127.0.0.1, served from its own thread and event loop."""

    def __init__(self) -> None:
        started: concurrent.futures.Future[tuple[ApiServer, str, Any, asyncio.Event]] = (
            concurrent.futures.Future()
        )
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._serve(started),), daemon=True
        )
        self._thread.start()
        self.server, self.url, self._loop, self._stop = started.result(timeout=10)

    async def _serve(self, started: concurrent.futures.Future[Any]) -> None:
        stop = asyncio.Event()
        async with ApiServer() as server, kmock.Server(server) as http:
            info = kmock.ResourceInfo
            verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}
            server.resources["v1/namespaces"] = info(
                kind="Namespace", namespaced=False, verbs=verbs
            )
            server.resources["v1/events"] = info(kind="Event", namespaced=True, verbs=verbs)
            server.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = info(
                kind="CustomResourceDefinition", namespaced=False, verbs=verbs
            )
            server.resources[DEPLOYMENTS] = info(
                kind="Deployment", namespaced=True, verbs=verbs, subresources={"scale", "status"}
            )
            server.resources[AUTOSCALERS] = info(
                kind=crd.KIND,
                singular="sloautoscaler",
                shortnames={"sla"},
                namespaced=True,
                verbs=verbs,
                subresources={"status"},
            )
            # The scale subresource renders as an autoscaling/v1 Scale, as in a cluster.
            scale = (server**-1)[DEPLOYMENTS, kmock.subresource("scale")]
            scale[kmock.action.FETCH] << self._scale_of
            scale[kmock.action.UPDATE] << self._scale_of
            started.set_result(
                (server, str(http.url).rstrip("/"), asyncio.get_running_loop(), stop)
            )
            await stop.wait()

    def _scale_of(self, request: kmock.Request) -> dict[str, Any]:
        key = (DEPLOYMENTS, request.namespace, request.name or "")
        if key not in self.server.objects or self.server.objects[key].deleted:
            raise kmock.KubernetesObjectNotFoundError()
        stored = self.server.objects[key]
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {"name": request.name, "namespace": request.namespace},
            "spec": {"replicas": stored.raw["spec"].get("replicas", 0)},
            "status": {"replicas": stored.raw.get("status", {}).get("replicas", 0)},
        }

    def on_loop(self, function: Callable[[ApiServer], T]) -> T:
        async def call() -> T:
            return function(self.server)

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout=10)

    def requests(self, predicate: Callable[[kmock.Request], bool]) -> list[kmock.Request]:
        return self.on_loop(lambda server: [r for r in server if predicate(r)])

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)


# -- what Prometheus would say -------------------------------------------------------------


class ScriptedSource:
    """An observation source reporting a settable arrival rate, fresh or stale."""

    def __init__(self, rate_rps: float) -> None:
        self.rate_rps = rate_rps
        self.stale = False
        self.calls = 0
        self.specs: list[crd.AutoscalerSpec] = []

    def build(self, spec: crd.AutoscalerSpec) -> ScriptedSource:
        self.specs.append(spec)
        return self

    def observe(self, *, now_s: float, replicas: Mapping[Pool, PoolObservation]) -> Observation:
        self.calls += 1
        return Observation(
            time_s=now_s - 1000.0 if self.stale else now_s,
            prefill=replicas[Pool.PREFILL],
            decode=replicas[Pool.DECODE],
            arrival_rate_rps=self.rate_rps,
            burst_arrival_rate_rps=self.rate_rps,
            interarrival_scv=1.0,
            lengths=LENGTHS,
        )


def expected_replicas(
    rate_rps: float, ttft_p99_s: float, tpot_p99_s: float = 0.1
) -> tuple[int, int]:
    """The solver's answer on its own, for the load the scripted source reports."""
    model = CapacityModel.build(
        LENGTHS,
        resolve_profile("llama-3-8b@h100-sxm"),
        tpot_slo_s=tpot_p99_s,
        link=KvLink(bytes_per_s=400e9 / 8),
    )
    result = solve(
        model,
        arrival_rate_rps=rate_rps,
        ca2=1.0,
        slo=SloTargets(ttft_p99_s=ttft_p99_s, tpot_p99_s=tpot_p99_s),
        headroom=0.15,
    )
    return result.prefill_workers, result.decode_workers


# -- the operator, embedded -------------------------------------------------------------------


class Operator:
    """kopf running the operator's handlers in a thread, until ``close()``."""

    def __init__(self, cluster: Cluster, source: ScriptedSource) -> None:
        configuration = client.Configuration(host=cluster.url)
        configuration.retries = False
        self.runtime = OperatorRuntime(configuration=configuration, source_factory=source.build)
        self._stop = threading.Event()
        ready = threading.Event()
        operator = kopf.operator(
            registry=self.runtime.registry(),
            settings=self.runtime.settings(standalone=True),
            standalone=True,
            namespaces=[NAMESPACE],
            stop_flag=self._stop,
            ready_flag=ready,
        )
        self._thread = threading.Thread(target=asyncio.run, args=(operator,), daemon=True)
        self._thread.start()
        assert ready.wait(timeout=DEADLINE_S), "kopf did not start"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=DEADLINE_S)
        assert not self._thread.is_alive(), "kopf did not stop"
        self.runtime.close()


def spec(**overrides: Any) -> dict[str, Any]:
    """A spec that goes straight to the solver's answer: no smoothing, no dead band, no
    cooldowns, no step limit, so that each tick's targets are the solver's."""
    base: dict[str, Any] = {
        "prefill": {"deployment": PREFILL, "minReplicas": 1, "maxReplicas": 20},
        "decode": {"deployment": DECODE, "minReplicas": 1, "maxReplicas": 20},
        "slo": {"ttftP99Seconds": 2.0, "tpotP99Seconds": 0.1},
        "profile": "llama-3-8b@h100-sxm",
        "intervalSeconds": INTERVAL_S,
        "emaWeight": 1.0,
        "deadBand": 0.0,
        "maxStepFraction": 10.0,
        "scaleUpCooldownSeconds": 0,
        "scaleDownCooldownSeconds": 0,
        "scaleDownStabilisationSeconds": 0,
        "metrics": {
            "prometheusUrl": "http://prometheus.monitoring:9090",
            "selector": 'namespace="llm"',
        },
    }
    return _merged(base, overrides)


def deployment(name: str, replicas: int) -> client.V1Deployment:
    labels = {"app.kubernetes.io/name": name}
    return client.V1Deployment(
        api_version="apps/v1",
        kind="Deployment",
        metadata=client.V1ObjectMeta(name=name, namespace=NAMESPACE),
        spec=client.V1DeploymentSpec(
            replicas=replicas,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(containers=[client.V1Container(name="w", image="w:1")]),
            ),
        ),
    )


class Kube:
    """The test's own client: what `kubectl` would do and see."""

    def __init__(self, cluster: Cluster) -> None:
        configuration = client.Configuration(host=cluster.url)
        configuration.retries = False
        api_client = client.ApiClient(configuration)
        self.apps = client.AppsV1Api(api_client)
        self.objects = client.CustomObjectsApi(api_client)
        self.cluster = cluster

    def create(self, spec_: dict[str, Any]) -> None:
        body = {
            "apiVersion": crd.API_VERSION,
            "kind": crd.KIND,
            "metadata": {"name": NAME, "namespace": NAMESPACE},
            "spec": spec_,
        }
        self.objects.create_namespaced_custom_object(
            crd.GROUP, crd.VERSION, NAMESPACE, crd.PLURAL, body
        )

    def get(self) -> dict[str, Any]:
        found = self.objects.get_namespaced_custom_object(
            crd.GROUP, crd.VERSION, NAMESPACE, crd.PLURAL, NAME
        )
        return cast(dict[str, Any], found)

    def patch_spec(self, patch: dict[str, Any]) -> None:
        self.objects.patch_namespaced_custom_object(
            crd.GROUP, crd.VERSION, NAMESPACE, crd.PLURAL, NAME, {"spec": patch}
        )

    def delete(self) -> None:
        self.objects.delete_namespaced_custom_object(
            crd.GROUP, crd.VERSION, NAMESPACE, crd.PLURAL, NAME
        )

    def replicas(self) -> tuple[int, int]:
        prefill = self.apps.read_namespaced_deployment(PREFILL, NAMESPACE).spec
        decode = self.apps.read_namespaced_deployment(DECODE, NAMESPACE).spec
        assert prefill is not None and decode is not None
        return int(prefill.replicas or 0), int(decode.replicas or 0)

    def condition(self, kind: str, status: str | None = None) -> dict[str, Any] | None:
        """The status condition of this type (only if its status is ``status``, if given)."""
        for condition in self.get().get("status", {}).get("conditions", []):
            if condition["type"] == kind and status in (None, condition["status"]):
                return cast(dict[str, Any], condition)
        return None

    def events(self) -> list[dict[str, Any]]:
        posts = self.cluster.requests(
            lambda r: r.method == "POST" and r.url.path.endswith("/events")
        )
        return [r.data for r in posts if r.data["involvedObject"].get("name") == NAME]

    def scale_patches(self) -> int:
        return len(
            self.cluster.requests(lambda r: r.method == "PATCH" and r.url.path.endswith("/scale"))
        )

    def gone(self) -> bool:
        key = (AUTOSCALERS, NAMESPACE, NAME)
        return self.cluster.on_loop(lambda s: key not in s.objects or s.objects[key].deleted)


def eventually(check: Callable[[], T | None], what: str, deadline_s: float = DEADLINE_S) -> T:
    """Poll ``check`` until it returns something truthy (generous deadline, no timing)."""
    end = time.monotonic() + deadline_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"not within {deadline_s:g} s: {what} (last: {value!r})")
        time.sleep(0.05)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    emulated = Cluster()
    yield emulated
    emulated.close()


@pytest.fixture
def kube(cluster: Cluster) -> Kube:
    kube = Kube(cluster)
    kube.apps.create_namespaced_deployment(NAMESPACE, deployment(PREFILL, 1))
    kube.apps.create_namespaced_deployment(NAMESPACE, deployment(DECODE, 1))
    return kube


@pytest.fixture
def source() -> ScriptedSource:
    return ScriptedSource(rate_rps=120.0)


@pytest.fixture
def operator(cluster: Cluster, kube: Kube, source: ScriptedSource) -> Iterator[Operator]:
    running = Operator(cluster, source)
    yield running
    running.close()


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
    assert resource["spec"]["metrics"] == spec()["metrics"]
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


def runner_for(kube: Kube, source: ScriptedSource) -> AutoscalerRunner:
    return AutoscalerRunner(
        namespace=NAMESPACE,
        name=NAME,
        api_client=kube.objects.api_client,
        source_factory=source.build,
        wall_clock=lambda: datetime(2025, 1, 1, tzinfo=UTC),
    )


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


def _race(cluster: Cluster, change: dict[str, Any]) -> None:
    """The next read of the resource sees it as it was; a write lands right after."""
    key = (AUTOSCALERS, NAMESPACE, NAME)

    fired = threading.Event()

    def read_then_write(server: ApiServer) -> None:
        def reaction(request: kmock.Request) -> dict[str, Any]:
            if fired.is_set():
                return dict(server.objects[key].raw)  # spent: answer as the emulator does
            fired.set()
            seen = copy.deepcopy(server.objects[key].raw)
            meta = seen["metadata"]
            server.objects[key].patch(
                _merged(change, {"metadata": {"resourceVersion": server.next_version()}})
            )
            assert meta["resourceVersion"] != server.objects[key].raw["metadata"]["resourceVersion"]
            return seen

        # (Not a [:1] slice: kmock counts the requests a filter saw before it was set.)
        server[kmock.action.FETCH, AUTOSCALERS, kmock.name(NAME)] << reaction

    cluster.on_loop(read_then_write)


def test_a_concurrent_spec_change_between_read_and_write_is_a_conflict(
    store: CustomResourceConfigStore, kube: Kube
) -> None:
    read = store.load()
    _race(kube.cluster, {"spec": {"headroom": 0.3}})
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
    _race(kube.cluster, {"status": {"observedGeneration": 1}})
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


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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

    source.rate_rps = 40.0
    restarted = runner_for(kube, source)  # a new operator process: nothing in memory
    outcome = restarted.tick(kube.get())
    # The EMA carries on from 120 (a fresh loop would start at 40), and the scale-down
    # cooldown started by the first process still holds (a fresh loop has none).
    assert outcome.status["arrivalRateRps"] == pytest.approx(0.5 * 120.0 + 0.5 * 40.0)
    assert kube.replicas() == scaled


def test_an_unreadable_policy_state_starts_fresh(kube: Kube, source: ScriptedSource) -> None:
    kube.create(spec(emaWeight=0.5))
    runner_for(kube, source).tick(kube.get())
    body = kube.get()
    body["status"]["policyState"] = "{not json"
    source.rate_rps = 40.0
    outcome = runner_for(kube, source).tick(body)
    assert outcome.status["arrivalRateRps"] == pytest.approx(40.0)
