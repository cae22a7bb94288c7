"""`make demo` on the emulated engine: the live stack and the simulator, side by side.

The live half runs every real component — router, Redis streams, prefill and decode
worker processes, Prometheus (when installed), the controller and its local
actuator — with ``workers.emulated`` standing in for the accelerator, so the pools
add capacity as real GPUs would: each emulated worker sleeps through its steps
instead of sharing two cores' compute. The simulated half replays the very requests
`sara load` sent, at the offsets they were sent, through ``sim.cluster`` under the
same production tick (``sim.control.run_controlled``), the same config and profile.

What differs between the two halves is what the simulator does not model: the
router and Redis hops, the KV hand-off over Redis, the client's HTTP streaming, the
controller observing through scrapes rather than exact counts, and a machine shared
with other work. docs/serving.md discusses the gap.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cli.live_demo import (
    TRACE,
    Timeline,
    _cli,
    _span,
    _stop,
    _wait_ready,
    calibration_spans,
    finish_plot,
    leftovers,
    monitor,
)
from sim.trace import Trace

POLL_S = 2.0
PREFILL_MAX, DECODE_MAX = 8, 4  # the pools' limits in the demo


RAMP_STEP_S = 5.0


@dataclass(frozen=True, kw_only=True)
class SegmentPhase:
    """One stretch of the demo: ``duration_s`` of the trace at ``rate_scale`` x its rate;
    with ``ramp_s``, the scale first rises linearly from ``ramp_from`` over ``ramp_s``
    (in steps of ``RAMP_STEP_S``), as real bursts build up over a while."""

    name: str
    rate_scale: float
    duration_s: float
    ramp_s: float = 0.0
    ramp_from: float = 1.0

    def scale_at(self, t_s: float) -> float:
        """The rate scale at ``t_s`` into the phase."""
        if t_s >= self.ramp_s:
            return self.rate_scale
        return self.ramp_from + (self.rate_scale - self.ramp_from) * t_s / self.ramp_s


@dataclass(frozen=True, kw_only=True)
class PhaseStats:
    """What one phase came to, live or simulated. P99s over the completed requests."""

    requests: int
    completed: int
    attainment: float
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    workers: dict[str, str]  # pool -> "min-max" over the phase


def demo_segment(
    trace: Trace, phases: list[SegmentPhase], *, context_tokens: int, rng: np.random.Generator
) -> list[Trace]:
    """Consecutive stretches of ``trace``, one per phase, each thinned or copied to its
    rate (``sim.workload.scale_rate``), arrivals from 0, lengths fitted to the context
    as `sara load --fit-context` fits them (output first, then the prompt)."""
    from sim.workload import scale_rate, time_slice

    out, start_s = [], 0.0
    for phase in phases:
        steps = []
        for lo in np.arange(
            0.0, phase.duration_s, RAMP_STEP_S if phase.ramp_s else phase.duration_s
        ):
            hi = min(lo + (RAMP_STEP_S if phase.ramp_s else phase.duration_s), phase.duration_s)
            part = time_slice(trace, start_s=start_s + lo, end_s=start_s + hi)
            part = scale_rate(part, phase.scale_at((lo + hi) / 2), rng)
            steps.append((part, lo))
        piece = Trace(
            arrival_s=np.concatenate([p.arrival_s + lo for p, lo in steps]),
            prompt_tokens=np.concatenate([p.prompt_tokens for p, _ in steps]),
            output_tokens=np.concatenate([p.output_tokens for p, _ in steps]),
            source=f"{trace.source} [{start_s:g} s, {start_s + phase.duration_s:g} s)",
        )
        output = np.minimum(piece.output_tokens, context_tokens - 1)
        prompt = np.minimum(piece.prompt_tokens, context_tokens - output)
        out.append(
            Trace(
                arrival_s=piece.arrival_s,
                prompt_tokens=prompt,
                output_tokens=output,
                source=f"{piece.source} ({phase.name})",
            )
        )
        start_s += phase.duration_s
    return out


def write_trace_csv(trace: Trace, path: Path) -> None:
    """The generic CSV `sara load --trace` reads (timestamp_s, prompt and output tokens)."""
    rows = ["timestamp_s,prompt_tokens,output_tokens"]
    rows += [
        f"{t:.6f},{p},{o}"
        for t, p, o in zip(trace.arrival_s, trace.prompt_tokens, trace.output_tokens, strict=True)
    ]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")


def demo_config(
    profile: str, ttft_p99_s: float, tpot_p99_s: float, *, startup_s: float
) -> dict[str, Any]:
    """The controller's defaults, with its time constants shrunk with the workers'
    startup so that the demo fits in minutes: a tick every 4 s, a scale-up allowed
    every tick and by up to the pool's size, the rate forecast over one startup plus
    one tick, that startup assumed until one is measured (the defaults are sized for
    minutes-long startups and 30-s ticks)."""
    from controller.config import ControllerConfig

    config = ControllerConfig().to_dict()
    interval_s = 4.0
    config.update(
        profile=profile,
        slo={"ttft_p99_s": ttft_p99_s, "tpot_p99_s": tpot_p99_s},
        headroom=0.1,
        interval_s=interval_s,
        # Long enough that a calm minute gives the length mix its samples.
        window_s=30.0,
        stale_after_s=40.0,
        ema_weight=0.5,
        burst_window_s=4.0,
        max_step_fraction=1.0,
        scale_up_cooldown_s=interval_s,
        scale_down_cooldown_s=12.0,
        scale_down_stabilisation_s=20.0,
        prefill={"min_replicas": 1, "max_replicas": PREFILL_MAX},
        decode={"min_replicas": 1, "max_replicas": DECODE_MAX},
    )
    config["forecast"] = {
        **config["forecast"],
        "enabled": True,
        "horizon_s": startup_s + interval_s,
        "trend_window_s": 30.0,
        "bin_s": interval_s,  # one measurement a tick (see controller.tick.forecast_config)
    }
    # Until a pool's first scale-up is measured, its lead time is this prior: the
    # default (120 s, a large model's start-up) would have the forecast extrapolate
    # the burst's ramp two minutes ahead on workers that start in seconds.
    config["lead_time"] = {**config["lead_time"], "startup_prior_s": startup_s}
    return config


def start_prometheus(work: Path, router_port: int) -> tuple[subprocess.Popen[Any], str] | None:
    """A private Prometheus scraping the router every second, or None if none is installed."""
    from workers.redis_util import free_port

    binary = shutil.which("prometheus")
    if binary is None:
        return None
    (work / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: sara\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{router_port}']\n",
        encoding="utf-8",
    )
    port = free_port()
    log = (work / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'prometheus-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return None
        try:
            import urllib.request

            with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as reply:
                if reply.status == 200:
                    return process, url
        except OSError:
            time.sleep(0.3)
    process.kill()
    process.wait()
    return None


def concatenate(pieces: list[Trace], starts_s: list[float]) -> Trace:
    """The phases one after the other, each shifted to its start."""
    return Trace(
        arrival_s=np.concatenate([p.arrival_s + s for p, s in zip(pieces, starts_s, strict=True)]),
        prompt_tokens=np.concatenate([p.prompt_tokens for p in pieces]),
        output_tokens=np.concatenate([p.output_tokens for p in pieces]),
        source="the demo segment",
    )


def run_segment(
    router: str,
    segment: Trace,
    phases: list[SegmentPhase],
    starts_s: list[float],
    *,
    vocab_size: int,
    timeline: Timeline,
    t0: float,
) -> list[Any]:
    """Send the whole segment open-loop, as `sara load` does (``cli.loadgen``), one run:
    the phases follow each other without a gap. The per-request results, in order."""
    import asyncio

    from cli.loadgen import PlanOptions, build_plan, run_load

    plan = build_plan(segment, PlanOptions(vocab_size=vocab_size), np.random.default_rng(0))
    timeline.phase_at.extend((s, ph.name) for s, ph in zip(starts_s, phases, strict=True))
    started_wall_s = time.time()
    results = asyncio.run(run_load(router, plan, request_timeout_s=120.0))
    timeline.phase_at.append((time.monotonic() - t0, "end"))
    return list(results), started_wall_s


def live_tick_phase_s(serve_log: Path, load_started_wall_s: float, interval_s: float) -> float:
    """Seconds from the load's start to the live controller's first tick after it (the
    controller logs each tick's wall-clock time); 0 where no tick was logged.

    The simulated controller ticks at the same offsets into the segment: a tick that
    falls a second or two later sees different 4-s windows and can take a decision at
    a threshold the other way (replayed at offsets 0-3 s apart, the simulator's own
    after-burst P99 TPOT spans 0.051-0.065 s on this segment)."""
    for line in serve_log.read_text(encoding="utf-8", errors="replace").splitlines():
        if '"event": "tick"' not in line:
            continue
        try:
            tick_s = float(json.loads(line[line.index("{") :])["time_s"])
        except (ValueError, KeyError, TypeError):
            continue
        if tick_s >= load_started_wall_s:
            return (tick_s - load_started_wall_s) % interval_s
    return 0.0


def live_stats(results: list[Any], rows: list[dict[str, Any]], slo: Any) -> PhaseStats:
    """The phase's live figures. Its workers are the controller's targets, as the
    simulator's ``sizes`` are: the status's ``current`` is what a tick observed before
    deciding, one tick behind its ``desired``."""
    from cli.loadgen import summarize

    report = summarize(results, ttft_slo_s=slo.ttft_p99_s, tpot_slo_s=slo.tpot_p99_s)
    return PhaseStats(
        requests=report.requests,
        completed=report.completed,
        attainment=report.slo_attainment,
        ttft_p99_s=None if report.ttft_s is None else report.ttft_s.p99,
        tpot_p99_s=None if report.tpot_s is None else report.tpot_s.p99,
        workers={
            pool: _span(
                [r[f"{pool}_desired"] for r in rows if isinstance(r[f"{pool}_desired"], int)]
            )
            for pool in ("prefill", "decode")
        },
    )


@dataclass(frozen=True, kw_only=True)
class Simulated:
    phases: list[PhaseStats]
    sizes: list[tuple[float, int, int]]  # (time s, prefill, decode) at every tick
    ttft_s: np.ndarray  # per request of the segment, in its order (NaN: none)
    tpot_s: np.ndarray


def simulate(
    pieces: list[Trace],
    starts_s: list[float],
    end_s: float,
    *,
    config: dict[str, Any],
    startup_s: float,
    token_budget: int,
    tick_phase_s: float = 0.0,
) -> Simulated:
    """The same requests at the same offsets through the simulator and the same tick,
    ticking ``tick_phase_s`` after the segment's start and every interval after, as
    the live controller did (``live_tick_phase_s``)."""
    from controller.config import ControllerConfig
    from controller.profiles import load_profile
    from queueing.pools import Pool
    from sim.cluster import Cluster, ClusterConfig
    from sim.control import run_controlled

    controller = ControllerConfig.from_dict(config)
    profile = load_profile(controller.profile)
    # The simulated controller ticks at multiples of the interval from time 0: the
    # segment starts ``lead_s`` in, so its ticks fall ``tick_phase_s`` into each interval.
    lead_s = (controller.interval_s - tick_phase_s) % controller.interval_s
    full = concatenate(pieces, [start + lead_s for start in starts_s])
    cluster = Cluster(
        ClusterConfig(
            prefill_workers=config["prefill"]["min_replicas"],
            decode_workers=config["decode"]["min_replicas"],
            profile=profile,
            token_budget=token_budget,
            kv_link_bytes_per_s=controller.kv_link_gbps * 1e9 / 8,
            startup_s=startup_s,
        ),
        full,
    )
    run = run_controlled(cluster, controller, profile=profile, until_s=end_s + lead_s)
    results = cluster.finish()
    sizes = [
        (
            (k + 1) * controller.interval_s - lead_s,
            d.pools[Pool.PREFILL].target,
            d.pools[Pool.DECODE].target,
        )
        for k, d in enumerate(run.decisions)
        if (k + 1) * controller.interval_s >= lead_s  # none before the segment starts
    ]
    slo = controller.slo
    stats, lo = [], 0
    total = sum(len(piece) for piece in pieces)
    for piece, start, stop in zip(pieces, starts_s, [*starts_s[1:], end_s], strict=True):
        idx = np.arange(lo, lo + len(piece))
        lo += len(piece)
        ttft, tpot = results.ttft_s[idx], results.tpot_s[idx]
        done = np.isfinite(results.finish_s[idx])
        ok = done & (ttft <= slo.ttft_p99_s) & (np.isnan(tpot) | (tpot <= slo.tpot_p99_s))
        in_phase = [(p, d) for t, p, d in sizes if start <= t < stop]
        stats.append(
            PhaseStats(
                requests=len(idx),
                completed=int(done.sum()),
                attainment=float(ok.mean()) if len(idx) else math.nan,
                ttft_p99_s=_p99(ttft[done]),
                tpot_p99_s=_p99(tpot[done & np.isfinite(tpot)]),
                workers={
                    "prefill": _span([p for p, _ in in_phase]),
                    "decode": _span([d for _, d in in_phase]),
                },
            )
        )
    return Simulated(
        phases=stats,
        sizes=sizes,
        ttft_s=results.ttft_s[:total].copy(),
        tpot_s=results.tpot_s[:total].copy(),
    )


def write_requests(path: Path, live: list[Any], sim: Simulated) -> None:
    """One CSV row per request of the segment: when it was due, how late the load
    generator sent it, and its TTFT and TPOT live and in the simulator — where the two
    part, request by request."""

    def cell(value: float | None) -> str:
        return "" if value is None or not math.isfinite(value) else f"{value:.4f}"

    lines = ["scheduled_s,send_lag_s,prompt_tokens,ttft_s,sim_ttft_s,tpot_s,sim_tpot_s"]
    for r, sim_ttft, sim_tpot in zip(live, sim.ttft_s, sim.tpot_s, strict=True):
        lines.append(
            f"{r.scheduled_s:.3f},{r.send_lag_s:.4f},{r.prompt_tokens},{cell(r.ttft_s)},"
            f"{cell(float(sim_ttft))},{cell(r.tpot_s)},{cell(float(sim_tpot))}"
        )
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _p99(values: np.ndarray) -> float | None:
    return float(np.percentile(values, 99)) if len(values) else None


def side_by_side(phases: list[SegmentPhase], live: list[PhaseStats], sim: list[PhaseStats]) -> str:
    def f(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    head = (
        f"{'phase':<7}{'rate rps':>9}{'sent':>6}{'ok':>6} "
        f"{'SLO met live':>12}{'sim':>8} {'P99 TTFT s live':>15}{'sim':>7} "
        f"{'P99 TPOT s live':>15}{'sim':>7} {'prefill live':>12}{'sim':>6} "
        f"{'decode live':>11}{'sim':>6}"
    )
    lines = [head]
    for phase, lv, sm in zip(phases, live, sim, strict=True):
        lines.append(
            f"{phase.name:<7}{lv.requests / phase.duration_s:>9.2f}{lv.requests:>6}"
            f"{lv.completed:>6} {lv.attainment * 100:>11.1f}%{sm.attainment * 100:>7.1f}% "
            f"{f(lv.ttft_p99_s):>15}{f(sm.ttft_p99_s):>7} {f(lv.tpot_p99_s):>15}"
            f"{f(sm.tpot_p99_s):>7} {lv.workers['prefill']:>12}{sm.workers['prefill']:>6} "
            f"{lv.workers['decode']:>11}{sm.workers['decode']:>6}"
        )
    return "\n".join(lines)


def plot(timeline: Timeline, sim: Simulated, path: Path, ttft_slo: float, tpot_slo: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = timeline.rows
    t = [r["t_s"] for r in rows]

    def series(key: str) -> list[float]:
        return [r[key] if isinstance(r[key], int | float) else float("nan") for r in rows]

    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    axes[0].plot(t, series("raw_rate_rps"), label="measured")
    axes[0].plot(t, series("smoothed_rate_rps"), label="smoothed (EMA)")
    axes[0].set_ylabel("arrivals (req/s)")
    st = [s[0] for s in sim.sizes]
    # Targets on both sides (``live_stats``): the live status's current replicas lag
    # its targets by a tick, and would read as a controller a tick slower.
    axes[1].step(t, series("prefill_desired"), where="post", label="prefill (live)")
    axes[1].step(t, series("decode_desired"), where="post", label="decode (live)")
    axes[1].step(st, [s[1] for s in sim.sizes], where="post", linestyle="--", label="prefill (sim)")
    axes[1].step(st, [s[2] for s in sim.sizes], where="post", linestyle="--", label="decode (sim)")
    axes[1].set_ylabel("workers (targets)")
    axes[1].yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[2].plot(t, series("ttft_p99_s"), label="P99 TTFT (controller's view)")
    axes[2].axhline(ttft_slo, color="red", linestyle="--", label="SLO")
    axes[2].set_ylabel("seconds")
    axes[3].plot(t, series("tpot_p99_s"), label="P99 TPOT (controller's view)")
    axes[3].axhline(tpot_slo, color="red", linestyle="--", label="SLO")
    axes[3].set_ylabel("seconds")
    axes[3].set_xlabel("time (s)")
    finish_plot(
        fig,
        axes,
        timeline,
        "sara serve --engine emulated: load, workers (live and simulated), P99s",
        path,
    )


def main_emulated(args: argparse.Namespace) -> int:
    from cli import demo as planning
    from controller.profiles import load_profile
    from queueing.budget import token_budget
    from queueing.solver import SloTargets
    from sim.trace_io import load_trace
    from workers.emulated import EMULATED_VOCAB_SIZE, context_tokens
    from workers.redis_util import free_port, free_port_block

    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    phases = [
        SegmentPhase(name="calm", rate_scale=args.calm_rate, duration_s=args.calm_s),
        SegmentPhase(
            name="burst",
            rate_scale=args.burst_rate,
            duration_s=args.burst_s,
            ramp_s=args.ramp_s,
            ramp_from=args.calm_rate,
        ),
        SegmentPhase(name="after", rate_scale=args.calm_rate, duration_s=args.after_s),
    ]
    print("== capacity plan for the Azure conversation hour, checked in the simulator")
    planning.main([])
    profile = load_profile(args.profile)
    budget = token_budget(profile, tpot_slo_s=args.tpot_p99)
    config = demo_config(args.profile, args.ttft_p99, args.tpot_p99, startup_s=args.startup_s)
    starts_s = [float(x) for x in np.cumsum([0.0] + [ph.duration_s for ph in phases[:-1]])]
    pieces = demo_segment(
        load_trace(TRACE),
        phases,
        context_tokens=context_tokens(profile),
        rng=np.random.default_rng(args.seed),
    )
    print(
        f"\n== the live stack on this machine, emulated {profile.name} workers "
        f"(token budget {budget}, startup {args.startup_s:g} s; the profile's is "
        f"{profile.startup_s:.0f} s)"
    )
    segment = concatenate(pieces, starts_s)
    print(
        "segment of the Azure conversation trace: "
        + ", ".join(
            f"{ph.name} {ph.duration_s:g} s at {ph.rate_scale:g}x ({len(pc)} requests)"
            for ph, pc in zip(phases, pieces, strict=True)
        )
        + f"; SLOs P99 TTFT {args.ttft_p99:g} s, P99 TPOT {args.tpot_p99:g} s"
    )
    left: list[int] = []
    with tempfile.TemporaryDirectory(prefix="sara-demo-") as tmp:
        work = Path(tmp)
        (work / "config.json").write_text(json.dumps(config))
        router_port, api_port = free_port(), free_port()
        ports = free_port_block(PREFILL_MAX + DECODE_MAX)  # worker i's metrics: base + i
        router, api = f"http://127.0.0.1:{router_port}", f"http://127.0.0.1:{api_port}"
        prometheus = start_prometheus(work, router_port)
        source = ["--prometheus", prometheus[1]] if prometheus else []
        print(
            f"controller observes through Prometheus at {prometheus[1]}"
            if prometheus
            else "no prometheus installed: the controller scrapes the router directly"
        )
        serve_log = (out / "serve.log").open("w")
        serve = subprocess.Popen(
            _cli(
                "serve",
                "--engine",
                "emulated",
                "--config",
                str(work / "config.json"),
                "--state-dir",
                str(work / "state"),
                "--listen",
                f"127.0.0.1:{router_port}",
                "--api-listen",
                f"127.0.0.1:{api_port}",
                "--token-budget",
                str(budget),
                "--max-running",
                str(budget),
                "--startup-s",
                str(args.startup_s),
                "--prefill-port",
                str(ports),
                "--decode-port",
                str(ports + PREFILL_MAX),
                "--grace-period-s",
                "30",
                *source,
            ),
            stdout=serve_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        timeline = Timeline()
        stop = threading.Event()
        try:
            _wait_ready(router, api, serve)  # the router is ready once both pools have a worker
            print(f"stack up: router {router}, controller {api}; logs in {out}/serve.log")
            t0 = time.monotonic()
            watcher = threading.Thread(target=monitor, args=(api, timeline, stop, t0), daemon=True)
            watcher.start()
            results, load_started_wall_s = run_segment(
                router, segment, phases, starts_s, vocab_size=EMULATED_VOCAB_SIZE,
                timeline=timeline, t0=t0,
            )  # fmt: skip
        finally:
            stop.set()
            _stop(serve)
            serve_log.close()
            if prometheus is not None:
                prometheus[0].terminate()
                prometheus[0].wait(timeout=30)
        left = leftovers(tmp)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    bounds = timeline.phase_at
    slo = SloTargets(ttft_p99_s=args.ttft_p99, tpot_p99_s=args.tpot_p99)
    live, lo = [], 0
    for i, piece in enumerate(pieces):
        rows = [r for r in timeline.rows if bounds[i][0] <= r["t_s"] < bounds[i + 1][0]]
        live.append(live_stats(results[lo : lo + len(piece)], rows, slo))
        lo += len(piece)
    print("\nlive, per phase:")
    for phase, st in zip(phases, live, strict=True):
        print(f"  {phase.name:<6} {json.dumps(st.__dict__)}")
    (out / "live.json").write_text(json.dumps([st.__dict__ for st in live], indent=1))
    tick_phase_s = live_tick_phase_s(
        out / "serve.log", load_started_wall_s, float(config["interval_s"])
    )
    print(f"the simulated controller ticks {tick_phase_s:.2f} s into each interval, as live")
    sim = simulate(
        pieces,
        starts_s,
        bounds[-1][0],
        config=config,
        startup_s=args.startup_s,
        token_budget=budget,
        tick_phase_s=tick_phase_s,
    )
    print("\nlive (sara serve --engine emulated) vs simulated (the same requests, same policy):")
    print(side_by_side(phases, live, sim.phases))
    print(calibration_spans(timeline, [phase.name for phase in phases]))
    png = out / "demo.png"
    plot(timeline, sim, png, args.ttft_p99, args.tpot_p99)
    (out / "timeline.json").write_text(json.dumps(timeline.rows, indent=1))
    write_requests(out / "requests.csv", results, sim)
    peak = max((r["prefill"] or 0 for r in timeline.rows), default=0)
    print(
        f"\nplot: {png}   prefill workers peaked at {peak}; "
        f"whole demo {time.monotonic() - started:.0f} s"
    )
    print("processes left behind: none" if not left else f"processes left behind, killed: {left}")
    return 0 if not left else 1
