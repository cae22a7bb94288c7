"""`sara simulate`: replay (or generate) a workload on a simulated cluster.

With ``--prefill-workers``/``--decode-workers`` the pools have that fixed size;
without, they get the solver's answer for the workload's mean rate, so the command
doubles as a check of the capacity model.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np

from controller import cli
from queueing.lengths import LengthSamples
from queueing.solver import InfeasibleSLOError, solve
from sim.cluster import Cluster, ClusterConfig
from sim.trace import Trace, TraceError


def _workload(args: argparse.Namespace, rng: np.random.Generator) -> Trace:
    from sim import workload

    if args.trace and args.lengths:
        raise cli.UsageError("--trace: give either --trace, or --lengths with --arrival-rate")
    if args.trace:
        trace = cli.load_trace_arg(args.trace)
    else:
        if not args.lengths or args.arrival_rate is None:
            raise cli.UsageError(
                "--trace: give --trace FILE, or --lengths FILE with --arrival-rate RPS"
            )
        cli._positive("--arrival-rate", args.arrival_rate)
        cli._positive("--duration-s", args.duration_s)
        ca2 = 1.0 if args.ca2 is None else args.ca2
        cli._positive("--ca2", ca2)
        lengths = cli.load_lengths_arg(args.lengths)
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
            cli._positive("--rate-scale", args.rate_scale)
            trace = workload.scale_rate(trace, args.rate_scale, rng)
    except (ValueError, TraceError) as exc:
        raise cli.UsageError(str(exc)) from exc
    if len(trace) < 3:
        raise cli.UsageError("--trace: the workload has fewer than 3 requests")
    return trace


def cmd_simulate(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(args.seed)
    trace = _workload(args, rng)
    profile = cli.load_profile(args.profile)
    slo = cli._slo(args)
    link = cli._link(args)
    lengths = LengthSamples(
        prompt_tokens=trace.prompt_tokens, output_tokens=trace.output_tokens, source=trace.source
    )
    if (args.prefill_workers is None) != (args.decode_workers is None):
        raise cli.UsageError("--prefill-workers: give both --prefill-workers and --decode-workers")
    try:
        model = cli.build_model(lengths, profile, slo, link)
        if args.prefill_workers is None:
            answer = solve(
                model,
                arrival_rate_rps=trace.mean_rate_rps,
                ca2=trace.interarrival_scv,
                slo=slo,
                headroom=args.headroom,
            )
            prefill, decode = answer.prefill_workers, answer.decode_workers
        else:
            prefill, decode = args.prefill_workers, args.decode_workers
    except InfeasibleSLOError as exc:
        cli._fail(str(exc), cli.EXIT_INFEASIBLE)
    try:
        config = ClusterConfig(
            prefill_workers=prefill,
            decode_workers=decode,
            profile=profile,
            token_budget=model.token_budget,
            kv_link_bytes_per_s=link.bytes_per_s,
            kv_link_latency_s=link.latency_s,
        )
    except ValueError as exc:
        raise cli.UsageError(str(exc)) from exc
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
            print(f"{key:<22}  {cli._fmt(value)}")
    return 0


def register(sub: Any, add_slo_args: Callable[[argparse.ArgumentParser], None]) -> None:
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
        default=cli.DEFAULT_HEADROOM,
        metavar="F",
        help="headroom of the solver when the pool sizes are not given",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's randomness")
    add_slo_args(p)
    p.set_defaults(func=cmd_simulate)
