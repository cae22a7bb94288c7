"""The Grafana SLO dashboard of SARA, generated (docs/dashboard.md explains each panel).

One function per panel returns a ``Panel`` (title, unit, description, PromQL targets);
``build_dashboard`` lays the panels out on a fixed grid, numbers them in order and
returns the dashboard model; ``render`` turns it into JSON with sorted keys, so the
same code always writes the same bytes. ``dashboard_queries`` lists every PromQL
expression with the template variables filled in, for tests that run them against a
real Prometheus.

Template variables: ``datasource`` (a Prometheus data source), ``namespace`` and
``autoscaler`` (label values; "All" is the regex ``.*``, which also matches series
without the label, e.g. a controller not run by the operator), ``window`` (the SLO
window of the attainment and error-budget panels), ``objective`` (the attainment
objective), ``ttft_slo`` and ``tpot_slo`` (the SLOs in seconds; their choices are the
router's histogram bucket bounds, the only values the attainment SLI can count at).

    python -m dashboards.sara_slo --out dashboards/sara-slo.json
    python -m dashboards.sara_slo --write-all     # both committed copies
    python -m dashboards.sara_slo --check         # exit 1 if a committed copy differs
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dashboards.grafana import (
    Panel,
    PanelKind,
    Target,
    custom_variable,
    datasource_variable,
    label_variable,
    layout,
    substitute,
)
from dashboards.promql import (
    TPOT_METRIC,
    TTFT_METRIC,
    aggregate,
    attainment,
    bounds_between,
    burn_rate,
    error_ratio,
    histogram_mean,
    histogram_p99,
    rate,
    selector,
    tpot_bound,
    ttft_bound,
)
from dashboards.rules import PAGE
from workers.router_metrics import TPOT_BUCKETS_S, TTFT_BUCKETS_S

ROOT = Path(__file__).resolve().parent.parent
OUTPUTS: tuple[Path, ...] = (
    ROOT / "dashboards" / "sara-slo.json",
    ROOT / "helm" / "sara" / "files" / "sara-slo.json",
)

UID = "sara-slo"
TITLE = "SARA: SLOs and autoscaling"
SCHEMA_VERSION = 39

# Label matchers: router and worker series carry the scrape's ``namespace``; the
# controller's also an ``autoscaler`` when the operator runs it.
NS = 'namespace=~"$namespace"'
CONTROLLER = (NS, 'autoscaler=~"$autoscaler"')
RATE_WINDOW = "$__rate_interval"
WAITING = 'state="waiting"'

DEFAULT_TTFT_SLO_S = 2.0
DEFAULT_TPOT_SLO_S = 0.1
DEFAULT_OBJECTIVE = "0.99"
DEFAULT_WINDOW = "1h"
WINDOWS: tuple[str, ...] = ("5m", "1h", "6h", "1d", "7d", "28d", "30d")
OBJECTIVES: tuple[str, ...] = ("0.9", "0.95", "0.99", "0.995", "0.999")
# The SLO choices: bucket bounds in a plausible range (the router has more).
TTFT_SLO_CHOICES = bounds_between(TTFT_BUCKETS_S, 0.1, 30.0)
TPOT_SLO_CHOICES = bounds_between(TPOT_BUCKETS_S, 0.01, 1.0)

# The burn-rate thresholds of the paging alert (14.4 and 6), drawn as lines.
FAST_BURN, SLOW_BURN = (c.factor for c in PAGE.conditions)

# What ``dashboard_queries`` substitutes when the caller does not say.
DEFAULT_VARIABLES: dict[str, str] = {
    "namespace": ".*",
    "autoscaler": ".*",
    "window": DEFAULT_WINDOW,
    "objective": DEFAULT_OBJECTIVE,
    "ttft_slo": ttft_bound(DEFAULT_TTFT_SLO_S),
    "tpot_slo": tpot_bound(DEFAULT_TPOT_SLO_S),
    "__rate_interval": "1m",
}


# -- SLOs ---------------------------------------------------------------------------------


def ttft_p99() -> Panel:
    return Panel(
        title="P99 time to first token",
        description=(
            "P99 TTFT measured at the router (arrival to first token) over the rate "
            "interval, with the TTFT SLO as a dashed line. Above the line, the prefill "
            "pool is too small or a burst is being absorbed."
        ),
        unit="s",
        targets=(
            Target(
                expr=histogram_p99(TTFT_METRIC, matchers=[NS], window=RATE_WINDOW),
                legend="P99 TTFT",
            ),
            Target(expr="vector($ttft_slo)", legend="SLO"),
        ),
        reference_series="SLO",
    )


def tpot_p99() -> Panel:
    return Panel(
        title="P99 time per output token",
        description=(
            "P99 TPOT measured at the router (per request: decode time / (tokens - 1)) "
            "over the rate interval, with the TPOT SLO as a dashed line. Above the "
            "line, the decode pool is too small."
        ),
        unit="s",
        targets=(
            Target(
                expr=histogram_p99(TPOT_METRIC, matchers=[NS], window=RATE_WINDOW),
                legend="P99 TPOT",
            ),
            Target(expr="vector($tpot_slo)", legend="SLO"),
        ),
        reference_series="SLO",
    )


def _ttft_attainment(window: str) -> str:
    return attainment(TTFT_METRIC, le="$ttft_slo", matchers=[NS], window=window)


def _tpot_attainment(window: str) -> str:
    return attainment(TPOT_METRIC, le="$tpot_slo", matchers=[NS], window=window)


def slo_attainment() -> Panel:
    return Panel(
        title="SLO attainment over the SLO window",
        description=(
            "Fraction of requests whose TTFT (resp. TPOT) was at most the SLO over the "
            "chosen SLO window: the rate of the histogram bucket with le equal to the "
            "SLO over the rate of all observations. Compare it with the objective."
        ),
        unit="percentunit",
        kind=PanelKind.STAT,
        max=1.0,
        targets=(
            Target(expr=_ttft_attainment("$window"), legend="TTFT", instant=True),
            Target(expr=_tpot_attainment("$window"), legend="TPOT", instant=True),
        ),
    )


def error_budget_remaining() -> Panel:
    return Panel(
        title="Error budget remaining over the SLO window",
        description=(
            "Share of the error budget (1 - objective) not yet spent over the SLO window: "
            "1 - (1 - attainment) / (1 - objective). 100 % means no slow request, 0 % "
            "means the objective is just met, below 0 it is missed."
        ),
        unit="percentunit",
        kind=PanelKind.STAT,
        min=None,
        max=1.0,
        thresholds=(("red", None), ("yellow", 0.0), ("green", 0.25)),
        targets=(
            Target(
                expr="1 - " + burn_rate(_ttft_attainment("$window"), objective="$objective"),
                legend="TTFT",
                instant=True,
            ),
            Target(
                expr="1 - " + burn_rate(_tpot_attainment("$window"), objective="$objective"),
                legend="TPOT",
                instant=True,
            ),
        ),
    )


_BURN_WINDOWS = ("5m", "30m", "1h", "6h")


def _burn_rate_panel(slo: str, attainment_of: Callable[[str], str]) -> Panel:
    return Panel(
        title=f"{slo} error budget burn rate",
        description=(
            f"How many times faster than allowed the {slo} error budget burns, over 5m, "
            "30m, 1h and 6h: (1 - attainment) / (1 - objective); 1 spends the budget "
            "exactly over the SLO window. The paging alert fires when both the 1h and "
            f"5m rates exceed {FAST_BURN} (red line), or both the 6h and 30m exceed "
            f"{SLOW_BURN:g} (orange line)."
        ),
        unit="suffix:x",
        thresholds=(("green", None), ("orange", SLOW_BURN), ("red", FAST_BURN)),
        threshold_lines=True,
        targets=tuple(
            Target(expr=burn_rate(attainment_of(w), objective="$objective"), legend=w)
            for w in _BURN_WINDOWS
        ),
    )


def ttft_burn_rate() -> Panel:
    return _burn_rate_panel("TTFT", _ttft_attainment)


def tpot_burn_rate() -> Panel:
    return _burn_rate_panel("TPOT", _tpot_attainment)


def request_outcomes() -> Panel:
    return Panel(
        title="Requests by outcome",
        description=(
            "Requests per second by how they ended at the router: ok, invalid (client "
            "error), rejected (queue full), unavailable (Redis down), timeout, error, "
            "cancelled (client left)."
        ),
        unit="reqps",
        stacked=True,
        targets=(
            Target(
                expr=aggregate(
                    "sum", rate("sara_request_outcomes_total", [NS], RATE_WINDOW), ["outcome"]
                ),
                legend="{{outcome}}",
            ),
        ),
    )


def request_error_ratio() -> Panel:
    return Panel(
        title="Request error ratio",
        description=(
            "Fraction of valid requests that failed (rejected, unavailable, timeout, "
            "error) over the rate interval. Failed requests are outside the latency "
            "SLIs, so watch this next to them."
        ),
        unit="percentunit",
        targets=(
            Target(expr=error_ratio(matchers=[NS], window=RATE_WINDOW), legend="error ratio"),
        ),
    )


# -- Autoscaling ----------------------------------------------------------------------------


def arrival_rate() -> Panel:
    return Panel(
        title="Arrival rate: raw vs smoothed",
        description=(
            "Requests per second: the controller's raw measurement and the smoothed "
            "(EMA) rate its solver sized the pools for, and the rate counted at the "
            "router. Smoothed lagging far behind raw during a ramp means slow reaction."
        ),
        unit="reqps",
        targets=(
            Target(
                expr=aggregate(
                    "max",
                    f"sara_controller_arrival_rate_rps{selector(CONTROLLER)}",
                    ["autoscaler", "kind"],
                ),
                legend="{{kind}} {{autoscaler}}",
            ),
            Target(
                expr=aggregate("sum", rate("sara_requests_total", [NS], RATE_WINDOW)),
                legend="at the router",
            ),
        ),
    )


def replicas() -> Panel:
    by = ["autoscaler", "pool"]
    return Panel(
        title="Desired vs current replicas",
        description=(
            "Per pool: the replicas the latest tick asked for, the replicas the actuator "
            "reported, and the workers with a live heartbeat at the router. Desired above "
            "current for long is a stuck scale-up (pending pods, quota)."
        ),
        unit="short",
        targets=(
            Target(
                expr=aggregate(
                    "max", f"sara_controller_desired_replicas{selector(CONTROLLER)}", by
                ),
                legend="{{pool}} desired {{autoscaler}}",
            ),
            Target(
                expr=aggregate(
                    "max", f"sara_controller_current_replicas{selector(CONTROLLER)}", by
                ),
                legend="{{pool}} current {{autoscaler}}",
            ),
            Target(
                expr=aggregate("sum", f"sara_router_live_workers{selector([NS])}", ["pool"]),
                legend="{{pool}} live at router",
            ),
        ),
    )


def predicted_vs_observed() -> Panel:
    by = ["autoscaler", "pool"]
    return Panel(
        title="Predicted vs observed P99",
        description=(
            "Per pool, the queueing model's P99 at the desired replicas and the P99 the "
            "controller observed (TTFT for prefill, TPOT for decode; log scale). Observed "
            "well above predicted means the model is optimistic."
        ),
        unit="s",
        min=None,
        log_scale=True,
        targets=(
            Target(
                expr=aggregate(
                    "max", f"sara_controller_predicted_p99_seconds{selector(CONTROLLER)}", by
                ),
                legend="{{pool}} predicted {{autoscaler}}",
            ),
            Target(
                expr=aggregate(
                    "max", f"sara_controller_observed_p99_seconds{selector(CONTROLLER)}", by
                ),
                legend="{{pool}} observed {{autoscaler}}",
            ),
        ),
    )


def model_error_ratio() -> Panel:
    return Panel(
        title="Model error ratio (observed / predicted P99)",
        description=(
            "Per pool, observed P99 divided by predicted P99: 1 is a perfect model, above "
            "1 the model is optimistic (under-provisions), below 1 pessimistic (costs GPUs)."
        ),
        unit="suffix:x",
        thresholds=(("green", None), ("orange", 1.15)),
        threshold_lines=True,
        targets=(
            Target(
                expr=aggregate(
                    "max",
                    f"sara_controller_model_error_ratio{selector(CONTROLLER)}",
                    ["autoscaler", "pool"],
                ),
                legend="{{pool}} {{autoscaler}}",
            ),
        ),
    )


def decisions_by_reason() -> Panel:
    return Panel(
        title="Decisions by reason",
        description=(
            "Controller ticks per second, by pool and by the reason that decided the "
            "pool's target (scale_up, within_dead_band, cooldown_down, metrics_stale, ...). "
            "A steady metrics_stale means the controller is holding on missing data."
        ),
        unit="ops",
        stacked=True,
        targets=(
            Target(
                expr=aggregate(
                    "sum",
                    rate("sara_controller_decisions_total", CONTROLLER, RATE_WINDOW),
                    ["pool", "reason"],
                ),
                legend="{{pool}} {{reason}}",
            ),
        ),
    )


def failing_ticks() -> Panel:
    return Panel(
        title="Failing control ticks",
        description=(
            "1 while the controller's latest tick failed (an actuator, profile or any other "
            "error: GET /readyz and /v1/status say which), 0 after one that succeeded. A "
            "controller whose ticks fail scales nothing; SaraControllerTickFailing fires."
        ),
        unit="short",
        targets=(
            Target(
                expr=aggregate("max", f"sara_controller_tick_failing{selector(CONTROLLER)}"),
                legend="failing",
            ),
        ),
    )


def solve_time() -> Panel:
    return Panel(
        title="Capacity solve time P99",
        description=(
            "P99 wall time of one capacity solve (the binary search over pool sizes). It "
            "should stay well under a millisecond."
        ),
        unit="s",
        targets=(
            Target(
                expr=histogram_p99(
                    "sara_controller_solve_seconds", matchers=CONTROLLER, window=RATE_WINDOW
                ),
                legend="P99 solve",
            ),
        ),
    )


# -- Workers and KV transfer ----------------------------------------------------------------


def queue_depth() -> Panel:
    return Panel(
        title="Queue depth",
        description=(
            "Per pool, requests the workers hold (waiting or running) and requests "
            "waiting in the pool's Redis stream (not yet taken by a worker); and requests "
            "in flight at the router. A growing prefill queue comes before a TTFT violation."
        ),
        unit="short",
        targets=(
            Target(
                expr=aggregate("sum", f"sara_worker_queue_depth{selector([NS])}", ["pool"]),
                legend="{{pool}} held by workers",
            ),
            Target(
                expr=aggregate(
                    "sum",
                    "sara_router_stream_requests" + selector([NS, WAITING]),
                    ["pool"],
                ),
                legend="{{pool}} waiting in stream",
            ),
            Target(
                expr=aggregate("sum", f"sara_router_inflight_requests{selector([NS])}"),
                legend="in flight at router",
            ),
        ),
    )


def iteration_time() -> Panel:
    return Panel(
        title="Worker iteration time P99",
        description=(
            "Per pool, P99 wall time of one engine iteration (one batch step). Decode "
            "iterations bound TPOT; long prefill iterations mean large chunks."
        ),
        unit="s",
        targets=(
            Target(
                expr=histogram_p99(
                    "sara_worker_iteration_seconds", matchers=[NS], window=RATE_WINDOW, by=["pool"]
                ),
                legend="{{pool}}",
            ),
        ),
    )


def batch_tokens() -> Panel:
    return Panel(
        title="Tokens per iteration",
        description=(
            "Per pool, mean tokens scheduled in one iteration (the batch under the token "
            "budget). Near the budget, the pool is saturated."
        ),
        unit="short",
        targets=(
            Target(
                expr=histogram_mean(
                    "sara_worker_batch_tokens", matchers=[NS], window=RATE_WINDOW, by=["pool"]
                ),
                legend="{{pool}}",
            ),
        ),
    )


def kv_utilization() -> Panel:
    return Panel(
        title="KV cache utilization",
        description=(
            "Per pool, the fraction of KV cache blocks in use: the fullest worker and the "
            "average. A full cache on decode workers stalls admissions."
        ),
        unit="percentunit",
        max=1.0,
        targets=(
            Target(
                expr=aggregate("max", f"sara_worker_kv_utilization{selector([NS])}", ["pool"]),
                legend="{{pool}} max",
            ),
            Target(
                expr=aggregate("avg", f"sara_worker_kv_utilization{selector([NS])}", ["pool"]),
                legend="{{pool}} mean",
            ),
        ),
    )


def kv_transfer_latency() -> Panel:
    return Panel(
        title="KV transfer latency P99",
        description=(
            "Per transport (redis, nccl) and direction, P99 time of one request's KV cache "
            "transfer: the send on the prefill worker and the receive on the decode "
            "worker. Both add to TTFT."
        ),
        unit="s",
        targets=(
            Target(
                expr=histogram_p99(
                    "sara_kv_transfer_seconds",
                    matchers=[NS],
                    window=RATE_WINDOW,
                    by=["transport", "direction"],
                ),
                legend="{{transport}} {{direction}}",
            ),
        ),
    )


def kv_transfer_throughput() -> Panel:
    return Panel(
        title="KV transfer throughput",
        description=(
            "Per transport and direction, bytes of KV cache moved per second (each byte "
            "is counted once sent, by the prefill worker, and once received, by the "
            "decode worker)."
        ),
        unit="Bps",
        targets=(
            Target(
                expr=aggregate(
                    "sum",
                    rate("sara_kv_transfer_bytes_total", [NS], RATE_WINDOW),
                    ["transport", "direction"],
                ),
                legend="{{transport}} {{direction}}",
            ),
        ),
    )


ROWS: tuple[tuple[str, tuple[Callable[[], Panel], ...]], ...] = (
    (
        "Service level objectives",
        (
            ttft_p99,
            tpot_p99,
            slo_attainment,
            error_budget_remaining,
            ttft_burn_rate,
            tpot_burn_rate,
            request_outcomes,
            request_error_ratio,
        ),
    ),
    (
        "Autoscaling",
        (
            arrival_rate,
            replicas,
            predicted_vs_observed,
            model_error_ratio,
            decisions_by_reason,
            failing_ticks,
            solve_time,
        ),
    ),
    (
        "Workers and KV transfer",
        (
            queue_depth,
            iteration_time,
            batch_tokens,
            kv_utilization,
            kv_transfer_latency,
            kv_transfer_throughput,
        ),
    ),
)


def _variables() -> list[dict[str, Any]]:
    return [
        datasource_variable(),
        label_variable(
            "namespace",
            "Namespace",
            "label_values(sara_requests_total, namespace)",
            "Kubernetes namespace of the router, workers and controller (All: any, or none).",
        ),
        label_variable(
            "autoscaler",
            "Autoscaler",
            'label_values(sara_controller_desired_replicas{namespace=~"$namespace"}, autoscaler)',
            "SLOAutoscaler resource whose controller metrics to show (All: any, or none).",
        ),
        custom_variable(
            "window",
            "SLO window",
            WINDOWS,
            DEFAULT_WINDOW,
            "Window of the attainment and error-budget panels (30d in production).",
        ),
        custom_variable(
            "objective",
            "Objective",
            OBJECTIVES,
            DEFAULT_OBJECTIVE,
            "Target fraction of requests within the SLO; 1 - objective is the error budget.",
        ),
        custom_variable(
            "ttft_slo",
            "TTFT SLO (s)",
            TTFT_SLO_CHOICES,
            DEFAULT_VARIABLES["ttft_slo"],
            "P99 TTFT SLO in seconds; the choices are the TTFT histogram's bucket bounds.",
        ),
        custom_variable(
            "tpot_slo",
            "TPOT SLO (s)",
            TPOT_SLO_CHOICES,
            DEFAULT_VARIABLES["tpot_slo"],
            "P99 TPOT SLO in seconds; the choices are the TPOT histogram's bucket bounds.",
        ),
    ]


def build_dashboard() -> dict[str, Any]:
    """The dashboard model: rows of panels, ids 1, 2, ... in reading order."""
    panels = layout([(title, [make() for make in makers]) for title, makers in ROWS])
    return {
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": "P99 TTFT/TPOT against their SLOs, error budgets, and what the "
        "SARA autoscaler decided and why.",
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [],
        "panels": panels,
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": ["sara", "slo", "autoscaling"],
        "templating": {"list": _variables()},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": TITLE,
        "uid": UID,
        "version": 1,
        "weekStart": "",
    }


def render(dashboard: Mapping[str, Any] | None = None) -> str:
    """The dashboard as JSON text: sorted keys, two-space indent, final newline."""
    model = build_dashboard() if dashboard is None else dashboard
    return json.dumps(model, indent=2, sort_keys=True, ensure_ascii=True) + "\n"


# -- Queries for tests ----------------------------------------------------------------------


def dashboard_queries(variables: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, variables filled in.

    ``variables`` overrides ``DEFAULT_VARIABLES`` (namespace and autoscaler ``.*``,
    window ``1h``, objective ``0.99``, SLOs 2 s and 0.1 s, ``__rate_interval`` ``1m``).
    SLO values are normalised to the bucket label text (``"2"`` becomes ``"2.0"``).
    Raises ``ValueError`` for an unknown variable name or an SLO that is not a bucket
    bound.
    """
    values = dict(DEFAULT_VARIABLES)
    for name, value in (variables or {}).items():
        if name not in DEFAULT_VARIABLES:
            raise ValueError(f"variables: unknown {name!r}, expected {sorted(DEFAULT_VARIABLES)}")
        values[name] = value
    values["ttft_slo"] = ttft_bound(float(values["ttft_slo"]))
    values["tpot_slo"] = tpot_bound(float(values["tpot_slo"]))
    return [
        (panel.title, substitute(target.expr, values))
        for _, panel_functions in ROWS
        for make in panel_functions
        for panel in (make(),)
        for target in panel.targets
    ]


# -- CLI ------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dashboards.sara_slo", description="Write the SARA Grafana dashboard."
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--out", type=Path, help="write the dashboard JSON to this file")
    action.add_argument(
        "--write-all", action="store_true", help="write every committed copy of the dashboard"
    )
    action.add_argument("--check", action="store_true", help="exit 1 if a committed copy differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        stale = [p for p in OUTPUTS if not p.is_file() or p.read_text(encoding="utf-8") != text]
        for path in stale:
            print(f"{path.relative_to(ROOT)}: differs from the generator", file=sys.stderr)
        return 1 if stale else 0
    for path in [args.out] if args.out is not None else list(OUTPUTS):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
