"""`sara load`: replay a trace open-loop against the router and report client-side latency.

    sara load --url http://127.0.0.1:8000 --trace traces/azure_conv.csv \\
        --time-scale 0.1 --duration-s 60 --max-prompt-tokens 256 --fit-context

Before sending, ``GET /v1/models`` names the model, its context (``max_model_len``,
for ``--fit-context``) and its vocabulary (``vocab_size``, SARA's extension; else
``--vocab-size``). Prompts are random token ids of the trace's (scaled, clipped)
lengths, sent with ``ignore_eos`` so that each request generates its trace output
length. Exit 0 once the run has finished (failed requests are in the report); 2 for
bad arguments, an unreadable trace or an unreachable URL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from typing import Any

from cli import common
from cli.common import UsageError

DEFAULT_VOCAB_SIZE = 256
PROGRESS_EVERY_S = 2.0


def _url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise UsageError(f"--url: expected http://HOST:PORT, got {value!r}")
    return value.rstrip("/")


def _model_card(url: str, timeout_s: float) -> dict[str, Any]:
    """The first entry of ``GET /v1/models``; ``UsageError`` when it cannot be read."""
    import httpx

    from cli.loadgen import completions_url

    models_url = completions_url(url).removesuffix("/completions") + "/models"
    try:
        resp = httpx.get(models_url, timeout=timeout_s)
        resp.raise_for_status()
        data = resp.json()["data"]
        return dict(data[0])
    except httpx.HTTPError as exc:
        raise UsageError(f"--url: cannot read {models_url}: {exc}") from exc
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise UsageError(f"--url: {models_url} did not list a model ({exc!r})") from exc


def _check(args: argparse.Namespace) -> None:
    for flag, value in (
        ("--rate-scale", args.rate_scale),
        ("--time-scale", args.time_scale),
        ("--length-scale", args.length_scale),
        ("--duration-s", args.duration_s),
        ("--request-timeout-s", args.request_timeout_s),
        ("--ttft-slo", args.ttft_slo),
        ("--tpot-slo", args.tpot_slo),
    ):
        common.positive(flag, value)
    for flag, value in (
        ("--max-requests", args.max_requests),
        ("--max-prompt-tokens", args.max_prompt_tokens),
        ("--max-output-tokens", args.max_output_tokens),
        ("--vocab-size", args.vocab_size),
        ("--max-inflight", args.max_inflight),
    ):
        if value is not None and value < 1:
            raise UsageError(f"{flag}: must be an integer >= 1, got {value}")


class _Progress:
    """One line on stderr every ``PROGRESS_EVERY_S``: done, failed, of how many."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self.done = 0
        self.failed = 0
        self._next = time.monotonic() + PROGRESS_EVERY_S

    def __call__(self, result: Any) -> None:
        self.done += 1
        self.failed += 0 if result.ok else 1
        now = time.monotonic()
        if self.enabled and now >= self._next:
            self._next = now + PROGRESS_EVERY_S
            print(
                f"sara load: {self.done}/{self.total} done, {self.failed} failed",
                file=sys.stderr,
                flush=True,
            )


def cmd_load(args: argparse.Namespace) -> int:
    import numpy as np

    from cli.loadgen import PlanOptions, build_plan, format_report, run_load, summarize

    _check(args)
    url = _url(args.url)
    trace = common.load_trace_arg(args.trace)
    card = _model_card(url, timeout_s=min(10.0, args.request_timeout_s))
    context = card.get("max_model_len")
    if args.fit_context and not (isinstance(context, int) and context >= 2):
        raise UsageError(f"--fit-context: {url} does not report max_model_len")
    vocab = args.vocab_size or card.get("vocab_size") or DEFAULT_VOCAB_SIZE
    try:
        options = PlanOptions(
            time_scale=args.time_scale,
            rate_scale=args.rate_scale,
            duration_s=args.duration_s,
            max_requests=args.max_requests,
            length_scale=args.length_scale,
            max_prompt_tokens=args.max_prompt_tokens,
            max_output_tokens=args.max_output_tokens,
            context_tokens=context if args.fit_context else None,
            vocab_size=int(vocab),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    plan = build_plan(trace, options, np.random.default_rng(args.seed))
    if not plan:
        raise UsageError("--duration-s: no request of the trace arrives within the window")
    progress = _Progress(len(plan), enabled=not args.json)
    results = asyncio.run(
        run_load(
            url,
            plan,
            model=args.model or card.get("id"),
            request_timeout_s=args.request_timeout_s,
            max_inflight=args.max_inflight,
            on_result=progress,
        )
    )
    report = summarize(results, ttft_slo_s=args.ttft_slo, tpot_slo_s=args.tpot_slo)
    if args.json:
        out = {"url": url, "trace": args.trace, "model": card.get("id"), **report.as_dict()}
        print(json.dumps(out, indent=2, default=_json_default))
    else:
        print(format_report(report))
    return 0


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"not JSON serialisable: {value!r}")


def register(sub: Any) -> None:
    from cli.loadgen import DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_REQUESTS

    p = sub.add_parser("load", help="replay a trace against the router; client-side latency")
    p.add_argument("--url", required=True, help="the router, e.g. http://127.0.0.1:8000")
    p.add_argument("--trace", required=True, metavar="FILE", help="trace file (any format)")
    p.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        metavar="K",
        help="multiply the arrival rate (thin or copy requests; default 1)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="F",
        help="multiply every arrival time (0.1 replays 10x faster; default 1)",
    )
    p.add_argument(
        "--duration-s",
        type=float,
        metavar="S",
        help="only requests arriving in the first S seconds (after scaling)",
    )
    p.add_argument(
        "--max-requests",
        type=int,
        default=DEFAULT_MAX_REQUESTS,
        metavar="N",
        help=f"send at most N requests (default {DEFAULT_MAX_REQUESTS})",
    )
    p.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="multiply prompt and output lengths (default 1)",
    )
    p.add_argument("--max-prompt-tokens", type=int, metavar="N", help="clip prompt lengths")
    p.add_argument("--max-output-tokens", type=int, metavar="N", help="clip output lengths")
    p.add_argument(
        "--fit-context",
        action="store_true",
        help="shorten prompts (then outputs) to fit the model's context",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        metavar="V",
        help="prompt ids in [0, V) (default: the router's, else 256)",
    )
    p.add_argument("--model", help="model name to send (default: the router's)")
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=120.0,
        metavar="S",
        help="give up on a request after S seconds (default 120)",
    )
    p.add_argument(
        "--max-inflight",
        type=int,
        default=DEFAULT_MAX_INFLIGHT,
        metavar="N",
        help=f"open connections at most (default {DEFAULT_MAX_INFLIGHT})",
    )
    p.add_argument(
        "--ttft-slo",
        type=float,
        default=common.DEFAULT_TTFT_P99_S,
        metavar="S",
        help=f"TTFT SLO for the attainment (default {common.DEFAULT_TTFT_P99_S})",
    )
    p.add_argument(
        "--tpot-slo",
        type=float,
        default=common.DEFAULT_TPOT_P99_S,
        metavar="S",
        help=f"TPOT SLO for the attainment (default {common.DEFAULT_TPOT_P99_S})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and rate scaling")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_load)
