"""What every `sara` command shares: exit codes, argument errors and parsers.

Exit codes: 0 success; 1 the SLOs cannot be met (one line says why); 2 bad arguments
or input files (a clear message, never a traceback). The defaults come from the
config dataclasses, so `sara solve` plans the way the controller does.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, NoReturn

from controller.config import ControllerConfig
from controller.profiles import load_profile
from queueing.catalog import DEFAULT_PROFILE_NAME
from queueing.lengths import LengthSamples
from queueing.profile import IterationProfile, ProfileError
from queueing.solver import CapacityModel, InfeasibleSLOError, KvLink, SloTargets
from sim.trace import Trace, TraceError

EXIT_INFEASIBLE = 1
EXIT_USAGE = 2
_DEFAULTS = ControllerConfig()
DEFAULT_TTFT_P99_S = _DEFAULTS.slo.ttft_p99_s
DEFAULT_TPOT_P99_S = _DEFAULTS.slo.tpot_p99_s
DEFAULT_HEADROOM = _DEFAULTS.headroom
DEFAULT_KV_LINK_GBPS = 400.0


class UsageError(Exception):
    """Bad arguments or input: reported in one line with exit code 2."""


def fail(message: str, code: int) -> NoReturn:
    """``sara: MESSAGE`` on stderr, then exit with ``code``."""
    print(f"sara: {message}", file=sys.stderr)
    raise SystemExit(code)


def load_profile_arg(spec: str) -> IterationProfile:
    """``--profile``: a built-in name or a profile JSON file (``controller.profiles``)."""
    try:
        return load_profile(spec)
    except OSError as exc:
        raise UsageError(f"--profile: cannot read {spec}: {exc.strerror}") from exc
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


def positive(name: str, value: float | None) -> None:
    """``UsageError`` naming the flag unless ``value`` is None or a finite number > 0."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise UsageError(f"{name}: must be a number > 0, got {value}")


def slo_targets(args: argparse.Namespace) -> SloTargets:
    positive("--ttft-p99", args.ttft_p99)
    positive("--tpot-p99", args.tpot_p99)
    return SloTargets(ttft_p99_s=args.ttft_p99, tpot_p99_s=args.tpot_p99)


def kv_link(args: argparse.Namespace) -> KvLink:
    positive("--kv-link-gbps", args.kv_link_gbps)
    return KvLink(bytes_per_s=args.kv_link_gbps * 1e9 / 8.0)


def build_model(
    lengths: LengthSamples, profile: IterationProfile, slo: SloTargets, link: KvLink
) -> CapacityModel:
    """The capacity model; ``InfeasibleSLOError`` passes through, bad input is a UsageError."""
    try:
        return CapacityModel.build(lengths, profile, tpot_slo_s=slo.tpot_p99_s, link=link)
    except InfeasibleSLOError:
        raise
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def fmt(value: Any) -> str:
    """One value of a result table: 4 significant digits, ``unstable`` for None."""
    if value is None:
        return "unstable"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def add_slo_args(p: argparse.ArgumentParser) -> None:
    """The SLO, profile, KV-link and ``--json`` flags of `sara solve` and `sara simulate`."""
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
