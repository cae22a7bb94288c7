"""Fixtures of the operator's tests over ``tests.controller.operator_harness``: an
emulated API server with the two worker Deployments, a scripted observation source,
and the operator (kopf embedded) running against them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.controller.operator_harness import (
    DECODE,
    NAMESPACE,
    PREFILL,
    Cluster,
    Kube,
    Operator,
    ScriptedSource,
    deployment,
)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    emulated = Cluster()
    yield emulated
    emulated.close()


@pytest.fixture
def kube(cluster: Cluster) -> Kube:
    kube = Kube(cluster)
    kube.apps.create_namespaced_deployment(NAMESPACE, deployment(PREFILL, 1))
    kube.apps.create_namespaced_deployment(NAMESPACE, deployment(DECODE, 1))
    return kube


@pytest.fixture
def source() -> ScriptedSource:
    return ScriptedSource(rate_rps=120.0)


@pytest.fixture
def operator(cluster: Cluster, kube: Kube, source: ScriptedSource) -> Iterator[Operator]:
    running = Operator(cluster, source)
    yield running
    running.close()
