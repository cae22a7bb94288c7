"""The kopf operator: one control loop per ``SLOAutoscaler`` resource.

kopf watches the resources; for each one it runs a daemon that ticks every
``spec.intervalSeconds``. A tick is ``AutoscalerRunner.tick``, blocking and
kopf-free, run in a worker thread:

1. parse the spec as it is now (kopf keeps the daemon's body current); a bad spec
   sets ``Ready=False, InvalidSpec`` and holds — nothing is scaled on a spec the
   operator cannot read;
2. ``ControlLoop.tick``: read the Deployments' replicas through the scale
   subresource, observe (Prometheus, ``spec.metrics``), ``decide``, scale (active
   mode only; ``decide`` already refuses to act on stale metrics);
3. patch the status (replicas, predictions, the reason chain, conditions);
4. back on kopf's loop: one Kubernetes Event per scaled pool and per condition
   whose status changed.

A spec change (kopf's update handler, e.g. a REST edit through
``CustomResourceConfigStore``) wakes the daemon, so the next decision follows at
once. Deleting a resource stops its daemon: kopf waits for the tick in flight to
finish before it lets the resource go (its finalizer), and no tick runs after.

The policy state (EMA, cooldowns, stabilisation windows) lives in memory per
resource; an operator restart starts it fresh, which holds rather than scales down
(a lower target must first hold for the stabilisation window).

``CustomResourceConfigStore`` is the ``ConfigStore`` over one resource's spec, so
that the REST API (``controller.api.create_app``) edits the resource and the spec
stays the single source of truth.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

import kopf
import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from controller import crd
from controller.actuator import Actuator, ActuatorError
from controller.actuators.kubernetes import KubernetesActuator, load_client_configuration
from controller.closing import close_if_closable
from controller.config import ConfigError, ControllerConfig
from controller.loop import ControlLoop
from controller.metrics import ControllerMetrics
from controller.observation import ObservationSource
from controller.policy import ControllerState
from controller.store import VersionConflictError, VersionedConfig, config_version
from controller.tick import TickRecord
from queueing.catalog import resolve_profile
from queueing.pools import Pool
from queueing.solver import InfeasibleSLOError

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("sara.operator")

FINALIZER = "sara.io/operator"
REQUEST_TIMEOUT_S = 10.0
# How often kopf re-checks a daemon that is still finishing its tick after a delete.
STOP_POLL_S = 1.0
# After an unexpected error in a tick, kopf restarts the daemon after this long.
DAEMON_BACKOFF_S = 5.0

SourceFactory = Callable[[crd.AutoscalerSpec], ObservationSource]
ActuatorFactory = Callable[[str, crd.AutoscalerSpec], Actuator]


class ResourceUnavailableError(RuntimeError):
    """The resource behind a store cannot be read now (missing, forbidden, unreachable).

    The REST API answers 503: the request may succeed later, nothing was changed.
    """


# --------------------------------------------------------------------------------------
# Kubernetes credentials
# --------------------------------------------------------------------------------------


def load_configuration(
    kubeconfig: str | os.PathLike[str] | None = None, context: str | None = None
) -> client.Configuration:
    """Credentials from where the operator runs: ``kubeconfig`` if given, else the
    pod's service account in a cluster, else ``$KUBECONFIG`` / ``~/.kube/config``.

    Raises ``ConfigError`` naming what was tried. The global client configuration
    is left untouched; kopf and the Kubernetes client both use the one returned.
    """
    try:
        return load_client_configuration(kubeconfig, context)
    except ActuatorError as exc:
        raise ConfigError(f"--kubeconfig: {exc}") from exc


def connection_info(configuration: client.Configuration) -> kopf.ConnectionInfo:
    """kopf's view of the same credentials the Kubernetes client uses.

    Read at every kopf login, so a rotated service-account token (which the client
    re-reads through its refresh hook) is picked up when kopf re-authenticates.
    """
    header = configuration.get_api_key_with_prefix(
        "BearerToken"
    ) or configuration.get_api_key_with_prefix("authorization")
    scheme: str | None = None
    token: str | None = None
    if header:
        first, _, rest = header.partition(" ")
        scheme, token = (first, rest) if rest else (None, first)
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        username=configuration.username or None,
        password=configuration.password or None,
        scheme=scheme,
        token=token,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


# --------------------------------------------------------------------------------------
# The config store over a resource's spec
# --------------------------------------------------------------------------------------


class CustomResourceConfigStore:
    """The config document of one ``SLOAutoscaler``, kept in its spec.

    ``load`` reads the resource; ``replace`` merge-patches the spec's knobs (the
    Deployments and the metrics are left as they are). Optimistic concurrency works
    at two levels: ``expected_version`` is checked against the spec's content as
    read (``VersionConflictError`` if it moved on), and the patch carries the
    ``metadata.resourceVersion`` of that read, so a write that lands in between is
    refused by the API server (409) instead of silently merged with. After a 409 the
    store reads again and decides afresh: with ``expected_version`` a changed config
    is a conflict, while a write that left the knobs alone (the operator's own status
    updates bump the resourceVersion too) is no reason to refuse; without it, the
    last writer wins. After ``attempts`` refused writes it gives up with a conflict.

    Errors: ``ResourceUnavailableError`` when the resource cannot be read or
    written (missing, forbidden, API server unreachable); ``ConfigError`` (naming
    the config document's field) for a config the spec cannot hold, such as a
    profile file path.
    """

    def __init__(
        self,
        *,
        api: client.CustomObjectsApi,
        namespace: str,
        name: str,
        attempts: int = 5,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        for label, value in (("namespace", namespace), ("name", name)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{label}: must be a non-empty string, got {value!r}")
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ValueError(f"attempts: must be an integer >= 1, got {attempts!r}")
        self._api = api
        self.namespace = namespace
        self.name = name
        self._attempts = attempts
        self._timeout_s = request_timeout_s

    @property
    def resource(self) -> str:
        return f"{crd.KIND} {self.namespace}/{self.name}"

    def load(self) -> VersionedConfig:
        _, current = self._read()
        return current

    def replace(self, config: ControllerConfig, *, expected_version: str | None) -> VersionedConfig:
        crd.check_config_for_spec(config)
        for _ in range(self._attempts):
            body, current = self._read()
            if expected_version is not None and expected_version != current.version:
                raise VersionConflictError(
                    expected_version=expected_version, current_version=current.version
                )
            new_version = config_version(config)
            if new_version == current.version:
                return current  # nothing to write; the resourceVersion stays as it is
            patch = {
                "metadata": {"resourceVersion": body["metadata"].get("resourceVersion")},
                "spec": crd.spec_patch_for(config),
            }
            try:
                written = self._api.patch_namespaced_custom_object(
                    crd.GROUP,
                    crd.VERSION,
                    self.namespace,
                    crd.PLURAL,
                    self.name,
                    patch,
                    _request_timeout=self._timeout_s,
                )
            except ApiException as exc:
                if exc.status == 409:
                    # Someone wrote in between. Read again: with an expected version the
                    # content check above tells a config change (conflict) from another
                    # write such as a status update (write again onto the fresh read).
                    continue
                if exc.status == 422:  # the API server's schema or CEL rules refused it
                    raise ConfigError(f"config: {self.resource} refused it: {exc.reason}") from exc
                raise self._unavailable("write", exc) from exc
            except urllib3.exceptions.HTTPError as exc:
                raise self._unavailable("write", exc) from exc
            return self._versioned(cast(dict[str, Any], written))
        _, current = self._read()
        raise VersionConflictError(
            expected_version=expected_version or "(any)", current_version=current.version
        )

    def _read(self) -> tuple[dict[str, Any], VersionedConfig]:
        try:
            body = self._api.get_namespaced_custom_object(
                crd.GROUP,
                crd.VERSION,
                self.namespace,
                crd.PLURAL,
                self.name,
                _request_timeout=self._timeout_s,
            )
        except (ApiException, urllib3.exceptions.HTTPError) as exc:
            raise self._unavailable("read", exc) from exc
        resource = cast(dict[str, Any], body)
        return resource, self._versioned(resource)

    def _versioned(self, body: Mapping[str, Any]) -> VersionedConfig:
        try:
            config = crd.parse_spec(body.get("spec")).config
        except ConfigError as exc:
            # A spec edited by hand into something invalid: the API cannot show it as a
            # config document, and must not write over it without the owner seeing why.
            raise ResourceUnavailableError(f"{self.resource}: the spec is invalid: {exc}") from exc
        return VersionedConfig(config=config, version=config_version(config))

    def _unavailable(self, action: str, exc: Exception) -> ResourceUnavailableError:
        if isinstance(exc, ApiException):
            detail = f"HTTP {exc.status}: {exc.reason}"
            if exc.status == 404:
                detail += " (no such resource)"
            elif exc.status == 403:
                verb = "get" if action == "read" else "patch"
                detail += f" (the operator needs RBAC '{verb} {crd.PLURAL}.{crd.GROUP}')"
        else:
            detail = str(exc)
        return ResourceUnavailableError(f"cannot {action} {self.resource}: {detail}")


# --------------------------------------------------------------------------------------
# One resource's loop
# --------------------------------------------------------------------------------------


class _SpecSnapshot:
    """The config the current tick runs with: the spec as parsed at the tick's start.

    A read-only ``ConfigStore`` for ``ControlLoop``: writes go to the resource
    (``CustomResourceConfigStore``), and reach the loop with the next spec it reads.
    """

    def __init__(self, config: ControllerConfig) -> None:
        self._current = VersionedConfig(config=config, version=config_version(config))

    def set(self, config: ControllerConfig) -> None:
        self._current = VersionedConfig(config=config, version=config_version(config))

    def load(self) -> VersionedConfig:
        return self._current

    def replace(self, config: ControllerConfig, *, expected_version: str | None) -> VersionedConfig:
        raise NotImplementedError("the spec is edited through CustomResourceConfigStore")


@dataclass(frozen=True, kw_only=True)
class _Bindings:
    """What the source and the actuator are built from; a change rebuilds them."""

    prefill_deployment: str
    decode_deployment: str
    metrics: crd.MetricsSpec
    window_s: float
    burst_window_s: float

    @classmethod
    def of(cls, spec: crd.AutoscalerSpec) -> _Bindings:
        return cls(
            prefill_deployment=spec.prefill_deployment,
            decode_deployment=spec.decode_deployment,
            metrics=spec.metrics,
            window_s=spec.config.window_s,
            burst_window_s=spec.config.burst_window_s,
        )


@dataclass(frozen=True, kw_only=True)
class TickOutcome:
    """What one tick did: the status it wrote, the events to post, when to tick next."""

    record: TickRecord | None  # None: the spec was invalid and nothing ran
    status: dict[str, Any]
    notices: list[crd.Notice] = field(default_factory=list)
    interval_s: float = 30.0


def prometheus_source(spec: crd.AutoscalerSpec) -> ObservationSource:
    """The production source: PromQL with the spec's selector and windows."""
    from controller.sources.prometheus import PrometheusSource

    return PrometheusSource(
        spec.metrics.prometheus_url,
        window_s=spec.config.window_s,
        burst_window_s=spec.config.burst_window_s,
        selector=spec.metrics.selector,
    )


def _policy_state_json(state: ControllerState) -> str:
    """The loop's memory for the status, without the length samples (the next window
    measures them again; they would make every status patch kilobytes larger)."""
    data = state.to_dict()
    data["lengths"] = None
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def _policy_state_from(
    namespace: str, name: str, status: Mapping[str, Any] | None
) -> ControllerState | None:
    raw = (status or {}).get("policyState")
    if not isinstance(raw, str) or not raw:
        return None
    try:
        return ControllerState.from_dict(json.loads(raw))
    except (ValueError, TypeError, KeyError) as exc:
        # A damaged record costs the history, not the loop: start fresh (which holds).
        log.warning(
            "%s/%s: status.policyState unreadable (%s); starting fresh", namespace, name, exc
        )
        return None


class AutoscalerRunner:
    """One resource's control loop without kopf: ``tick(body)`` does a whole tick.

    Blocking (HTTP to Prometheus and to the API server); the operator runs it in a
    worker thread. ``source_factory`` builds the observation source from the spec
    (Prometheus in production); the actuator is a ``KubernetesActuator`` on the
    resource's namespace and the spec's Deployments over ``api_client``; the status
    is merge-patched through the same client. ``clock`` is the loop's clock
    (seconds), ``wall_clock`` stamps the conditions' transition times.
    """

    def __init__(
        self,
        *,
        namespace: str,
        name: str,
        api_client: client.ApiClient,
        source_factory: SourceFactory = prometheus_source,
        actuator_factory: ActuatorFactory | None = None,
        clock: Callable[[], float] = time.time,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.namespace = namespace
        self.name = name
        self._objects = client.CustomObjectsApi(api_client)
        self._apps = client.AppsV1Api(api_client)
        self._source_factory = source_factory
        self._actuator_factory = actuator_factory or self._kubernetes_actuator
        self._clock = clock
        self._wall_clock = wall_clock
        self._timeout_s = request_timeout_s
        self.metrics = ControllerMetrics()
        self._loop: ControlLoop | None = None
        self._snapshot: _SpecSnapshot | None = None
        self._bindings: _Bindings | None = None
        self._status: dict[str, Any] | None = None  # the last status written
        self._invalid: str | None = None  # the spec error last reported
        self._lock = threading.Lock()  # one tick at a time; close() waits for it
        self._closed = False
        self.woken: asyncio.Event | None = None  # created on kopf's loop, see wake()

    # -- what the REST API reads ----------------------------------------------------------

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"resource": f"{self.namespace}/{self.name}"}
        if self._loop is not None:
            out.update(self._loop.status())
        if self._status is not None:
            out["conditions"] = self._status.get("conditions", [])
        return out

    def decisions(self, limit: int) -> list[dict[str, Any]]:
        return [] if self._loop is None else self._loop.decisions(limit)

    def ready(self) -> bool:
        return self._loop is not None and self._loop.ready() and self._invalid is None

    # -- one tick ---------------------------------------------------------------------------

    def tick(self, body: Mapping[str, Any]) -> TickOutcome:
        """One tick over ``body``, the resource as kopf last saw it."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.namespace}/{self.name}: the runner is closed")
            previous = self._status if self._status is not None else body.get("status")
            generation = body.get("metadata", {}).get("generation")
            try:
                spec = crd.parse_spec(body.get("spec"))
            except ConfigError as exc:
                return self._reject(exc, previous, generation)
            self._invalid = None
            loop = self._bind(spec, previous)
            try:
                record = loop.tick()
            except InfeasibleSLOError as exc:
                # The TPOT target is below one decode step: no model can be built, so
                # decide() has nothing to say. Report it like any failed tick.
                record = TickRecord(
                    time_s=self._clock(),
                    config_version=config_version(spec.config),
                    decision=None,
                    applied=False,
                    error=f"slo: {exc}",
                )
            status = crd.build_status(
                record, generation=generation, previous=previous, now=self._wall_clock()
            )
            notices = crd.notices_for(record, _conditions(previous), status["conditions"])
            status["policyState"] = _policy_state_json(loop.state)
            self._write(status)
            return TickOutcome(
                record=record, status=status, notices=notices, interval_s=spec.config.interval_s
            )

    def _reject(
        self, error: ConfigError, previous: Mapping[str, Any] | None, generation: int | None
    ) -> TickOutcome:
        status = crd.invalid_spec_status(
            error, generation=generation, previous=previous, now=self._wall_clock()
        )
        notices: list[crd.Notice] = []
        if self._invalid != str(error) and self._write(status):  # once per bad spec
            self._invalid = str(error)
            notices = crd.notices_for(None, _conditions(previous), status["conditions"])
        interval_s = self._snapshot.load().config.interval_s if self._snapshot else 30.0
        return TickOutcome(record=None, status=status, notices=notices, interval_s=interval_s)

    def _bind(self, spec: crd.AutoscalerSpec, previous: Mapping[str, Any] | None) -> ControlLoop:
        bindings = _Bindings.of(spec)
        if self._loop is None or self._snapshot is None:
            self._snapshot = _SpecSnapshot(spec.config)
            self._loop = ControlLoop(
                store=self._snapshot,
                source=self._source_factory(spec),
                actuator=self._actuator_factory(self.namespace, spec),
                metrics=self.metrics,
                clock=self._clock,
                profile_loader=resolve_profile,  # a cluster has no profile files
            )
            # A restarted operator resumes the loop's memory from the status: its
            # cooldowns and stabilisation windows hold, the EMA carries on.
            restored = _policy_state_from(self.namespace, self.name, previous)
            if restored is not None:
                self._loop.state = restored
        else:
            self._snapshot.set(spec.config)
            if bindings != self._bindings:
                # Other Deployments or another Prometheus: new adapters, same policy
                # state (the pools' history is what the resource has seen).
                close_if_closable(self._loop.source)
                self._loop.source = self._source_factory(spec)
                self._loop.actuator = self._actuator_factory(self.namespace, spec)
        self._bindings = bindings
        return self._loop

    def _kubernetes_actuator(self, namespace: str, spec: crd.AutoscalerSpec) -> Actuator:
        return KubernetesActuator(
            namespace=namespace,
            deployments={
                Pool.PREFILL: spec.prefill_deployment,
                Pool.DECODE: spec.decode_deployment,
            },
            api=self._apps,
            retries=2,
            request_timeout_s=self._timeout_s,
        )

    def _write(self, status: dict[str, Any]) -> bool:
        """Merge-patch the status; False (logged) when it could not be written."""
        try:
            self._objects.patch_namespaced_custom_object_status(
                crd.GROUP,
                crd.VERSION,
                self.namespace,
                crd.PLURAL,
                self.name,
                {"status": status},
                _request_timeout=self._timeout_s,
            )
        except ApiException as exc:
            if exc.status == 404:  # deleted meanwhile: nothing left to report on
                log.info(
                    "%s/%s: gone before its status could be written", self.namespace, self.name
                )
                return False
            # The status is a report: the next tick writes a fresh one. Scaling went on.
            log.warning(
                "%s/%s: cannot write the status (HTTP %s: %s); the next tick retries",
                self.namespace,
                self.name,
                exc.status,
                exc.reason,
            )
            return False
        except urllib3.exceptions.HTTPError as exc:
            log.warning(
                "%s/%s: cannot write the status (%s); the next tick retries",
                self.namespace,
                self.name,
                exc,
            )
            return False
        self._status = status
        return True

    # -- waking and closing -----------------------------------------------------------------

    def wake(self) -> None:
        """Tick now rather than at the end of the interval (call on kopf's loop)."""
        if self.woken is None:
            self.woken = asyncio.Event()
        self.woken.set()

    async def sleep(self, interval_s: float, stopped: kopf.DaemonStopped) -> None:
        """Until the interval is over, ``wake`` is called, or the daemon must stop."""
        if self.woken is None:
            self.woken = asyncio.Event()
        waits = {
            asyncio.ensure_future(self.woken.wait()),
            asyncio.ensure_future(stopped.wait()),
        }
        try:
            await asyncio.wait(waits, timeout=interval_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
            self.woken.clear()

    def close(self) -> None:
        """Stop for good: waits for a tick in flight, then releases the source."""
        with self._lock:
            self._closed = True
            if self._loop is not None:
                close_if_closable(self._loop.source)
                close_if_closable(self._loop.actuator)


def _conditions(status: Mapping[str, Any] | None) -> list[Mapping[str, Any]] | None:
    conditions = (status or {}).get("conditions")
    return conditions if isinstance(conditions, list) else None


# --------------------------------------------------------------------------------------
# The operator: every resource's runner, and the kopf handlers that drive them
# --------------------------------------------------------------------------------------


class OperatorRuntime:
    """The runners of the resources this operator serves, by namespace and name.

    Built once per process; ``registry()`` gives kopf the handlers bound to it.
    ``started`` is set once kopf has started (the REST API's readiness).
    """

    def __init__(
        self,
        *,
        configuration: client.Configuration,
        source_factory: SourceFactory = prometheus_source,
        actuator_factory: ActuatorFactory | None = None,
        clock: Callable[[], float] = time.time,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.configuration = configuration
        self.api_client = client.ApiClient(configuration)
        self._source_factory = source_factory
        self._actuator_factory = actuator_factory
        self._clock = clock
        self._wall_clock = wall_clock
        self._timeout_s = request_timeout_s
        self._runners: dict[tuple[str, str], tuple[str, AutoscalerRunner]] = {}
        self.started = threading.Event()

    def runner(self, namespace: str, name: str, uid: str) -> AutoscalerRunner:
        """The runner of this resource, made on first use; a new uid (the resource
        was deleted and created again under its name) starts from a fresh state."""
        key = (namespace, name)
        known = self._runners.get(key)
        if known is not None and known[0] == uid:
            return known[1]
        if known is not None:
            known[1].close()
        runner = AutoscalerRunner(
            namespace=namespace,
            name=name,
            api_client=self.api_client,
            source_factory=self._source_factory,
            actuator_factory=self._actuator_factory,
            clock=self._clock,
            wall_clock=self._wall_clock,
            request_timeout_s=self._timeout_s,
        )
        self._runners[key] = (uid, runner)
        return runner

    def get(self, namespace: str, name: str) -> AutoscalerRunner | None:
        known = self._runners.get((namespace, name))
        return None if known is None else known[1]

    def served(self) -> list[tuple[str, str]]:
        return sorted(self._runners)

    def forget(self, namespace: str, name: str, uid: str) -> None:
        known = self._runners.get((namespace, name))
        if known is not None and known[0] == uid:
            del self._runners[(namespace, name)]
            known[1].close()

    def store(self, namespace: str, name: str) -> CustomResourceConfigStore:
        return CustomResourceConfigStore(
            api=client.CustomObjectsApi(self.api_client),
            namespace=namespace,
            name=name,
            request_timeout_s=self._timeout_s,
        )

    def registry(self) -> kopf.OperatorRegistry:
        """kopf's handlers for ``sloautoscalers.sara.io``, bound to this runtime."""
        registry = kopf.OperatorRegistry()
        resource = (crd.GROUP, crd.VERSION, crd.PLURAL)

        @kopf.on.startup(registry=registry)
        async def started(**_: Any) -> None:
            self.started.set()

        @kopf.on.cleanup(registry=registry)
        async def stopping(**_: Any) -> None:
            self.started.clear()

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            return connection_info(self.configuration)

        @kopf.on.resume(*resource, registry=registry)
        @kopf.on.create(*resource, registry=registry)
        @kopf.on.update(*resource, field="spec", registry=registry)
        async def reconfigure(
            spec: kopf.Spec, namespace: str | None, name: str, uid: str, **_: Any
        ) -> None:
            # The daemon reads the spec at every tick; this only checks it early (a
            # bad spec fails the handler, which kopf shows) and makes the loop re-decide
            # now instead of at the end of its interval.
            runner = self.runner(_namespaced(namespace), name, uid)
            runner.wake()  # a bad spec too: the daemon reports InvalidSpec at once
            try:
                crd.parse_spec(dict(spec))
            except ConfigError as exc:
                raise kopf.PermanentError(str(exc)) from exc

        @kopf.daemon(
            *resource,
            registry=registry,
            id="control-loop",
            cancellation_polling=STOP_POLL_S,
            backoff=DAEMON_BACKOFF_S,
        )
        async def control_loop(
            body: kopf.Body,
            namespace: str | None,
            name: str,
            uid: str,
            stopped: kopf.DaemonStopped,
            **_: Any,
        ) -> None:
            namespace = _namespaced(namespace)
            runner = self.runner(namespace, name, uid)
            try:
                while not stopped:
                    snapshot = copy.deepcopy(dict(body))
                    outcome = await asyncio.to_thread(runner.tick, snapshot)
                    for notice in outcome.notices:
                        post = kopf.warn if notice.type is crd.EventType.WARNING else kopf.info
                        post(body, reason=notice.reason, message=notice.message)
                    await runner.sleep(outcome.interval_s, stopped)
            finally:
                if stopped.reason is not None and (
                    kopf.DaemonStoppingReason.RESOURCE_DELETED in stopped.reason
                ):
                    self.forget(namespace, name, uid)

        return registry

    def settings(self, *, standalone: bool) -> kopf.OperatorSettings:
        settings = kopf.OperatorSettings()
        # The namespaces are named exactly and the CRD is installed before the operator
        # starts: no cluster-wide listing of namespaces or CRDs (and no RBAC for it).
        settings.scanning.disabled = True
        settings.persistence.finalizer = FINALIZER
        settings.posting.reporting_component = "sara-operator"
        settings.peering.standalone = standalone
        return settings

    def close(self) -> None:
        for _, runner in list(self._runners.values()):
            runner.close()
        self._runners.clear()
        close: Callable[[], None] = self.api_client.close  # unannotated in the client
        close()


def _namespaced(namespace: str | None) -> str:
    if namespace is None:  # the CRD is namespaced; kopf passes None only for cluster scope
        raise kopf.PermanentError(f"{crd.KIND} must be namespaced")
    return namespace


# --------------------------------------------------------------------------------------
# The REST API over one resource
# --------------------------------------------------------------------------------------


class ServedResourceStore:
    """The ``ConfigStore`` of the resource the REST API serves.

    With ``resource`` (namespace, name), that one; without, the only resource this
    operator runs (the usual install: one ``SLOAutoscaler`` per release). Zero or
    several raise ``ResourceUnavailableError`` (503) until one is named.
    """

    def __init__(self, runtime: OperatorRuntime, resource: tuple[str, str] | None) -> None:
        self._runtime = runtime
        self.resource = resource

    def target(self) -> tuple[str, str]:
        if self.resource is not None:
            return self.resource
        served = self._runtime.served()
        if len(served) == 1:
            return served[0]
        if not served:
            raise ResourceUnavailableError(
                f"no {crd.KIND} is served by this operator (yet): create one, or name one "
                "with --api-resource NAMESPACE/NAME"
            )
        names = ", ".join(f"{ns}/{name}" for ns, name in served)
        raise ResourceUnavailableError(
            f"{len(served)} {crd.KIND} resources are served ({names}): name the one this API "
            "edits with --api-resource NAMESPACE/NAME"
        )

    def load(self) -> VersionedConfig:
        return self._runtime.store(*self.target()).load()

    def replace(self, config: ControllerConfig, *, expected_version: str | None) -> VersionedConfig:
        return self._runtime.store(*self.target()).replace(
            config, expected_version=expected_version
        )


def create_operator_app(
    runtime: OperatorRuntime,
    *,
    resource: tuple[str, str] | None = None,
    api_token: str | None = None,
) -> FastAPI:
    """``controller.api.create_app`` over one resource's spec and its runner.

    ``/readyz`` is ready once kopf has started and, when the served resource exists,
    its loop has decided once. A resource that cannot be read answers 503.
    """
    from fastapi import Request
    from fastapi.responses import JSONResponse

    from controller.api import create_app

    store = ServedResourceStore(runtime, resource)
    idle = ControllerMetrics()  # what /metrics shows while no loop runs

    def runner() -> AutoscalerRunner | None:
        try:
            return runtime.get(*store.target())
        except ResourceUnavailableError:
            return None

    def status() -> Mapping[str, Any]:
        found = runner()
        if found is None:
            return {"resource": None if resource is None else "/".join(resource), "ticks": 0}
        return found.status()

    def decisions(limit: int) -> list[dict[str, Any]]:
        found = runner()
        return [] if found is None else found.decisions(limit)

    def ready() -> bool:
        if not runtime.started.is_set():
            return False
        found = runner()
        return found is None or found.ready()

    def metrics() -> bytes:
        found = runner()
        return (idle if found is None else found.metrics).exposition()

    app = create_app(
        store=store,
        status=status,
        decisions=decisions,
        ready=ready,
        metrics=metrics,
        api_token=api_token,
    )

    async def unavailable(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503)

    app.add_exception_handler(ResourceUnavailableError, unavailable)
    return app


__all__ = [
    "AutoscalerRunner",
    "CustomResourceConfigStore",
    "OperatorRuntime",
    "ResourceUnavailableError",
    "ServedResourceStore",
    "TickOutcome",
    "connection_info",
    "create_operator_app",
    "load_configuration",
    "prometheus_source",
]
