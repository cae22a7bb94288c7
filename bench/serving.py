"""Serving overhead: tokens per second through router + Redis + workers vs the engine alone.

The same generated model, the same batch (``--batch`` requests of ``--prompt``
tokens each generating ``--max-tokens`` tokens, EOS ignored), measured in the same
run, alternating:

- engine: one ``Engine`` in this process runs the whole batch (chunked prefill,
  then decoding), one torch thread, as a worker runs;
- served: the batch as concurrent streaming requests to ``sara router``, through a
  private Redis to one prefill and one decode worker process (one torch thread each),
  the KV cache moved over Redis; the clock runs from the first request sent to the
  last token read by the client.

Generated tokens per second = batch x max_tokens / wall time. The bench prints both
and their ratio (target >= 0.7), the median over ``--trials``.

The model is a generated Llama of ~25 M parameters (hidden 512, 8 layers): big
enough that a step's compute, not Python, dominates, as with any real model; the
tiny test model is so small that per-token bookkeeping would be most of the cost.

    .venv/bin/python bench/serving.py [--batch 16] [--prompt 128] [--max-tokens 64]

``--router-ceiling``: the router + Redis ceiling instead. Redis, the router and
``--workers`` emulated workers per pool (``--profile``) as processes; requests of
``--prompt`` + ``--max-tokens`` tokens at each of ``--rates`` for ``--seconds``,
through the router by the load generator of `sara load`, then the same requests
straight onto the Redis streams (the pools without the router). Printed per rate:
TTFT P50/P99 both ways, the router's added P99 (routed minus direct), streamed
tokens/s, and the CPU per request of the router and of the load generator; then the
highest rate below the first whose added P99 exceeds 10 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import numpy as np

from workers.redis_util import RedisServer, free_port

TARGET_RATIO = 0.7
BENCH_CONFIG = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
TOKEN_BUDGET = 256
NUM_BLOCKS = 1024


def prompts(batch: int, length: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (length,), generator=gen).tolist() for _ in range(batch)]


def engine_tokens_per_s(model_dir: Path, batch: list[list[int]], max_tokens: int) -> float:
    from workers.checkpoint import load_model
    from workers.engine import Engine
    from workers.sampling import SamplingParams

    model = load_model(model_dir)
    engine = Engine(model, token_budget=TOKEN_BUDGET, num_blocks=NUM_BLOCKS, max_running=64)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = engine.generate(batch, params)
    elapsed = time.perf_counter() - start
    assert all(len(o) == max_tokens for o in out)
    return len(batch) * max_tokens / elapsed


async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int], n: int) -> int:
    body = {"prompt": prompt, "max_tokens": n, "stream": True, "ignore_eos": True}
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(event["error"])
                tokens += len(event["choices"][0].get("token_ids") or [])
    return tokens


async def _served_batch(url: str, batch: list[list[int]], max_tokens: int) -> float:
    limits = httpx.Limits(max_connections=len(batch) + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(_stream(client, url, p, max_tokens) for p in batch))
        elapsed = time.perf_counter() - start
    assert all(c == max_tokens for c in counts), counts
    return len(batch) * max_tokens / elapsed


def wait_ready(
    url: str, procs: list[subprocess.Popen[bytes]], close: Callable[[], None], logs: Path
) -> None:
    """Until the router's ``/readyz`` answers 200 (2 min at most); if it never does, or
    a process of the stack exits first, ``close`` the stack and raise."""
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            close()
            raise RuntimeError(f"the stack did not become ready; logs in {logs}")
        time.sleep(0.2)


class ServedStack:
    """Redis, the router and one worker per pool, as ``sara serve`` runs them."""

    def __init__(self, model_dir: Path, logs: Path) -> None:
        self.redis = RedisServer.start()
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        common = ["--redis", self.redis.url, "--model", str(model_dir)]
        python = [sys.executable, "-m", "cli"]
        worker_args = ["--token-budget", str(TOKEN_BUDGET), "--num-blocks", str(NUM_BLOCKS)]
        self.procs = [
            subprocess.Popen(
                [*python, "router", *common, "--listen", f"127.0.0.1:{port}"],
                stdout=(logs / "router.log").open("wb"),
                stderr=subprocess.STDOUT,
            ),
            *(
                subprocess.Popen(
                    [*python, "worker", pool, *common, *worker_args],
                    stdout=(logs / f"{pool}.log").open("wb"),
                    stderr=subprocess.STDOUT,
                )
                for pool in ("prefill", "decode")
            ),
        ]
        wait_ready(self.url, self.procs, self.close, logs)

    def close(self) -> None:
        from router_faults import stop_all

        stop_all(self.procs, timeout_s=30)
        self.redis.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16, help="concurrent requests")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--max-tokens", type=int, default=64, help="generated per request")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument(
        "--router-ceiling", action="store_true",
        help="instead: the router + Redis ceiling against emulated workers",
    )  # fmt: skip
    parser.add_argument("--workers", type=int, default=4, help="ceiling: workers per pool")
    parser.add_argument("--profile", default=CEILING_PROFILE, help="ceiling: emulated profile")
    parser.add_argument("--rates", default="2,4,8,16,24,32", help="ceiling: req/s, ascending")
    parser.add_argument("--seconds", type=float, default=10.0, help="ceiling: per rate")
    parser.add_argument("--router-profile", help="ceiling: write the router's cProfile here")
    args = parser.parse_args()
    if args.router_ceiling:
        return router_ceiling(args)

    import torch

    from workers.checkpoint import tiny_config, write_tiny_checkpoint
    from workers.engine import tune_cpu_allocator

    torch.set_num_threads(1)
    tune_cpu_allocator()
    batch = prompts(args.batch, args.prompt)
    with tempfile.TemporaryDirectory(prefix="sara-bench-") as tmp:
        model_dir = write_tiny_checkpoint(
            Path(tmp) / "model", seed=0, config=tiny_config(**BENCH_CONFIG), tokenizer=False
        )
        logs = Path(tmp) / "logs"
        logs.mkdir()
        stack = ServedStack(model_dir, logs)
        try:
            asyncio.run(_served_batch(stack.url, batch[:2], 4))  # warm-up: imports, caches
            engine_tokens_per_s(model_dir, batch[:2], 4)
            engine, served = [], []
            for _ in range(args.trials):
                engine.append(engine_tokens_per_s(model_dir, batch, args.max_tokens))
                served.append(asyncio.run(_served_batch(stack.url, batch, args.max_tokens)))
        finally:
            stack.close()
    e, s = statistics.median(engine), statistics.median(served)
    ratio = s / e
    print(
        f"serving overhead: {args.batch} requests x ({args.prompt} prompt + {args.max_tokens} "
        f"generated) tokens, generated ~25M-parameter Llama on cpu, 1 torch thread per process; "
        f"median of {args.trials} trials"
    )
    print(f"engine alone, one process:          {e:9.1f} generated tokens/s")
    print(f"router + Redis + prefill + decode:  {s:9.1f} generated tokens/s")
    ok = ratio >= TARGET_RATIO
    print(f"ratio served / engine = {ratio:.2f} (target >= {TARGET_RATIO}): "
          f"{'PASS' if ok else 'FAIL'}")  # fmt: skip
    return 0 if ok else 1


# --------------------------------------------------------------------------- router ceiling

CEILING_PROFILE = "llama-3-8b@h100-sxm"
ADDED_P99_LIMIT_S = 0.010


def _fixed_rate_plan(rate_per_s: float, duration_s: float, prompt: int, max_tokens: int) -> list:
    from cli.loadgen import PlannedRequest

    gen = np.random.default_rng(0)
    n = max(1, int(rate_per_s * duration_s))
    return [
        PlannedRequest(
            index=i,
            send_at_s=i / rate_per_s,
            prompt_token_ids=tuple(int(t) for t in gen.integers(3, 250, prompt)),
            max_tokens=max_tokens,
        )
        for i in range(n)
    ]


async def _direct(redis_url: str, plan: list, clock: Any = time.perf_counter) -> list[float]:
    """The same requests straight onto the Redis streams (no HTTP, no router): each
    one's TTFT from its scheduled time, as the load generator measures it."""
    import redis.asyncio

    from workers.protocol import AsyncStreams, PrefillRequest

    client = redis.asyncio.Redis.from_url(redis_url, max_connections=2048)
    streams = AsyncStreams(client)
    start = clock() + 0.05

    async def one(req: Any) -> float:
        scheduled = start + req.send_at_s
        await asyncio.sleep(max(0.0, scheduled - clock()))
        wall = time.time()
        pre = PrefillRequest(
            request_id=f"cmpl-bench{req.index:08d}{int(wall * 1e6)}",
            prompt_token_ids=req.prompt_token_ids,
            max_tokens=req.max_tokens,
            temperature=0.0,
            top_p=1.0,
            seed=req.index,
            ignore_eos=True,
            arrival_s=wall,
            deadline_s=wall + 120,
        )
        await streams.enqueue_prefill(pre)
        last, n, first = "0-0", 0, None
        while n < req.max_tokens:
            last, events = await streams.read_tokens(pre.request_id, last, block_ms=500)
            if events and first is None:
                first = clock() - scheduled
            n += len(events)
        await streams.finish(pre.request_id)
        assert first is not None
        return first

    try:
        return list(await asyncio.gather(*(one(r) for r in plan)))
    finally:
        await client.aclose()


