"""`make demo`: the whole stack on this machine, autoscaling through a burst.

0. Plans capacity for the bundled Azure conversation trace and checks the plan in
   the simulator (the table of ``cli.demo``, a few seconds).
1. Cuts a segment out of the Azure conversation trace — calm, burst, calm: three
   consecutive stretches of the trace, thinned or copied to ``--calm-rate`` and
   ``--burst-rate`` times its rate (``sim.workload.scale_rate``) — at a scale that
   needs several workers per pool on the profile (default Llama-2-70B TP4 on A100).
2. Starts `sara serve --engine emulated`: a private Redis, the router, one prefill
   and one decode worker whose every step lasts what the profile says
   (``workers.emulated``), and the controller with the local actuator, observing
   through a real Prometheus that scrapes the router when one is installed, by
   scraping the router itself otherwise.
3. Replays the segment phase by phase with `sara load`, printing a progress line
   every few seconds: offered rate, workers per pool (current → desired), the P99s
   the controller observes against the SLOs.
4. Replays the same requests, at the times they were sent, in the simulator with the
   same controller config and profile (``sim.control.run_controlled``), and prints
   the two side by side per phase: attainment, P99 TTFT/TPOT, workers.
5. Writes a plot of load, workers and P99s (live and simulated), stops the stack and
   checks that no process it started is left.

``--engine torch`` runs the earlier demo instead: a small Llama in PyTorch on this
CPU, its profile measured first (`make demo-torch`).

    python -m cli.live_demo [--out DIR] [--calm-s 50] [--burst-s 110] ...
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "data" / "traces" / "AzureLLMInferenceTrace_conv.csv"
# ~8 M parameters: a step's compute, not Python, dominates; still fast on one core.
DEMO_MODEL = {
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}
POLL_S = 2.0
EMULATED_PROFILE = "llama-2-70b-tp4@a100-80g"
# A 70B TP4 worker takes ~99 s to start (the profile's startup_s); the demo compresses
# it to fit in minutes, and the simulator replays with the same startup.
EMULATED_STARTUP_S = 5.0
EMULATED_DEFAULTS: dict[str, Any] = {
    "ttft_p99": 2.0, "tpot_p99": 0.1, "calm_rate": 0.3, "burst_rate": 1.2,
    "calm_s": 50.0, "burst_s": 120.0, "after_s": 80.0,
}  # fmt: skip
TORCH_DEFAULTS: dict[str, Any] = {
    "ttft_p99": 0.8, "tpot_p99": 0.05, "calm_rate": 0.2, "burst_rate": 1.0,
    "calm_s": 40.0, "burst_s": 75.0, "after_s": 80.0,
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Phase:
    name: str
    rate_scale: float  # of the trace's ~5.4 requests/s
    duration_s: float


@dataclass
class Timeline:
    """What the monitor saw, one row per poll."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    phase_at: list[tuple[float, str]] = field(default_factory=list)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli", *args]


def _get_json(url: str, timeout_s: float = 2.0) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return dict(json.loads(reply.read()))
    except (OSError, ValueError, urllib.error.URLError):
        return None


def prepare_model(work: Path) -> tuple[Path, Path]:
    """The demo model's folder and its measured profile."""
    from workers.checkpoint import tiny_config, write_tiny_checkpoint

    model_dir = write_tiny_checkpoint(work / "demo-model", seed=0, config=tiny_config(**DEMO_MODEL))
    profile = work / "demo-profile.json"
    print("measuring the model's iteration-time profile on this CPU (about 30 s)...", flush=True)
    subprocess.run(
        _cli(
            "profile",
            "--model",
            str(model_dir),
            "--device",
            "cpu",
            "--out",
            str(profile),
            "--repeats",
            "5",
            "--refine",
            "1",
            "--budget-grid",
            "0,64,256",
            "--batch-grid",
            "0,8,32",
            "--context-grid",
            "256,1024",
        ),
        check=True,
        stdout=sys.stdout,
        stderr=subprocess.DEVNULL,
    )
    return model_dir, profile


