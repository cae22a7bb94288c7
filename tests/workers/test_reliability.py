"""The whole data plane under load, in real processes: router, Redis, two workers per pool.

Tens of concurrent streaming requests go through the router while a worker of each
pool is killed with SIGKILL holding requests (checked: it is frozen with SIGSTOP, its
pending entries are counted, then it is killed), or sent SIGTERM (a scale-down).
Every request is counted: it completes, or ends with an error event, or hangs (the
client gives up) — and none may hang or vanish.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

pytest.importorskip("torch")

from queueing.pools import Pool
from workers.checkpoint import write_tiny_checkpoint
from workers.protocol import GROUPS, KeySpace
from workers.redis_util import RedisServer, free_port

REQUESTS = 40
CLIENT_TIMEOUT_S = 90.0
ROUTER_TIMEOUT_S = 60.0
RECLAIM_IDLE_MS = 1500
KEYS = KeySpace()


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli", *args]


@dataclass
class Stack:
    redis: RedisServer
    client: redis.Redis
    router_url: str
    workers: dict[str, subprocess.Popen[bytes]]
    model_dir: Path
    logs: Path

    def start_worker(self, pool: Pool, worker_id: str) -> None:
        log = (self.logs / f"{worker_id}.log").open("ab")
        self.workers[worker_id] = subprocess.Popen(
            cli(
                "worker", pool.value, "--redis", self.redis.url, "--model", str(self.model_dir),
                "--worker-id", worker_id, "--token-budget", "64", "--num-blocks", "512",
                "--reclaim-idle-ms", str(RECLAIM_IDLE_MS),
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def pending(self, pool: Pool, worker_id: str) -> int:
        info = self.client.xpending_range(
            KEYS.stream(pool), GROUPS[pool], min="-", max="+", count=1000, consumername=worker_id
        )
        return len(info)

    def wait_for_no_pending(self, *, timeout_s: float = 30.0) -> dict[Pool, int]:
        """Wait until no entry of either pool is pending; what is still pending at the end.

        A worker publishes a request's last token, then acknowledges its entry: a
        worker killed between the two leaves an entry of a request its client already
        has whole. A survivor acknowledges it once the dead worker's heartbeat has
        expired and the next reclaim pass runs — seconds later, more on a busy
        machine — so "nothing left held" is a property to wait for, not to sample.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            left = {
                pool: int(self.client.xpending(KEYS.stream(pool), GROUPS[pool])["pending"])
                for pool in Pool
            }
            if not any(left.values()) or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def live(self, pool: Pool) -> set[str]:
        return {
            m.decode()
            for m in self.client.zrangebyscore(KEYS.workers(pool), time.time() * 1000, "+inf")
        }


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    server = RedisServer.start()
    model_dir = write_tiny_checkpoint(tmp_path / "tiny", seed=0)
    port = free_port()
    logs = tmp_path / "logs"
    logs.mkdir()
    router = subprocess.Popen(
        cli(
            "router", "--redis", server.url, "--model", str(model_dir),
            "--listen", f"127.0.0.1:{port}", "--request-timeout-s", str(ROUTER_TIMEOUT_S),
        ),
        stdout=(logs / "router.log").open("ab"),
        stderr=subprocess.STDOUT,
    )
    s = Stack(
        redis=server,
        client=redis.Redis.from_url(server.url),
        router_url=f"http://127.0.0.1:{port}",
        workers={},
        model_dir=model_dir,
        logs=logs,
    )
    try:
        for pool in Pool:
            for i in range(2):
                s.start_worker(pool, f"{pool.value}-{i}")
        deadline = time.monotonic() + 120
        while not all(len(s.live(pool)) == 2 for pool in Pool):
            assert time.monotonic() < deadline, "workers did not register: " + _tails(logs)
            time.sleep(0.2)
        while True:
            try:
                if httpx.get(f"{s.router_url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the router is not ready: " + _tails(logs)
            time.sleep(0.2)
        yield s
    finally:
        for proc in [*s.workers.values(), router]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        server.stop()


def _tails(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(logs.iterdir()))


async def one_request(client: httpx.AsyncClient, url: str, i: int) -> str:
    """Stream one completion; its outcome: ``ok``, ``error: ...`` or ``hung``."""
    body = {
        "prompt": [(i * 7 + k) % 500 + 3 for k in range(200 + 10 * i)],
        "max_tokens": 120,
        "stream": True,
    }
    tokens = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return f"error: HTTP {resp.status_code} {resp.text[:300]}"
            done, finish = False, None
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    return f"error: {event['error'].get('message')}"
                choice = event["choices"][0]
                tokens += len(choice.get("token_ids") or [])
                finish = choice.get("finish_reason") or finish
            if done and finish in ("length", "stop") and (finish == "stop" or tokens == 120):
                return "ok"
            return f"error: stream ended after {tokens} tokens (finish {finish}, done {done})"
    except httpx.TimeoutException as exc:
        return f"hung: {type(exc).__name__} after {tokens} tokens"


async def load(url: str, during: object, *, keep_sending: bool = False) -> Counter[str]:
    """REQUESTS streams over a little under a second, then ``during`` in a thread.

    With ``keep_sending`` the requests go on at the same pace (up to ten times as
    many) until ``during`` returns, so that work is still in flight whenever it looks
    for some: fast emulated workers can finish a burst's prefills before ``during``
    starts."""
    timeout = httpx.Timeout(CLIENT_TIMEOUT_S, connect=10.0)
    most = REQUESTS * (10 if keep_sending else 1)
    limits = httpx.Limits(max_connections=most + 10)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        tasks = []
        for i in range(REQUESTS):
            tasks.append(asyncio.create_task(one_request(client, url, i)))
            await asyncio.sleep(0.02)  # a burst over a little under a second
        chooser = asyncio.create_task(asyncio.to_thread(during))  # type: ignore[arg-type]
        while keep_sending and not chooser.done() and len(tasks) < most:
            tasks.append(asyncio.create_task(one_request(client, url, len(tasks) % REQUESTS)))
            await asyncio.sleep(0.02)
        await chooser
        outcomes = await asyncio.gather(*tasks)
    errors = sorted({o for o in outcomes if o != "ok"})
    counts = Counter(o.split(":")[0] for o in outcomes)
    print("outcomes:", dict(counts), "errors:", errors)
    return counts


def kill_holding(stack: Stack, pool: Pool, worker_id: str, sig: signal.Signals) -> int:
    """Signal the worker at a moment it holds entries; how many it held."""
    proc = stack.workers[worker_id]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        os.kill(proc.pid, signal.SIGSTOP)  # freeze it, so what it holds cannot change
        held = stack.pending(pool, worker_id)
        if held:
            os.kill(proc.pid, sig)
            if sig is not signal.SIGKILL:
                os.kill(proc.pid, signal.SIGCONT)
            return held
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.005)
    raise AssertionError(f"{worker_id} never held an entry")


