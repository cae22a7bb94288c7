"""The ``sara`` command line: the parser, and nothing else.

Each verb lives in its own module (``cli/<verb>_cmd.py``) with ``register(subparsers)``
and a ``cmd_<verb>(args)`` it sets as ``func``; they import their heavy libraries
(torch, redis, kopf) only when run, so building the parser stays light. Exit codes and
the shared helpers are in ``cli.common``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from cli import (
    common,
    controller_cmd,
    load_cmd,
    operator_cmd,
    profile_cmd,
    profiles_cmd,
    router_cmd,
    serve_cmd,
    simulate_cmd,
    solve_cmd,
    supervision,
    worker_cmd,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sara", description="SLO-driven autoscaling for disaggregated LLM inference"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for verb in (
        solve_cmd,
        profiles_cmd,
        simulate_cmd,
        controller_cmd,
        operator_cmd,
        profile_cmd,
        load_cmd,
        worker_cmd,
        router_cmd,
        serve_cmd,
    ):
        verb.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # A child of `sara serve` ends when it does, however it ends (cli.supervision).
    supervision.watch_parent_from_env()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except common.UsageError as exc:
        common.fail(str(exc), common.EXIT_USAGE)


if __name__ == "__main__":
    raise SystemExit(main())
