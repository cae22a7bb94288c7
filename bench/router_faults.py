"""The router under abuse: an overload of concurrent requests, and one huge prompt.

A private Redis, `sara router`, and one prefill and one decode worker of the emulated
engine (``llama-3-8b@h100-sxm``: the real scheduler, steps timed by the profile), all
real processes on loopback.

1. Overload: ``--concurrent`` requests (default 1,300) at once, sent from a process
   of their own (``--client-nice N`` lowers its priority, as a client on another
   machine would not take the router's CPU; default 0). Printed: the answers by
   status (targets: only 200 and 429, no 503 while Redis is healthy) and the
   ``/healthz`` latency measured every 20 ms throughout, each from a process of its
   own: on the router's health listener (``--health-listen``: a process of the
   router's own; target: its maximum under 100 ms), and on the serving port (the
   event loop's own answer, for comparison).
2. A 10 MB prompt while 20 streams run, sent twice from processes of their own: on a
   connection that closes after the answer (``urllib``, ``Connection: close``) and on
   a kept-alive one (``http.client``, as httpx, the openai client or curl keep
   theirs). Printed: how each was answered and how long it took (target: 413 or 400
   within 1 s), and the streams' P99 inter-token gap against the same 20 streams
   without it, measured in the same run (target: ratio at most 1.5).

The load average (1 min) is printed with each phase: the machine may be shared.

    .venv/bin/python bench/router_faults.py [--concurrent 1300] [--client-nice 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import numpy as np

from controller.profiles import load_profile
from workers.emulated import model_card
from workers.redis_util import RedisServer, free_port

PROFILE = "llama-3-8b@h100-sxm"

# A separate process, so the probe's own timing is not the load generator's.
PROBE = """
import sys, time, urllib.request
url, stop_after = sys.argv[1], float(sys.argv[2])
times, end = [], time.monotonic() + stop_after
while time.monotonic() < end:
    t = time.monotonic()
    urllib.request.urlopen(url, timeout=10).read()
    times.append(time.monotonic() - t)
    time.sleep(0.02)
times.sort()
print(times[-1], times[int(0.99 * (len(times) - 1))], len(times))
"""

# The overload from its own process: its CPU is the client's, not the router's.
OVERLOAD = """
import asyncio, json, os, sys
import httpx
url, n, nice = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.nice(nice)

async def main():
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def one(i):
            body = {"prompt": [3 + (i + k) % 500 for k in range(32)], "max_tokens": 16}
            try:
                return (await client.post(url + "/v1/completions", json=body)).status_code
            except httpx.HTTPError:
                return -1  # a transport error: counted apart
        return await asyncio.gather(*(one(i) for i in range(n)))

