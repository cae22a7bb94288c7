"""Policy quality: the production controller against the baselines and the oracle.

Seven workloads (``workload``: conv, code, diurnal, long, step, onoff, weekly), each
with its own profile and SLOs, every policy on the same trace, scenario and seed;
docs/backtesting.md describes them. Every workload runs on a profile whose context
holds all of its requests (the 128k-context Llama-3.1-70B for the conversation,
code, ShareGPT-diurnal and long-context ones), so no request is rejected and every
policy is judged on the whole trace.

Prints one table (attainment, P99s, GPU-hours, relative to the oracle and to
static-peak, scale events per pool per hour, lost requests) and the acceptance
checks for ``sara`` and ``sara-forecast`` (at least 99 % wherever static-peak meets
it, never dominated by static-peak or threshold, the oracle at least 99 %, the
median over workloads at most 1.15x the oracle's GPU-hours, at most 20 scale events
per hour per pool, no lost request). Policies run in parallel processes (``--jobs``,
default 2); ``--quick`` runs four policies. ``--sensitivity`` adds variants (not
part of the timed run): the threshold policy with a lower target or a queue-aware
metric, ``sara`` / ``sara-forecast`` with a 60-s measurement window, ``sara`` with a
0.3 headroom or without its scale-down stabilisation (``sara s0``), and
``sara-forecast`` with a 180-s trend window. ``--bounds`` adds ``reactive-oracle``
(the oracle's plan asked for only when each window starts: what any policy that
reacts to the load can reach at best); ``--dispersion`` prints how bursty each
workload is at the controller's scales and stops. ``--draw K`` runs the five
synthetic workloads' K-th other draw instead (their generators seeded afresh: the
same shapes, rates, lengths and SLOs, other arrivals), to tell what a result owes to
the shape from what it owes to one draw of it.

    .venv/bin/python bench/policy_quality.py [--jobs 2] [--markdown] [--quick] [--sensitivity]
        [--bounds] [--dispersion] [--draw K]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# One BLAS thread per process: these benches run a process per core, and a threaded
# LAPACK call (the prefill model's banded solve) then oversubscribes the cores and
# runs a hundred times slower. Set before numpy is first imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.counters import dispersion_index
from queueing.catalog import resolve_profile
from queueing.lengths import LengthSamples
from queueing.solver import KvLink, SloTargets
from sim.backtest import BacktestResult, run_backtest
from sim.control import counted_scv
from sim.policies import (
    POLICY_NAMES,
    BacktestPolicy,
    OraclePolicy,
    OracleWindow,
    SaraPolicy,
    Scenario,
    ThresholdPolicy,
    ThresholdTargets,
    forecasting,
    make_policy,
    plan_oracle,
    warm_start,
)
from sim.trace import Trace
from sim.trace_io import load_lengths, load_trace
from sim.workload import diurnal_arrivals, gamma_arrivals, poisson_arrivals, synthesize

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "data/traces"
ARXIV = TRACES / "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"
BUDGET_S = 300.0
SLO = SloTargets(ttft_p99_s=2.0, tpot_p99_s=0.1)
LINK = KvLink(bytes_per_s=400e9 / 8)


@dataclass(frozen=True)
class Workload:
    name: str
    trace: Trace
    scenario: Scenario


def _scenario(profile: str, slo: SloTargets = SLO) -> Scenario:
    return Scenario(profile=resolve_profile(profile), slo=slo, link=LINK)


def _time_changed(
    rate_rps: Callable[[np.ndarray], np.ndarray],
    *,
    duration_s: float,
    ca2: float,
    rng: np.random.Generator,
) -> np.ndarray:
    """Arrivals whose rate follows ``rate_rps(t)`` (> 0), by the time change of
    ``sim.workload.diurnal_arrivals``: a stationary Gamma renewal process of rate 1 and
    gap SCV ``ca2`` in operational time, mapped through the inverse cumulative rate
    (here tabulated on a 1-s grid and interpolated)."""
    grid = np.arange(0.0, duration_s + 1.0, 1.0)
    mid = rate_rps(grid[:-1] + 0.5)
    cumulative = np.concatenate([[0.0], np.cumsum(mid)])
    operational = gamma_arrivals(rate_rps=1.0, ca2=ca2, duration_s=float(cumulative[-1]), rng=rng)
    times = np.interp(operational, cumulative, grid)
    return np.sort(times[times < duration_s])


def _long_context_lengths(rng: np.random.Generator, count: int) -> LengthSamples:
    """Long-context requests built from the arXiv summarisation lengths: each prompt
    is k documents of that file put together (a multi-document context), k from 1 to
    32 with P(k) proportional to 1/k^2 (a heavy tail: most prompts hold one or two
    documents, about 1 in 50 holds 16 or more, the longest about 128k tokens); the
    output is the last document's summary."""
    docs = load_lengths(ARXIV)
    k_values = np.arange(1, 33)
    weights = 1.0 / k_values.astype(np.float64) ** 2
    ks = rng.choice(k_values, size=count, p=weights / weights.sum())
    rows = rng.integers(0, len(docs), size=(count, 32))
    prompt = np.array(
        [int(docs.prompt_tokens[rows[i, :k]].sum()) for i, k in enumerate(ks)], dtype=np.int64
    )
    output = docs.output_tokens[rows[np.arange(count), ks - 1]].astype(np.int64)
    return LengthSamples(prompt_tokens=prompt, output_tokens=output, source="arXiv x k documents")


