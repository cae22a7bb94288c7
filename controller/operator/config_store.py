"""``CustomResourceConfigStore``: the ``ConfigStore`` over one resource's spec, so that
the REST API (``controller.api.create_app``) edits the resource and the spec stays the
single source of truth.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from controller import crd
from controller.config import ConfigError, ControllerConfig
from controller.operator.kube import REQUEST_TIMEOUT_S, ResourceUnavailableError
from controller.store import VersionConflictError, VersionedConfig, config_version


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


__all__ = ["CustomResourceConfigStore"]
