"""`sara solve`: the fewest prefill/decode workers that meet the SLOs, or how an
allocation fares (``--prefill-workers N --decode-workers M``).

Exit 1 (with ``{"feasible": false, ...}`` under ``--json``) when the SLOs cannot be met.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any

from cli import common
from cli.common import UsageError
from queueing.lengths import LengthSamples
from queueing.solver import InfeasibleSLOError, evaluate, solve
from sim.trace import TraceError


@dataclass(frozen=True, kw_only=True)
class LoadSpec:
    """What `sara solve` plans for: rate, burstiness and length mix."""

    arrival_rate_rps: float
    ca2: float
    lengths: LengthSamples
    source: str


def _load_spec(args: argparse.Namespace) -> LoadSpec:
    if args.trace and (args.lengths or args.arrival_rate is not None):
        raise UsageError("--trace: give either --trace, or --arrival-rate with --lengths")
    if args.trace:
        trace = common.load_trace_arg(args.trace)
        try:
            rate = trace.mean_rate_rps * args.rate_scale
            ca2 = trace.interarrival_scv if args.ca2 is None else args.ca2
        except TraceError as exc:
            raise UsageError(f"--trace: {exc}") from exc
        lengths = LengthSamples(
            prompt_tokens=trace.prompt_tokens,
            output_tokens=trace.output_tokens,
            source=trace.source,
        )
        return LoadSpec(arrival_rate_rps=rate, ca2=ca2, lengths=lengths, source=args.trace)
    if args.arrival_rate is None or not args.lengths:
        raise UsageError(
            "--arrival-rate: give --trace FILE, or --arrival-rate RPS with --lengths FILE"
        )
    common.positive("--arrival-rate", args.arrival_rate)
    lengths = common.load_lengths_arg(args.lengths)
    return LoadSpec(
        arrival_rate_rps=args.arrival_rate * args.rate_scale,
        ca2=1.0 if args.ca2 is None else args.ca2,
        lengths=lengths,
        source=args.lengths,
    )


def cmd_solve(args: argparse.Namespace) -> int:
    common.positive("--rate-scale", args.rate_scale)
    if args.ca2 is not None and not (math.isfinite(args.ca2) and args.ca2 >= 0):
        raise UsageError(f"--ca2: must be a number >= 0, got {args.ca2}")
    if not (0 <= args.headroom < 10):
        raise UsageError(f"--headroom: must be in [0, 10), got {args.headroom}")
    if (args.prefill_workers is None) != (args.decode_workers is None):
        raise UsageError("--prefill-workers: give both --prefill-workers and --decode-workers")
    spec = _load_spec(args)
    profile = common.load_profile_arg(args.profile)
    slo = common.slo_targets(args)
    link = common.kv_link(args)
    shared: dict[str, Any] = {
        "arrival_rate_rps": spec.arrival_rate_rps,
        "ca2": spec.ca2,
        "ttft_slo_s": slo.ttft_p99_s,
        "tpot_slo_s": slo.tpot_p99_s,
        "headroom": args.headroom,
        "profile": profile.name,
        "source": spec.source,
    }
    try:
        model = common.build_model(spec.lengths, profile, slo, link)
        if args.prefill_workers is not None:
            for flag, value in (
                ("--prefill-workers", args.prefill_workers),
                ("--decode-workers", args.decode_workers),
            ):
                if value < 1:
                    raise UsageError(f"{flag}: must be >= 1, got {value}")
            ev = evaluate(
                model,
                prefill_workers=args.prefill_workers,
                decode_workers=args.decode_workers,
                arrival_rate_rps=spec.arrival_rate_rps,
                ca2=spec.ca2,
                slo=slo,
            )
            out = {
                **shared,
                "mode": "evaluate",
                "prefill_workers": ev.prefill.workers,
                "decode_workers": ev.decode.workers,
                "ttft_p99_s": ev.prefill.p99_s,
                "tpot_p99_s": ev.decode.p99_s,
                "token_budget": ev.token_budget,
                "prefill_utilisation": ev.prefill.utilisation,
                "feasible": ev.feasible,
            }
        else:
            result = solve(
                model,
                arrival_rate_rps=spec.arrival_rate_rps,
                ca2=spec.ca2,
                slo=slo,
                headroom=args.headroom,
            )
            out = {**shared, "mode": "solve", **result.as_dict()}
    except InfeasibleSLOError as exc:
        if args.json:
            print(json.dumps({**shared, "feasible": False, "reason": str(exc)}))
        common.fail(str(exc), common.EXIT_INFEASIBLE)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print_solve(out)
    return 0


def _print_solve(out: dict[str, Any]) -> None:
    width = max(len(k) for k in out)
    for key, value in out.items():
        print(f"{key:<{width}}  {common.fmt(value)}")


def register(sub: Any) -> None:
    p = sub.add_parser("solve", help="the fewest prefill/decode workers that meet the SLOs")
    p.add_argument("--trace", metavar="FILE", help="trace file: rate, ca2 and lengths from it")
    p.add_argument("--arrival-rate", type=float, metavar="RPS", help="arrival rate in requests/s")
    p.add_argument("--lengths", metavar="FILE", help="any trace or length-only file")
    p.add_argument("--ca2", type=float, help="inter-arrival SCV (default: the trace's, else 1)")
    p.add_argument("--rate-scale", type=float, default=1.0, metavar="K", help="multiply the rate")
    p.add_argument(
        "--headroom",
        type=float,
        default=common.DEFAULT_HEADROOM,
        metavar="F",
        help=f"plan for SLO / (1 + F) (default {common.DEFAULT_HEADROOM}, the controller's)",
    )
    p.add_argument("--prefill-workers", type=int, metavar="N", help="evaluate this allocation")
    p.add_argument("--decode-workers", type=int, metavar="M", help="evaluate this allocation")
    common.add_slo_args(p)
    p.set_defaults(func=cmd_solve)
