"""The router's probes off the serving loop: the health process, its view of the loop,
and `sara router --health-listen` end to end, over a real redis-server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.workers.conftest import (
    KEYS,
    ProtocolWorker,
    ServerThread,
    byte_detokenize,
    byte_tokenize,
)
from workers.redis_util import RedisServer, free_port
from workers.router import RouterConfig, create_router_app
from workers.router_health import HealthConfig, HealthProcess, LoopWatch


def get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def health(redis_url: str, watch: LoopWatch, *, stall_s: float = 5.0) -> HealthProcess:
    config = HealthConfig(
        host="127.0.0.1",
        port=0,
        stall_s=stall_s,
        redis_url=redis_url,
        key_prefix=KEYS.prefix,
        redis_timeout_s=1.0,
    )
    return HealthProcess(config, watch).start()


@pytest.fixture
def watch() -> LoopWatch:
    return LoopWatch()


def test_healthz_follows_the_loop_beat_it_is_given(
    redis_server: RedisServer, watch: LoopWatch
) -> None:
    probe = health(redis_server.url, watch, stall_s=5.0)
    try:
        url = f"http://127.0.0.1:{probe.port}/healthz"
        status, body = get(url)
        assert (status, body["status"]) == (503, "stalled")
        assert "has not started" in body["reason"]
        watch.beat(time.monotonic())
        assert get(url) == (200, {"status": "ok"})
        watch.beat(time.monotonic() - 60.0)  # the loop last ran a minute ago
        status, body = get(url)
        assert status == 503 and "has not run for 60" in body["reason"]
    finally:
        probe.stop()


def test_readyz_needs_redis_and_a_ready_worker_of_each_pool(
    redis_server: RedisServer, watch: LoopWatch
) -> None:
    watch.beat(time.monotonic())
    probe = health(redis_server.url, watch)
    try:
        url = f"http://127.0.0.1:{probe.port}/readyz"
        status, body = get(url)
        assert status == 503 and body["workers"] == {"prefill": 0, "decode": 0}
        worker = ProtocolWorker(redis_server.url).start()
        try:
            deadline = time.monotonic() + 5
            while get(url)[0] != 200:
                assert time.monotonic() < deadline, get(url)
                time.sleep(0.05)
            assert get(url)[1] == {"status": "ready", "workers": {"prefill": 1, "decode": 1}}
        finally:
            worker.stop()
    finally:
        probe.stop()


def test_readyz_without_redis_is_a_503_naming_it(watch: LoopWatch) -> None:
    watch.beat(time.monotonic())
    probe = health(f"redis://127.0.0.1:{free_port()}/0", watch)
    try:
        status, body = get(f"http://127.0.0.1:{probe.port}/readyz")
        assert status == 503 and "Redis does not answer" in body["reason"]
    finally:
        probe.stop()


def test_a_taken_port_is_refused_naming_it(redis_server: RedisServer, watch: LoopWatch) -> None:
    first = health(redis_server.url, watch)
    try:
        config = HealthConfig(
            host="127.0.0.1",
            port=first.port or 0,
            stall_s=1.0,
            redis_url=redis_server.url,
            key_prefix=KEYS.prefix,
            redis_timeout_s=1.0,
        )
        with pytest.raises(OSError, match=f"127.0.0.1:{first.port}"):
            HealthProcess(config, LoopWatch()).start()
    finally:
        first.stop()


def test_the_router_app_stamps_its_loop_watch(redis_server: RedisServer, watch: LoopWatch) -> None:
    config = RouterConfig(redis_url=redis_server.url, max_context_tokens=64, key_prefix=KEYS.prefix)
    app = create_router_app(
        config, tokenize=byte_tokenize, detokenize=byte_detokenize, loop_watch=watch
    )
    server = ServerThread(app).start()
    try:
        deadline = time.monotonic() + 5
        while watch.stalled_s(time.monotonic()) > 1.0:
            assert time.monotonic() < deadline, "the serving loop never stamped the watch"
            time.sleep(0.05)
    finally:
        server.stop()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(
        json.dumps({"max_position_embeddings": 256, "vocab_size": 512})
    )
    return tmp_path


def start_router(
    redis_url: str, model: Path, port: int, health_port: int
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "cli", "router", "--redis", redis_url, "--model", str(model)),
            *("--listen", f"127.0.0.1:{port}", "--health-listen", f"127.0.0.1:{health_port}"),
            *("--key-prefix", KEYS.prefix),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if k != "SARA_PARENT_PID"},
    )


def wait_for(url: str, router: subprocess.Popen[bytes]) -> tuple[int, dict[str, Any]]:
    deadline = time.monotonic() + 60
    while True:
        assert router.poll() is None, router.stderr.read() if router.stderr else ""
        try:
            return get(url)
        except OSError:
            assert time.monotonic() < deadline, f"{url} never answered"
            time.sleep(0.1)


def port_closed_soon(port: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=0.5)
        except httpx.HTTPError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_sara_router_health_listener_answers_and_goes_with_the_router(
    redis_server: RedisServer, model_dir: Path, how: signal.Signals
) -> None:
    port, health_port = free_port(), free_port()
    router = start_router(redis_server.url, model_dir, port, health_port)
    try:
        assert wait_for(f"http://127.0.0.1:{port}/healthz", router)[0] == 200
        deadline = time.monotonic() + 10
        while (answer := get(f"http://127.0.0.1:{health_port}/healthz"))[0] != 200:
            assert time.monotonic() < deadline, answer  # the loop's first beat
            time.sleep(0.05)
        status, body = get(f"http://127.0.0.1:{health_port}/readyz")
        assert status == 503 and "no ready prefill or decode worker" in body["reason"]
        router.send_signal(how)
        router.wait(timeout=30)
        assert port_closed_soon(health_port), "the health process outlived the router"
    finally:
        if router.poll() is None:
            router.kill()
            router.wait()


def test_health_listen_needs_host_and_port(model_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cli", "router", "--model", str(model_dir), "--health-listen", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--health-listen" in done.stderr
