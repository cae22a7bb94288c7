"""The REST API over one resource: ``ServedResourceStore`` picks the resource the API
edits, ``create_operator_app`` serves ``controller.api.create_app`` over its spec and
its runner.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from controller import crd
from controller.config import ControllerConfig
from controller.metrics import ControllerMetrics
from controller.operator.kube import ResourceUnavailableError
from controller.operator.runner import AutoscalerRunner
from controller.operator.runtime import OperatorRuntime
from controller.store import VersionedConfig

if TYPE_CHECKING:
    from fastapi import FastAPI


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

    def ready() -> tuple[bool, str]:
        if not runtime.started.is_set():
            return False, "the operator has not started yet"
        found = runner()
        return (True, "ready") if found is None else found.readiness()

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


__all__ = ["ServedResourceStore", "create_operator_app"]
