"""Where the router's event loop goes during the overload of ``router_faults.py``.

The same stack (a private Redis, one emulated prefill and one decode worker), with
`sara router` run under cProfile and a lag sampler on its event loop (a task that
sleeps 10 ms and records how late it woke); then ``--concurrent`` requests at once
from a process of their own. Printed: every loop gap over 30 ms (seconds since the
burst was sent, milliseconds late; the sender process takes a second or two to
start), and the functions with the most time of their own. cProfile counts wall
time (on a shared machine, preemption lands on whatever ran), and an async
generator's suspension inside an ``await`` is counted as its own time: the router's
``_read`` shows the time its requests waited for tokens, not work.

    .venv/bin/python bench/router_loop_profile.py [--concurrent 1300] [--top 15]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pstats
import subprocess
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def profiled_router(out_dir: Path, argv: list[str]) -> int:
    """`sara router ARGV` under cProfile, its loop sampled; results into ``out_dir``."""
    import cProfile

    from cli.__main__ import main
    from controller import http_server

    lags: list[tuple[float, float]] = []
    serve = http_server.serve_http

    def serve_sampled(app: Any, **kwargs: Any) -> None:
        inner = app.router.lifespan_context

        @asynccontextmanager
        async def lifespan(a: Any) -> Any:
            async def sample() -> None:
                while True:
                    t = time.monotonic()
                    await asyncio.sleep(0.01)
                    lags.append((time.monotonic(), time.monotonic() - t - 0.01))

            task = asyncio.create_task(sample())
            async with inner(a):
                yield
            task.cancel()

        app.router.lifespan_context = lifespan
        serve(app, **kwargs)

    http_server.serve_http = serve_sampled  # type: ignore[assignment]
    profile = cProfile.Profile()
    profile.enable()
    try:
        return main(argv)
    finally:
        profile.disable()
        profile.dump_stats(str(out_dir / "router.prof"))
        (out_dir / "lags.json").write_text(json.dumps(lags))


def main() -> int:
    from router_faults import (
        PROBE,
        PROFILE,
        load_average,
        overload,
        start_workers,
        stop_all,
        wait_ready,
    )

    from controller.profiles import load_profile
    from workers.emulated import model_card
    from workers.redis_util import RedisServer, free_port

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrent", type=int, default=1300)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sara-router-loop-"))
    model = work / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(model_card(load_profile(PROFILE))))
    server = RedisServer.start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router_args = ["router", "--redis", server.url, "--model", str(model), "--listen",
                   f"127.0.0.1:{port}", "--request-timeout-s", "120"]  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--profiled-router", str(work), *router_args],
            stdout=(work / "router.log").open("wb"), stderr=subprocess.STDOUT,
        )
    ]  # fmt: skip
    procs += start_workers(work, server.url, model)
    try:
        wait_ready(url)
        print(f"{args.concurrent} concurrent requests; {load_average()}")
        probe = subprocess.Popen(
            [sys.executable, "-c", PROBE, f"{url}/healthz", "12"], stdout=subprocess.PIPE, text=True
        )
        time.sleep(0.5)
        burst = time.monotonic()
        statuses = overload(url, args.concurrent, nice=0)
        worst_s = float(probe.communicate()[0].split()[0])
        print(f"  answers {dict(sorted(statuses.items()))}; serving-port /healthz worst "
              f"{worst_s * 1000:.1f} ms; {load_average()}")  # fmt: skip
    finally:
        stop_all(procs, timeout_s=30)
        server.stop()
    lags = json.loads((work / "lags.json").read_text())
    late = [(round(t - burst, 2), round(lag * 1000)) for t, lag in lags if lag > 0.03]
    print(f"  loop gaps over 30 ms (s since the burst, ms): {late}")
    stats = pstats.Stats(str(work / "router.prof"))
    total = stats.total_tt  # type: ignore[attr-defined]
    print(f"  cProfile: {total:.1f} s in the router; most time of their own:")
    stats.sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--profiled-router":
        raise SystemExit(profiled_router(Path(sys.argv[2]), sys.argv[3:]))
    raise SystemExit(main())