class EmulatedStack:
    """Redis, ``sara router`` and emulated prefill/decode workers as separate processes."""

    def __init__(self, work: Path, *, workers: int, profile: str, router_prof: Path | None):
        from controller.profiles import load_profile
        from workers.emulated import model_card

        self.redis = RedisServer.start()
        model = work / "model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(model_card(load_profile(profile))))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        common = ["--redis", self.redis.url, "--model", str(model)]
        python = [sys.executable]
        router = ["-m", "cli", "router", *common, "--listen", f"127.0.0.1:{port}"]
        if router_prof is not None:
            router = ["-m", "cProfile", "-o", str(router_prof), *router]
        self.procs = [
            subprocess.Popen(
                [*python, *router],
                stdout=(work / "router.log").open("wb"),
                stderr=subprocess.STDOUT,
            )
        ]
        for pool in ("prefill", "decode"):
            for i in range(workers):
                self.procs.append(
                    subprocess.Popen(
                        [*python, "-m", "cli", "worker", pool, *common, "--engine", "emulated",
                         "--profile", profile, "--startup-s", "0",
                         "--metrics-listen", f"127.0.0.1:{free_port()}"],
                        stdout=(work / f"{pool}{i}.log").open("wb"),
                        stderr=subprocess.STDOUT,
                    )
                )  # fmt: skip
        wait_ready(self.url, self.procs, self.close, work)
        time.sleep(1.0)  # every worker registered

    def close(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGINT)  # the router's profile is written on a clean exit
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.redis.stop()


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else math.nan