def controller_config(profile: Path, ttft_p99_s: float, tpot_p99_s: float) -> dict[str, Any]:
    """Defaults, with a control loop fast enough for a demo of minutes."""
    from controller.config import ControllerConfig

    config = ControllerConfig().to_dict()
    config.update(
        profile=str(profile),
        slo={"ttft_p99_s": ttft_p99_s, "tpot_p99_s": tpot_p99_s},
        headroom=0.1,
        interval_s=4.0,
        window_s=12.0,
        stale_after_s=30.0,
        ema_weight=0.5,
        burst_window_s=4.0,
        scale_up_cooldown_s=8.0,
        scale_down_cooldown_s=12.0,
        scale_down_stabilisation_s=20.0,
        prefill={"min_replicas": 1, "max_replicas": 3},
        decode={"min_replicas": 1, "max_replicas": 2},
    )
    # Adapt to this machine quickly: the profile times the engine alone, the live
    # stack adds Redis, the router and contention for two cores.
    config["calibration"] = {**config["calibration"], "ema_weight": 0.5}
    return config


def monitor(api: str, timeline: Timeline, stop: threading.Event, start_s: float) -> None:
    while not stop.wait(POLL_S):
        status = _get_json(f"{api}/v1/status")
        if status is None:
            continue
        t = time.monotonic() - start_s
        cur, want = status.get("current") or {}, status.get("desired") or {}
        obs = status.get("observed_p99_s") or {}
        calibration = status.get("calibration") or {}
        row = {
            "t_s": t,
            "raw_rate_rps": status.get("raw_rate_rps"),
            "smoothed_rate_rps": status.get("smoothed_rate_rps"),
            "prefill": cur.get("prefill"),
            "decode": cur.get("decode"),
            "prefill_desired": want.get("prefill"),
            "decode_desired": want.get("decode"),
            "ttft_p99_s": obs.get("prefill"),
            "tpot_p99_s": obs.get("decode"),
            "calibration_prefill": calibration.get("prefill"),
            "calibration_decode": calibration.get("decode"),
        }
        timeline.rows.append(row)
        phase = next((name for start, name in reversed(timeline.phase_at) if start <= t), "-")
        print(
            f"t={t:5.0f}s {phase:<6} rate {_fmt(row['raw_rate_rps'], 4.1)} rps "
            f"(smoothed {_fmt(row['smoothed_rate_rps'], 4.1)})  "
            f"prefill {row['prefill']}→{row['prefill_desired']}  "
            f"decode {row['decode']}→{row['decode_desired']}  "
            f"P99 TTFT {_fmt(row['ttft_p99_s'], 5.2)} s  TPOT {_fmt(row['tpot_p99_s'], 6.3)} s",
            flush=True,
        )


def _fmt(value: Any, spec: float) -> str:
    width, digits = str(spec).split(".")
    if not isinstance(value, int | float):
        return "-".rjust(int(width))
    return f"{value:{width}.{digits}f}"


