"""Any scalable kind as a pool: a StatefulSet and custom resources with a scale
subresource, against kmock's Kubernetes emulator through the real client.

The emulator serves the discovery documents of the kinds declared below (as an API
server does for installed CRDs) and merges a PATCH of ``.../NAME/scale`` into the
object; a low-priority reaction renders the scale subresource as an
``autoscaling/v1`` ``Scale``, as the API server does from a CRD's
``subresources.scale`` paths.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator
from typing import Any

import kmock
import pytest
from kubernetes import client

from controller.actuator import ActuatorError
from controller.actuators.kubernetes import KubernetesActuator
from controller.crd import ScaleTargetRef
from controller.observation import PoolObservation
from queueing.pools import Pool

NAMESPACE = "llm"
STATEFULSETS = kmock.resource("apps", "v1", "statefulsets")
# LeaderWorkerSet (sigs.k8s.io/lws): a group of pods per replica, with a scale subresource.
LWS = kmock.resource("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
# An engine operator's own kind that reports running replicas but no ready ones.
ENGINE = kmock.resource("serving.example.com", "v1alpha1", "enginepools")
# A kind without a scale subresource.
CACHES = kmock.resource("serving.example.com", "v1alpha1", "kvcaches")
KINDS = {
    STATEFULSETS: ("StatefulSet", {"scale", "status"}),
    LWS: ("LeaderWorkerSet", {"scale", "status"}),
    ENGINE: ("EnginePool", {"scale", "status"}),
    CACHES: ("KVCache", {"status"}),
}


class Cluster:
    def __init__(self) -> None:
        started: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(started),))
        self._thread.daemon = True
        self._thread.start()
        self.emulator, self.url, self._loop, self._stop = started.result(timeout=10)

    async def _serve(self, started: concurrent.futures.Future[Any]) -> None:
        stop = asyncio.Event()
        async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
            verbs = {"get", "list", "watch", "create", "patch", "update"}
            for resource, (kind, subresources) in KINDS.items():
                emulator.resources[resource] = kmock.ResourceInfo(
                    kind=kind, namespaced=True, verbs=verbs, subresources=subresources
                )
                if "scale" in subresources:
                    scale = (emulator**-1)[resource, kmock.subresource("scale")]
                    scale[kmock.action.FETCH] << self._scale_of(resource)
                    scale[kmock.action.UPDATE] << self._scale_of(resource)
            url = str(server.url).rstrip("/")
            started.set_result((emulator, url, asyncio.get_running_loop(), stop))
            await stop.wait()

    def _scale_of(self, resource: kmock.resource) -> Any:
        def render(request: kmock.Request) -> dict[str, Any]:
            key = (resource, request.namespace, request.name or "")
            if key not in self.emulator.objects or self.emulator.objects[key].deleted:
                raise kmock.KubernetesObjectNotFoundError()
            raw = self.emulator.objects[key].raw
            return {
                "apiVersion": "autoscaling/v1",
                "kind": "Scale",
                "metadata": {"name": request.name, "namespace": request.namespace},
                "spec": {"replicas": raw["spec"].get("replicas", 0)},
                "status": {"replicas": raw.get("status", {}).get("replicas", 0)},
            }

        return render

    def requests(self, method: str) -> list[kmock.Request]:
        async def call() -> list[kmock.Request]:
            return [r for r in self.emulator if r.method == method]

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout=10)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    emulated = Cluster()
    yield emulated
    emulated.close()


@pytest.fixture
def objects(cluster: Cluster) -> client.CustomObjectsApi:
    configuration = client.Configuration(host=cluster.url)
    configuration.retries = False
    api = client.CustomObjectsApi(client.ApiClient(configuration))
    for (group, version, plural), name, replicas, status in (
        (("apps", "v1", "statefulsets"), "decode", 2, {"replicas": 2, "readyReplicas": 1}),
        (("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"), "prefill", 3, {}),
        (("serving.example.com", "v1alpha1", "enginepools"), "decode-pool", 4, {"replicas": 3}),
        (("serving.example.com", "v1alpha1", "kvcaches"), "cache", 1, {}),
    ):
        body = {
            "apiVersion": f"{group}/{version}",
            "kind": "Object",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"replicas": replicas},
        }
        api.create_namespaced_custom_object(group, version, NAMESPACE, plural, body)
        if status:
            api.patch_namespaced_custom_object_status(
                group, version, NAMESPACE, plural, name, {"status": status}
            )
    return api


def actuator(cluster: Cluster, targets: dict[Pool, ScaleTargetRef]) -> KubernetesActuator:
    configuration = client.Configuration(host=cluster.url)
    configuration.retries = False
    apps = client.AppsV1Api(client.ApiClient(configuration))
    return KubernetesActuator(
        namespace=NAMESPACE, targets=targets, api=apps, retries=0, sleep=lambda _: None
    )


STATEFULSET = ScaleTargetRef(api_version="apps/v1", kind="StatefulSet", name="decode")
LEADER_WORKER_SET = ScaleTargetRef(
    api_version="leaderworkerset.x-k8s.io/v1", kind="LeaderWorkerSet", name="prefill"
)
ENGINE_POOL = ScaleTargetRef(
    api_version="serving.example.com/v1alpha1", kind="EnginePool", name="decode-pool"
)


def test_a_statefulset_and_a_leaderworkerset_are_read_and_scaled_through_their_scale(
    cluster: Cluster, objects: client.CustomObjectsApi
) -> None:
    scaler = actuator(cluster, {Pool.PREFILL: LEADER_WORKER_SET, Pool.DECODE: STATEFULSET})
    assert scaler.observe(Pool.DECODE) == PoolObservation(current_replicas=2, ready_replicas=1)
    # No readyReplicas reported yet, and the scale says none is running.
    assert scaler.observe(Pool.PREFILL) == PoolObservation(current_replicas=3, ready_replicas=0)
    scaler.scale(Pool.DECODE, 5)
    scaler.scale(Pool.PREFILL, 1)
    paths = [r.url.path for r in cluster.requests("PATCH")]
    assert paths[-2:] == [
        f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/decode/scale",
        f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NAMESPACE}/leaderworkersets/prefill/scale",
    ]
    statefulset = objects.get_namespaced_custom_object(
        "apps", "v1", NAMESPACE, "statefulsets", "decode"
    )
    assert statefulset["spec"]["replicas"] == 5
    assert scaler.observe(Pool.PREFILL).current_replicas == 1
    # The plural came from the group's discovery document, read once.
    discovery = [r for r in cluster.requests("GET") if r.url.path.count("/") == 3]
    assert [r.url.path for r in discovery] == ["/apis/leaderworkerset.x-k8s.io/v1"]


def test_a_kind_without_ready_replicas_counts_the_running_ones_of_its_scale(
    cluster: Cluster, objects: client.CustomObjectsApi
) -> None:
    scaler = actuator(cluster, {Pool.DECODE: ENGINE_POOL})
    assert scaler.observe(Pool.DECODE) == PoolObservation(current_replicas=4, ready_replicas=3)
    scaler.scale(Pool.DECODE, 6)
    pool = objects.get_namespaced_custom_object(
        "serving.example.com", "v1alpha1", NAMESPACE, "enginepools", "decode-pool"
    )
    assert pool["spec"]["replicas"] == 6


def test_a_kind_without_a_scale_subresource_or_unknown_to_the_server_is_refused_by_name(
    cluster: Cluster, objects: client.CustomObjectsApi
) -> None:
    cache = ScaleTargetRef(api_version="serving.example.com/v1alpha1", kind="KVCache", name="c")
    with pytest.raises(ActuatorError, match=r"kind KVCache of serving\.example\.com/v1alpha1 has"):
        actuator(cluster, {Pool.DECODE: cache}).observe(Pool.DECODE)
    missing = ScaleTargetRef(api_version="serving.example.com/v1alpha1", kind="Nope", name="x")
    with pytest.raises(ActuatorError, match=r"serves no kind Nope in serving\.example\.com/"):
        actuator(cluster, {Pool.DECODE: missing}).scale(Pool.DECODE, 2)


def test_a_missing_object_names_its_kind_and_a_forbidden_one_the_rule_it_needs(
    cluster: Cluster, objects: client.CustomObjectsApi
) -> None:
    gone = ScaleTargetRef(api_version="apps/v1", kind="StatefulSet", name="gone")
    with pytest.raises(
        ActuatorError, match=f"StatefulSet {NAMESPACE}/gone .decode pool. not found"
    ):
        actuator(cluster, {Pool.DECODE: gone}).observe(Pool.DECODE)

    async def forbid() -> None:
        patches = cluster.emulator[kmock.action.UPDATE, LWS, kmock.subresource("scale")]
        patches << kmock.KubernetesError(status=403, reason="Forbidden", message="no")

    asyncio.run_coroutine_threadsafe(forbid(), cluster._loop).result(timeout=10)
    with pytest.raises(
        ActuatorError, match=r"'patch leaderworkersets.leaderworkerset.x-k8s.io/scale'"
    ):
        actuator(cluster, {Pool.PREFILL: LEADER_WORKER_SET}).scale(Pool.PREFILL, 2)