def router_ceiling(args: argparse.Namespace) -> int:
    from cli.loadgen import ResultStatus, run_load

    rates = [float(r) for r in args.rates.split(",")]
    with tempfile.TemporaryDirectory(prefix="sara-ceiling-") as tmp:
        work = Path(tmp)
        prof = Path(args.router_profile).resolve() if args.router_profile else None
        stack = EmulatedStack(work, workers=args.workers, profile=args.profile, router_prof=prof)
        rows = []
        try:
            warm = _fixed_rate_plan(2.0, 2.0, args.prompt, args.max_tokens)
            asyncio.run(run_load(stack.url, warm))
            for rate in rates:
                plan = _fixed_rate_plan(rate, args.seconds, args.prompt, args.max_tokens)
                cpu0, client0 = _cpu_s(stack.procs[0].pid), time.process_time()
                t0 = time.perf_counter()
                results = asyncio.run(run_load(stack.url, plan))
                wall = time.perf_counter() - t0
                router_cpu = (_cpu_s(stack.procs[0].pid) - cpu0) / len(plan)
                client_cpu = (time.process_time() - client0) / len(plan)
                direct = asyncio.run(_direct(stack.redis.url, plan))
                ok = [r for r in results if r.status is ResultStatus.OK]
                routed = [r.ttft_s for r in ok if r.ttft_s is not None]
                added = _p(routed, 99) - _p(direct, 99)
                tokens_s = sum(r.output_tokens for r in ok) / wall
                rows.append((rate, tokens_s, len(ok) / len(plan), _p(direct, 50), _p(direct, 99),
                             _p(routed, 50), _p(routed, 99), added, router_cpu))  # fmt: skip
                print(
                    f"{rate:6.1f} req/s {tokens_s:8.0f} tok/s  ok {len(ok) / len(plan):6.1%}  "
                    f"TTFT direct P50/P99 {_p(direct, 50) * 1e3:6.1f}/{_p(direct, 99) * 1e3:6.1f}"
                    " ms"
                    f"  routed {_p(routed, 50) * 1e3:6.1f}/{_p(routed, 99) * 1e3:6.1f} ms  "
                    f"added P99 {added * 1e3:6.1f} ms  CPU/req router {router_cpu * 1e3:4.1f} ms"
                    f" load generator {client_cpu * 1e3:4.1f} ms",
                    flush=True,
                )
        finally:
            stack.close()
    # The ceiling: the highest rate below the first one whose added P99 is over the limit.
    first_over = next((i for i, r in enumerate(rows) if r[7] > ADDED_P99_LIMIT_S), len(rows))
    under, over = rows[:first_over], rows[first_over:]
    print(
        f"router + Redis ceiling ({args.workers} + {args.workers} emulated {args.profile} "
        f"workers, {args.prompt} prompt + {args.max_tokens} generated tokens per request): "
        + (
            f"added TTFT P99 <= {ADDED_P99_LIMIT_S * 1e3:g} ms up to {under[-1][0]:g} req/s "
            f"({under[-1][1]:.0f} streamed tokens/s)"
            if under
            else "over the limit at every rate"
        )
        + (f"; exceeded at {over[0][0]:g} req/s ({over[0][1]:.0f} tokens/s)" if over else "")
    )
    return 0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    raise SystemExit(main())
