"""The dashboard's and the rules' PromQL against a real Prometheus scraping `sara serve`.

`sara serve` runs the whole stack (Redis, router, a prefill and a decode worker, the
controller); a real Prometheus scrapes the router, the controller and the workers
every second and evaluates the generated rule file; the test drives load through
the router, then runs every expression of the Grafana dashboard and of the rules:
each must parse and evaluate, every dashboard query and recording rule must return
data, and every rule must be loaded healthy.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")

from controller.config import ControllerConfig
from dashboards.rules import OUTPUT as RULES_FILE
from dashboards.rules import rule_queries
from dashboards.sara_slo import dashboard_queries
from workers.redis_util import free_port, free_port_block

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
WORKER_SLOTS = 3  # metrics ports scraped per pool (the controller may add workers)


@dataclass
class Running:
    prometheus: str
    router: str


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():
                return
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            pass
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.5)


def query(prometheus: str, expr: str) -> dict[str, Any]:
    reply = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
    body = reply.json()
    assert reply.status_code == 200 and body["status"] == "success", (expr, body)
    return dict(body["data"])


def _stop(process: subprocess.Popen[Any], timeout_s: float = 60) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    if not Path(PROMETHEUS).exists():
        pytest.fail("the prometheus binary is missing: apt-get install prometheus (CI does)")
    work = tmp_path_factory.mktemp("e2e")
    config = ControllerConfig().to_dict()
    config.update(interval_s=2.0, window_s=10.0, burst_window_s=2.0, stale_after_s=20.0)
    (work / "config.json").write_text(json.dumps(config))
    router_port, api_port = free_port(), free_port()
    # Worker i of a pool listens on base + i: one block below the ephemeral range,
    # where router_port and api_port are drawn, so no worker can land on either.
    prefill_port = free_port_block(2 * WORKER_SLOTS)
    decode_port = prefill_port + WORKER_SLOTS
    serve = subprocess.Popen(
        [
            sys.executable, "-m", "cli", "serve",
            "--model-cache", str(work / "models"), "--config", str(work / "config.json"),
            "--state-dir", str(work / "state"), "--listen", f"127.0.0.1:{router_port}",
            "--api-listen", f"127.0.0.1:{api_port}", "--prefill-port", str(prefill_port),
            "--decode-port", str(decode_port), "--grace-period-s", "10",
        ],
        stdout=(work / "serve.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    targets = [f"127.0.0.1:{router_port}", f"127.0.0.1:{api_port}"] + [
        f"127.0.0.1:{base + i}" for base in (prefill_port, decode_port) for i in range(WORKER_SLOTS)
    ]
    (work / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files: ['{RULES_FILE}']\n"
        "scrape_configs:\n  - job_name: sara\n    static_configs:\n"
        f"      - targets: {json.dumps(targets)}\n"
    )
    prom_port = free_port()
    prometheus = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=(work / "prometheus.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    router = f"http://127.0.0.1:{router_port}"
    prom = f"http://127.0.0.1:{prom_port}"
    try:
        wait_until(
            lambda: httpx.get(f"{router}/readyz", timeout=1).status_code == 200,
            "the stack to be ready: " + str(work / "serve.log"),
            timeout_s=120,
        )
        wait_until(
            lambda: httpx.get(f"{prom}/-/ready", timeout=1).status_code == 200,
            "Prometheus to be ready",
            timeout_s=30,
        )
        yield Running(prometheus=prom, router=router)
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=20)
        _stop(serve)


@pytest.fixture(scope="module")
def loaded(running: Running) -> Running:
    """About 20 s of traffic (plain and streamed), then enough scrapes for every window."""
    with httpx.Client(timeout=60) as client:
        for i in range(40):
            body = {
                "prompt": "Hello, world! How are you today?" if i % 2 else [3 + i, 4, 5, 6],
                "max_tokens": 8 + i % 5,
                "stream": bool(i % 3),
            }
            reply = client.post(f"{running.router}/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            time.sleep(0.4)

    def everything_scraped() -> bool:
        up = query(running.prometheus, 'sum(up{job="sara"})')["result"]
        ticks = query(running.prometheus, "sum(sara_controller_decisions_total)")["result"]
        return float(up[0]["value"][1]) >= 4 and float(ticks[0]["value"][1]) >= 5

    wait_until(everything_scraped, "router, controller and workers scraped", timeout_s=60)
    time.sleep(3)  # a few rule evaluations over the scraped data
    return running


def test_every_dashboard_query_parses_and_returns_data(loaded: Running) -> None:
    empty = []
    for title, expr in dashboard_queries({"window": "5m"}):
        if not query(loaded.prometheus, expr)["result"]:
            empty.append((title, expr))
    assert not empty, f"{len(empty)} dashboard queries returned nothing: {empty}"


def test_every_recording_rule_returns_data_and_every_alert_expression_evaluates(
    loaded: Running,
) -> None:
    empty = []
    for name, expr in rule_queries():
        result = query(loaded.prometheus, expr)["result"]
        if ":" in name and not result:  # a recording rule: always has a value
            empty.append((name, expr))
    assert not empty, f"recording rules without data: {empty}"


def test_prometheus_loaded_every_rule_and_evaluates_each_without_error(loaded: Running) -> None:
    reply = httpx.get(f"{loaded.prometheus}/api/v1/rules", timeout=10).json()
    rules = [rule for group in reply["data"]["groups"] for rule in group["rules"]]
    assert {r["name"] for r in rules} == {name for name, _ in rule_queries()}
    unhealthy = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not unhealthy, unhealthy
