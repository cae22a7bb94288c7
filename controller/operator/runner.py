"""One resource's control loop without kopf: ``AutoscalerRunner.tick``, blocking and
kopf-free (the operator runs it in a worker thread):

1. parse the spec as it is now (kopf keeps the daemon's body current); a bad spec
   sets ``Ready=False, InvalidSpec`` and holds — nothing is scaled on a spec the
   operator cannot read;
2. ``ControlLoop.tick``: read the Deployments' replicas through the scale
   subresource, observe (Prometheus, ``spec.metrics``), ``decide``, scale (active
   mode only; ``decide`` already refuses to act on stale metrics);
3. patch the status (replicas, predictions, the reason chain, conditions), and
   return the notices (Events) for kopf's loop to post.

The forecaster's arrival record is warm-started by ``ControlLoop`` from the source's
history (Prometheus: a ``query_range`` of the arrival rate over the last day) when
the loop is built, and again when the spec binds another series (another
Prometheus, selector or window), so neither a new operator nor a re-pointed one
waits a trend window or a day before it forecasts.

The policy state (EMA, cooldowns, stabilisation windows) lives in memory per
resource and is written to ``status.policyState``; a restarted operator resumes it
from there (an unreadable record starts fresh, which holds rather than scales down:
a lower target must first hold for the stabilisation window).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from controller import crd
from controller.actuator import Actuator
from controller.actuators.kubernetes import KubernetesActuator
from controller.closing import close_if_closable
from controller.config import ConfigError, ControllerConfig, MetricsConfig
from controller.loop import ControlLoop
from controller.metrics import ControllerMetrics
from controller.observation import ObservationSource
from controller.operator.kube import REQUEST_TIMEOUT_S
from controller.policy import ControllerState
from controller.store import VersionedConfig, config_version
from controller.tick import TickRecord
from queueing.catalog import resolve_profile
from queueing.pools import Pool
from queueing.solver import InfeasibleSLOError

log = logging.getLogger("sara.operator")

SourceFactory = Callable[[crd.AutoscalerSpec], ObservationSource]
ActuatorFactory = Callable[[str, crd.AutoscalerSpec], Actuator]


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

    prefill_target: crd.ScaleTargetRef
    decode_target: crd.ScaleTargetRef
    metrics: crd.MetricsSpec
    window_s: float
    burst_window_s: float
    metrics_config: MetricsConfig

    @classmethod
    def of(cls, spec: crd.AutoscalerSpec) -> _Bindings:
        return cls(
            prefill_target=spec.prefill_target,
            decode_target=spec.decode_target,
            metrics=spec.metrics,
            window_s=spec.config.window_s,
            burst_window_s=spec.config.burst_window_s,
            metrics_config=spec.config.metrics,
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
        scv_span_s=spec.config.lead_time.pool_s,
        selector=spec.metrics.selector,
        metrics=spec.config.metrics,
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

    def readiness(self) -> tuple[bool, str]:
        """Ready while the spec is valid and the loop's latest tick succeeded; else
        not, with the reason (the invalid spec, or the loop's own)."""
        if self._invalid is not None:
            return False, f"invalid spec: {self._invalid}"
        if self._loop is None:
            return False, "no control loop yet"
        return self._loop.readiness()

    def ready(self) -> bool:
        return self.readiness()[0]

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
                # Other scale targets or another Prometheus: new adapters, same policy
                # state (the pools' history is what the resource has seen).
                close_if_closable(self._loop.source)
                previous_bindings = self._bindings
                same_series = previous_bindings is not None and _series(
                    previous_bindings
                ) == _series(bindings)
                # Another series warm-starts the forecaster's record again from the
                # new source's history (ControlLoop.replace_source).
                self._loop.replace_source(self._source_factory(spec), same_series=same_series)
                self._loop.actuator = self._actuator_factory(self.namespace, spec)
        self._bindings = bindings
        return self._loop

    def _kubernetes_actuator(self, namespace: str, spec: crd.AutoscalerSpec) -> Actuator:
        return KubernetesActuator(
            namespace=namespace,
            targets={pool: spec.target(pool) for pool in Pool},
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


def _series(bindings: _Bindings) -> tuple[object, ...]:
    """What the measured arrivals depend on (not the scale targets)."""
    return (
        bindings.metrics,
        bindings.window_s,
        bindings.burst_window_s,
        bindings.metrics_config,
    )


def _conditions(status: Mapping[str, Any] | None) -> list[Mapping[str, Any]] | None:
    conditions = (status or {}).get("conditions")
    return conditions if isinstance(conditions, list) else None


__all__ = [
    "ActuatorFactory",
    "AutoscalerRunner",
    "SourceFactory",
    "TickOutcome",
    "prometheus_source",
]
