"""The Kubernetes actuator against kmock's Kubernetes emulator, through the real client.

No cluster: ``kmock.KubernetesEmulator`` serves the apps/v1 Deployments API on a
loopback port from its own thread and event loop, and the official ``kubernetes``
client talks HTTP to it. The emulator keeps Deployments in memory and merges a PATCH
of ``.../deployments/NAME/scale`` into the Deployment, which is what the real scale
subresource does to ``spec.replicas``; two low-priority reactions render that
subresource as an ``autoscaling/v1`` ``Scale`` (the emulator alone would answer with
the whole Deployment). Failures are scripted with kmock reactions that answer a
Kubernetes ``Status`` error. One emulator quirk: it records a PATCH in its store even
when a scripted reaction answers it with an error, so the tests count the requests
rather than read the store to prove that a failed attempt was retried.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import kmock
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kubernetes import client

from controller.actuator import Actuator, ActuatorError, ActuatorRetryableError
from controller.actuators.kubernetes import KubernetesActuator, backoff_delays_s
from controller.observation import PoolObservation
from queueing.pools import Pool

T = TypeVar("T")
NAMESPACE = "sara"
DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
NAMES = {Pool.PREFILL: "sara-prefill", Pool.DECODE: "sara-decode"}


class EmulatedCluster:
    """A Kubernetes API on 127.0.0.1: kmock's emulator served from a thread."""

    def __init__(self) -> None:
        self._started: concurrent.futures.Future[
            tuple[kmock.KubernetesEmulator, str, asyncio.AbstractEventLoop, asyncio.Event]
        ] = concurrent.futures.Future()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)
        self._thread.start()
        self._emulator, self.url, self._loop, self._stop = self._started.result(timeout=10)

    async def _serve(self) -> None:
        stop = asyncio.Event()
        async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
            low = emulator**-1  # below scripted faults, above the emulator's own fallbacks
            scale = low[DEPLOYMENTS, kmock.subresource("scale")]
            scale[kmock.action.FETCH] << self._scale_of
            scale[kmock.action.UPDATE] << self._scale_of
            url = str(server.url).rstrip("/")
            self._started.set_result((emulator, url, asyncio.get_running_loop(), stop))
            await stop.wait()

    def _scale_of(self, request: kmock.Request) -> dict[str, Any]:
        key = (DEPLOYMENTS, request.namespace, request.name or "")
        if key not in self._emulator.objects or self._emulator.objects[key].deleted:
            raise kmock.KubernetesObjectNotFoundError()
        deployment = self._emulator.objects[key].raw
        labels = deployment["spec"]["selector"]["matchLabels"]
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {"name": request.name, "namespace": request.namespace},
            "spec": {"replicas": deployment["spec"].get("replicas", 0)},
            "status": {
                "replicas": deployment.get("status", {}).get("replicas", 0),
                "selector": ",".join(f"{k}={v}" for k, v in labels.items()),
            },
        }

    def on_loop(self, function: Callable[[kmock.KubernetesEmulator], T]) -> T:
        """Run ``function(emulator)`` on the emulator's loop (its state is not thread-safe)."""

        async def call() -> T:
            return function(self._emulator)

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout=10)

    def requests(self, method: str) -> list[kmock.Request]:
        return self.on_loop(lambda e: [r for r in e if r.method == method])

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)


def apps_api(host: str) -> client.AppsV1Api:
    configuration = client.Configuration(host=host)
    configuration.retries = False  # the actuator owns retrying
    return client.AppsV1Api(client.ApiClient(configuration))


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
                spec=client.V1PodSpec(
                    containers=[client.V1Container(name="worker", image="sara-worker:test")]
                ),
            ),
        ),
    )


@pytest.fixture
def cluster() -> Iterator[EmulatedCluster]:
    emulated = EmulatedCluster()
    yield emulated
    emulated.close()


@pytest.fixture
def api(cluster: EmulatedCluster) -> client.AppsV1Api:
    """The client, with the two pools' Deployments created through it."""
    apps = apps_api(cluster.url)
    apps.create_namespaced_deployment(NAMESPACE, deployment(NAMES[Pool.PREFILL], 2))
    apps.create_namespaced_deployment(NAMESPACE, deployment(NAMES[Pool.DECODE], 3))
    return apps


class Sleeps(list[float]):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def actuator(
    api: client.AppsV1Api, sleeps: Sleeps | None = None, **options: Any
) -> KubernetesActuator:
    return KubernetesActuator(
        namespace=NAMESPACE,
        deployments=NAMES,
        api=api,
        sleep=sleeps if sleeps is not None else Sleeps(),
        **options,
    )


