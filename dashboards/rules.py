"""The Prometheus rules of SARA, generated (docs/dashboard.md explains each rule).

Recording rules, per ``namespace`` (the label the scrape adds; without it, one series):

- ``sara:ttft_seconds:p99_rate5m``, ``sara:tpot_seconds:p99_rate5m``: P99 over 5m.
- ``sara:ttft_slo_attainment:ratio_rate<W>``, ``sara:tpot_slo_attainment:ratio_rate<W>``
  for W in ``ATTAINMENT_WINDOWS``: the fraction of requests within the SLO, counted
  with the histogram bucket whose ``le`` equals the SLO (so the SLO must be one of the
  router's bucket bounds; ``RuleConfig`` refuses any other value).
- ``sara:request_errors:ratio_rate5m``: the fraction of valid requests that failed.

Alerts: multi-window, multi-burn-rate alerts on both attainment SLIs (the SRE
workbook's set: page at 14.4x over 1h and 5m or 6x over 6h and 30m; ticket at 3x over
1d and 2h or 1x over 3d and 6h), the controller's metrics missing, the controller not
deciding, and a stuck scale-up.

    python -m dashboards.rules --write-all   # helm/sara/files/prometheus-rules.yaml
    python -m dashboards.rules --check       # exit 1 if the committed file differs
    python -m dashboards.rules --out FILE --ttft-slo 1.0 --objective 0.995
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dashboards.promql import (
    TPOT_METRIC,
    TTFT_METRIC,
    attainment,
    error_ratio,
    histogram_p99,
    tpot_bound,
    ttft_bound,
)

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "helm" / "sara" / "files" / "prometheus-rules.yaml"

BY = ("namespace",)
ATTAINMENT_WINDOWS: tuple[str, ...] = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
_DURATION = re.compile(r"^[1-9][0-9]*[smhd]$")


@dataclass(frozen=True, kw_only=True)
class BurnCondition:
    """Both windows burn the budget faster than ``factor`` times the allowed rate."""

    factor: float
    long_window: str
    short_window: str


@dataclass(frozen=True, kw_only=True)
class BurnAlert:
    suffix: str  # alert name: Sara<SLI>ErrorBudgetBurn<suffix>
    severity: str
    conditions: tuple[BurnCondition, ...]


# The SRE workbook's recommended set (chapter "Alerting on SLOs"), for a 30-day window:
# 14.4x for 1h spends 2 % of the budget, 6x for 6h 5 %, 3x for 1d and 1x for 3d 10 %.
PAGE = BurnAlert(
    suffix="Fast",
    severity="critical",
    conditions=(
        BurnCondition(factor=14.4, long_window="1h", short_window="5m"),
        BurnCondition(factor=6.0, long_window="6h", short_window="30m"),
    ),
)
TICKET = BurnAlert(
    suffix="Slow",
    severity="warning",
    conditions=(
        BurnCondition(factor=3.0, long_window="1d", short_window="2h"),
        BurnCondition(factor=1.0, long_window="3d", short_window="6h"),
    ),
)
BURN_ALERTS: tuple[BurnAlert, ...] = (PAGE, TICKET)


@dataclass(frozen=True, kw_only=True)
class RuleConfig:
    """The generator's parameters.

    ``ttft_slo_s``, ``tpot_slo_s``: SLOs in seconds, each a bucket bound of the router's
    histogram. ``objective``: the target attainment, in (0, 1). ``scale_up_stuck_for``:
    how long desired may exceed current replicas before ``SaraScaleUpStuck`` fires.
    ``controller_missing_for``: how long the controller's metrics may be missing (or
    its decisions stopped) before the staleness alerts fire. Durations are PromQL
    durations such as ``10m``. A bad value raises ``ValueError`` naming the field.
    """

    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    objective: float = 0.99
    scale_up_stuck_for: str = "10m"
    controller_missing_for: str = "10m"

    def __post_init__(self) -> None:
        ttft_bound(self.ttft_slo_s)
        tpot_bound(self.tpot_slo_s)
        if not 0.0 < self.objective < 1.0:
            raise ValueError(f"objective: must be in (0, 1), got {self.objective!r}")
        for name in ("scale_up_stuck_for", "controller_missing_for"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _DURATION.match(value):
                raise ValueError(f"{name}: must be a duration such as 10m, got {value!r}")

    @property
    def budget(self) -> str:
        """The error budget, 1 - objective, as a PromQL number (``0.01``)."""
        return repr(round(1.0 - self.objective, 12))


def _record_name(sli: str, window: str) -> str:
    return f"sara:{sli}_slo_attainment:ratio_rate{window}"


def recording_rules(config: RuleConfig) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = [
        {
            "record": f"sara:{sli}_seconds:p99_rate5m",
            "expr": histogram_p99(metric, matchers=[], window="5m", by=BY),
        }
        for sli, metric in (("ttft", TTFT_METRIC), ("tpot", TPOT_METRIC))
    ]
    for sli, metric, le in (
        ("ttft", TTFT_METRIC, ttft_bound(config.ttft_slo_s)),
        ("tpot", TPOT_METRIC, tpot_bound(config.tpot_slo_s)),
    ):
        rules.extend(
            {
                "record": _record_name(sli, window),
                "expr": attainment(metric, le=le, matchers=[], window=window, by=BY, split=True),
            }
            for window in ATTAINMENT_WINDOWS
        )
    rules.append(
        {
            "record": "sara:request_errors:ratio_rate5m",
            "expr": error_ratio(matchers=[], window="5m", by=BY, split=True),
        }
    )
    return rules


def _burn_expr(sli: str, alert: BurnAlert, budget: str) -> str:
    def over(window: str, factor: float) -> str:
        return f"  1 - {_record_name(sli, window)} > {factor:g} * {budget}"

    return "\nor\n".join(
        f"(\n{over(c.long_window, c.factor)}\nand\n{over(c.short_window, c.factor)}\n)"
        for c in alert.conditions
    )


def _budget_lasts(factor: float) -> str:
    """How long a 30-day error budget lasts when it burns ``factor`` times too fast."""
    days = 30.0 / factor
    return f"{days:.0f} days" if days >= 2 else f"{days * 24:.0f} hours"


def _pace(alert: BurnAlert) -> str:
    first, *others = alert.conditions
    return " or ".join(
        [
            f"{first.factor:g}x the sustainable rate over {first.long_window} and "
            f"{first.short_window} (a 30-day budget lasts {_budget_lasts(first.factor)})",
            *(
                f"{c.factor:g}x over {c.long_window} and {c.short_window} "
                f"({_budget_lasts(c.factor)})"
                for c in others
            ),
        ]
    )


def burn_alerts(config: RuleConfig) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    for sli, slo_s, le, pool, causes in (
        (
            "ttft",
            config.ttft_slo_s,
            ttft_bound(config.ttft_slo_s),
            "prefill",
            "the prefill queue depth and the KV transfer latency",
        ),
        (
            "tpot",
            config.tpot_slo_s,
            tpot_bound(config.tpot_slo_s),
            "decode",
            "the decode iteration time and KV cache utilization",
        ),
    ):
        name = sli.upper()
        for alert in BURN_ALERTS:
            speed = "fast" if alert.suffix == "Fast" else "steadily"
            rules.append(
                {
                    "alert": f"Sara{name}ErrorBudgetBurn{alert.suffix}",
                    "expr": _burn_expr(sli, alert, config.budget),
                    "labels": {"severity": alert.severity, "slo": sli},
                    "annotations": {
                        "summary": (
                            f"{name} SLO error budget burning {speed} in "
                            "{{ $labels.namespace }}"
                        ),
                        "description": (
                            f"Requests slower than the {name} SLO ({slo_s:g} s, bucket le={le} of "
                            f"sara_{sli}_seconds) spend the error budget of the "
                            f"{config.objective:g} objective at {_pace(alert)}. Check the "
                            f"{pool} pool on the dashboard: desired vs current replicas "
                            f"(SaraScaleUpStuck), the model error ratio, {causes}. If the "
                            "controller holds (metrics_stale, cooldown_up, clamped_max, gpu_budget "
                            "in Decisions by reason), raise its limit or scale the pool by hand."
                        ),
                    },
                }
            )
    return rules


def controller_alerts(config: RuleConfig) -> list[dict[str, Any]]:
    missing_for = config.controller_missing_for
    return [
        {
            "alert": "SaraControllerMetricsMissing",
            "expr": (
                "count by (namespace) (sara_requests_total)\n"
                "unless on (namespace)\n"
                "count by (namespace) (sara_controller_desired_replicas)"
            ),
            "for": missing_for,
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "SARA controller metrics missing in {{ $labels.namespace }}",
                "description": (
                    "The router's metrics are scraped but no sara_controller_* series "
                    f"has been scraped for {missing_for}: the controller is down, crash-looping "
                    "or not scraped, and nothing sizes the pools. Check the controller "
                    "pod, its logs and GET /healthz, and the scrape configuration."
                ),
            },
        },
        {
            "alert": "SaraControllerNotDeciding",
            "expr": (
                "count by (namespace, autoscaler) (sara_controller_desired_replicas)\n"
                "unless on (namespace, autoscaler)\n"
                "(\n"
                "  sum by (namespace, autoscaler) "
                f"(increase(sara_controller_decisions_total[{missing_for}])) > 0\n"
                ")"
            ),
            "for": "5m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": (
                    "SARA controller in {{ $labels.namespace }} makes no decisions"
                    "{{ with $labels.autoscaler }} (autoscaler {{ . }}){{ end }}"
                ),
                "description": (
                    "The controller's metrics are scraped but sara_controller_decisions_total "
                    f"has not advanced for {missing_for}: every tick ends before a decision "
                    "(invalid config, replicas unreadable, profile missing) or the loop "
                    "hangs, so its gauges are stale. Read the tick errors in GET /v1/status "
                    "and GET /v1/decisions and in the controller's logs."
                ),
            },
        },
        {
            "alert": "SaraControllerTickFailing",
            "expr": "max by (namespace, autoscaler) (sara_controller_tick_failing) > 0",
            "for": "2m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": (
                    "SARA controller ticks fail in {{ $labels.namespace }}"
                    "{{ with $labels.autoscaler }} (autoscaler {{ . }}){{ end }}"
                ),
                "description": (
                    "Every control tick for 2m has failed (an actuator, profile or any "
                    "other error), so nothing is scaled: a dead worker is not replaced. "
                    "GET /readyz and GET /v1/status give the error; so do the logs."
                ),
            },
        },
        {
            "alert": "SaraScaleUpStuck",
            "expr": (
                "max by (namespace, autoscaler, pool) (sara_controller_desired_replicas)\n"
                ">\n"
                "max by (namespace, autoscaler, pool) (sara_controller_current_replicas)"
            ),
            "for": config.scale_up_stuck_for,
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": ("{{ $labels.pool }} pool scale-up stuck in {{ $labels.namespace }}"),
                "description": (
                    "The controller has asked for more {{ $labels.pool }} replicas than "
                    f"the actuator reports for {config.scale_up_stuck_for}. Look for "
                    "Pending pods (no free GPU, quota, image pull), the Deployment's "
                    "conditions and the SLOAutoscaler status; in local mode, workers "
                    "that fail to start. The SLO burns until the replicas arrive."
                ),
            },
        },
    ]


def rule_groups(config: RuleConfig | None = None) -> dict[str, Any]:
    """The rule file's content (``groups:``) for ``config`` (defaults if ``None``)."""
    cfg = RuleConfig() if config is None else config
    groups = (
        ("sara-slo.rules", recording_rules(cfg)),
        ("sara-slo.alerts", burn_alerts(cfg)),
        ("sara-controller.alerts", controller_alerts(cfg)),
    )
    return {
        "groups": [
            {"name": name, "rules": [{**r, "expr": PromQL(r["expr"])} for r in rules]}
            for name, rules in groups
        ]
    }


