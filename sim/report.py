"""Presenting back-test results: the summary table (text, Markdown, HTML) and a
report directory with PNG plots and an ``index.html``.

This is the I/O edge of the back-testing code: it writes files and draws with
matplotlib (imported only when plotting, through its object-oriented API with the
Agg canvas, so no global pyplot state and no display is needed).
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from queueing.pools import Pool
from sim.backtest import BacktestResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PLOTS = ("load.png", "replicas.png", "latency.png", "gpu_hours.png")

# A fixed colour and line style per policy, so a policy looks the same in every plot.
# Policies that often coincide (sara and sara-forecast; either and a static pool)
# differ in line style too, so a line hidden under another still shows.
_STYLE: dict[str, tuple[str, str]] = {
    "sara": ("#1f77b4", "-"),
    "sara-forecast": ("#17becf", "--"),
    "oracle": ("#000000", "--"),
    "static-peak": ("#7f7f7f", "-."),
    "static-mean": ("#bcbd22", "-."),
    "threshold": ("#ff7f0e", "-"),
    "throughput": ("#d62728", "-"),
    "throughput-trend": ("#9467bd", "-"),
}
_FALLBACK = ("#2ca02c", "#8c564b", "#e377c2")


@dataclass(frozen=True, kw_only=True)
class Row:
    """One policy's line of the summary table."""

    policy: str
    slo_attainment: float | None
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    gpu_hours: float
    relative_gpu_hours: float | None  # over the reference policy's
    prefill_events_per_hour: float
    decode_events_per_hour: float
    lost_requests: int


def reference_policy(results: Mapping[str, BacktestResult]) -> str | None:
    """What relative GPU-hours are over: the oracle if it ran, else static-peak."""
    return next((n for n in ("oracle", "static-peak") if n in results), None)


def summary_rows(
    results: Mapping[str, BacktestResult], *, reference: str | None = "oracle"
) -> list[Row]:
    """Table rows in the order of ``results``; GPU-hours relative to ``reference``
    when it is among them (else the column is empty)."""
    ref = results.get(reference) if reference is not None else None
    ref_gpu = ref.summary.gpu_hours if ref is not None else None
    rows = []
    for name, r in results.items():
        per_hour = r.scale_events_per_hour
        rows.append(
            Row(
                policy=name,
                slo_attainment=r.summary.slo_attainment,
                ttft_p99_s=r.summary.ttft_p99_s,
                tpot_p99_s=r.summary.tpot_p99_s,
                gpu_hours=r.summary.gpu_hours,
                relative_gpu_hours=(r.summary.gpu_hours / ref_gpu) if ref_gpu else None,
                prefill_events_per_hour=per_hour.get("prefill", 0.0),
                decode_events_per_hour=per_hour.get("decode", 0.0),
                lost_requests=r.summary.lost_requests,
            )
        )
    return rows


def headers(reference: str | None = "oracle") -> tuple[str, ...]:
    return (
        "policy",
        "SLO attainment",
        "P99 TTFT (s)",
        "P99 TPOT (s)",
        "GPU-hours",
        f"x {reference}" if reference else "x reference",
        "scale events/h (P/D)",
        "lost",
    )


def _cells(row: Row) -> list[str]:
    def num(value: float | None, spec: str) -> str:
        return "-" if value is None or not math.isfinite(value) else format(value, spec)

    return [
        row.policy,
        "-" if row.slo_attainment is None else f"{100 * row.slo_attainment:.2f} %",
        num(row.ttft_p99_s, ".3g"),
        num(row.tpot_p99_s, ".3g"),
        f"{row.gpu_hours:.1f}",
        num(row.relative_gpu_hours, ".2f"),
        f"{row.prefill_events_per_hour:.1f} / {row.decode_events_per_hour:.1f}",
        str(row.lost_requests),
    ]


def format_table(
    rows: Sequence[Row], *, markdown: bool = False, reference: str | None = "oracle"
) -> str:
    """The rows as an aligned text table, or as a Markdown table; ``reference`` names
    the policy the relative GPU-hours are over (as given to ``summary_rows``)."""
    titles = headers(reference)
    body = [_cells(r) for r in rows]
    if markdown:
        lines = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(c[i]) for c in body)) for i, h in enumerate(titles)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(titles, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip() for cells in body
    ]
    return "\n".join(lines)


def html_table(rows: Sequence[Row], *, reference: str | None = "oracle") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers(reference))
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in _cells(r)) + "</tr>" for r in rows
    )
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>{body}</tbody>\n</table>"


# -- plots ---------------------------------------------------------------------------------


def _style(name: str, index: int) -> tuple[str, str]:
    return _STYLE.get(name, (_FALLBACK[index % len(_FALLBACK)], "-"))


def _minutes(result: BacktestResult) -> np.ndarray:
    s = result.series
    return np.asarray((s.start_s + s.window_s / 2.0) / 60.0)


def _figure(rows: int) -> tuple[Figure, list[Axes]]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.4 * rows), dpi=100, layout="constrained")
    axes = [fig.add_subplot(rows, 1, i + 1) for i in range(rows)]
    return fig, axes


def _legend(ax: Axes) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)


