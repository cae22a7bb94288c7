"""The kopf runtime: every resource's runner, and the kopf handlers that drive them.

kopf watches the resources; for each one it runs a daemon that ticks every
``spec.intervalSeconds`` (``AutoscalerRunner.tick`` in a worker thread) and, back on
kopf's loop, posts one Kubernetes Event per scaled pool and per condition whose
status changed.

A spec change (kopf's update handler, e.g. a REST edit through
``CustomResourceConfigStore``) wakes the daemon, so the next decision follows at
once. Deleting a resource stops its daemon: kopf waits for the tick in flight to
finish before it lets the resource go (its finalizer), and no tick runs after.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes import client

from controller import crd
from controller.config import ConfigError
from controller.operator.config_store import CustomResourceConfigStore
from controller.operator.kube import REQUEST_TIMEOUT_S, connection_info
from controller.operator.runner import (
    ActuatorFactory,
    AutoscalerRunner,
    SourceFactory,
    prometheus_source,
)

FINALIZER = "sara.io/operator"
# How often kopf re-checks a daemon that is still finishing its tick after a delete.
STOP_POLL_S = 1.0
# After an unexpected error in a tick, kopf restarts the daemon after this long.
DAEMON_BACKOFF_S = 5.0


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


__all__ = ["DAEMON_BACKOFF_S", "FINALIZER", "STOP_POLL_S", "OperatorRuntime"]
