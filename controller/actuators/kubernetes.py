"""Kubernetes Deployments as pools, scaled through their ``scale`` subresource.

``observe`` reads the scale (``spec.replicas``: what the pool is set to) and the
Deployment (``status.readyReplicas``: how many pods serve); ``scale`` patches the
scale subresource, the same call ``kubectl scale`` and the HPA make, so the
controller needs no write access to the Deployment itself.

Failures, as ``controller.actuator`` defines them: 409 Conflict, 429 Too Many
Requests, 5xx, timeouts and broken connections are retried here with capped
exponential backoff (``retries`` times), then raise ``ActuatorRetryableError``;
404, 401, 403 and other 4xx raise ``ActuatorError`` at once, naming the Deployment
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
from controller.observation import PoolObservation
from queueing.pools import Pool

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETRYABLE_STATUSES = frozenset({409, 429})  # and every 5xx

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
    deployment: str
    action: str  # "read the scale of", "scale", ...
    permission: str  # the RBAC rule it needs, e.g. "patch deployments/scale"

    @property
    def target(self) -> str:
        return f"Deployment {self.namespace}/{self.deployment} ({self.pool.value} pool)"


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
            "Deployment name in the controller's configuration"
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


def _count(value: Any) -> int:
    """A replica count from the API (``None`` when the field is unset, which means 0)."""
    return 0 if value is None else int(value)


class KubernetesActuator:
    """Scales one Deployment per pool in one namespace.

    ``api`` defaults to an ``AppsV1Api`` on the client's default configuration; use
    ``from_environment`` to load in-cluster or kubeconfig credentials. A call is tried
    ``retries + 1`` times at most, sleeping ``backoff_delays_s(...)`` in between
    (``sleep`` is injectable); each attempt times out after ``request_timeout_s``.
    """

    def __init__(
        self,
        *,
        namespace: str,
        deployments: Mapping[Pool, str],
        api: client.AppsV1Api | None = None,
        retries: int = 5,
        backoff_s: float = 0.2,
        max_backoff_s: float = 2.0,
        request_timeout_s: float = 10.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"namespace: must be a non-empty string, got {namespace!r}")
        for pool, name in deployments.items():
            if not isinstance(pool, Pool):
                raise ValueError(f"deployments: keys must be Pool members, got {pool!r}")
            if not isinstance(name, str) or not name:
                raise ValueError(f"deployments[{pool.value}]: must be a non-empty name")
        if not deployments:
            raise ValueError("deployments: must name at least one pool's Deployment")
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
        self._deployments = dict(deployments)
        self._api = api if api is not None else client.AppsV1Api()
        self._delays_s = backoff_delays_s(retries, backoff_s, max_backoff_s)
        self._timeout_s = float(request_timeout_s)
        self._sleep = sleep

    @classmethod
    def from_environment(
        cls,
        *,
        namespace: str,
        deployments: Mapping[Pool, str],
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
            api=client.AppsV1Api(client.ApiClient(configuration)),
            retries=retries,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            request_timeout_s=request_timeout_s,
            sleep=sleep,
        )

    def observe(self, pool: Pool) -> PoolObservation:
        """``spec.replicas`` of the scale and ``status.readyReplicas`` of the Deployment."""
        name = self._deployment(pool)
        scale = self._call(
            self._describe(pool, name, "read the scale of", "get deployments/scale"),
            lambda: self._api.read_namespaced_deployment_scale(
                name, self._namespace, _request_timeout=self._timeout_s
            ),
        )
        deployment = self._call(
            self._describe(pool, name, "read", "get deployments"),
            lambda: self._api.read_namespaced_deployment(
                name, self._namespace, _request_timeout=self._timeout_s
            ),
        )
        current = _count(scale.spec.replicas if scale.spec is not None else None)
        status = deployment.status
        ready = _count(status.ready_replicas if status is not None else None)
        return PoolObservation(current_replicas=current, ready_replicas=ready)

    def scale(self, pool: Pool, replicas: int) -> None:
        """Patch the scale subresource's ``spec.replicas`` (idempotent)."""
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ValueError(f"replicas: must be an integer >= 0, got {replicas!r}")
        name = self._deployment(pool)
        self._call(
            self._describe(pool, name, "scale", "patch deployments/scale"),
            lambda: self._api.patch_namespaced_deployment_scale(
                name,
                self._namespace,
                {"spec": {"replicas": replicas}},
                _request_timeout=self._timeout_s,
            ),
        )
        logger.info(
            "scaled Deployment %s/%s (%s pool) to %d replicas",
            self._namespace,
            name,
            pool.value,
            replicas,
        )

    def _deployment(self, pool: Pool) -> str:
        try:
            return self._deployments[pool]
        except KeyError:
            raise ActuatorError(f"no Deployment configured for the {pool.value} pool") from None

    def _describe(self, pool: Pool, name: str, action: str, permission: str) -> _Call:
        return _Call(
            pool=pool,
            namespace=self._namespace,
            deployment=name,
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