def conflict() -> kmock.KubernetesError:
    return kmock.KubernetesError(
        status=409,
        reason="Conflict",
        message="Operation cannot be fulfilled: the object has been modified",
    )


def scale_patches(cluster: EmulatedCluster) -> kmock.View:
    return cluster.on_loop(
        lambda e: e[kmock.action.UPDATE, DEPLOYMENTS, kmock.subresource("scale")]
    )


def test_observe_reads_the_scale_and_the_ready_replicas(
    cluster: EmulatedCluster, api: client.AppsV1Api
) -> None:
    api.patch_namespaced_deployment_status(
        NAMES[Pool.DECODE], NAMESPACE, {"status": {"replicas": 3, "readyReplicas": 2}}
    )
    scaler: Actuator = actuator(api)  # statically: it is an Actuator
    assert scaler.observe(Pool.DECODE) == PoolObservation(current_replicas=3, ready_replicas=2)
    # A Deployment whose pods never became ready has no readyReplicas at all.
    assert scaler.observe(Pool.PREFILL) == PoolObservation(current_replicas=2, ready_replicas=0)
    paths = [r.url.path for r in cluster.requests("GET")]
    assert f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/sara-decode/scale" in paths


def test_scale_patches_the_scale_subresource_and_the_deployment_follows(
    cluster: EmulatedCluster, api: client.AppsV1Api
) -> None:
    scaler = actuator(api)
    scaler.scale(Pool.PREFILL, 5)
    (patch,) = cluster.requests("PATCH")
    assert patch.url.path == f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/sara-prefill/scale"
    assert patch.data == {"spec": {"replicas": 5}}
    assert api.read_namespaced_deployment(NAMES[Pool.PREFILL], NAMESPACE).spec.replicas == 5
    stored = cluster.on_loop(lambda e: e.objects[DEPLOYMENTS, NAMESPACE, "sara-prefill"].raw)
    assert stored["spec"]["replicas"] == 5
    assert scaler.observe(Pool.PREFILL).current_replicas == 5
    assert api.read_namespaced_deployment(NAMES[Pool.DECODE], NAMESPACE).spec.replicas == 3


def test_scaling_to_zero_and_back_is_allowed(api: client.AppsV1Api) -> None:
    scaler = actuator(api)
    scaler.scale(Pool.DECODE, 0)
    assert scaler.observe(Pool.DECODE).current_replicas == 0
    scaler.scale(Pool.DECODE, 1)
    assert scaler.observe(Pool.DECODE).current_replicas == 1


@pytest.mark.parametrize("pool", list(Pool))
def test_a_missing_deployment_is_a_permanent_error_naming_it(
    cluster: EmulatedCluster, pool: Pool
) -> None:
    scaler = actuator(apps_api(cluster.url))  # nothing created
    for attempt in (lambda: scaler.observe(pool), lambda: scaler.scale(pool, 2)):
        with pytest.raises(ActuatorError) as caught:
            attempt()
        assert type(caught.value) is ActuatorError
        assert f"Deployment {NAMESPACE}/{NAMES[pool]}" in str(caught.value)
        assert "not found" in str(caught.value)
    assert len(cluster.requests("GET")) == 1  # neither is retried
    assert len(cluster.requests("PATCH")) == 1


def test_a_conflict_is_retried_with_backoff_and_then_succeeds(
    cluster: EmulatedCluster, api: client.AppsV1Api
) -> None:
    cluster.on_loop(lambda e: scale_patches_view(e)[:2] << conflict())
    sleeps = Sleeps()
    actuator(api, sleeps, backoff_s=0.1, max_backoff_s=1.0).scale(Pool.DECODE, 6)
    assert sleeps == [0.1, 0.2]
    assert len(scale_patches(cluster)) == 3
    assert api.read_namespaced_deployment(NAMES[Pool.DECODE], NAMESPACE).spec.replicas == 6


@pytest.mark.parametrize(("status", "reason"), [(429, "TooManyRequests"), (500, "InternalError")])
def test_throttling_and_server_errors_are_retried(
    cluster: EmulatedCluster, api: client.AppsV1Api, status: int, reason: str
) -> None:
    error = kmock.KubernetesError(status=status, reason=reason, message="try again")
    cluster.on_loop(lambda e: scale_patches_view(e)[:1] << error)
    sleeps = Sleeps()
    actuator(api, sleeps).scale(Pool.PREFILL, 4)
    assert sleeps == [0.2]
    assert api.read_namespaced_deployment(NAMES[Pool.PREFILL], NAMESPACE).spec.replicas == 4