def run_phases(
    router: str, phases: list[Phase], args: argparse.Namespace, timeline: Timeline, t0: float
) -> list[tuple[Phase, dict[str, Any]]]:
    reports: list[tuple[Phase, dict[str, Any]]] = []
    for phase in phases:
        timeline.phase_at.append((time.monotonic() - t0, phase.name))
        out = subprocess.run(
            _cli(
                "load",
                "--url",
                router,
                "--trace",
                str(TRACE),
                "--rate-scale",
                str(phase.rate_scale),
                "--duration-s",
                str(phase.duration_s),
                "--length-scale",
                str(args.length_scale),
                "--fit-context",
                "--max-output-tokens",
                str(args.max_output_tokens),
                "--ttft-slo",
                str(args.ttft_p99),
                "--tpot-slo",
                str(args.tpot_p99),
                "--seed",
                str(len(reports)),
                "--json",
            ),
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            raise RuntimeError(f"sara load failed ({phase.name}): {out.stderr[-2000:]}")
        reports.append((phase, json.loads(out.stdout)))
    timeline.phase_at.append((time.monotonic() - t0, "end"))
    return reports


def summary(reports: list[tuple[Phase, dict[str, Any]]], timeline: Timeline) -> str:
    def p99(rep: dict[str, Any], key: str) -> str:
        pct = rep.get(key)
        return "-" if not pct else f"{pct['p99']:.3f}"

    lines = [
        f"{'phase':<7}{'rate rps':>9}{'sent':>6}{'ok':>6}{'P99 TTFT s':>12}{'P99 TPOT s':>12}"
        f"{'SLO met':>9}{'prefill':>9}{'decode':>8}"
    ]
    bounds = timeline.phase_at
    for i, (phase, rep) in enumerate(reports):
        lo, hi = bounds[i][0], bounds[i + 1][0]
        rows = [r for r in timeline.rows if lo <= r["t_s"] < hi]
        pre = [r["prefill"] for r in rows if isinstance(r["prefill"], int)]
        dec = [r["decode"] for r in rows if isinstance(r["decode"], int)]
        lines.append(
            f"{phase.name:<7}{rep['offered_rate_rps']:>9.2f}{rep['requests']:>6}"
            f"{rep['completed']:>6}{p99(rep, 'ttft_s'):>12}{p99(rep, 'tpot_s'):>12}"
            f"{rep['slo_attainment'] * 100:>8.1f}%"
            f"{_span(pre):>9}{_span(dec):>8}"
        )
    return "\n".join(lines)


def _span(values: list[int]) -> str:
    return "-" if not values else f"{min(values)}-{max(values)}"


def calibration_spans(timeline: Timeline, phase_names: list[str]) -> str:
    """The controller's calibration factor (observed / predicted P99) per phase.

    Near 1 means the profile describes the engine being served: the model plans on
    what the workers really do, not on a correction pinned at its bound.
    """
    lines = ["calibration factor (observed / predicted P99), min-max per phase:"]
    bounds = timeline.phase_at
    for i, name in enumerate(phase_names):
        lo, hi = bounds[i][0], bounds[i + 1][0]
        rows = [r for r in timeline.rows if lo <= r["t_s"] < hi]
        spans = []
        for pool in ("prefill", "decode"):
            values = [r[f"calibration_{pool}"] for r in rows]
            values = [v for v in values if isinstance(v, int | float)]
            span = "-" if not values else f"{min(values):.2f}-{max(values):.2f}"
            spans.append(f"{pool} {span}")
        lines.append(f"  {name:<6} " + "   ".join(spans))
    return "\n".join(lines)


def plot(timeline: Timeline, path: Path, ttft_slo: float, tpot_slo: float) -> None:
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
    axes[1].step(t, series("prefill"), where="post", label="prefill")
    axes[1].step(t, series("decode"), where="post", label="decode")
    axes[1].set_ylabel("workers")
    axes[1].yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[2].plot(t, series("ttft_p99_s"), label="P99 TTFT")
    axes[2].axhline(ttft_slo, color="red", linestyle="--", label="SLO")
    axes[2].set_ylabel("seconds")
    axes[3].plot(t, series("tpot_p99_s"), label="P99 TPOT")
    axes[3].axhline(tpot_slo, color="red", linestyle="--", label="SLO")
    axes[3].set_ylabel("seconds")
    axes[3].set_xlabel("time (s)")
    finish_plot(fig, axes, timeline, "sara serve: load, workers and P99 latency through a burst",
                path)


def finish_plot(fig: Any, axes: Any, timeline: Any, title: str, path: Path) -> None:
    """Mark the phases on every panel, add legends and grids, and save the figure."""
    import matplotlib.pyplot as plt

    for ax in axes:
        for start, name in timeline.phase_at[:-1]:
            ax.axvline(start, color="grey", linewidth=0.8)
            if ax is axes[0]:
                ax.text(start, 0, f" {name}", va="bottom", fontsize=8)
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def leftovers(marker: str) -> list[int]:
    """Processes whose command line mentions ``marker`` (this run's temp folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="ignore")
        except OSError:
            continue
        if marker in cmdline:
            found.append(int(entry.name))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("emulated", "torch"), default="emulated")
    parser.add_argument("--out", default="demo-out", help="where the plot and logs go")
    parser.add_argument("--ttft-p99", type=float, help="TTFT SLO (s; emulated 2, torch 0.8)")
    parser.add_argument("--tpot-p99", type=float, help="TPOT SLO (s; emulated 0.1, torch 0.05)")
    parser.add_argument("--calm-rate", type=float, help="rate scale when calm")
    parser.add_argument("--burst-rate", type=float, help="rate scale in the burst")
    parser.add_argument("--calm-s", type=float)
    parser.add_argument("--burst-s", type=float)
    parser.add_argument("--after-s", type=float)
    parser.add_argument("--length-scale", type=float, default=0.25, help="torch: lengths x")
    parser.add_argument("--max-output-tokens", type=int, default=128, help="torch: output cap")
    parser.add_argument("--profile", default=EMULATED_PROFILE, help="emulated: the profile")
    parser.add_argument(
        "--startup-s", type=float, default=EMULATED_STARTUP_S, help="emulated: worker startup"
    )
    parser.add_argument("--seed", type=int, default=0, help="emulated: the segment's draws")
    parser.add_argument(
        "--ramp-s", type=float, default=80.0, help="emulated: the burst builds up over this"
    )
    args = parser.parse_args(argv)
    defaults = EMULATED_DEFAULTS if args.engine == "emulated" else TORCH_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.engine == "emulated":
        from cli.live_emulated import main_emulated

        return main_emulated(args)
    return main_torch(args)


def main_torch(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    phases = [
        Phase(name="calm", rate_scale=args.calm_rate, duration_s=args.calm_s),
        Phase(name="burst", rate_scale=args.burst_rate, duration_s=args.burst_s),
        Phase(name="after", rate_scale=args.calm_rate, duration_s=args.after_s),
    ]
    from cli import demo as planning
    from workers.redis_util import free_port, free_port_block

    started = time.monotonic()

    print("== capacity plan for the Azure conversation hour, checked in the simulator")
    planning.main([])
    print("\n== the live stack on this machine")
    with tempfile.TemporaryDirectory(prefix="sara-demo-") as tmp:
        work = Path(tmp)
        model_dir, profile = prepare_model(work)
        config_file = work / "config.json"
        config_file.write_text(json.dumps(controller_config(profile, args.ttft_p99, args.tpot_p99)))
        router_port, api_port = free_port(), free_port()
        ports = free_port_block(3 + 2)  # worker i's metrics on base + i (pools 1-3, 1-2)
        router, api = f"http://127.0.0.1:{router_port}", f"http://127.0.0.1:{api_port}"
        serve_log = (out / "serve.log").open("w")
        serve = subprocess.Popen(
            _cli(
                "serve",
                "--model",
                str(model_dir),
                "--config",
                str(config_file),
                "--state-dir",
                str(work / "state"),
                "--listen",
                f"127.0.0.1:{router_port}",
                "--api-listen",
                f"127.0.0.1:{api_port}",
                "--token-budget",
                "256",
                "--prefill-port",
                str(ports),
                "--decode-port",
                str(ports + 3),
                "--grace-period-s",
                "20",
            ),
            stdout=serve_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        timeline = Timeline()
        stop = threading.Event()
        try:
            _wait_ready(router, api, serve)
            print(f"stack up: router {router}, controller {api}; logs in {out}/serve.log")
            t0 = time.monotonic()
            watcher = threading.Thread(target=monitor, args=(api, timeline, stop, t0), daemon=True)
            watcher.start()
            reports = run_phases(router, phases, args, timeline, t0)
            # A little longer: the scale-down that follows the calm.
            time.sleep(max(0.0, 8.0))
        finally:
            stop.set()
            _stop(serve)
            serve_log.close()
        left = leftovers(tmp)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    print()
    print(summary(reports, timeline))
    print(calibration_spans(timeline, [phase.name for phase in phases]))
    png = out / "demo.png"
    plot(timeline, png, args.ttft_p99, args.tpot_p99)
    (out / "timeline.json").write_text(json.dumps(timeline.rows, indent=1))
    peak = max((r["prefill"] or 0 for r in timeline.rows), default=0)
    print(
        f"\nplot: {png}   prefill workers peaked at {peak}; "
        f"whole demo {time.monotonic() - started:.0f} s"
    )
    print(
        "processes left behind: none" if not left else f"processes left behind and killed: {left}"
    )
    return 0 if not left else 1


def _wait_ready(router: str, api: str, serve: subprocess.Popen[Any]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if serve.poll() is not None:
            raise RuntimeError(f"sara serve exited with status {serve.returncode}")
        ready = _get_json(f"{router}/readyz")
        status = _get_json(f"{api}/v1/status")
        if ready is not None and ready.get("ready", True) and status is not None:
            return
        time.sleep(0.5)
    raise RuntimeError("the stack did not become ready within 120 s")


def _stop(serve: subprocess.Popen[Any]) -> None:
    if serve.poll() is None:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()


if __name__ == "__main__":
    raise SystemExit(main())