# A private dumper class, so the representers below leave yaml.SafeDumper as it is.
# Expressions are written as literal blocks, long prose folded at the line width.
_Dumper: Any = type("_Dumper", (yaml.SafeDumper,), {})


def _str(dumper: Any, value: str) -> Any:
    style = ">" if len(value) > 80 and " " in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


def _expr(dumper: Any, value: str) -> Any:
    return dumper.represent_scalar("tag:yaml.org,2002:str", str(value), style="|")


class PromQL(str):
    """An expression: always written as a literal block, as it is."""


_Dumper.add_representer(str, _str)
_Dumper.add_representer(PromQL, _expr)

HEADER = (
    "# Prometheus rules for SARA. Generated by `python -m dashboards.rules --write-all`:\n"
    "# do not edit; docs/dashboard.md explains each rule.\n"
)


def render(config: RuleConfig | None = None) -> str:
    """The rule file as YAML text (deterministic: same config, same bytes)."""
    body: str = yaml.dump(
        rule_groups(config), Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=False
    )
    return HEADER + body


def rule_queries(config: RuleConfig | None = None) -> list[tuple[str, str]]:
    """(record or alert name, PromQL) for every rule, in file order."""
    return [
        (str(rule.get("record") or rule["alert"]), str(rule["expr"]))
        for group in rule_groups(config)["groups"]
        for rule in group["rules"]
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dashboards.rules", description="Write SARA's Prometheus rules."
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--out", type=Path, help="write the rule file here")
    action.add_argument(
        "--write-all", action="store_true", help=f"write {OUTPUT.relative_to(ROOT)}"
    )
    action.add_argument("--check", action="store_true", help="exit 1 if it differs")
    defaults = RuleConfig()
    parser.add_argument("--ttft-slo", type=float, default=defaults.ttft_slo_s, help="seconds")
    parser.add_argument("--tpot-slo", type=float, default=defaults.tpot_slo_s, help="seconds")
    parser.add_argument("--objective", type=float, default=defaults.objective)
    parser.add_argument("--scale-up-stuck-for", default=defaults.scale_up_stuck_for)
    parser.add_argument("--controller-missing-for", default=defaults.controller_missing_for)
    args = parser.parse_args(argv)
    try:
        config = RuleConfig(
            ttft_slo_s=args.ttft_slo,
            tpot_slo_s=args.tpot_slo,
            objective=args.objective,
            scale_up_stuck_for=args.scale_up_stuck_for,
            controller_missing_for=args.controller_missing_for,
        )
    except ValueError as exc:
        parser.error(str(exc))
    if args.out is None and config != defaults:
        parser.error("the committed file uses the defaults: pass --out with other values")
    text = render(config)
    if args.check:
        if not OUTPUT.is_file() or OUTPUT.read_text(encoding="utf-8") != text:
            print(f"{OUTPUT.relative_to(ROOT)}: differs from the generator", file=sys.stderr)
            return 1
        return 0
    path: Path = OUTPUT if args.out is None else args.out
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
