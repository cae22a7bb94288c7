"""The reliability checks of test_reliability.py against emulated pools of 8 + 8 workers.

The same router, Redis, protocol, reclaim and drain as with the torch engine, at a
pool size only emulated workers fit on this machine: 16 worker processes, each step
timed by a test profile. The same 40 concurrent streams; a worker of each pool is
frozen holding entries, then killed (SIGKILL) or asked to drain (SIGTERM).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

pytest.importorskip("torch")

from queueing.pools import Pool
from tests.profiles import TEST_8B
from tests.workers.test_reliability import (
    RECLAIM_IDLE_MS,
    REQUESTS,
    ROUTER_TIMEOUT_S,
    Stack,
    _tails,
    cli,
    load,
)
from workers.checkpoint import write_tiny_checkpoint
from workers.protocol import KeySpace
from workers.redis_util import RedisServer, free_port

PER_POOL = 8
KEYS = KeySpace()


class EmulatedStack(Stack):
    profile: Path

    def start_worker(self, pool: Pool, worker_id: str) -> None:
        log = (self.logs / f"{worker_id}.log").open("ab")
        self.workers[worker_id] = subprocess.Popen(
            cli(
                "worker",
                pool.value,
                "--engine",
                "emulated",
                "--profile",
                str(self.profile),
                "--startup-s",
                "0",
                "--redis",
                self.redis.url,
                "--model",
                str(self.model_dir),
                "--worker-id",
                worker_id,
                "--token-budget",
                "256",
                "--num-blocks",
                "512",
                "--reclaim-idle-ms",
                str(RECLAIM_IDLE_MS),
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[EmulatedStack]:
    server = RedisServer.start()
    # The tiny checkpoint's config.json gives the router and the emulated workers one
    # vocabulary and context; no weights are loaded by the workers.
    model_dir = write_tiny_checkpoint(tmp_path / "tiny", seed=0)
    profile = tmp_path / "profile.json"
    profile.write_text(TEST_8B.to_json())
    port = free_port()
    logs = tmp_path / "logs"
    logs.mkdir()
    router = subprocess.Popen(
        cli(
            "router",
            "--redis",
            server.url,
            "--model",
            str(model_dir),
            "--listen",
            f"127.0.0.1:{port}",
            "--request-timeout-s",
            str(ROUTER_TIMEOUT_S),
        ),
        stdout=(logs / "router.log").open("ab"),
        stderr=subprocess.STDOUT,
    )
    s = EmulatedStack(
        redis=server,
        client=redis.Redis.from_url(server.url),
        router_url=f"http://127.0.0.1:{port}",
        workers={},
        model_dir=model_dir,
        logs=logs,
    )
    s.profile = profile
    try:
        for pool in Pool:
            for i in range(PER_POOL):
                s.start_worker(pool, f"{pool.value}-{i}")
        deadline = time.monotonic() + 240
        while not all(len(s.live(pool)) == PER_POOL for pool in Pool):
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


def kill_any_holding(
    stack: EmulatedStack, pool: Pool, candidates: list[str], sig: signal.Signals
) -> str:
    """Signal whichever of ``candidates`` first holds an entry; its id.

    Eight workers share a pool's stream and a request reaches only some of them, so
    the victim is the first worker found holding work, not a fixed one."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for worker_id in candidates:
            proc = stack.workers[worker_id]
            os.kill(proc.pid, signal.SIGSTOP)  # freeze it, so what it holds cannot change
            if stack.pending(pool, worker_id):
                os.kill(proc.pid, sig)
                if sig is not signal.SIGKILL:
                    os.kill(proc.pid, signal.SIGCONT)
                return worker_id
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.005)
    raise AssertionError(f"none of {candidates} ever held an entry")


def test_killing_an_emulated_worker_of_each_pool_mid_stream_loses_no_request(
    stack: EmulatedStack,
) -> None:
    victims: dict[tuple[Pool, signal.Signals], str] = {}

    def during() -> None:
        for sig in (signal.SIGKILL, signal.SIGTERM):  # a crash, then a scale-down
            for pool in Pool:
                taken = {v for (p, _), v in victims.items() if p is pool}
                names = [f"{pool.value}-{i}" for i in range(PER_POOL)]
                free = [n for n in names if n not in taken]
                victims[(pool, sig)] = kill_any_holding(stack, pool, free, sig)

    outcomes = asyncio.run(load(stack.router_url, during, keep_sending=True))
    assert len(victims) == 4, victims
    assert outcomes["ok"] >= REQUESTS and set(outcomes) == {"ok"}, (outcomes, _tails(stack.logs))
    for (_, sig), worker_id in victims.items():
        if sig is signal.SIGTERM:
            assert stack.workers[worker_id].wait(timeout=60) == 0, _tails(stack.logs)
    assert stack.wait_for_no_pending() == {Pool.PREFILL: 0, Pool.DECODE: 0}
    for pool in Pool:
        assert len(stack.live(pool)) == PER_POOL - 2
