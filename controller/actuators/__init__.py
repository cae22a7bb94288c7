"""Actuators: what turns a decision into running workers (DESIGN §4, §5).

- ``AdvisoryActuator`` (``advisory``): records the targets and changes nothing.
- ``LocalProcessActuator`` (``local``): worker processes on this machine.
- ``KubernetesActuator`` (``kubernetes``): Deployments through their scale subresource.

``KubernetesActuator`` is not re-exported here so that the advisory and local modes
never import the Kubernetes client: import it from ``controller.actuators.kubernetes``.
All of them implement ``controller.actuator.Actuator`` and raise its error types.
"""

from __future__ import annotations

from controller.actuators.advisory import AdvisoryActuator
from controller.actuators.local import LocalProcessActuator, http_readiness

__all__ = ["AdvisoryActuator", "LocalProcessActuator", "http_readiness"]
