"""`sara controller` end to end: the server, the loop, a scrape source and the
advisory actuator, driven by a test exporter on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.controller.conftest_sources import RouterExporter

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def router() -> Iterator[RouterExporter]:
    exporter = RouterExporter()
    stop = threading.Event()
    rng = np.random.default_rng(0)

    def drive() -> None:  # ~40 requests/s with lengths inside the exporter's buckets
        while not stop.wait(0.025):
            exporter.record(ttft_s=float(rng.uniform(0.05, 0.3)),
                            tpot_s=float(rng.uniform(0.01, 0.05)),
                            prompt=int(rng.integers(100, 1000)),
                            output=int(rng.integers(10, 250)))

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    yield exporter
    stop.set()
    thread.join(timeout=5)
    exporter.stop()


def wait_for(predicate, timeout_s: float):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_the_controller_decides_from_scraped_metrics_and_takes_config_edits(
    router: RouterExporter, tmp_path: Path
) -> None:
    seed = {"interval_s": 1.0, "window_s": 4.0, "burst_window_s": 2.0, "stale_after_s": 10.0,
            "profile": "llama-3-8b@h100-sxm", "mode": "advisory"}
    config_file = tmp_path / "seed.json"
    config_file.write_text(json.dumps(seed))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "cli", "controller", "--config", str(config_file),
           "--state-dir", str(tmp_path / "state"), "--listen", f"127.0.0.1:{port}",
           "--actuator", "advisory", "--metrics-source", "scrape", router.url]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "SARA_API_TOKEN": TOKEN},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: httpx.get(f"{base}/healthz").status_code == 200, 30)
        status = wait_for(
            lambda: (s := httpx.get(f"{base}/v1/status").json()).get("raw_rate_rps") and s, 30
        )
        assert 20 < status["raw_rate_rps"] < 60  # driven at ~40 req/s
        assert status["mode"] == "advisory"
        assert httpx.get(f"{base}/readyz").status_code == 200
        decisions = httpx.get(f"{base}/v1/decisions", params={"limit": 5}).json()
        assert decisions and decisions[0]["reasons"]
        metrics = httpx.get(f"{base}/metrics").text
        assert "sara_controller_desired_replicas" in metrics

        # Mutations need the token; a valid edit takes effect and survives.
        assert httpx.patch(f"{base}/v1/config", json={"dead_band": 0.2}).status_code == 401
        ok = httpx.patch(f"{base}/v1/config", json={"dead_band": 0.2},
                         headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200
        assert httpx.get(f"{base}/v1/config").json()["dead_band"] == 0.2
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    stored = json.loads((tmp_path / "state" / "config.json").read_text())
    assert stored["dead_band"] == 0.2
    assert (tmp_path / "state" / "state.json").exists()
