"""`sara profiles`: the built-in iteration-time profiles, as a table or JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any

from queueing.catalog import DEFAULT_PROFILE_NAME, builtin_profiles


def cmd_profiles(args: argparse.Namespace) -> int:
    profiles = builtin_profiles()
    if args.json:
        print(json.dumps({name: json.loads(p.to_json()) for name, p in profiles.items()}, indent=2))
        return 0
    print(
        f"{'profile':<28} {'t0 ms':>7} {'t_tok us':>9} {'KV tokens':>11} "
        f"{'context':>8} {'startup s':>10}"
    )
    for name, p in profiles.items():
        default = "  (default)" if name == DEFAULT_PROFILE_NAME else ""
        context = "-" if p.max_context_tokens is None else f"{p.max_context_tokens:,}"
        print(
            f"{name:<28} {p.t0_s * 1e3:>7.2f} {p.t_tok_s * 1e6:>9.2f} "
            f"{p.kv_capacity_tokens:>11,} {context:>8} {p.startup_s:>10.1f}{default}"
        )
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("profiles", help="list the built-in iteration-time profiles")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_profiles)
