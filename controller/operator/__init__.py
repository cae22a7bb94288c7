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
resource and in ``status.policyState``; a restarted operator resumes it from there,
and one without a readable record starts fresh, which holds rather than scales down
(a lower target must first hold for the stabilisation window).

``CustomResourceConfigStore`` is the ``ConfigStore`` over one resource's spec, so
that the REST API (``controller.api.create_app``) edits the resource and the spec
stays the single source of truth.

The modules: ``kube`` (credentials, kopf's connection info, the unavailable-resource
error), ``config_store`` (the spec as the REST config store), ``runner`` (one
resource's tick), ``runtime`` (the runners and kopf's handlers), ``app`` (the REST API
over the served resource).
"""

from controller.operator.app import ServedResourceStore, create_operator_app
from controller.operator.config_store import CustomResourceConfigStore
from controller.operator.kube import (
    ResourceUnavailableError,
    connection_info,
    load_configuration,
)
from controller.operator.runner import AutoscalerRunner, TickOutcome, prometheus_source
from controller.operator.runtime import OperatorRuntime

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
