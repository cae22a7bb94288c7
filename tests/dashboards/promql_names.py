"""Metric names: those the project's metrics classes define, and those a PromQL expression reads.

``defined_metric_names`` builds each metrics class on a fresh registry and lists the
series names Prometheus will store (``_total`` for counters; ``_bucket``, ``_count``,
``_sum`` for histograms), so the check follows the code rather than a hand list.
"""

from __future__ import annotations

import re
import shutil

import pytest
from prometheus_client import CollectorRegistry

from controller.metrics import ControllerMetrics
from queueing.pools import Pool
from workers.router_metrics import RouterMetrics
from workers.worker_metrics import WorkerMetrics

PROMTOOL_MISSING = (
    "promtool not found on PATH: install it (Debian: apt-get install prometheus) — "
    "the rule checks are part of the suite and are never skipped"
)


def promtool_path() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(PROMTOOL_MISSING)
    return path


def _series_names(registry: CollectorRegistry) -> set[str]:
    names: set[str] = set()
    for family in registry.collect():
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names.update(f"{family.name}_{suffix}" for suffix in ("bucket", "count", "sum"))
        else:
            names.add(family.name)
    return names


def defined_metric_names() -> set[str]:
    registries = (
        RouterMetrics().registry,
        ControllerMetrics().registry,
        *(WorkerMetrics(pool).registry for pool in Pool),
    )
    return set().union(*(_series_names(r) for r in registries))


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_DURATION = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
_KEYWORDS |= {"group_left", "group_right", "inf", "nan", "Inf", "NaN"}


def metric_names(expr: str) -> set[str]:
    """The metric (and recorded-series) names an expression selects; functions excluded."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _DURATION.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    return {
        name
        for name, call in _IDENTIFIER.findall(text)
        if not call and name not in _KEYWORDS and not re.fullmatch(r"\d\w*", name)
    }