statuses = asyncio.run(main())
print(json.dumps({str(s): statuses.count(s) for s in set(statuses)}))
"""

# A 10 MB prompt from its own process: the time from the first byte sent to the answer.
# The body is built before the streams start (its CPU is the client's), and sent when
# a line arrives on stdin.
HUGE = """
import http.client, json, sys, time, urllib.error, urllib.parse, urllib.request
url, mode = sys.argv[1], sys.argv[2]
body = json.dumps({"prompt": "x" * (10 * 1024 * 1024)}).encode()
headers = {"Content-Type": "application/json"}
print("ready", flush=True)
sys.stdin.readline()
started = time.monotonic()
try:
    if mode == "close":
        request = urllib.request.Request(url, data=body, headers=headers)
        status = urllib.request.urlopen(request, timeout=60).status
    else:
        parts = urllib.parse.urlsplit(url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        connection.request("POST", parts.path, body=body, headers=headers)
        status = connection.getresponse().status
except urllib.error.HTTPError as exc:
    status = exc.code
except (ConnectionResetError, BrokenPipeError, urllib.error.URLError):
    status = "reset"  # refused before the whole body was sent
print(status, time.monotonic() - started)
"""


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli", *args]


def wait_ready(url: str, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} not ready after {timeout_s} s")


def overload(url: str, n: int, *, nice: int) -> Counter[int]:
    out = subprocess.run(
        [sys.executable, "-c", OVERLOAD, url, str(n), str(nice)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return Counter({int(k): v for k, v in json.loads(out).items()})


def stop_all(procs: list[subprocess.Popen[bytes]], *, timeout_s: float) -> None:
    """SIGTERM every process, then wait for each (killed after ``timeout_s``)."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_workers(work: Path, redis_url: str, model: Path) -> list[subprocess.Popen[bytes]]:
    """One emulated prefill and one emulated decode worker, logging into ``work``."""
    return [
        subprocess.Popen(
            cli("worker", pool, "--engine", "emulated", "--profile", PROFILE, "--startup-s",
                "0", "--redis", redis_url, "--model", str(model)),
            stdout=(work / f"{pool}.log").open("wb"), stderr=subprocess.STDOUT,
        )
        for pool in ("prefill", "decode")
    ]  # fmt: skip


def load_average() -> str:
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"


async def streams(
    url: str, n: int, *, huge_after_s: float | None
) -> tuple[list[float], dict[str, tuple[str, float]]]:
    """Inter-token gaps of ``n`` streams; with ``huge_after_s``, a 10 MB prompt sent
    that long after the start on a closing connection, and one 1.5 s later on a
    kept-alive one: how each was answered, and how long it took."""
    gaps: list[float] = []
    refusals: dict[str, tuple[str, float]] = {}
    async with httpx.AsyncClient(timeout=120) as client:

        async def stream(i: int) -> None:
            body = {"prompt": [5 + i] * 64, "max_tokens": 300, "stream": True}
            last = None
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        now = time.monotonic()
                        if last is not None:
                            gaps.append(now - last)
                        last = now

        async def huge(mode: str, sender: asyncio.subprocess.Process, after_s: float) -> None:
            # From another process: building and sending 10 MB here would stall this
            # loop, and the streams' gaps measured in it would be the client's own.
            await asyncio.sleep(after_s)
            out, _ = await sender.communicate(b"go\n")
            status, seconds = out.decode().split()
            refusals[mode] = (status, float(seconds))

        jobs = [stream(i) for i in range(n)]
        if huge_after_s is not None:
            for k, mode in enumerate(("close", "keep-alive")):
                sender = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", HUGE, f"{url}/v1/completions", mode,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                )  # fmt: skip
                assert sender.stdout is not None
                assert (await sender.stdout.readline()).strip() == b"ready"
                jobs.append(huge(mode, sender, huge_after_s + 1.5 * k))
        await asyncio.gather(*jobs)
    return gaps, refusals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrent", type=int, default=1300)
    parser.add_argument("--client-nice", type=int, default=0, help="the overload's niceness")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sara-router-faults-"))
    model = work / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(model_card(load_profile(PROFILE))))
    server = RedisServer.start()
    port, health_port = free_port(), free_port()
    url, health_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{health_port}"
    procs = [
        subprocess.Popen(
            cli("router", "--redis", server.url, "--model", str(model), "--listen",
                f"127.0.0.1:{port}", "--request-timeout-s", "120", "--health-listen",
                f"127.0.0.1:{health_port}"),
            stdout=(work / "router.log").open("wb"), stderr=subprocess.STDOUT,
        )
    ]  # fmt: skip
    procs += start_workers(work, server.url, model)
    try:
        wait_ready(url)
        print(f"1. {args.concurrent} concurrent requests, one prefill and one decode worker "
              f"(client niceness {args.client_nice}); {load_average()}")  # fmt: skip
        probes = {
            where: subprocess.Popen(
                [sys.executable, "-c", PROBE, f"{base}/healthz", "15"],
                stdout=subprocess.PIPE,
                text=True,
            )
            for where, base in (("health listener", health_url), ("serving port", url))
        }
        time.sleep(0.5)
        started = time.monotonic()
        statuses = overload(url, args.concurrent, nice=args.client_nice)
        print(f"  answers: {dict(sorted(statuses.items()))} in {time.monotonic() - started:.1f} s")
        for where, probe in probes.items():
            worst_s, p99_s, n = probe.communicate()[0].split()
            print(f"  /healthz on the {where}: worst {float(worst_s) * 1000:.1f} ms, P99 "
                  f"{float(p99_s) * 1000:.1f} ms over {n} probes")  # fmt: skip
        print(f"  503 answers: {statuses.get(503, 0)} (target 0); other than 200/429: "
              f"{sum(v for k, v in statuses.items() if k not in (200, 429))}; "
              f"{load_average()}")  # fmt: skip

        print(f"2. a 10 MB prompt while 20 streams run; {load_average()}")
        base, _ = asyncio.run(streams(url, 20, huge_after_s=None))
        hit, refusals = asyncio.run(streams(url, 20, huge_after_s=1.0))
        p99_base, p99_hit = np.percentile(base, 99), np.percentile(hit, 99)
        for mode, (status, seconds) in refusals.items():
            print(f"  10 MB prompt ({mode}): HTTP {status} after {seconds:.3f} s "
                  "(target 413 or 400 within 1 s)")  # fmt: skip
        print(
            f"  P99 inter-token gap: baseline {p99_base * 1000:.1f} ms, with the 10 MB "
            f"prompts {p99_hit * 1000:.1f} ms: ratio {p99_hit / p99_base:.2f} (target <= 1.5); "
            f"{load_average()}"
        )
    finally:
        stop_all(procs, timeout_s=15)
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