def test_persistent_server_errors_raise_a_retryable_error_after_the_configured_retries(
    cluster: EmulatedCluster, api: client.AppsV1Api
) -> None:
    unavailable = kmock.KubernetesError(
        status=503, reason="ServiceUnavailable", message="etcdserver: leader changed"
    )
    cluster.on_loop(lambda e: scale_patches_view(e) << unavailable)
    sleeps = Sleeps()
    scaler = actuator(api, sleeps, retries=4, backoff_s=0.2, max_backoff_s=1.0)
    with pytest.raises(ActuatorRetryableError) as caught:
        scaler.scale(Pool.PREFILL, 7)
    assert sleeps == [0.2, 0.4, 0.8, 1.0]  # doubling, capped
    assert len(scale_patches(cluster)) == 5
    message = str(caught.value)
    assert "503" in message and "leader changed" in message and "5 attempts" in message
    assert f"{NAMESPACE}/{NAMES[Pool.PREFILL]}" in message


def test_reads_are_retried_too(cluster: EmulatedCluster, api: client.AppsV1Api) -> None:
    error = kmock.KubernetesError(status=502, reason="BadGateway", message="proxy")
    cluster.on_loop(
        lambda e: e[kmock.action.FETCH, DEPLOYMENTS, kmock.subresource("scale")][:1] << error
    )
    sleeps = Sleeps()
    assert actuator(api, sleeps).observe(Pool.PREFILL).current_replicas == 2
    assert sleeps == [0.2]


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (403, "needs RBAC permission 'patch deployments/scale' in namespace sara"),
        (401, "unauthenticated"),
        (422, "HTTP 422"),
    ],
)
def test_authorisation_and_validation_failures_are_permanent_and_say_what_is_missing(
    cluster: EmulatedCluster, api: client.AppsV1Api, status: int, expected: str
) -> None:
    error = kmock.KubernetesError(status=status, reason="Denied", message="no")
    cluster.on_loop(lambda e: scale_patches_view(e) << error)
    sleeps = Sleeps()
    with pytest.raises(ActuatorError) as caught:
        actuator(api, sleeps).scale(Pool.DECODE, 2)
    assert type(caught.value) is ActuatorError
    assert expected in str(caught.value)
    assert sleeps == []


def test_a_forbidden_read_names_the_read_permission(
    cluster: EmulatedCluster, api: client.AppsV1Api
) -> None:
    error = kmock.KubernetesError(status=403, reason="Forbidden", message="no")
    read_scale = (kmock.action.FETCH, DEPLOYMENTS, kmock.subresource("scale"))
    cluster.on_loop(lambda e: e[read_scale][kmock.name("sara-decode")] << error)
    with pytest.raises(ActuatorError, match="'get deployments/scale'"):
        actuator(api).observe(Pool.DECODE)


def test_a_slow_api_server_times_out_and_is_retried(
    cluster: EmulatedCluster, api: client.AppsV1Api
) -> None:
    slow = cluster.on_loop(lambda e: scale_patches_view(e)[:1] << (lambda: asyncio.sleep(2.0)))
    sleeps = Sleeps()
    actuator(api, sleeps, request_timeout_s=0.3).scale(Pool.PREFILL, 3)
    assert sleeps == [0.2]
    assert len(cluster.on_loop(lambda e: list(slow))) == 1


def test_an_unreachable_api_server_is_a_retryable_error() -> None:
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sleeps = Sleeps()
    scaler = actuator(apps_api(f"http://127.0.0.1:{port}"), sleeps, retries=2)
    with pytest.raises(ActuatorRetryableError, match="3 attempts"):
        scaler.observe(Pool.PREFILL)
    assert sleeps == [0.2, 0.4]


def scale_patches_view(emulator: kmock.KubernetesEmulator) -> Any:
    return emulator[kmock.action.UPDATE, DEPLOYMENTS, kmock.subresource("scale")]