SYNTHETIC = ("diurnal", "long", "step", "onoff", "weekly")


def drawn(name: str, draw: int) -> str:
    """The name of ``name``'s ``draw``-th other draw: its generator seeded afresh, the
    same shape, rates, lengths and SLOs (``diurnal#2``; ``workload`` builds it, and
    only the synthetic five have other draws). Draw 0 is the bench's own."""
    if draw < 0:
        raise ValueError(f"draw: must be >= 0, got {draw}")
    return f"{name}#{draw}" if draw else name


@functools.cache
def workload(name: str) -> Workload:
    """Build a workload (once per process); ``NAME#K`` is ``drawn(NAME, K)``."""
    base, _, draw_text = name.partition("#")
    if draw_text and not draw_text.isdigit():
        raise ValueError(f"workload: the draw in {name!r} must be a whole number")
    draw = int(draw_text) if draw_text else 0
    if draw and base not in SYNTHETIC:
        raise ValueError(f"workload: {base!r} is a recorded trace and has no draw {draw}")

    def rng_for(seed: int) -> np.random.Generator:
        return np.random.default_rng(seed if draw == 0 else (seed, draw))

    if base == "conv":
        # The whole hour replayed 2.5 times as fast: every recorded request, 2.5 x the rate.
        trace = load_trace(TRACES / "AzureLLMInferenceTrace_conv.csv", speedup=2.5)
        return Workload(name, trace, _scenario("llama-3.1-70b-tp4@a100-80g"))
    if base == "code":
        trace = load_trace(TRACES / "AzureLLMInferenceTrace_code.csv")
        return Workload(name, trace, _scenario("llama-3.1-70b-tp4@h100-sxm"))
    if base == "diurnal":
        rng = rng_for(7)
        lengths = load_lengths(TRACES / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv")
        arrivals = diurnal_arrivals(
            mean_rate_rps=10.0,
            peak_to_trough=4.0,
            period_s=1200.0,
            duration_s=2400.0,
            ca2=4.0,
            rng=rng,
        )
        trace = synthesize(
            arrival_s=arrivals,
            lengths=lengths,
            rng=rng,
            source="ShareGPT lengths, diurnal (2 x 20-min days, peak/trough 4), Gamma SCV 4",
        )
        return Workload(name, trace, _scenario("llama-3.1-70b-tp4@h100-sxm"))
    if base == "long":
        rng = rng_for(11)
        arrivals = gamma_arrivals(rate_rps=3.0, ca2=9.0, duration_s=1800.0, rng=rng)
        trace = synthesize(
            arrival_s=arrivals,
            lengths=_long_context_lengths(rng, 20_000),
            rng=rng,
            source="arXiv documents x k (1-32, P ~ 1/k^2), 3 req/s, Gamma SCV 9, 30 min",
        )
        slo = SloTargets(ttft_p99_s=30.0, tpot_p99_s=0.1)
        return Workload(name, trace, _scenario("llama-3.1-70b-tp4@h100-sxm", slo))
    if base == "step":
        rng = rng_for(13)
        lengths = load_lengths(TRACES / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv")
        arrivals = np.concatenate(
            [
                poisson_arrivals(rate_rps=12.0, duration_s=600.0, rng=rng),
                600.0 + poisson_arrivals(rate_rps=36.0, duration_s=600.0, rng=rng),
            ]
        )
        trace = synthesize(
            arrival_s=arrivals,
            lengths=lengths,
            rng=rng,
            source="ShareGPT lengths, Poisson 12 req/s, a 3x step to 36 req/s at 600 s",
        )
        slo = SloTargets(ttft_p99_s=1.0, tpot_p99_s=0.05)
        return Workload(name, trace, _scenario("llama-3-8b@h100-sxm", slo))
    if base == "onoff":
        rng = rng_for(17)
        conv = load_trace(TRACES / "AzureLLMInferenceTrace_conv.csv")
        lengths = LengthSamples(
            prompt_tokens=conv.prompt_tokens.astype(np.int64),
            output_tokens=conv.output_tokens.astype(np.int64),
            source="Azure conversation lengths",
        )
        # Silent minutes (2-6 min, uniform) then a Poisson burst of 60-150 s at 25 req/s.
        parts, t = [], 0.0
        while t < 2400.0:
            t += rng.uniform(120.0, 360.0)
            on_s = rng.uniform(60.0, 150.0)
            parts.append(t + poisson_arrivals(rate_rps=25.0, duration_s=on_s, rng=rng))
            t += on_s
        trace = synthesize(
            arrival_s=np.concatenate(parts),
            lengths=lengths,
            rng=rng,
            source="Azure conversation lengths, 60-150-s bursts at 25 req/s after 2-6 silent min",
        )
        slo = SloTargets(ttft_p99_s=1.5, tpot_p99_s=0.08)
        return Workload(name, trace, _scenario("mistral-7b@a100-80g", slo))
    if base == "weekly":
        rng = rng_for(19)
        lengths = load_lengths(ARXIV)
        day_s = 480.0

        def rate(t: np.ndarray) -> np.ndarray:
            # A daily sinusoid (peak/trough 3, trough at midnight) scaled by the day of
            # the week: five working days, then a weekend at half the level.
            daily = 1.0 - 0.5 * np.cos(2.0 * np.pi * t / day_s)
            weekend = (t // day_s) % 7 >= 5
            return 6.0 * daily * np.where(weekend, 0.5, 1.0)

        trace = synthesize(
            arrival_s=_time_changed(rate, duration_s=7 * day_s, ca2=2.0, rng=rng),
            lengths=lengths,
            rng=rng,
            source="arXiv lengths, a week of 8-min days (peak/trough 3, weekend 0.5), SCV 2",
        )
        slo = SloTargets(ttft_p99_s=1.5, tpot_p99_s=0.08)
        return Workload(name, trace, _scenario("llama-3-8b@a100-80g", slo))
    raise ValueError(f"workload: unknown {name!r}")


WORKLOADS = ("conv", "code", "diurnal", "long", "step", "onoff", "weekly")
QUICK_POLICIES = ("sara", "static-peak", "threshold", "oracle")


# -- sensitivity variants (policies configured differently from their defaults) ----------


def _sara_window_60(forecast: bool) -> Callable[[Trace, Scenario], BacktestPolicy]:
    """sara (or sara-forecast) with a 60-s measurement window (the default is 30 s)."""

    def build(trace: Trace, scenario: Scenario) -> BacktestPolicy:
        config = dataclasses.replace(scenario.controller_config, window_s=60.0)
        if forecast:
            config = forecasting(scenario, config)
        policy = SaraPolicy(scenario, warm_start(trace, scenario), config=config)
        policy.name = "sara-forecast w60" if forecast else "sara w60"
        return policy

    return build


def _sara_variant(
    label: str, *, trend_window_s: float | None = None, headroom: float | None = None
) -> Callable[[Trace, Scenario], BacktestPolicy]:
    """sara (or sara-forecast, with a trend window) with a different headroom or
    forecaster setting."""

    def build(trace: Trace, scenario: Scenario) -> BacktestPolicy:
        config = scenario.controller_config
        if headroom is not None:
            config = dataclasses.replace(config, headroom=headroom)
        if trend_window_s is not None:
            config = forecasting(scenario, config)
            config = dataclasses.replace(
                config,
                forecast=dataclasses.replace(config.forecast, trend_window_s=trend_window_s),
            )
        policy = SaraPolicy(scenario, warm_start(trace, scenario), config=config)
        policy.name = label
        return policy

    return build


def _sara_unstabilised(label: str) -> Callable[[Trace, Scenario], BacktestPolicy]:
    """sara without the scale-down stabilisation window (the lead-time bound alone)."""

    def build(trace: Trace, scenario: Scenario) -> BacktestPolicy:
        config = dataclasses.replace(scenario.controller_config, scale_down_stabilisation_s=0.0)
        policy = SaraPolicy(scenario, warm_start(trace, scenario), config=config)
        policy.name = label
        return policy

    return build


def _threshold(
    targets: ThresholdTargets, label: str
) -> Callable[[Trace, Scenario], BacktestPolicy]:
    def build(trace: Trace, scenario: Scenario) -> BacktestPolicy:
        policy = ThresholdPolicy(scenario, warm_start(trace, scenario), targets=targets)
        policy.name = label
        return policy

    return build


@functools.cache
def _oracle_windows(name: str) -> tuple[OracleWindow, ...]:
    """The oracle's plan of a workload, planned once per process: the oracle and the
    reactive-oracle bound replay the same plan."""
    w = workload(name)
    return plan_oracle(w.trace, w.scenario).windows


def _oracle(name: str) -> BacktestPolicy:
    return OraclePolicy(workload(name).scenario, _oracle_windows(name))


def _reactive_oracle(name: str) -> BacktestPolicy:
    """The oracle's plan without its lead: each window's workers are asked for (one
    1-s tick before) the moment the window starts, so they serve a start-up later.
    It knows every window's size; where a window's load is there from its start it
    reacts at the earliest instant a causal policy could, so its attainment bounds
    what any policy reaches that does not hold capacity before the load is there.
    Where the load comes later in the window it asks early for it, and is no bound
    (docs/backtesting.md, ``code``)."""
    policy = OraclePolicy(workload(name).scenario, _oracle_windows(name))
    policy.lead_s = 0.0
    policy.name = "reactive-oracle"
    return policy


VARIANTS: dict[str, Callable[[Trace, Scenario], BacktestPolicy]] = {
    "sara w60": _sara_window_60(forecast=False),
    "sara-forecast w60": _sara_window_60(forecast=True),
    "sara h0.3": _sara_variant("sara h0.3", headroom=0.3),
    "sara s0": _sara_unstabilised("sara s0"),
    "sara-forecast t180": _sara_variant("sara-forecast t180", trend_window_s=180.0),
    "threshold 0.5": _threshold(ThresholdTargets(prefill=0.5, decode=0.5), "threshold 0.5"),
    "threshold queue": _threshold(ThresholdTargets(count_queued=True), "threshold queue"),
}
# Not a policy to deploy: the bound on what reacting to the load can reach (--bounds).
BOUNDS: dict[str, Callable[[str], BacktestPolicy]] = {
    "reactive-oracle": _reactive_oracle,
}
# Run in one process per workload: they share the oracle's plan, and the oracle's
# planning replays static-peak and its own plan, which sim.policies.base.replay then
# reuses rather than simulating again.
PLANNED = ("oracle", "static-peak", *BOUNDS)


def run_task(task: tuple[str, tuple[str, ...]]) -> list[tuple[str, str, BacktestResult]]:
    name, policy_names = task
    w = workload(name)
    out = []
    for policy_name in policy_names:
        if policy_name in VARIANTS:
            policy = VARIANTS[policy_name](w.trace, w.scenario)
        elif policy_name in BOUNDS:
            policy = BOUNDS[policy_name](name)
        elif policy_name == "oracle":
            policy = _oracle(name)
        else:
            policy = make_policy(policy_name, w.trace, w.scenario)
        out.append((name, policy_name, run_backtest(w.trace, policy, w.scenario)))
    return out


# -- the table -----------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


HEADERS = (
    "workload",
    "policy",
    "attainment",
    "P99 TTFT s",
    "P99 TPOT s",
    "GPU-h",
    "x oracle",
    "x static-peak",
    "events/h P",
    "events/h D",
    "lost",
)


def table(results: dict[str, dict[str, BacktestResult]], *, markdown: bool) -> str:
    rows = []
    for wname, by_policy in results.items():
        oracle = by_policy.get("oracle")
        peak = by_policy.get("static-peak")
        for pname, r in by_policy.items():
            s = r.summary
            per_hour = r.scale_events_per_hour
            rows.append(
                [
                    wname,
                    pname,
                    "-" if s.slo_attainment is None else f"{100 * s.slo_attainment:.2f} %",
                    _fmt(s.ttft_p99_s, ".3g"),
                    _fmt(s.tpot_p99_s, ".3g"),
                    f"{s.gpu_hours:.1f}",
                    _fmt(s.gpu_hours / oracle.summary.gpu_hours if oracle else None, ".2f"),
                    _fmt(s.gpu_hours / peak.summary.gpu_hours if peak else None, ".2f"),
                    f"{per_hour['prefill']:.1f}",
                    f"{per_hour['decode']:.1f}",
                    str(s.lost_requests),
                ]
            )
    if markdown:
        out = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
        out += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(out)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADERS)]
    out = ["  ".join(h.ljust(w) for h, w in zip(HEADERS, widths, strict=True))]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(out)


MAX_EVENTS_PER_HOUR = 20.0
MEDIAN_OVER_ORACLE = 1.15
TARGET = 0.99  # the SLOs are P99s


def _dominated(mine: BacktestResult, other: BacktestResult) -> bool:
    """Whether ``other`` is at least as good on both axes and better on one."""
    a, b = mine.summary, other.summary
    att_a, att_b = a.slo_attainment or 0.0, b.slo_attainment or 0.0
    return (
        att_b >= att_a
        and b.gpu_hours <= a.gpu_hours
        and (att_b > att_a or b.gpu_hours < a.gpu_hours)
    )


def acceptance(results: dict[str, dict[str, BacktestResult]], policy: str = "sara") -> list[str]:
    """One line per workload and criterion, for ``policy``; then the median over the
    workloads of its GPU-hours against the oracle's."""
    lines = []
    ratios = []
    for wname, by_policy in results.items():
        if policy not in by_policy:
            continue
        run = by_policy[policy]
        mine = run.summary
        att = mine.slo_attainment or 0.0
        checks: list[tuple[str, bool]] = []
        peak = by_policy.get("static-peak")
        if peak is not None:
            peak_att = peak.summary.slo_attainment or 0.0
            if peak_att >= TARGET:
                checks.append(
                    (f"attainment {100 * att:.2f} % >= 99 % (static-peak meets it)", att >= TARGET)
                )
        for ref in ("static-peak", "threshold"):
            if ref in by_policy:
                other = by_policy[ref].summary
                checks.append(
                    (
                        f"not dominated by {ref}: {100 * att:.2f} % at {mine.gpu_hours:.1f} GPU-h "
                        f"vs {100 * (other.slo_attainment or 0.0):.2f} % at "
                        f"{other.gpu_hours:.1f}",
                        not _dominated(run, by_policy[ref]),
                    )
                )
        if "oracle" in by_policy:
            oracle = by_policy["oracle"].summary
            ratios.append(mine.gpu_hours / oracle.gpu_hours)
            oracle_att = oracle.slo_attainment or 0.0
            checks.append(
                (f"oracle attainment {100 * oracle_att:.2f} % >= 99 %", oracle_att >= TARGET)
            )
        worst = max(run.scale_events_per_hour.values())
        checks.append((f"scale events {worst:.1f}/h/pool <= 20", worst <= MAX_EVENTS_PER_HOUR))
        checks.append((f"lost {mine.lost_requests} == 0", mine.lost_requests == 0))
        for text, ok in checks:
            lines.append(f"  {wname:<8} {policy:<14} {'met   ' if ok else 'MISSED'}  {text}")
    if ratios:
        median = float(np.median(ratios))
        verdict = "met   " if median <= MEDIAN_OVER_ORACLE else "MISSED"
        lines.append(
            f"  {'all':<8} {policy:<14} {verdict}  median GPU-hours {median:.2f} x oracle "
            f"<= {MEDIAN_OVER_ORACLE}"
        )
    return lines


def dispersion(names: list[str]) -> str:
    """How bursty each workload's arrivals are at the scales the controller reads:
    the mean (and median) over its 30-s windows of the gap SCV and of the index of
    dispersion of the window's 5-s counts about the window's mean, of the ca² the
    sources read at each tick (5-s counts over 300 s about the windows' levels and
    the changes of level, ``controller.counters.interarrival_scv``), and the
    index of dispersion of the counts over 30 s, one lead time (start-up + a 30-s
    tick) and 300 s, from half the mean squared successive difference of the counts
    (which a slow trend does not inflate)."""
    rows = [
        "| workload | window gap SCV mean / median | window 5-s IDC mean / median "
        "| ca² read (300 s) mean / median "
        "| IDC at 30 s | IDC at the lead time | IDC at 300 s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        w = workload(name)
        t = w.trace.arrival_s
        gap, idc, read = [], [], []
        for end in np.arange(30.0, float(t[-1]), 30.0):
            inside = t[(t > end - 30.0) & (t <= end)]
            g = gap_scv(inside)
            d = counted_dispersion(inside, end_s=float(end), window_s=30.0, step_s=5.0)
            if g is not None and d is not None:
                gap.append(g)
                idc.append(d)
            span = min(300.0, float(end))
            r = counted_scv(t, end_s=float(end), span_s=span, step_s=5.0, window_s=30.0)
            if r is not None:
                read.append(r)
        lead_s = w.scenario.worker_startup_s + 30.0
        spans = []
        for span in (30.0, lead_s, 300.0):
            counts = np.histogram(t, bins=np.arange(0.0, float(t[-1]), span))[0]
            spans.append(0.5 * float(np.mean(np.diff(counts) ** 2)) / float(counts.mean()))
        rows.append(
            f"| {name} | {np.mean(gap):.2f} / {np.median(gap):.2f} | "
            f"{np.mean(idc):.2f} / {np.median(idc):.2f} | "
            f"{np.mean(read):.2f} / {np.median(read):.2f} | {spans[0]:.1f} | "
            f"{spans[1]:.1f} ({lead_s:.0f} s) | {spans[2]:.1f} |"
        )
    return "\n".join(rows)


def gap_scv(arrivals: np.ndarray) -> float | None:
    """The SCV of a window's inter-arrival gaps (None with fewer than 10 arrivals)."""
    if len(arrivals) < 10:
        return None
    gaps = np.diff(arrivals)
    mean = float(gaps.mean())
    return float(gaps.var() / (mean * mean)) if mean > 0 else None


def counted_dispersion(
    arrival_s: np.ndarray, *, end_s: float, window_s: float, step_s: float
) -> float | None:
    """The index of dispersion of the counts in ``step_s`` sub-windows back from
    ``end_s`` over ``window_s``, as the production sources compute it."""
    k = math.floor(window_s / step_s + 1e-9)
    edges = end_s - step_s * np.arange(k, -1, -1, dtype=np.float64)
    counts = np.histogram(arrival_s, bins=edges)[0]
    return dispersion_index(counts, np.full(k, step_s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument(
        "--draw",
        type=int,
        default=0,
        help="run the synthetic workloads' K-th other draw (seeded afresh; 0 = the bench's)",
    )
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument("--sensitivity", action="store_true", help="add the variants")
    parser.add_argument(
        "--bounds",
        action="store_true",
        help="add reactive-oracle: the oracle's plan asked for only when each window starts",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"only {', '.join(QUICK_POLICIES)} (about half the time)",
    )
    parser.add_argument(
        "--dispersion",
        action="store_true",
        help="print how bursty each workload is at the controller's scales, and stop",
    )
    args = parser.parse_args()
    names = args.workloads.split(",")
    if args.draw:
        names = [drawn(n, args.draw) for n in names if n in SYNTHETIC]
    if args.dispersion:
        print(dispersion(names))
        return
    policies = list(QUICK_POLICIES) if args.quick else args.policies.split(",")
    if args.sensitivity:
        policies += list(VARIANTS)
    if args.bounds:
        policies += list(BOUNDS)
    # The oracle's group first (it plans with window simulations before its run),
    # then one task per other policy.
    tasks: list[tuple[str, tuple[str, ...]]] = []
    for w in names:
        planned = tuple(p for p in policies if p in PLANNED)
        if "oracle" not in planned:  # without the oracle nothing is shared
            tasks += [(w, (p,)) for p in planned]
        elif planned:
            tasks.append((w, planned))
    tasks.sort(key=lambda t: (not any(p in ("oracle", *BOUNDS) for p in t[1]), t[0] == "code"))
    tasks += [(w, (p,)) for w in names for p in policies if p not in PLANNED]
    started = time.perf_counter()
    done: dict[tuple[str, str], BacktestResult] = {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for group in pool.map(run_task, tasks):
            for wname, pname, result in group:
                done[(wname, pname)] = result
                print(f"  {wname:<8} {pname:<18} {result.wall_s:6.1f} s", file=sys.stderr)
    wall_s = time.perf_counter() - started
    results = {w: {p: done[(w, p)] for p in policies} for w in names}
    for w in names:
        trace = workload(w).trace
        scenario = workload(w).scenario
        print(
            f"{w}: {trace.source}: {len(trace)} requests over {trace.duration_s:.0f} s; "
            f"{scenario.profile.name}, startup {scenario.worker_startup_s:.0f} s"
        )
    print()
    print(table(results, markdown=args.markdown))
    print()
    for policy in ("sara", "sara-forecast"):
        if all(policy in by_policy for by_policy in results.values()):
            print(f"acceptance for {policy}:")
            print("\n".join(acceptance(results, policy)))
    lost = sum(r.summary.lost_requests for r in done.values())
    print(f"\nlost requests, all runs: {lost}")
    verdict = "within" if wall_s < BUDGET_S else "OVER"
    print(
        f"wall time: {wall_s:.1f} s with {args.jobs} processes ({verdict} the "
        f"{BUDGET_S:.0f}-s budget)"
    )


if __name__ == "__main__":
    main()