def _plot_load(result: BacktestResult, path: Path) -> None:
    fig, (ax,) = _figure(1)
    s = result.series
    ax.plot(_minutes(result), s.arrival_rate_rps, color="#333333", label="arrival rate")
    ax.set_title(f"Load (requests arriving per {s.window_s:g}-s window)")
    ax.set_xlabel("time (min)")
    ax.set_ylabel("arrival rate (req/s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _legend(ax)
    fig.savefig(path)


def _plot_replicas(results: Mapping[str, BacktestResult], path: Path) -> None:
    from matplotlib.ticker import MaxNLocator

    fig, axes = _figure(2)
    for pool, ax in zip(Pool, axes, strict=True):
        column = 1 if pool is Pool.PREFILL else 2  # timeline rows: (time, prefill, decode)
        for i, (name, r) in enumerate(results.items()):
            times = [t / 60.0 for t, _, _ in r.timeline] + [r.duration_s / 60.0]
            sizes = [row[column] for row in r.timeline]
            sizes.append(sizes[-1])
            colour, dash = _style(name, i)
            ax.step(times, sizes, where="post", color=colour, linestyle=dash, label=name)
        ax.set_title(f"{pool.value.capitalize()} pool: provisioned workers (starting or serving)")
        ax.set_xlabel("time (min)")
        ax.set_ylabel("workers")
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        _legend(ax)
    fig.savefig(path)


def _plot_latency(
    results: Mapping[str, BacktestResult], ttft_slo_s: float, tpot_slo_s: float, path: Path
) -> None:
    fig, axes = _figure(2)
    for ax, key, label, slo in (
        (axes[0], "ttft_p99_s", "P99 TTFT", ttft_slo_s),
        (axes[1], "tpot_p99_s", "P99 TPOT", tpot_slo_s),
    ):
        for i, (name, r) in enumerate(results.items()):
            colour, dash = _style(name, i)
            values = getattr(r.series, key)
            ax.plot(_minutes(r), values, color=colour, linestyle=dash, label=name, marker=".")
        ax.axhline(slo, color="#d62728", linestyle=":", linewidth=2, label=f"SLO {slo:g} s")
        window = next(iter(results.values())).series.window_s
        ax.set_title(f"{label} of the requests arriving in each {window:g}-s window")
        ax.set_xlabel("time (min)")
        ax.set_ylabel(f"{label} (s, log scale)")
        ax.set_yscale("log")
        _plain_log_labels(ax)
        ax.grid(alpha=0.3, which="both")
        _legend(ax)
    fig.savefig(path)


def _plain_log_labels(ax: Axes) -> None:
    """Label a log axis with plain numbers (0.5, 1, 2, 5) instead of powers of ten."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda value, _: f"{value:g}")
    ax.yaxis.set_major_formatter(plain)
    low, high = ax.get_ylim()
    if high / low < 100:  # a narrow range: also label the 2x and 5x minor ticks
        decades = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
        minors = [m * 10.0**d for d in decades for m in (2, 5)]
        ax.yaxis.set_minor_locator(FixedLocator([v for v in minors if low <= v <= high]))
        ax.yaxis.set_minor_formatter(plain)
    else:
        ax.yaxis.set_minor_formatter(NullFormatter())


def _plot_gpu_hours(results: Mapping[str, BacktestResult], path: Path) -> None:
    fig, (ax,) = _figure(1)
    for i, (name, r) in enumerate(results.items()):
        colour, dash = _style(name, i)
        s = r.series
        end_min = (s.start_s + s.window_s) / 60.0
        ax.plot(
            np.concatenate([[0.0], end_min]),
            np.concatenate([[0.0], s.gpu_hours_cumulative]),
            color=colour,
            linestyle=dash,
            label=f"{name} ({r.summary.gpu_hours:.1f} GPU-h in all)",
        )
    ax.set_title("Cumulative GPU-hours of provisioned workers")
    ax.set_xlabel("time (min)")
    ax.set_ylabel("GPU-hours")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _legend(ax)
    fig.savefig(path)


def write_report(
    directory: Path,
    results: Mapping[str, BacktestResult],
    *,
    title: str,
    description: Mapping[str, Any],
    ttft_slo_s: float,
    tpot_slo_s: float,
) -> Path:
    """Write ``index.html`` and the PNG plots into ``directory`` (created if needed);
    returns the page's path. ``description`` lists the scenario (key: value)."""
    if not results:
        raise ValueError("results: nothing to report")
    directory.mkdir(parents=True, exist_ok=True)
    first = next(iter(results.values()))
    _plot_load(first, directory / "load.png")
    _plot_replicas(results, directory / "replicas.png")
    _plot_latency(results, ttft_slo_s, tpot_slo_s, directory / "latency.png")
    _plot_gpu_hours(results, directory / "gpu_hours.png")
    reference = reference_policy(results)
    rows = summary_rows(results, reference=reference)
    facts = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
        for k, v in description.items()
    )
    figures = "".join(
        f'<figure><img src="{name}" alt="{html.escape(alt)}"><figcaption>'
        f"{html.escape(alt)}</figcaption></figure>\n"
        for name, alt in (
            ("load.png", "Load: arrival rate per window"),
            ("replicas.png", "Provisioned workers per pool and policy"),
            ("latency.png", "P99 TTFT and TPOT per window against the SLOs"),
            ("gpu_hours.png", "Cumulative GPU-hours per policy"),
        )
    )
    page = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 70em; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; }}
thead th {{ background: #f0f0f0; }}
img {{ max-width: 100%; }}
figure {{ margin: 1.5em 0; }}
</style>
</head>
<body>
<h1>{html.escape(title)}</h1>
<table>{facts}</table>
<h2>Summary</h2>
{html_table(rows, reference=reference)}
<p>SLO attainment: the share of all requests that met both the TTFT and the TPOT SLO
(a request that never finished did not). GPU-hours: every worker from its start to its
retirement, times its GPUs{"" if reference is None else f"; relative to {reference}"}.
Scale events: changes of a pool's size, per hour of trace.</p>
<h2>Plots</h2>
{figures}
</body>
</html>
"""
    index = directory / "index.html"
    index.write_text(page, encoding="utf-8")
    return index
