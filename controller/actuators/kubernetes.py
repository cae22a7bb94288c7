"""Kubernetes resources as pools, scaled through their ``scale`` subresource.

A pool is any namespaced resource with a ``scale`` subresource (``ScaleTargetRef``:
apiVersion, kind, name, as an HPA names its target): a Deployment, a StatefulSet, a
LeaderWorkerSet, an engine operator's own kind. ``observe`` reads the scale
(``spec.replicas``: what the pool is set to) and the resource
(``status.readyReplicas``: how many serve; the scale's ``status.replicas`` for a kind
that does not report ready replicas); ``scale`` patches the scale subresource, the
same call ``kubectl scale`` and the HPA make, so the controller needs no write access
to the resource itself. The resource's plural name comes from the API server's
discovery document of its group version (built-in for the apps/v1 kinds), which also
says whether the kind has a scale subresource at all.

Failures, as ``controller.actuator`` defines them: 409 Conflict, 429 Too Many
Requests, 5xx, timeouts and broken connections are retried here with capped
exponential backoff (``retries`` times), then raise ``ActuatorRetryableError``;
404, 401, 403 and other 4xx raise ``ActuatorError`` at once, naming the resource
and, for 403, the RBAC permission that is missing. Every call carries a timeout.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from controller.actuator import ActuatorError, ActuatorRetryableError
from controller.crd.spec import ScaleTargetRef
from controller.observation import PoolObservation
from queueing.pools import Pool

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETRYABLE_STATUSES = frozenset({409, 429})  # and every 5xx
# The plurals of the built-in scalable kinds (no discovery request needed for these).
KNOWN_PLURALS: dict[tuple[str, str], str] = {
    ("apps", "Deployment"): "deployments",
    ("apps", "StatefulSet"): "statefulsets",
    ("apps", "ReplicaSet"): "replicasets",
}

# The client's config loaders are unannotated: give them the types they are used with.
_load_incluster_config: Callable[..., None] = config.load_incluster_config
_load_kube_config: Callable[..., None] = config.load_kube_config


def backoff_delays_s(retries: int, backoff_s: float, max_backoff_s: float) -> list[float]:
    """The sleeps between attempts: ``backoff_s`` doubling each time, capped at the maximum."""
    return [min(backoff_s * 2.0**attempt, max_backoff_s) for attempt in range(retries)]


def load_client_configuration(
    kubeconfig: str | os.PathLike[str] | None = None, context: str | None = None
) -> client.Configuration:
    """Credentials from where the process runs: ``kubeconfig`` (a path, with
    ``context``) if given, else the pod's service account in a cluster, else
    ``$KUBECONFIG`` / ``~/.kube/config``. ``ActuatorError`` naming what was tried when
    none loads. The global client configuration is left untouched.
    """
    configuration = client.Configuration()
    try:
        if kubeconfig is None:
            try:
                _load_incluster_config(client_configuration=configuration)
            except config.ConfigException:  # not in a cluster
                # The client reads $KUBECONFIG once, at import: read it now instead.
                _load_kube_config(
                    config_file=os.environ.get("KUBECONFIG") or None,
                    context=context,
                    client_configuration=configuration,
                )
        else:
            _load_kube_config(
                config_file=os.fspath(kubeconfig),
                context=context,
                client_configuration=configuration,
            )
    except (config.ConfigException, OSError) as exc:
        where = (
            f"kubeconfig {os.fspath(kubeconfig)}"
            if kubeconfig is not None
            else "the in-cluster service account or the default kubeconfig"
        )
        raise ActuatorError(f"no Kubernetes credentials from {where}: {exc}") from exc
    # urllib3 would otherwise retry a timed-out GET three more times inside one
    # attempt; the retry policy (and its backoff) lives in one place: _call.
    configuration.retries = False
    return configuration


@dataclass(frozen=True, kw_only=True)
class _Call:
    """What one API call is for, for the error messages."""

    pool: Pool
    namespace: str
    kind: str
    name: str
    action: str  # "read the scale of", "scale", ...
    permission: str  # the RBAC rule it needs, e.g. "patch deployments/scale"

    @property
    def target(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name} ({self.pool.value} pool)"


def _api_message(exc: ApiException) -> str:
    """The API server's own explanation (the Status ``message``), else the HTTP reason."""
    try:
        message = json.loads(exc.body or "").get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message or exc.reason or "no details")


def _classify(exc: Exception, call: _Call) -> ActuatorError:
    if not isinstance(exc, ApiException):  # urllib3: timeout, refused or reset connection
        return ActuatorRetryableError(f"cannot {call.action} {call.target}: {exc}")
    status = int(exc.status or 0)
    detail = f"HTTP {status}: {_api_message(exc)}"
    if status == 404:
        return ActuatorError(
            f"{call.target} not found ({detail}): create it, or fix the namespace or the "
            f"{call.kind} name in the controller's configuration"
        )
    if status == 401:
        return ActuatorError(
            f"cannot {call.action} {call.target}: unauthenticated ({detail}); check the "
            "service account token or the kubeconfig credentials"
        )
    if status == 403:
        return ActuatorError(
            f"cannot {call.action} {call.target}: forbidden ({detail}); the controller's "
            f"service account needs RBAC permission '{call.permission}' in namespace "
            f"{call.namespace}"
        )
    if status == 0 or status in RETRYABLE_STATUSES or status >= 500:  # 0: TLS/transport
        return ActuatorRetryableError(f"cannot {call.action} {call.target}: {detail}")
    return ActuatorError(f"cannot {call.action} {call.target}: {detail}")


