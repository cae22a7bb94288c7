"""Faults a user of `sara serve` hits, on the real stack: every process is real (Redis,
the router, emulated workers, the controller), on loopback.

- ``kill -9`` of the private Redis under load: streams in flight end with an error
  event (none hangs), new requests get 503 at once, the stack serves again once the
  supervisor has restarted Redis, and the controller does not scale up meanwhile
  (the 503s are not demand);
- with no decode worker alive a request fails fast with a clear error;
- SIGKILL of `sara serve`, and SIGTERM while it is still starting, leave no process
  behind: looked for by the ports and by the command line, not only by process group.

The workers are the emulated engine (``--engine emulated``: the real scheduler, steps
timed by a built-in profile, no model weights), so the stack starts in seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from controller.config import ControllerConfig
from workers.redis_util import free_port

STREAMS = 40
PROFILE = "llama-3-8b@h100-sxm"
START_TIMEOUT_S = 90.0


@dataclass
class Serve:
    process: subprocess.Popen[bytes]
    work: Path
    router: str
    api: str
    ports: list[int]
    log: Path

    def tail(self) -> str:
        logs = [self.log, *sorted((self.work / "state" / "logs").glob("*.log"))]
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in logs if p.exists())

    def redis_url(self) -> str:
        text = self.log.read_text()
        at = text.index("redis on redis://") + len("redis on ")
        return text[at:].split()[0]


def start_serve(work: Path, *, config: dict[str, Any] | None = None) -> Serve:
    router_port, api_port = free_port(), free_port()
    prefill_port, decode_port = free_port(), free_port()
    config_file = work / "config.json"
    config_file.write_text(json.dumps(config or ControllerConfig(profile=PROFILE).to_dict()))
    log = work / "serve.log"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli",
            "serve",
            "--engine",
            "emulated",
            "--startup-s",
            "0",
            "--config",
            str(config_file),
            "--state-dir",
            str(work / "state"),
            "--listen",
            f"127.0.0.1:{router_port}",
            "--api-listen",
            f"127.0.0.1:{api_port}",
            "--prefill-port",
            str(prefill_port),
            "--decode-port",
            str(decode_port),
            "--grace-period-s",
            "5",
            "--request-timeout-s",
            "30",
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if k != "SARA_PARENT_PID"},
    )
    return Serve(
        process=process,
        work=work,
        router=f"http://127.0.0.1:{router_port}",
        api=f"http://127.0.0.1:{api_port}",
        ports=[router_port, api_port, prefill_port, decode_port],
        log=log,
    )


def wait_ready(serve: Serve) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert serve.process.poll() is None, "sara serve exited:\n" + serve.tail()
        try:
            if httpx.get(f"{serve.router}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the stack did not become ready:\n" + serve.tail()
        time.sleep(0.2)


def processes_of(serve: Serve) -> list[str]:
    """Live processes that belong to this stack: by command line (the state directory,
    the router's or a worker's port) or by a listening port of the stack."""
    marks = [str(serve.work), *(f"127.0.0.1:{p}" for p in serve.ports)]
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(mark in cmdline for mark in marks):
            found.append(f"{entry.name}: {cmdline.strip()}")
    return found


def ports_in_use(ports: list[int]) -> list[int]:
    taken = []
    for port in ports:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                taken.append(port)
    return taken


def assert_nothing_left(serve: Serve, extra_ports: list[int], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        left, taken = processes_of(serve), ports_in_use(serve.ports + extra_ports)
        if not left and not taken:
            return
        assert time.monotonic() < deadline, f"left behind: {left}, ports taken: {taken}"
        time.sleep(0.2)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    config = ControllerConfig.from_dict(
        {"profile": PROFILE, "interval_s": 1.0, "window_s": 5.0, "stale_after_s": 10.0}
    ).to_dict()
    s = start_serve(tmp_path, config=config)
    try:
        wait_ready(s)
        yield s
    finally:
        if s.process.poll() is None:
            s.process.send_signal(signal.SIGTERM)
            try:
                s.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                s.process.kill()
                s.process.wait()


async def one_stream(client: httpx.AsyncClient, url: str, i: int) -> str:
    body = {"prompt": [3 + (i + k) % 500 for k in range(64)], "max_tokens": 400, "stream": True}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return f"HTTP {resp.status_code}: {resp.json()['error']['code']}"
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and '"error"' in line:
                    return "error event: " + json.loads(line[6:])["error"]["code"]
                if line == "data: [DONE]":
                    return "ok"
        return "ended without [DONE]"
    except httpx.TimeoutException:
        return "hung"


def replicas(serve: Serve) -> dict[str, int]:
    status = httpx.get(f"{serve.api}/v1/status", timeout=5).json()
    return dict(status.get("desired") or {})


def test_killing_redis_under_load_fails_streams_fast_and_the_stack_recovers_unscaled(
    serve: Serve,
) -> None:
    client = redis.Redis.from_url(serve.redis_url())
    redis_pid = int(client.info("server")["process_id"])
    before = replicas(serve)

    async def scenario() -> tuple[Counter[str], float, int]:
        timeout = httpx.Timeout(20.0, connect=5.0)
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=64)) as c:
            tasks = [asyncio.create_task(one_stream(c, serve.router, i)) for i in range(STREAMS)]
            await asyncio.sleep(1.0)  # streams under way
            os.kill(redis_pid, signal.SIGKILL)
            started = time.monotonic()
            refused = await c.post(f"{serve.router}/v1/completions", json={"prompt": [5, 6]})
            refused_after_s = time.monotonic() - started
            outcomes = Counter(await asyncio.gather(*tasks))
            return outcomes, refused_after_s, refused.status_code

    outcomes, refused_after_s, status = asyncio.run(scenario())
    print("outcomes:", dict(outcomes), "503 after", refused_after_s)
    assert outcomes["hung"] == 0, outcomes
    # In flight: an error event; not yet admitted (a loaded machine is slow to take
    # all 40): refused at once with 503; finished before the kill: ok.
    allowed = {"ok", "error event: redis_unavailable", "HTTP 503: redis_unavailable"}
    assert set(outcomes) <= allowed, outcomes
    assert outcomes["error event: redis_unavailable"] >= 1, outcomes
    # New requests during the outage: 503 at once (the supervisor may already have
    # brought Redis back, which is a 200; either way no wait).
    assert status in (503, 200) and refused_after_s < 2.0
    # Served again once Redis is back (restarted empty; the workers re-register).
    deadline = time.monotonic() + 30
    while True:
        resp = httpx.post(
            f"{serve.router}/v1/completions", json={"prompt": [5, 6], "max_tokens": 4}, timeout=10
        )
        if resp.status_code == 200:
            break
        assert time.monotonic() < deadline, f"not served 30 s after the kill:\n{serve.tail()}"
        time.sleep(0.5)
    assert "redis-server exited unexpectedly" in serve.log.read_text()
    # The 503s were not demand: several ticks later the controller still wants what
    # it wanted before the outage.
    time.sleep(3.0)
    assert replicas(serve) == before, serve.tail()


def test_with_no_decode_worker_alive_a_request_fails_within_five_seconds(
    serve: Serve,
) -> None:
    decode = [int(line.split(":")[0]) for line in processes_of(serve) if " worker decode " in line]
    assert decode, processes_of(serve)
    for pid in decode:
        # Frozen, not killed: the actuator sees it running and does not replace it,
        # and its heartbeat stops, so it drops out of the registry.
        os.kill(pid, signal.SIGSTOP)
    try:
        # Once its heartbeat has expired, the registry has no decode worker.
        deadline = time.monotonic() + 15
        while httpx.get(f"{serve.router}/readyz", timeout=2).status_code == 200:
            assert time.monotonic() < deadline, "the decode worker never dropped out"
            time.sleep(0.2)
        started = time.monotonic()
        resp = httpx.post(
            f"{serve.router}/v1/completions", json={"prompt": [5, 6], "max_tokens": 4}, timeout=10
        )
        elapsed = time.monotonic() - started
    finally:
        for pid in decode:
            os.kill(pid, signal.SIGCONT)
    assert elapsed < 5.0
    if resp.status_code == 503:  # the replacement may already be up: then it is served
        error = resp.json()["error"]
        assert error["code"] == "no_workers" and "decode" in error["message"]
    else:
        assert resp.status_code == 200, resp.text


def test_sigkill_of_sara_serve_leaves_no_process_behind(serve: Serve) -> None:
    redis_port = int(serve.redis_url().rsplit(":", 1)[1].split("/")[0])
    assert processes_of(serve), "nothing found to begin with"
    serve.process.kill()
    serve.process.wait()
    assert_nothing_left(serve, [redis_port])


def test_sigterm_while_sara_serve_starts_leaves_no_process_behind(tmp_path: Path) -> None:
    s = start_serve(tmp_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    # Mid start-up: the router is being started (Redis is up, nothing answers yet).
    while "redis on" not in s.log.read_text():
        assert s.process.poll() is None and time.monotonic() < deadline, s.tail()
        time.sleep(0.05)
    s.process.send_signal(signal.SIGTERM)
    assert s.process.wait(timeout=30) != 0
    assert_nothing_left(s, [])
