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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import torch

from workers.checkpoint import load_model, tiny_config, write_tiny_checkpoint
from workers.engine import Engine, tune_cpu_allocator
from workers.redis_util import RedisServer, free_port
from workers.sampling import SamplingParams

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
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (length,), generator=gen).tolist() for _ in range(batch)]


def engine_tokens_per_s(model_dir: Path, batch: list[list[int]], max_tokens: int) -> float:
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
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.close()
                raise RuntimeError(f"the stack did not become ready; logs in {logs}")
            time.sleep(0.2)

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.redis.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16, help="concurrent requests")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--max-tokens", type=int, default=64, help="generated per request")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()

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


if __name__ == "__main__":
    raise SystemExit(main())
