"""The ``sara`` command line.

Exit codes: 0 success; 1 the SLOs cannot be met (one line says why); 2 bad arguments
or input files (a clear message, never a traceback).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from queueing.catalog import DEFAULT_PROFILE_NAME, builtin_profiles, resolve_profile
from queueing.lengths import LengthSamples
from queueing.profile import IterationProfile, ProfileError
from queueing.solver import (
    CapacityModel,
    InfeasibleSLOError,
    KvLink,
    SloTargets,
    evaluate,
    solve,
)
from sim.trace import Trace, TraceError

EXIT_INFEASIBLE = 1
EXIT_USAGE = 2
DEFAULT_TTFT_P99_S = 2.0
DEFAULT_TPOT_P99_S = 0.1
DEFAULT_HEADROOM = 0.1
DEFAULT_KV_LINK_GBPS = 400.0


class UsageError(Exception):
    """Bad arguments or input: reported in one line with exit code 2."""


def _fail(message: str, code: int) -> NoReturn:
    print(f"sara: {message}", file=sys.stderr)
    raise SystemExit(code)


def load_profile(spec: str) -> IterationProfile:
    """A built-in profile by name, or a profile JSON file by path."""
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"--profile: cannot read {spec}: {exc.strerror}") from exc
        try:
            return IterationProfile.from_json(text)
        except ProfileError as exc:
            raise UsageError(f"--profile {spec}: {exc}") from exc
    try:
        return resolve_profile(spec)
    except ProfileError as exc:
        raise UsageError(f"--profile: {exc}") from exc


def load_trace_arg(path: str, *, flag: str = "--trace") -> Trace:
    from sim.trace_io import load_trace

    try:
        return load_trace(path)
    except (TraceError, OSError) as exc:
        raise UsageError(f"{flag}: {exc}") from exc


def load_lengths_arg(path: str) -> LengthSamples:
    from sim.trace_io import load_lengths

    try:
        return load_lengths(path)
    except (TraceError, OSError) as exc:
        raise UsageError(f"--lengths: {exc}") from exc


def parse_listen(flag: str, value: str, *, any_port: bool = False) -> tuple[str, int]:
    """``HOST:PORT`` (an empty host is loopback); ``any_port`` also allows 0 (the OS
    picks one). ``UsageError`` naming ``flag`` otherwise."""
    host, sep, port = value.rpartition(":")
    low = 0 if any_port else 1
    if not sep or not port.isdigit() or not low <= int(port) < 65536:
        raise UsageError(f"{flag}: expected HOST:PORT, got {value!r}")
    return host or "127.0.0.1", int(port)


def _positive(name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise UsageError(f"{name}: must be a number > 0, got {value}")


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
        trace = load_trace_arg(args.trace)
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
    _positive("--arrival-rate", args.arrival_rate)
    lengths = load_lengths_arg(args.lengths)
    return LoadSpec(
        arrival_rate_rps=args.arrival_rate * args.rate_scale,
        ca2=1.0 if args.ca2 is None else args.ca2,
        lengths=lengths,
        source=args.lengths,
    )


def _slo(args: argparse.Namespace) -> SloTargets:
    _positive("--ttft-p99", args.ttft_p99)
    _positive("--tpot-p99", args.tpot_p99)
    return SloTargets(ttft_p99_s=args.ttft_p99, tpot_p99_s=args.tpot_p99)


def _link(args: argparse.Namespace) -> KvLink:
    _positive("--kv-link-gbps", args.kv_link_gbps)
    return KvLink(bytes_per_s=args.kv_link_gbps * 1e9 / 8.0)


def build_model(
    lengths: LengthSamples, profile: IterationProfile, slo: SloTargets, link: KvLink
) -> CapacityModel:
    try:
        return CapacityModel.build(lengths, profile, tpot_slo_s=slo.tpot_p99_s, link=link)
    except InfeasibleSLOError:
        raise
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def cmd_solve(args: argparse.Namespace) -> int:
    _positive("--rate-scale", args.rate_scale)
    if args.ca2 is not None and not (math.isfinite(args.ca2) and args.ca2 >= 0):
        raise UsageError(f"--ca2: must be a number >= 0, got {args.ca2}")
    if not (0 <= args.headroom < 10):
        raise UsageError(f"--headroom: must be in [0, 10), got {args.headroom}")
    if (args.prefill_workers is None) != (args.decode_workers is None):
        raise UsageError("--prefill-workers: give both --prefill-workers and --decode-workers")
    spec = _load_spec(args)
    profile = load_profile(args.profile)
    slo = _slo(args)
    link = _link(args)
    common: dict[str, Any] = {
        "arrival_rate_rps": spec.arrival_rate_rps,
        "ca2": spec.ca2,
        "ttft_slo_s": slo.ttft_p99_s,
        "tpot_slo_s": slo.tpot_p99_s,
        "headroom": args.headroom,
        "profile": profile.name,
        "source": spec.source,
    }
    try:
        model = build_model(spec.lengths, profile, slo, link)
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
                **common,
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
            out = {**common, "mode": "solve", **result.as_dict()}
    except InfeasibleSLOError as exc:
        if args.json:
            print(json.dumps({**common, "feasible": False, "reason": str(exc)}))
        _fail(str(exc), EXIT_INFEASIBLE)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print_solve(out)
    return 0


def _fmt(value: Any) -> str:
    if value is None:
        return "unstable"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _print_solve(out: dict[str, Any]) -> None:
    width = max(len(k) for k in out)
    for key, value in out.items():
        print(f"{key:<{width}}  {_fmt(value)}")


def cmd_profiles(args: argparse.Namespace) -> int:
    profiles = builtin_profiles()
    if args.json:
        print(json.dumps({name: json.loads(p.to_json()) for name, p in profiles.items()}, indent=2))
        return 0
    print(f"{'profile':<28} {'t0 ms':>7} {'t_tok us':>9} {'KV tokens':>11} {'startup s':>10}")
    for name, p in profiles.items():
        default = "  (default)" if name == DEFAULT_PROFILE_NAME else ""
        print(
            f"{name:<28} {p.t0_s * 1e3:>7.2f} {p.t_tok_s * 1e6:>9.2f} "
            f"{p.kv_capacity_tokens:>11,} {p.startup_s:>10.1f}{default}"
        )
    return 0


def _add_slo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ttft-p99",
        type=float,
        default=DEFAULT_TTFT_P99_S,
        metavar="S",
        help=f"P99 time-to-first-token SLO in seconds (default {DEFAULT_TTFT_P99_S})",
    )
    p.add_argument(
        "--tpot-p99",
        type=float,
        default=DEFAULT_TPOT_P99_S,
        metavar="S",
        help=f"P99 time-per-output-token SLO in seconds (default {DEFAULT_TPOT_P99_S})",
    )
    p.add_argument(
        "--profile",
        default=DEFAULT_PROFILE_NAME,
        metavar="NAME|FILE",
        help=f"built-in profile name (see `sara profiles`) or a profile JSON file "
        f"(default {DEFAULT_PROFILE_NAME})",
    )
    p.add_argument(
        "--kv-link-gbps",
        type=float,
        default=DEFAULT_KV_LINK_GBPS,
        metavar="GBPS",
        help=f"prefill-to-decode KV link in Gbit/s (default {DEFAULT_KV_LINK_GBPS:g})",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sara", description="SLO-driven autoscaling for disaggregated LLM inference"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("solve", help="the fewest prefill/decode workers that meet the SLOs")
    p.add_argument("--trace", metavar="FILE", help="trace file: rate, ca2 and lengths from it")
    p.add_argument("--arrival-rate", type=float, metavar="RPS", help="arrival rate in requests/s")
    p.add_argument("--lengths", metavar="FILE", help="any trace or length-only file")
    p.add_argument("--ca2", type=float, help="inter-arrival SCV (default: the trace's, else 1)")
    p.add_argument("--rate-scale", type=float, default=1.0, metavar="K", help="multiply the rate")
    p.add_argument(
        "--headroom",
        type=float,
        default=DEFAULT_HEADROOM,
        metavar="F",
        help=f"plan for SLO / (1 + F) (default {DEFAULT_HEADROOM})",
    )
    p.add_argument("--prefill-workers", type=int, metavar="N", help="evaluate this allocation")
    p.add_argument("--decode-workers", type=int, metavar="M", help="evaluate this allocation")
    _add_slo_args(p)
    p.set_defaults(func=cmd_solve)

    p = sub.add_parser("profiles", help="list the built-in iteration-time profiles")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_profiles)

    # Each subcommand module imports its heavy libraries (torch, redis) only when run.
    from controller import (
        cli_controller,
        cli_load,
        cli_operator,
        cli_profile,
        cli_serve,
        cli_simulate,
        cli_worker,
    )

    cli_simulate.register(sub, _add_slo_args)
    cli_controller.register(sub)
    cli_operator.register(sub)
    cli_profile.register(sub)
    cli_load.register(sub)
    cli_worker.register(sub)
    cli_serve.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except UsageError as exc:
        _fail(str(exc), EXIT_USAGE)


if __name__ == "__main__":
    raise SystemExit(main())
