"""The operator's test harness: an emulated API server, kopf embedded, a scripted source.

No cluster: ``ApiServer`` is kmock's Kubernetes emulator, served on a loopback port
from its own thread, with the API server's bookkeeping that kopf and optimistic
concurrency rely on added (resourceVersion, generation, uid, generateName, a 409 for
a stale resourceVersion, a 422 for a failed JSON-patch test). kopf runs embedded
(``kopf.operator`` with stop and ready flags) in another thread, standalone and with
cluster scanning disabled; the operator's runners talk to the emulator with the
official client, exactly as in a cluster.

The one edge that is scripted is the observation source: the tests decide what
Prometheus would report (Prometheus is not what is under test here).

The fixtures over these (``cluster``, ``kube``, ``source``, ``operator``) are in
``tests/controller/conftest.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import itertools
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar, cast

import attrs
import jsonpatch
import kmock
import kopf
import numpy as np
from kubernetes import client

from controller import crd
from controller.observation import Observation, PoolObservation
from controller.operator import AutoscalerRunner, OperatorRuntime
from queueing.lengths import LengthSamples
from queueing.pools import Pool

T = TypeVar("T")
NAMESPACE = "llm"
NAME = "llama"
PREFILL, DECODE = "llama-prefill", "llama-decode"
DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
# Pools of other kinds: a StatefulSet and an engine operator's kind, both scalable.
STATEFULSETS = kmock.resource("apps", "v1", "statefulsets")
ENGINE_POOLS = kmock.resource("serving.example.com", "v1alpha1", "enginepools")
SCALABLE = (DEPLOYMENTS, STATEFULSETS, ENGINE_POOLS)
AUTOSCALERS = kmock.resource(crd.GROUP, crd.VERSION, crd.PLURAL)
INTERVAL_S = 0.3
# What the spec() below writes out rather than leaving to the controller's defaults, so
# that the tests' expected worker counts follow from the spec, not from copied defaults.
PROFILE = "llama-3-8b@h100-sxm"
HEADROOM = 0.15
KV_LINK_GBPS = 400.0
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
            for resource, kind in zip(
                SCALABLE, ("Deployment", "StatefulSet", "EnginePool"), strict=True
            ):
                server.resources[resource] = info(
                    kind=kind, namespaced=True, verbs=verbs, subresources={"scale", "status"}
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
            for resource in SCALABLE:
                scale = (server**-1)[resource, kmock.subresource("scale")]
                scale[kmock.action.FETCH] << self._scale_of
                scale[kmock.action.UPDATE] << self._scale_of
            started.set_result(
                (server, str(http.url).rstrip("/"), asyncio.get_running_loop(), stop)
            )
            await stop.wait()

    def _scale_of(self, request: kmock.Request) -> dict[str, Any]:
        key = (request.resource, request.namespace, request.name or "")
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
        "profile": PROFILE,
        "headroom": HEADROOM,
        "kvLinkGbps": KV_LINK_GBPS,
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


# -- one tick, without kopf; ports ------------------------------------------------------


def runner_for(kube: Kube, source: ScriptedSource) -> AutoscalerRunner:
    return AutoscalerRunner(
        namespace=NAMESPACE,
        name=NAME,
        api_client=kube.objects.api_client,
        source_factory=source.build,
        wall_clock=lambda: datetime(2025, 1, 1, tzinfo=UTC),
    )


def race(cluster: Cluster, change: dict[str, Any]) -> None:
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


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