@pytest.fixture
def kubeconfig(cluster: EmulatedCluster, tmp_path: Path) -> Path:
    """A kubeconfig file whose current context is the emulated cluster."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: emulated\n"
        f"clusters:\n- name: emulated\n  cluster:\n    server: {cluster.url}\n"
        "users:\n- name: tester\n  user:\n    token: not-a-secret\n"
        "contexts:\n- name: emulated\n  context:\n    cluster: emulated\n    user: tester\n"
    )
    return path


def test_from_environment_loads_a_kubeconfig_and_talks_to_its_server(
    cluster: EmulatedCluster, api: client.AppsV1Api, kubeconfig: Path
) -> None:
    scaler = KubernetesActuator.from_environment(
        namespace=NAMESPACE, deployments=NAMES, kubeconfig=kubeconfig
    )
    scaler.scale(Pool.DECODE, 8)
    assert scaler.observe(Pool.DECODE).current_replicas == 8
    (patch,) = cluster.requests("PATCH")
    assert patch.headers.get("Authorization") == "Bearer not-a-secret"


def test_outside_a_cluster_from_environment_falls_back_to_the_default_kubeconfig(
    cluster: EmulatedCluster,
    api: client.AppsV1Api,
    kubeconfig: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    scaler = KubernetesActuator.from_environment(namespace=NAMESPACE, deployments=NAMES)
    assert scaler.observe(Pool.PREFILL).current_replicas == 2


def test_from_environment_makes_one_request_per_attempt_even_when_reads_time_out(
    cluster: EmulatedCluster, api: client.AppsV1Api, kubeconfig: Path
) -> None:
    # The client's urllib3 pool would retry a timed-out GET 3 times inside one attempt.
    read_scale = (kmock.action.FETCH, DEPLOYMENTS, kmock.subresource("scale"))
    cluster.on_loop(lambda e: e[read_scale] << (lambda: asyncio.sleep(2.0)))
    sleeps = Sleeps()
    scaler = KubernetesActuator.from_environment(
        namespace=NAMESPACE,
        deployments=NAMES,
        kubeconfig=kubeconfig,
        retries=1,
        request_timeout_s=0.2,
        sleep=sleeps,
    )
    with pytest.raises(ActuatorRetryableError, match="2 attempts"):
        scaler.observe(Pool.PREFILL)
    assert sleeps == [0.2]
    assert len(cluster.on_loop(lambda e: list(e[read_scale]))) == 2


def test_from_environment_without_credentials_is_a_permanent_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-kubeconfig"
    with pytest.raises(ActuatorError, match="no-kubeconfig"):
        KubernetesActuator.from_environment(
            namespace=NAMESPACE, deployments=NAMES, kubeconfig=missing
        )


def test_a_pool_without_a_deployment_and_a_negative_target_are_rejected(
    api: client.AppsV1Api,
) -> None:
    scaler = KubernetesActuator(
        namespace=NAMESPACE, deployments={Pool.PREFILL: "sara-prefill"}, api=api
    )
    with pytest.raises(ActuatorError, match="decode pool"):
        scaler.scale(Pool.DECODE, 1)
    bad_targets: list[Any] = [-1, True, 1.5]
    for bad in bad_targets:
        with pytest.raises(ValueError, match="replicas"):
            scaler.scale(Pool.PREFILL, bad)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"namespace": ""}, "namespace"),
        ({"deployments": {}}, "deployments"),
        ({"deployments": {Pool.PREFILL: ""}}, "deployments[prefill]"),
        ({"retries": -1}, "retries"),
        ({"backoff_s": 0.0}, "backoff_s"),
        ({"max_backoff_s": float("inf")}, "max_backoff_s"),
        ({"request_timeout_s": -1.0}, "request_timeout_s"),
    ],
)
def test_invalid_options_are_rejected_naming_the_field(options: dict[str, Any], field: str) -> None:
    arguments: dict[str, Any] = {"namespace": NAMESPACE, "deployments": NAMES, "api": object()}
    with pytest.raises(ValueError, match=field.replace("[", "\\[").replace("]", "\\]")):
        KubernetesActuator(**{**arguments, **options})


@given(
    retries=st.integers(min_value=0, max_value=30),
    backoff_s=st.floats(min_value=1e-3, max_value=10.0),
    max_backoff_s=st.floats(min_value=1e-3, max_value=60.0),
)
def test_the_backoff_doubles_until_its_cap_and_never_exceeds_it(
    retries: int, backoff_s: float, max_backoff_s: float
) -> None:
    delays = backoff_delays_s(retries, backoff_s, max_backoff_s)
    assert len(delays) == retries
    assert all(0 < d <= max_backoff_s for d in delays)
    assert all(b == min(2 * a, max_backoff_s) for a, b in itertools.pairwise(delays))
    if delays:
        assert delays[0] == min(backoff_s, max_backoff_s)