def test_killing_a_worker_of_each_pool_mid_stream_loses_no_request(stack: Stack) -> None:
    held: dict[str, int] = {}

    def during() -> None:
        held["prefill"] = kill_holding(stack, Pool.PREFILL, "prefill-0", signal.SIGKILL)
        held["decode"] = kill_holding(stack, Pool.DECODE, "decode-0", signal.SIGKILL)

    outcomes = asyncio.run(load(stack.router_url, during))
    assert held["prefill"] >= 1 and held["decode"] >= 1, held
    assert outcomes["hung"] == 0, (outcomes, _tails(stack.logs))
    assert sum(v for k, v in outcomes.items() if k in ("ok", "error", "hung")) == REQUESTS
    # The survivors took over every entry of the dead: each request completes.
    assert outcomes["ok"] == REQUESTS, (outcomes, _tails(stack.logs))
    assert stack.wait_for_no_pending() == {Pool.PREFILL: 0, Pool.DECODE: 0}


def test_a_sigterm_scale_down_under_load_fails_no_request(stack: Stack) -> None:
    held: dict[str, int] = {}

    def during() -> None:
        held["prefill"] = kill_holding(stack, Pool.PREFILL, "prefill-0", signal.SIGTERM)
        held["decode"] = kill_holding(stack, Pool.DECODE, "decode-0", signal.SIGTERM)

    outcomes = asyncio.run(load(stack.router_url, during))
    assert held["prefill"] >= 1 and held["decode"] >= 1, held
    assert outcomes["ok"] == REQUESTS, (outcomes, _tails(stack.logs))
    for worker_id in ("prefill-0", "decode-0"):
        assert stack.workers[worker_id].wait(timeout=30) == 0, _tails(stack.logs)
    assert stack.live(Pool.PREFILL) == {"prefill-1"}
    assert stack.live(Pool.DECODE) == {"decode-1"}
