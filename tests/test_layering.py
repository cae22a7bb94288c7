"""The layering contract of DESIGN §2, checked on the source's import statements.

Lowest first: queueing (numpy/scipy only) -> the pure cores (workers.scheduler,
workers.kv_cache, controller.policy and the plain data it decides on: controller.config,
controller.observation, controller.actuator, and the arithmetic the sources and the
simulated source share: controller.histograms, controller.counters) -> sim -> adapters
(the rest of controller, workers, dashboards) -> cli, the top layer (the `sara` command
line, the demos and the load generator). A module may import only from its own layer or
below, so nothing outside cli imports cli (bench/ and the tests may); only adapter and cli
modules may import the I/O and runtime libraries. The import-time graph of the project has no cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.without_torch import BLOCK_TORCH

ROOT = Path(__file__).resolve().parent.parent
PROJECT = {"queueing", "sim", "controller", "workers", "dashboards", "cli"}
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
    "controller.crd.spec",
    "controller.crd.status",
    "controller.crd.openapi",
    "controller.tick",
    "controller.histograms",
    "controller.counters",
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
    if module == "cli" or module.startswith("cli."):
        return PROJECT  # the CLI sits on top
    return PROJECT - {"cli"}  # adapters: everything but the CLI


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
        BLOCK_TORCH
        + "import workers, workers.scheduler, workers.kv_cache, sim.cluster, queueing.solver\n"
        "import cli.__main__\n"
        "assert 'torch' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_time_imports(path: Path, known: set[str]) -> set[str]:
    """The project modules whose import runs when ``path`` is imported.

    Statements inside functions (lazy by design) and ``if TYPE_CHECKING:`` blocks are
    left out; class bodies, ``try`` and ordinary ``if`` blocks run at import and count.
    Each statement names its most specific module: ``from controller import crd`` is
    ``controller.crd``, ``from controller.crd import X`` is ``controller.crd``; the
    implicit import of a parent package is left out.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    found.add(f"{base}.{alias.name}")
                elif base in known:
                    found.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found - {module}


def import_graph() -> dict[str, set[str]]:
    """Project module -> the project modules its import runs."""
    paths = {module_name(path): path for path in MODULES if path.exists()}
    known = set(paths)
    return {module: import_time_imports(path, known) for module, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    found = []
    for component in components:
        start = min(component)
        path, seen = [start], {start}
        while True:  # walk inside the component until a node repeats
            step = min(w for w in graph[path[-1]] if w in component)
            if step in seen:
                found.append([*path[path.index(step) :], step])
                break
            path.append(step)
            seen.add(step)
    return found


def test_the_cycle_finder_reports_a_cycle_and_passes_a_dag() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_project_import_graph_has_no_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles at import time: " + "; ".join(
        " -> ".join(cycle) for cycle in found
    )
