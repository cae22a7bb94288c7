"""`sara simulate`: replay (or generate) a workload on a simulated cluster.

Without ``--policy``/``--compare`` the pools are fixed: ``--prefill-workers`` /
``--decode-workers``, or the solver's answer for the workload's mean rate (so the
command doubles as a check of the capacity model).

With ``--policy NAME`` (and/or ``--compare a,b,c``) it back-tests scaling policies
(``sim.policies``) on the same workload and seed: the production controller
(``sara``), the baselines and the clairvoyant ``oracle``. ``--json`` prints
``{"policies": {NAME: {...}}}`` plus the scenario; ``--report DIR`` writes an HTML
page with plots. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from cli import common
from cli.common import UsageError
from queueing.lengths import LengthSamples
from queueing.solver import InfeasibleSLOError, solve
from sim.backtest import DEFAULT_SERIES_WINDOW_S, BacktestResult, compare
from sim.cluster import Cluster, ClusterConfig
from sim.policies import POLICY_NAMES, Allocation, Scenario
from sim.trace import Trace, TraceError


def _workload(args: argparse.Namespace, rng: np.random.Generator) -> Trace:
    from sim import workload

    if args.trace and args.lengths:
        raise UsageError("--trace: give either --trace, or --lengths with --arrival-rate")
    if args.trace:
        trace = common.load_trace_arg(args.trace)
    else:
        if not args.lengths or args.arrival_rate is None:
            raise UsageError(
                "--trace: give --trace FILE, or --lengths FILE with --arrival-rate RPS"
            )
        common.positive("--arrival-rate", args.arrival_rate)
        common.positive("--duration-s", args.duration_s)
        ca2 = 1.0 if args.ca2 is None else args.ca2
        common.positive("--ca2", ca2)
        lengths = common.load_lengths_arg(args.lengths)
        arrivals = workload.gamma_arrivals(
            rate_rps=args.arrival_rate, ca2=ca2, duration_s=args.duration_s, rng=rng
        )
        trace = workload.synthesize(
            arrival_s=arrivals,
            lengths=lengths,
            rng=rng,
            source=f"{lengths.source} at {args.arrival_rate:g} req/s, ca2={ca2:g}",
        )
    try:
        if args.slice_start is not None or args.slice_end is not None:
            start = 0.0 if args.slice_start is None else args.slice_start
            end = float(trace.arrival_s[-1]) + 1.0 if args.slice_end is None else args.slice_end
            trace = workload.time_slice(trace, start_s=start, end_s=end)
        if args.rate_scale != 1.0:
            common.positive("--rate-scale", args.rate_scale)
            trace = workload.scale_rate(trace, args.rate_scale, rng)
    except (ValueError, TraceError) as exc:
        raise UsageError(str(exc)) from exc
    if len(trace) < 3:
        raise UsageError("--trace: the workload has fewer than 3 requests")
    return trace


def cmd_simulate(args: argparse.Namespace) -> int:
    if args.policy or args.compare:
        return cmd_backtest(args)
    if args.report:
        raise UsageError("--report: needs --policy or --compare")
    headroom = common.DEFAULT_HEADROOM if args.headroom is None else args.headroom
    rng = np.random.default_rng(args.seed)
    trace = _workload(args, rng)
    profile = common.load_profile_arg(args.profile)
    slo = common.slo_targets(args)
    link = common.kv_link(args)
    lengths = LengthSamples(
        prompt_tokens=trace.prompt_tokens, output_tokens=trace.output_tokens, source=trace.source
    )
    if (args.prefill_workers is None) != (args.decode_workers is None):
        raise UsageError("--prefill-workers: give both --prefill-workers and --decode-workers")
    try:
        model = common.build_model(lengths, profile, slo, link)
        if args.prefill_workers is None:
            answer = solve(
                model,
                arrival_rate_rps=trace.mean_rate_rps,
                ca2=trace.interarrival_scv,
                slo=slo,
                headroom=headroom,
            )
            prefill, decode = answer.prefill_workers, answer.decode_workers
        else:
            prefill, decode = args.prefill_workers, args.decode_workers
    except InfeasibleSLOError as exc:
        common.fail(str(exc), common.EXIT_INFEASIBLE)
    try:
        config = ClusterConfig(
            prefill_workers=prefill,
            decode_workers=decode,
            profile=profile,
            token_budget=model.token_budget,
            kv_link_bytes_per_s=link.bytes_per_s,
            kv_link_latency_s=link.latency_s,
            startup_s=args.startup_s,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    started = time.perf_counter()
    results = Cluster(config, trace).run()
    wall_s = time.perf_counter() - started
    summary = results.summary(ttft_slo_s=slo.ttft_p99_s, tpot_slo_s=slo.tpot_p99_s)
    out: dict[str, Any] = {
        "source": trace.source,
        "profile": profile.name,
        "prefill_workers": prefill,
        "decode_workers": decode,
        "token_budget": model.token_budget,
        **asdict(summary),
        "simulated_s": trace.duration_s,
        "wall_s": wall_s,
        "speedup": trace.duration_s / wall_s if wall_s > 0 else math.inf,
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for key, value in out.items():
            print(f"{key:<22}  {common.fmt(value)}")
    return 0


def _policy_names(args: argparse.Namespace) -> list[str]:
    names: list[str] = []
    if args.policy:
        names.append(args.policy.strip())
    if args.compare:
        names.extend(n.strip() for n in args.compare.split(","))
    flag = "--policy" if args.policy else "--compare"
    for name in names:
        if name not in POLICY_NAMES:
            raise UsageError(
                f"{flag}: unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}"
            )
    return list(dict.fromkeys(names))  # keep the order, drop repeats


class Progress:
    """A progress line on ``stream``: redrawn in place on a terminal, one line per
    finished phase otherwise (so logs stay short)."""

    def __init__(self, stream: TextIO, names: list[str]) -> None:
        self.stream = stream
        self.names = names
        self.tty = stream.isatty()
        self._drawn_s = 0.0
        self._started = time.perf_counter()

    def __call__(self, name: str, phase: str, fraction: float) -> None:
        now = time.perf_counter()
        step = f"[{self.names.index(name) + 1}/{len(self.names)}] {name}"
        what = "planning (window simulations)" if phase == "plan" else "simulating"
        if fraction >= 1.0:
            line = f"{step}: {what} done ({now - self._started:.1f} s)"
            self.stream.write(("\r\x1b[K" if self.tty else "") + line + "\n")
            self.stream.flush()
            self._started = now
            return
        if not self.tty or now - self._drawn_s < 0.2:
            return
        self._drawn_s = now
        width = 30
        filled = int(width * fraction)
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(f"\r\x1b[K{step}: {what} [{bar}] {100 * fraction:3.0f} %")
        self.stream.flush()


def cmd_backtest(args: argparse.Namespace) -> int:
    names = _policy_names(args)
    for flag, value in (("--startup-s", args.startup_s),):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{flag}: must be a number >= 0, got {value}")
    common.positive("--window-s", args.window_s)
    if (args.prefill_workers is None) != (args.decode_workers is None):
        raise UsageError("--prefill-workers: give both --prefill-workers and --decode-workers")
    rng = np.random.default_rng(args.seed)
    trace = _workload(args, rng)
    profile = common.load_profile_arg(args.profile)
    slo = common.slo_targets(args)
    link = common.kv_link(args)
    headroom = common.DEFAULT_HEADROOM if args.headroom is None else args.headroom
    try:
        scenario = Scenario(
            profile=profile, slo=slo, link=link, startup_s=args.startup_s, headroom=headroom
        )
        initial = None
        if args.prefill_workers is not None:
            initial = Allocation(prefill=args.prefill_workers, decode=args.decode_workers)
        # Fails early, with the reason, when the SLOs or the KV capacity cannot work.
        scenario.capacity_model(
            LengthSamples(
                prompt_tokens=trace.prompt_tokens,
                output_tokens=trace.output_tokens,
                source=trace.source,
            )
        )
    except InfeasibleSLOError as exc:
        common.fail(str(exc), common.EXIT_INFEASIBLE)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    progress = None if args.no_progress else Progress(sys.stderr, names)
    try:
        results = compare(
            trace,
            names,
            scenario,
            initial=initial,
            series_window_s=args.window_s,
            progress=progress,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    description = {
        "workload": trace.source,
        "requests": len(trace),
        "duration_s": round(trace.duration_s, 1),
        "profile": profile.name,
        "startup_s": round(scenario.worker_startup_s, 1),
        "ttft_p99_slo_s": slo.ttft_p99_s,
        "tpot_p99_slo_s": slo.tpot_p99_s,
        "headroom": headroom,
        "seed": args.seed,
    }
    report_path = None
    if args.report:
        from sim.report import write_report

        report_path = write_report(
            Path(args.report),
            results,
            title=f"Back-test: {trace.source}",
            description=description,
            ttft_slo_s=slo.ttft_p99_s,
            tpot_slo_s=slo.tpot_p99_s,
        )
        print(f"sara: report written to {report_path}", file=sys.stderr)
    if args.json:
        out = {**description, "policies": {n: r.as_dict() for n, r in results.items()}}
        print(json.dumps(out, indent=2))
    else:
        _print_backtest(description, results)
    return 0


def _print_backtest(description: dict[str, Any], results: dict[str, BacktestResult]) -> None:
    from sim.report import format_table, reference_policy, summary_rows

    for key, value in description.items():
        print(f"{key:<16}  {common.fmt(value)}")
    print()
    reference = reference_policy(results)
    print(format_table(summary_rows(results, reference=reference), reference=reference))


def register(sub: Any) -> None:
    p = sub.add_parser("simulate", help="replay a workload on a simulated cluster")
    p.add_argument("--trace", metavar="FILE", help="trace to replay (Azure, Mooncake, generic)")
    p.add_argument("--lengths", metavar="FILE", help="lengths for a generated workload")
    p.add_argument("--arrival-rate", type=float, metavar="RPS", help="generated arrival rate")
    p.add_argument("--ca2", type=float, help="generated inter-arrival SCV (1 = Poisson)")
    p.add_argument("--duration-s", type=float, default=600.0, help="generated workload length")
    p.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        metavar="K",
        help="multiply the arrival rate, keeping the trace's shape",
    )
    p.add_argument("--slice-start", type=float, metavar="S", help="start of a time slice")
    p.add_argument("--slice-end", type=float, metavar="S", help="end of a time slice")
    p.add_argument("--prefill-workers", type=int, metavar="N", help="fixed prefill pool size")
    p.add_argument("--decode-workers", type=int, metavar="M", help="fixed decode pool size")
    p.add_argument(
        "--headroom",
        type=float,
        default=None,
        metavar="F",
        help=f"solver headroom: plan for SLO / (1 + F) (default {common.DEFAULT_HEADROOM:g}, "
        f"the controller's)",
    )
    p.add_argument(
        "--policy",
        metavar="NAME",
        help=f"back-test a scaling policy: {', '.join(POLICY_NAMES)}",
    )
    p.add_argument(
        "--compare",
        metavar="A,B,...",
        help="back-test several policies on the same workload (comma-separated names)",
    )
    p.add_argument(
        "--startup-s",
        type=float,
        metavar="S",
        help="seconds from a scale-up to a serving worker (default: the profile's)",
    )
    p.add_argument(
        "--window-s",
        type=float,
        default=DEFAULT_SERIES_WINDOW_S,
        metavar="S",
        help=f"window of the per-window series in --json and the report "
        f"(default {DEFAULT_SERIES_WINDOW_S:g})",
    )
    p.add_argument("--report", metavar="DIR", help="write an HTML report with plots to DIR")
    p.add_argument("--no-progress", action="store_true", help="print no progress on stderr")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's randomness")
    common.add_slo_args(p)
    p.set_defaults(func=cmd_simulate)
