"""Grafana's dashboard model, as much of it as the SARA dashboard uses.

A ``Panel`` says what a panel shows (title, unit, description, PromQL targets);
``layout`` places rows of panels on the 24-column grid and numbers them;
``*_variable`` build template variables. Everything returns plain dicts for
``json.dumps``; nothing here knows SARA's metrics.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Every panel and query reads the data source chosen in ``$datasource``.
DATASOURCE: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}


class PanelKind(enum.Enum):
    TIMESERIES = "timeseries"
    STAT = "stat"


@dataclass(frozen=True, kw_only=True)
class Target:
    """One PromQL query of a panel; ``instant`` for a single value (stat panels)."""

    expr: str
    legend: str
    instant: bool = False


@dataclass(frozen=True, kw_only=True)
class Panel:
    """What a panel shows. ``thresholds``: (color, lower bound) steps, the first unbounded.

    ``threshold_lines`` draws the thresholds as lines; ``reference_series`` names the
    legend of a target drawn as a dashed red reference line (an SLO).
    """

    title: str
    description: str
    unit: str
    targets: tuple[Target, ...]
    kind: PanelKind = PanelKind.TIMESERIES
    min: float | None = 0.0
    max: float | None = None
    thresholds: tuple[tuple[str, float | None], ...] = (("green", None),)
    threshold_lines: bool = False
    stacked: bool = False
    log_scale: bool = False
    reference_series: str | None = None

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError(f"targets: panel {self.title!r} needs at least one")
        if not self.unit or not self.description:
            raise ValueError(f"unit, description: panel {self.title!r} needs both")


PANEL_WIDTH = 12  # two panels per line on Grafana's 24-column grid
PANEL_HEIGHT = 8


def _thresholds(steps: Sequence[tuple[str, float | None]]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in steps]}


def _target_json(target: Target, ref_id: str) -> dict[str, Any]:
    return {
        "datasource": DATASOURCE,
        "editorMode": "code",
        "expr": target.expr,
        "instant": target.instant,
        "legendFormat": target.legend,
        "range": not target.instant,
        "refId": ref_id,
    }


def _reference_override(name: str) -> dict[str, Any]:
    return {
        "matcher": {"id": "byName", "options": name},
        "properties": [
            {"id": "color", "value": {"fixedColor": "red", "mode": "fixed"}},
            {"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}},
            {"id": "custom.fillOpacity", "value": 0},
        ],
    }


def panel_json(panel: Panel, *, panel_id: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "thresholds": _thresholds(panel.thresholds),
        "unit": panel.unit,
    }
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.max is not None:
        defaults["max"] = panel.max
    options: dict[str, Any]
    if panel.kind is PanelKind.TIMESERIES:
        defaults["color"] = {"mode": "palette-classic"}
        defaults["custom"] = {
            "drawStyle": "line",
            "fillOpacity": 10,
            "lineWidth": 1,
            "scaleDistribution": {"log": 10, "type": "log"}
            if panel.log_scale
            else {"type": "linear"},
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"group": "A", "mode": "normal" if panel.stacked else "none"},
            "thresholdsStyle": {"mode": "line" if panel.threshold_lines else "off"},
        }
        options = {
            "legend": {
                "calcs": [],
                "displayMode": "list",
                "placement": "bottom",
                "showLegend": True,
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    else:
        defaults["color"] = {"mode": "thresholds"}
        defaults["decimals"] = 2
        options = {
            "colorMode": "value",
            "graphMode": "none",
            "justifyMode": "auto",
            "orientation": "auto",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": "auto",
        }
    overrides = (
        [] if panel.reference_series is None else [_reference_override(panel.reference_series)]
    )
    return {
        "datasource": DATASOURCE,
        "description": panel.description,
        "fieldConfig": {"defaults": defaults, "overrides": overrides},
        "gridPos": {"h": PANEL_HEIGHT, "w": PANEL_WIDTH, "x": x, "y": y},
        "id": panel_id,
        "options": options,
        "targets": [_target_json(t, chr(ord("A") + i)) for i, t in enumerate(panel.targets)],
        "title": panel.title,
        "type": panel.kind.value,
    }


def row_json(title: str, *, panel_id: int, y: int) -> dict[str, Any]:
    return {
        "collapsed": False,
        "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
        "id": panel_id,
        "panels": [],
        "title": title,
        "type": "row",
    }


def custom_variable(
    name: str, label: str, choices: Sequence[str], default: str, description: str
) -> dict[str, Any]:
    if default not in choices:
        raise ValueError(f"{name}: default {default!r} is not one of {list(choices)}")
    return {
        "current": {"selected": True, "text": default, "value": default},
        "description": description,
        "hide": 0,
        "includeAll": False,
        "label": label,
        "multi": False,
        "name": name,
        "options": [{"selected": c == default, "text": c, "value": c} for c in choices],
        "query": ",".join(choices),
        "skipUrlSync": False,
        "type": "custom",
    }


def label_variable(name: str, label: str, query: str, description: str) -> dict[str, Any]:
    return {
        "allValue": ".*",
        "current": {"selected": True, "text": "All", "value": "$__all"},
        "datasource": DATASOURCE,
        "definition": query,
        "description": description,
        "hide": 0,
        "includeAll": True,
        "label": label,
        "multi": False,
        "name": name,
        "options": [],
        "query": {
            "qryType": 1,
            "query": query,
            "refId": "PrometheusVariableQueryEditor-VariableQuery",
        },
        "refresh": 2,
        "regex": "",
        "skipUrlSync": False,
        "sort": 1,
        "type": "query",
    }


def layout(rows: Sequence[tuple[str, Sequence[Panel]]]) -> list[dict[str, Any]]:
    """Rows of panels on the grid, two panels a line, ids 1, 2, ... in reading order."""
    out: list[dict[str, Any]] = []
    y = 0
    for title, row_panels in rows:
        out.append(row_json(title, panel_id=len(out) + 1, y=y))
        y += 1
        for i, panel in enumerate(row_panels):
            x = (i % 2) * PANEL_WIDTH
            out.append(panel_json(panel, panel_id=len(out) + 1, x=x, y=y))
            if i % 2 == 1 or i == len(row_panels) - 1:
                y += PANEL_HEIGHT
    return out


def datasource_variable() -> dict[str, Any]:
    """``$datasource``: a choice among the Prometheus data sources."""
    return {
        "current": {},
        "hide": 0,
        "includeAll": False,
        "label": "Data source",
        "multi": False,
        "name": "datasource",
        "options": [],
        "query": "prometheus",
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
        "type": "datasource",
    }


_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """``expr`` with ``$name`` and ``${name}`` replaced; raises ``KeyError`` if one is unset."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise KeyError(f"template variable ${name} has no value (in {expr!r})")
        return variables[name]

    return _VARIABLE.sub(value, expr)