def _at(document: Any, *keys: str) -> Any:
    """A field of a JSON object from the API, ``None`` where any level is missing."""
    for key in keys:
        if not isinstance(document, dict):
            return None
        document = document.get(key)
    return document


def _count(value: Any) -> int:
    """A replica count from the API (``None`` when the field is unset, which means 0)."""
    return 0 if value is None else int(value)


@dataclass(frozen=True, kw_only=True)
class _Resource:
    """A scale target resolved to its REST path: group, version and plural."""

    target: ScaleTargetRef
    plural: str

    @property
    def rule(self) -> str:
        """The resource as an RBAC rule names it (``statefulsets``, ``lws.x-k8s.io``...)."""
        group = self.target.group
        return self.plural if group == "apps" else f"{self.plural}.{group}"


class KubernetesActuator:
    """Scales one resource per pool in one namespace through its scale subresource.

    ``targets`` names each pool's resource; ``deployments`` (a name per pool) is the
    short form for apps/v1 Deployments. ``api`` defaults to an ``AppsV1Api`` on the
    client's default configuration (its ``api_client`` serves every kind); use
    ``from_environment`` to load in-cluster or kubeconfig credentials. A call is tried
    ``retries + 1`` times at most, sleeping ``backoff_delays_s(...)`` in between
    (``sleep`` is injectable); each attempt times out after ``request_timeout_s``.
    """

    def __init__(
        self,
        *,
        namespace: str,
        deployments: Mapping[Pool, str] | None = None,
        targets: Mapping[Pool, ScaleTargetRef] | None = None,
        api: client.AppsV1Api | None = None,
        retries: int = 5,
        backoff_s: float = 0.2,
        max_backoff_s: float = 2.0,
        request_timeout_s: float = 10.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"namespace: must be a non-empty string, got {namespace!r}")
        if (deployments is None) == (targets is None):
            raise ValueError("targets: give exactly one of deployments and targets")
        if deployments is not None:
            if not deployments:
                raise ValueError("deployments: must name at least one pool's Deployment")
            for pool, name in deployments.items():
                if not isinstance(pool, Pool):
                    raise ValueError(f"deployments: keys must be Pool members, got {pool!r}")
                if not isinstance(name, str) or not name:
                    raise ValueError(f"deployments[{pool.value}]: must be a non-empty name")
            targets = {pool: ScaleTargetRef.deployment(name) for pool, name in deployments.items()}
        assert targets is not None
        for pool, target in targets.items():
            if not isinstance(pool, Pool):
                raise ValueError(f"targets: keys must be Pool members, got {pool!r}")
            if not isinstance(target, ScaleTargetRef):
                raise ValueError(f"targets[{pool.value}]: must be a ScaleTargetRef, got {target!r}")
        if not targets:
            raise ValueError("targets: must name at least one pool's resource")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries: must be an integer >= 0, got {retries!r}")
        for field, value in (
            ("backoff_s", backoff_s),
            ("max_backoff_s", max_backoff_s),
            ("request_timeout_s", request_timeout_s),
        ):
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{field}: must be a finite number > 0, got {value!r}")
        self._namespace = namespace
        self._targets = dict(targets)
        self._api = api if api is not None else client.AppsV1Api()
        self._objects = client.CustomObjectsApi(self._api.api_client)
        self._resolved: dict[Pool, _Resource] = {}
        self._delays_s = backoff_delays_s(retries, backoff_s, max_backoff_s)
        self._timeout_s = float(request_timeout_s)
        self._sleep = sleep

    @classmethod
    def from_environment(
        cls,
        *,
        namespace: str,
        deployments: Mapping[Pool, str] | None = None,
        targets: Mapping[Pool, ScaleTargetRef] | None = None,
        kubeconfig: str | os.PathLike[str] | None = None,
        context: str | None = None,
        retries: int = 5,
        backoff_s: float = 0.2,
        max_backoff_s: float = 2.0,
        request_timeout_s: float = 10.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> KubernetesActuator:
        """An actuator with credentials from where it runs.

        With ``kubeconfig`` (a path), that file (and ``context``); otherwise the pod's
        service account when running in a cluster, else the default kubeconfig
        (``$KUBECONFIG`` or ``~/.kube/config``). Raises ``ActuatorError`` when none of
        them can be loaded. The global client configuration is left untouched.
        """
        configuration = load_client_configuration(kubeconfig, context)
        return cls(
            namespace=namespace,
            deployments=deployments,
            targets=targets,
            api=client.AppsV1Api(client.ApiClient(configuration)),
            retries=retries,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            request_timeout_s=request_timeout_s,
            sleep=sleep,
        )

    def observe(self, pool: Pool) -> PoolObservation:
        """``spec.replicas`` of the scale and ``status.readyReplicas`` of the resource
        (the scale's ``status.replicas`` when the kind does not report ready ones)."""
        resource = self._resource(pool)
        target = resource.target
        scale = self._call(
            self._describe(pool, "read the scale of", f"get {resource.rule}/scale"),
            lambda: self._objects.get_namespaced_custom_object_scale(
                target.group,
                target.version,
                self._namespace,
                resource.plural,
                target.name,
                _request_timeout=self._timeout_s,
            ),
        )
        obj = self._call(
            self._describe(pool, "read", f"get {resource.rule}"),
            lambda: self._objects.get_namespaced_custom_object(
                target.group,
                target.version,
                self._namespace,
                resource.plural,
                target.name,
                _request_timeout=self._timeout_s,
            ),
        )
        current = _count(_at(scale, "spec", "replicas"))
        status = _at(obj, "status")
        if isinstance(status, dict) and "readyReplicas" in status:
            ready = _count(status["readyReplicas"])
        else:
            ready = min(current, _count(_at(scale, "status", "replicas")))
        return PoolObservation(current_replicas=current, ready_replicas=ready)

    def scale(self, pool: Pool, replicas: int) -> None:
        """Patch the scale subresource's ``spec.replicas`` (idempotent)."""
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ValueError(f"replicas: must be an integer >= 0, got {replicas!r}")
        resource = self._resource(pool)
        target = resource.target
        self._call(
            self._describe(pool, "scale", f"patch {resource.rule}/scale"),
            lambda: self._objects.patch_namespaced_custom_object_scale(
                target.group,
                target.version,
                self._namespace,
                resource.plural,
                target.name,
                {"spec": {"replicas": replicas}},
                _request_timeout=self._timeout_s,
            ),
        )
        logger.info(
            "scaled %s %s/%s (%s pool) to %d replicas",
            target.kind,
            self._namespace,
            target.name,
            pool.value,
            replicas,
        )

    def _target(self, pool: Pool) -> ScaleTargetRef:
        try:
            return self._targets[pool]
        except KeyError:
            raise ActuatorError(f"no scale target configured for the {pool.value} pool") from None

    def _resource(self, pool: Pool) -> _Resource:
        """The pool's target with its plural, from discovery once (then remembered)."""
        if pool in self._resolved:
            return self._resolved[pool]
        target = self._target(pool)
        plural = KNOWN_PLURALS.get((target.group, target.kind))
        if plural is None:
            plural = self._discover(pool, target)
        self._resolved[pool] = _Resource(target=target, plural=plural)
        return self._resolved[pool]

    def _discover(self, pool: Pool, target: ScaleTargetRef) -> str:
        path = f"/apis/{target.group}/{target.version}"
        call = _Call(
            pool=pool,
            namespace=self._namespace,
            kind=target.kind,
            name=target.name,
            action=f"discover the API {target.api_version} of",
            permission=f"get {path} (discovery, granted to every authenticated user)",
        )
        listing = self._call(
            call,
            lambda: self._objects.get_api_resources(
                target.group, target.version, _request_timeout=self._timeout_s
            ),
        )
        names = {str(r.name): r for r in (listing.resources or [])}
        for name, entry in names.items():
            if "/" not in name and entry.kind == target.kind:
                if f"{name}/scale" not in names:
                    raise ActuatorError(
                        f"{call.target}: kind {target.kind} of {target.api_version} has no "
                        "scale subresource; a pool must be a resource that can be scaled "
                        "(kubectl scale)"
                    )
                return name
        raise ActuatorError(
            f"{call.target}: the API server serves no kind {target.kind} in "
            f"{target.api_version} (is its CRD installed?)"
        )

    def _describe(self, pool: Pool, action: str, permission: str) -> _Call:
        target = self._target(pool)
        return _Call(
            pool=pool,
            namespace=self._namespace,
            kind=target.kind,
            name=target.name,
            action=action,
            permission=permission,
        )

    def _call(self, call: _Call, request: Callable[[], T]) -> T:
        """``request()``, retried while the failure is retryable and attempts are left."""
        attempts = len(self._delays_s) + 1
        for attempt, delay_s in enumerate([*self._delays_s, None], start=1):
            try:
                return request()
            except (ApiException, urllib3.exceptions.HTTPError) as exc:
                error = _classify(exc, call)
                if not isinstance(error, ActuatorRetryableError):
                    raise error from exc
                if delay_s is None:
                    raise ActuatorRetryableError(
                        f"{error} (gave up after {attempts} attempts)"
                    ) from exc
                logger.warning(
                    "attempt %d/%d failed: %s; retrying in %.2f s",
                    attempt,
                    attempts,
                    error,
                    delay_s,
                )
            self._sleep(delay_s)
        raise AssertionError("unreachable: the last attempt returns or raises")
