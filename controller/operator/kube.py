"""The operator's connection to Kubernetes: the credentials it runs with, kopf's view of
them, and the error a store raises when its resource cannot be reached.
"""

from __future__ import annotations

import os

import kopf
from kubernetes import client

from controller.actuator import ActuatorError
from controller.actuators.kubernetes import load_client_configuration
from controller.config import ConfigError

REQUEST_TIMEOUT_S = 10.0


class ResourceUnavailableError(RuntimeError):
    """The resource behind a store cannot be read now (missing, forbidden, unreachable).

    The REST API answers 503: the request may succeed later, nothing was changed.
    """


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


__all__ = [
    "REQUEST_TIMEOUT_S",
    "ResourceUnavailableError",
    "connection_info",
    "load_configuration",
]
