"""The router's probes, answered by a process of their own, off the serving loop.

A probe answered by the event loop that serves the requests waits behind every
callback already queued: under an overload (a thousand requests arriving at once,
most of them refused) that is hundreds of milliseconds, and a liveness probe with a
timeout restarts a router that is merely busy. A thread of the router's own process
is not enough either: it needs the GIL, which the loop's thread holds while it works
(and keeps while the OS has it preempted on a loaded machine). So ``HealthProcess``
answers ``/healthz`` and ``/readyz`` from a child process with its own socket (a
``HealthServer``), whose latency depends on neither the loop's queue nor its GIL.

It still reports on the loop: the app's lifespan runs ``beat_loop``, which stamps
``LoopWatch`` (a double in shared memory; ``CLOCK_MONOTONIC`` is one clock for every
process of the machine) every ``interval_s``; ``/healthz`` is 503 once the loop has
not run for ``stall_s`` (a wedged loop is not alive, however fast the probe is
answered). ``/readyz`` asks Redis with a client of its own: Redis answers and each
pool has a ready worker in the registry (the rule of the router's own ``/readyz``).
The child exits when its parent is gone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import redis

from queueing.pools import Pool
from workers.protocol import KeySpace
from workers.registry import Registry

logger = logging.getLogger(__name__)

Readiness = Callable[[], tuple[bool, dict[str, Any]]]


def readiness_body(ready_workers: dict[Pool, int]) -> tuple[bool, dict[str, Any]]:
    """Ready when each pool has a ready worker; the body of ``/readyz``."""
    counts = {pool.value: ready_workers.get(pool, 0) for pool in Pool}
    missing = [pool for pool, n in counts.items() if n == 0]
    body: dict[str, Any] = {"status": "not ready" if missing else "ready", "workers": counts}
    if missing:
        body["reason"] = f"no ready {' or '.join(missing)} worker in the registry"
    return not missing, body


def redis_readiness(client: redis.Redis, keys: KeySpace) -> Readiness:
    """``/readyz`` over a synchronous Redis client (its own connections)."""

    def ready() -> tuple[bool, dict[str, Any]]:
        registry = Registry(client, keys)
        try:
            client.ping()
            live = {pool: sum(w.ready for w in registry.live(pool)) for pool in Pool}
        except redis.RedisError as exc:
            return False, {"status": "not ready", "reason": f"Redis does not answer: {exc}"}
        return readiness_body(live)

    return ready


_SPAWN = multiprocessing.get_context("spawn")  # no fork of a process with threads


class LoopWatch:
    """When the serving event loop last ran (``time.monotonic`` seconds), in shared
    memory: written by the loop, read by the health process. One aligned double,
    written and read whole, so no lock."""

    def __init__(self, value: Any | None = None) -> None:
        self._value = _SPAWN.RawValue("d", math.nan) if value is None else value

    def beat(self, now_s: float) -> None:
        self._value.value = now_s

    def stalled_s(self, now_s: float) -> float:
        """Seconds since the loop last ran; infinite before its first beat."""
        last = float(self._value.value)
        return math.inf if math.isnan(last) else now_s - last


async def beat_loop(
    watch: LoopWatch, *, interval_s: float, clock: Callable[[], float] = time.monotonic
) -> None:
    """Stamp ``watch`` every ``interval_s`` for as long as the loop runs (cancel to end)."""
    while True:
        watch.beat(clock())
        await asyncio.sleep(interval_s)


class HealthServer:
    """``GET /healthz`` and ``GET /readyz`` on ``host:port`` (0: a free port), each
    request in a thread of its own. ``start()`` binds (``OSError`` if it cannot);
    ``stop()`` closes it."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        watch: LoopWatch,
        stall_s: float,
        readiness: Readiness,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (math.isfinite(stall_s) and stall_s > 0):
            raise ValueError(f"stall_s: expected seconds > 0, got {stall_s!r}")
        self.host, self.requested_port = host, port
        self.watch, self.stall_s, self.readiness, self.clock = watch, stall_s, readiness, clock
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return int(self._server.server_address[1])

    def healthz(self) -> tuple[int, dict[str, Any]]:
        stalled = self.watch.stalled_s(self.clock())
        if stalled > self.stall_s:
            why = (
                "the event loop has not started"
                if math.isinf(stalled)
                else f"the event loop has not run for {stalled:.1f} s (limit {self.stall_s:g} s)"
            )
            return 503, {"status": "stalled", "reason": why}
        return 200, {"status": "ok"}

    def readyz(self) -> tuple[int, dict[str, Any]]:
        status, body = self.healthz()
        if status != 200:
            return status, body
        ready, body = self.readiness()
        return (200 if ready else 503), body

    def start(self) -> HealthServer:
        probes = {"/healthz": self.healthz, "/readyz": self.readyz}

        class Handler(BaseHTTPRequestHandler):
            timeout = 5.0  # a client that sends nothing does not keep its thread

            def do_GET(self) -> None:
                answer = probes.get(self.path.split("?")[0])
                status, body = (404, {"status": "no such path"}) if answer is None else answer()
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # probes every few seconds: not worth a log line each

        server = ThreadingHTTPServer((self.host, self.requested_port), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.5}, daemon=True
        )
        self._thread.name = "router-health"
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


@dataclass(frozen=True, kw_only=True)
class HealthConfig:
    """What the health process needs: where to listen, the stall limit, and Redis."""

    host: str
    port: int
    stall_s: float
    redis_url: str
    key_prefix: str
    redis_timeout_s: float

    def __post_init__(self) -> None:
        for name in ("stall_s", "redis_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: expected seconds > 0, got {value!r}")
        if not (isinstance(self.port, int) and 0 <= self.port < 65536):
            raise ValueError(f"port: expected 0..65535, got {self.port!r}")


def _health_main(config: HealthConfig, value: Any, parent_pid: int, report: Any) -> None:
    from workers.protocol import connect

    try:
        client = connect(config.redis_url, timeout_s=config.redis_timeout_s)
        server = HealthServer(
            config.host,
            config.port,
            watch=LoopWatch(value),
            stall_s=config.stall_s,
            readiness=redis_readiness(client, KeySpace(config.key_prefix)),
        ).start()
    except (OSError, ValueError) as exc:
        report.send(("error", f"cannot listen on {config.host}:{config.port}: {exc}"))
        return
    report.send(("port", server.port))
    while os.getppid() == parent_pid:  # the router is gone: nothing to report on
        time.sleep(0.5)
    server.stop()


class HealthProcess:
    """A ``HealthServer`` in a child process reporting on ``watch``'s loop.

    ``start()`` waits until it listens (``OSError`` naming the address if it cannot);
    ``stop()`` ends it. It also ends by itself within 0.5 s of its parent."""

    def __init__(self, config: HealthConfig, watch: LoopWatch) -> None:
        self.config = config
        self.watch = watch
        self._process: Any = None
        self.port: int | None = None

    def start(self, timeout_s: float = 30.0) -> HealthProcess:
        receive, report = _SPAWN.Pipe(duplex=False)
        self._process = _SPAWN.Process(
            target=_health_main,
            args=(self.config, self.watch._value, os.getpid(), report),
            name="sara-router-health",
            daemon=True,
        )
        self._process.start()
        report.close()
        if not receive.poll(timeout_s):
            self.stop()
            raise OSError(f"the health listener did not start within {timeout_s:g} s")
        kind, value = receive.recv()
        if kind == "error":
            self.stop()
            raise OSError(value)
        self.port = int(value)
        return self

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.join(timeout=5)
            self._process = None
