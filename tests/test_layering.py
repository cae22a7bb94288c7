"""The layering contract of DESIGN §2, checked on the source's import statements.

Lowest first: queueing (numpy/scipy only) -> the pure cores (workers.scheduler,
workers.kv_cache, controller.policy and the plain data it decides on: controller.config,
controller.observation, controller.actuator) -> sim -> adapters -> CLI. A module may import
only from its own layer or below, and only adapter modules may import the I/O and
runtime libraries.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = {"queueing", "sim", "controller", "workers", "dashboards"}
ADAPTER_LIBRARIES = {
    "torch",
    "redis",
    "kubernetes",
    "kopf",
    "fastapi",
    "uvicorn",
    "prometheus_client",
    "httpx",
    "requests",
    "safetensors",
    "tokenizers",
    "starlette",
    "pydantic",
}
PURE_CORES = {
    "workers.scheduler",
    "workers.kv_cache",
    "controller.policy",
    "controller.config",
    "controller.observation",
    "controller.actuator",
    "controller.crd",
    "controller.tick",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module named by an import statement, at any depth (lazy imports too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def allowed(module: str) -> set[str]:
    """Project modules (prefixes) that ``module`` may import."""
    if module.startswith("queueing"):
        return {"queueing"}
    if module in PURE_CORES:
        return {"queueing", *PURE_CORES}
    if module.startswith("sim"):
        return {"queueing", "sim", *PURE_CORES}
    return PROJECT  # adapters and the CLI sit on top


MODULES = sorted(
    p for pkg in PROJECT for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts
)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_each_module_imports_only_from_its_layer_or_below(path: Path) -> None:
    module = module_name(path)
    permitted = allowed(module)
    for imported in imports_of(path):
        top = imported.split(".")[0]
        if top not in PROJECT:
            continue
        assert any(imported == p or imported.startswith(p + ".") for p in permitted), (
            f"{module} imports {imported}, which is above its layer"
        )


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_the_pure_layers_use_no_io_or_runtime_library(path: Path) -> None:
    module = module_name(path)
    if not (module.startswith(("queueing", "sim")) or module in PURE_CORES):
        return
    third_party = (
        {name.split(".")[0] for name in imports_of(path)} - PROJECT - set(sys.stdlib_module_names)
    )
    if module.startswith("queueing"):
        assert third_party <= {"numpy", "scipy"}, f"{module} imports {third_party}"
    assert not third_party & ADAPTER_LIBRARIES, f"{module} imports {third_party}"


def test_the_simulator_controller_cli_and_pure_workers_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import workers, workers.scheduler, workers.kv_cache, sim.cluster, queueing.solver\n"
        "import controller.cli\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
