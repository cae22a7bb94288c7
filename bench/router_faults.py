"""The router under abuse: an overload of concurrent requests, and one huge prompt.

A private Redis, `sara router`, and one prefill and one decode worker of the emulated
engine (``llama-3-8b@h100-sxm``: the real scheduler, steps timed by the profile), all
real processes on loopback.

1. Overload: ``--concurrent`` requests (default 1,300) at once. Printed: the answers
   by status (targets: only 200 and 429, no 503 while Redis is healthy) and the
   ``/healthz`` latency measured every 20 ms throughout from another process
   (target: its maximum under 100 ms).
2. A 10 MB prompt while 20 streams run: printed, how long its refusal took (target:
   413 within 1 s) and the streams' P99 inter-token gap against the same 20 streams
   without it, measured in the same run (target: ratio at most 1.5).

    .venv/bin/python bench/router_faults.py [--concurrent 1300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
worst, n, end = 0.0, 0, time.monotonic() + stop_after
while time.monotonic() < end:
    t = time.monotonic()
    urllib.request.urlopen(url, timeout=5).read()
    worst = max(worst, time.monotonic() - t); n += 1
    time.sleep(0.02)
print(worst, n)
"""


# A 10 MB prompt from its own process: the time from the first byte sent to the answer.
HUGE = """
import json, sys, time, urllib.error, urllib.request
body = json.dumps({"prompt": "x" * (10 * 1024 * 1024)}).encode()
headers = {"Content-Type": "application/json"}
request = urllib.request.Request(sys.argv[1], data=body, headers=headers)
started = time.monotonic()
try:
    status = urllib.request.urlopen(request, timeout=60).status
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


async def overload(url: str, n: int) -> Counter[int]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one(i: int) -> int:
            body = {"prompt": [3 + (i + k) % 500 for k in range(32)], "max_tokens": 16}
            try:
                return (await client.post(f"{url}/v1/completions", json=body)).status_code
            except httpx.HTTPError:
                return -1  # a transport error: counted apart

        return Counter(await asyncio.gather(*(one(i) for i in range(n))))


async def streams(url: str, n: int, *, huge_after_s: float | None) -> tuple[list[float], float]:
    """Inter-token gaps of ``n`` streams; with ``huge_after_s``, how long a 10 MB prompt
    sent that long after the start took to be refused (NaN otherwise)."""
    gaps: list[float] = []
    refused_s = float("nan")
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

        async def huge() -> None:
            # From another process: building and sending 10 MB here would stall this
            # loop, and the streams' gaps measured in it would be the client's own.
            nonlocal refused_s
            assert huge_after_s is not None
            await asyncio.sleep(huge_after_s)
            sender = await asyncio.create_subprocess_exec(
                sys.executable, "-c", HUGE, f"{url}/v1/completions", stdout=subprocess.PIPE
            )
            out, _ = await sender.communicate()
            status, seconds = out.decode().split()
            refused_s = float(seconds)
            print(f"  10 MB prompt: HTTP {status} after {refused_s:.3f} s")

        jobs = [stream(i) for i in range(n)] + ([huge()] if huge_after_s is not None else [])
        await asyncio.gather(*jobs)
    return gaps, refused_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrent", type=int, default=1300)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sara-router-faults-"))
    model = work / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(model_card(load_profile(PROFILE))))
    server = RedisServer.start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = [
        subprocess.Popen(
            cli("router", "--redis", server.url, "--model", str(model), "--listen",
                f"127.0.0.1:{port}", "--request-timeout-s", "120"),
            stdout=(work / "router.log").open("wb"), stderr=subprocess.STDOUT,
        )
    ]  # fmt: skip
    for pool in ("prefill", "decode"):
        procs.append(
            subprocess.Popen(
                cli("worker", pool, "--engine", "emulated", "--profile", PROFILE, "--startup-s",
                    "0", "--redis", server.url, "--model", str(model)),
                stdout=(work / f"{pool}.log").open("wb"), stderr=subprocess.STDOUT,
            )
        )  # fmt: skip
    try:
        wait_ready(url)
        print(f"1. {args.concurrent} concurrent requests, one prefill and one decode worker")
        probe = subprocess.Popen(
            [sys.executable, "-c", PROBE, f"{url}/healthz", "15"], stdout=subprocess.PIPE, text=True
        )
        time.sleep(0.5)
        started = time.monotonic()
        statuses = asyncio.run(overload(url, args.concurrent))
        print(f"  answers: {dict(sorted(statuses.items()))} in {time.monotonic() - started:.1f} s")
        worst_s, probes = probe.communicate()[0].split()
        print(f"  /healthz: worst {float(worst_s) * 1000:.1f} ms over {probes} probes")
        print(f"  503 answers: {statuses.get(503, 0)} (target 0); other than 200/429: "
              f"{sum(v for k, v in statuses.items() if k not in (200, 429))}")  # fmt: skip

        print("2. a 10 MB prompt while 20 streams run")
        base, _ = asyncio.run(streams(url, 20, huge_after_s=None))
        hit, refused_s = asyncio.run(streams(url, 20, huge_after_s=1.0))
        p99_base, p99_hit = np.percentile(base, 99), np.percentile(hit, 99)
        print(
            f"  P99 inter-token gap: baseline {p99_base * 1000:.1f} ms, with the 10 MB "
            f"prompt {p99_hit * 1000:.1f} ms: ratio {p99_hit / p99_base:.2f} (target <= 1.5)"
        )
        print(f"  refused after {refused_s:.3f} s (target < 1 s)")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
