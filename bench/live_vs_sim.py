"""Live vs simulated: the same trace through the real stack and through the simulator.

A stretch of the Azure conversation trace (``--duration-s`` of it, at its real rate)
is replayed by `sara load` through `sara serve --engine emulated` — the router, a
private Redis, emulated prefill and decode workers of fixed pool sizes (the
controller runs, its limits pinned to the size), the KV moved over Redis — and the
very same requests go through ``sim.cluster`` with the same profile, token budget
and pool sizes. Printed per pool size: P50/P99 TTFT and TPOT live and simulated,
the capacity model's P99 prediction beside them, and the emulation's timing
accuracy read from the workers' own metrics: the sum of
``sara_worker_iteration_seconds`` plus ``sara_worker_emulated_overlap_seconds_total``
(the worker's work between back-to-back steps, which the emulated accelerator
overlapped) over the sum of ``sara_worker_emulated_profile_seconds_total`` (the
profile's time of the same steps), per pool.

Targets: live P99 TTFT and TPOT within 15 % of the simulator's; iteration time
within 5 % of the profile's. Both are measured on whatever else the machine runs.

    .venv/bin/python bench/live_vs_sim.py [--pools 4x4,8x8] [--duration-s 600]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from cli.live_demo import TRACE, _stop, _wait_ready
from cli.live_emulated import SegmentPhase, demo_config, demo_segment, write_trace_csv
from controller.profiles import load_profile
from queueing.budget import token_budget
from queueing.lengths import LengthSamples
from queueing.solver import CapacityModel, KvLink, SloTargets, evaluate
from sim.cluster import Cluster, ClusterConfig
from sim.trace_io import load_trace
from sim.workload import summarize
from workers.emulated import context_tokens
from workers.redis_util import free_port, free_port_block

METRIC = re.compile(
    r"^(sara_worker_iteration_seconds_sum|sara_worker_emulated_profile_seconds_total"
    r"|sara_worker_emulated_overlap_seconds_total)"
    r"\{[^}]*\} (\S+)$",
    re.M,
)


def scrape_timing(ports: list[int]) -> tuple[float, float]:
    """Summed seconds of the workers on ``ports``: measured iterations plus the work
    between back-to-back steps they overlapped (the steps' cadence), and the profile's."""
    measured = profile = 0.0
    for port in ports:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                text = reply.read().decode()
        except OSError as exc:
            raise RuntimeError(
                f"the worker whose metrics are on port {port} does not answer ({exc}): it "
                "exited or was replaced during the run, so its timing cannot be summed"
            ) from exc
        for name, value in METRIC.findall(text):
            if name.startswith("sara_worker_emulated_profile"):
                profile += float(value)
            else:
                measured += float(value)
    return measured, profile


def live(
    csv: Path, work: Path, *, prefill: int, decode: int, config: dict[str, Any], budget: int,
    slo: SloTargets, logs: Path,
) -> dict[str, Any]:  # fmt: skip
    config = {
        **config,
        "prefill": {"min_replicas": prefill, "max_replicas": prefill},
        "decode": {"min_replicas": decode, "max_replicas": decode},
    }
    (work / "config.json").write_text(json.dumps(config))
    router_port, api_port = free_port(), free_port()
    pre_port = free_port_block(prefill + decode)  # worker i's metrics on base + i
    dec_port = pre_port + prefill
    router, api = f"http://127.0.0.1:{router_port}", f"http://127.0.0.1:{api_port}"
    log = (work / "serve.log").open("w")
    serve = subprocess.Popen(
        [sys.executable, "-m", "cli", "serve", "--engine", "emulated",
         "--config", str(work / "config.json"), "--state-dir", str(work / "state"),
         "--listen", f"127.0.0.1:{router_port}", "--api-listen", f"127.0.0.1:{api_port}",
         "--token-budget", str(budget), "--max-running", str(budget), "--startup-s", "0",
         "--initial-replicas", str(max(prefill, decode)),
         "--prefill-port", str(pre_port), "--decode-port", str(dec_port)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_ready(router, api, serve)
        time.sleep(3.0)  # every worker registered
        before = {
            "prefill": scrape_timing([pre_port + i for i in range(prefill)]),
            "decode": scrape_timing([dec_port + i for i in range(decode)]),
        }
        out = subprocess.run(
            [sys.executable, "-m", "cli", "load", "--url", router, "--trace", str(csv),
             "--ttft-slo", str(slo.ttft_p99_s), "--tpot-slo", str(slo.tpot_p99_s), "--json"],
            capture_output=True, text=True,
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        report = json.loads(out.stdout)
        after = {
            "prefill": scrape_timing([pre_port + i for i in range(prefill)]),
            "decode": scrape_timing([dec_port + i for i in range(decode)]),
        }
    finally:
        _stop(serve)
        log.close()
        # Kept: a run of ten minutes that went wrong must say why afterwards.
        logs.mkdir(parents=True, exist_ok=True)
        shutil.copy(work / "serve.log", logs / "serve.log")
        if (work / "state" / "logs").is_dir():
            shutil.copytree(work / "state" / "logs", logs / "workers", dirs_exist_ok=True)
    timing = {
        pool: (after[pool][0] - before[pool][0]) / max(after[pool][1] - before[pool][1], 1e-12)
        for pool in after
    }
    return {"report": report, "timing": timing}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", default="4x4,8x8", help="prefill x decode sizes")
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--start-s", type=float, default=0.0, help="where in the trace")
    parser.add_argument("--profile", default="llama-2-70b-tp4@a100-80g")
    parser.add_argument("--ttft-p99", type=float, default=2.0)
    parser.add_argument("--tpot-p99", type=float, default=0.1)
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument(
        "--logs", default="bench-out/live_vs_sim", help="where each run's serve and worker logs go"
    )
    args = parser.parse_args()
    profile = load_profile(args.profile)
    budget = token_budget(profile, tpot_slo_s=args.tpot_p99)
    slo = SloTargets(ttft_p99_s=args.ttft_p99, tpot_p99_s=args.tpot_p99)
    full = load_trace(TRACE)
    if args.start_s:
        from sim.workload import time_slice

        full = time_slice(full, start_s=args.start_s, end_s=full.arrival_s[-1] + 1)
    (piece,) = demo_segment(
        full,
        [SegmentPhase(name="replay", rate_scale=args.rate_scale, duration_s=args.duration_s)],
        context_tokens=context_tokens(profile),
        rng=np.random.default_rng(0),
    )
    stats = summarize(piece)
    lengths = LengthSamples(
        prompt_tokens=piece.prompt_tokens, output_tokens=piece.output_tokens, source="replay"
    )
    model = CapacityModel.build(lengths, profile, tpot_slo_s=slo.tpot_p99_s, link=KvLink())
    print(
        f"{len(piece)} requests over {args.duration_s:g} s of {TRACE.name} "
        f"({stats.mean_rate_rps:.2f} req/s, ca2 {stats.interarrival_scv:.2f}); "
        f"{profile.name}, token budget {budget}"
    )
    config = demo_config(args.profile, args.ttft_p99, args.tpot_p99, startup_s=0.0)
    rows = []
    for spec in args.pools.split(","):
        n, m = (int(x) for x in spec.lower().split("x"))
        sim = Cluster(
            ClusterConfig(
                prefill_workers=n, decode_workers=m, profile=profile, token_budget=budget,
                kv_link_bytes_per_s=KvLink().bytes_per_s,
            ),
            piece,
        ).finish()  # fmt: skip
        ev = evaluate(
            model, prefill_workers=n, decode_workers=m,
            arrival_rate_rps=float(stats.mean_rate_rps or 0.0),
            ca2=float(stats.interarrival_scv or 1.0), slo=slo,
        )  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="sara-lvs-") as tmp:
            started = time.monotonic()
            got = live(_csv(piece, Path(tmp)), Path(tmp), prefill=n, decode=m, config=config,
                       budget=budget, slo=slo, logs=Path(args.logs) / f"{n}x{m}")  # fmt: skip
            wall = time.monotonic() - started
        rep = got["report"]
        sim_ttft, sim_tpot = sim.ttft_s, sim.tpot_s[np.isfinite(sim.tpot_s)]
        rows.append(
            (
                f"{n}+{m}",
                ("live", rep["ttft_s"]["p50"], rep["ttft_s"]["p99"],
                 rep["tpot_s"]["p50"], rep["tpot_s"]["p99"], rep["slo_attainment"]),
                ("sim", *np.percentile(sim_ttft, [50, 99]), *np.percentile(sim_tpot, [50, 99]),
                 None),
                ("model", None, ev.prefill.p99_s, None, ev.decode.p99_s, None),
                got["timing"],
                wall,
            )
        )  # fmt: skip
        print_rows(rows[-1:])
    return 0


def print_rows(rows: list[Any]) -> None:
    def f(x: float | None, scale: float = 1.0) -> str:
        return "-" if x is None else f"{x * scale:.3f}"

    print(
        f"\n{'pools':<7}{'':<7}{'TTFT p50 s':>11}{'p99':>8}{'TPOT p50 ms':>13}{'p99':>9}"
        f"{'SLO met':>9}"
    )
    for pools, *lines, timing, wall in rows:
        for name, t50, t99, p50, p99, att in lines:
            met = "-" if att is None else f"{att:.1%}"
            print(
                f"{pools:<7}{name:<7}{f(t50):>11}{f(t99):>8}{f(p50, 1e3):>13}{f(p99, 1e3):>9}"
                f"{met:>9}"
            )
        lv, sm = lines[0], lines[1]
        print(
            f"{'':<7}live/sim P99 TTFT {lv[2] / sm[2]:.3f}, P99 TPOT {lv[4] / sm[4]:.3f} "
            f"(target within 0.85-1.15); iteration time / profile: prefill "
            f"{timing['prefill']:.4f}, decode {timing['decode']:.4f} (target <= 1.05); "
            f"live run {wall:.0f} s",
            flush=True,
        )


def _csv(piece: Any, work: Path) -> Path:
    path = work / "replay.csv"
    write_trace_csv(piece, path)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
