"""`make demo`: plan capacity for a real trace, then check the plan in the simulator.

It loads the bundled Azure conversation trace (one hour of production chat traffic),
asks the solver for the fewest prefill and decode workers that meet the SLOs, and
replays the hour on a simulated cluster of that size — and of one worker fewer in
each pool — printing predicted and simulated P99s side by side.

    python -m cli.demo [--profile NAME] [--ttft-p99 S] [--tpot-p99 S]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from queueing.catalog import resolve_profile
from queueing.lengths import LengthSamples
from queueing.solver import CapacityModel, KvLink, SloTargets, evaluate, solve
from sim.cluster import Cluster, ClusterConfig
from sim.trace_io import load_trace
from sim.workload import summarize

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "data" / "traces" / "AzureLLMInferenceTrace_conv.csv"


@dataclass(frozen=True, kw_only=True)
class Line:
    label: str
    prefill: int
    decode: int
    ttft_pred_s: float | None
    ttft_sim_s: float | None
    tpot_pred_s: float | None
    tpot_sim_s: float | None
    attainment: float | None
    gpu_hours: float


def _fmt_s(value: float | None, scale: float = 1.0) -> str:
    return "unstable" if value is None else f"{value * scale:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="llama-2-70b-tp4@h100-sxm")
    parser.add_argument("--ttft-p99", type=float, default=2.0)
    parser.add_argument("--tpot-p99", type=float, default=0.1)
    parser.add_argument("--headroom", type=float, default=0.1)
    args = parser.parse_args(argv)

    trace = load_trace(TRACE)
    stats = summarize(trace)
    profile = resolve_profile(args.profile)
    slo = SloTargets(ttft_p99_s=args.ttft_p99, tpot_p99_s=args.tpot_p99)
    link = KvLink()
    print(f"Trace: {TRACE.name} (Azure LLM inference, CC-BY-4.0)")
    print(
        f"  {stats.requests} requests over {stats.duration_s / 60:.0f} min, "
        f"mean {stats.mean_rate_rps:.2f} req/s (busiest minute {stats.busiest_minute_rps:.2f}), "
        f"inter-arrival SCV {stats.interarrival_scv:.2f}"
    )
    print(
        f"  prompt tokens mean {stats.prompt_mean_tokens:.0f} / p99 {stats.prompt_p99_tokens:.0f}; "
        f"output tokens mean {stats.output_mean_tokens:.0f} / p99 {stats.output_p99_tokens:.0f}"
    )
    print(
        f"Profile: {profile.name} (TP{profile.tensor_parallel}); SLOs: P99 TTFT "
        f"{slo.ttft_p99_s} s, P99 TPOT {slo.tpot_p99_s * 1e3:.0f} ms; headroom {args.headroom:.0%}"
    )

    lengths = LengthSamples(
        prompt_tokens=trace.prompt_tokens, output_tokens=trace.output_tokens, source=trace.source
    )
    model = CapacityModel.build(lengths, profile, tpot_slo_s=slo.tpot_p99_s, link=link)
    rate = stats.busiest_minute_rps
    ca2 = trace.interarrival_scv
    started = time.perf_counter()
    answer = solve(model, arrival_rate_rps=rate, ca2=ca2, slo=slo, headroom=args.headroom)
    solve_ms = (time.perf_counter() - started) * 1e3
    print(
        f"\nSolve for the busiest minute ({rate:.2f} req/s, ca2 {ca2:.2f}) in {solve_ms:.2f} ms: "
        f"{answer.prefill_workers} prefill + {answer.decode_workers} decode workers, "
        f"token budget {answer.token_budget}"
    )
    print(
        f"  prefill bound by {answer.prefill_bound.value}, decode bound by "
        f"{answer.decode_bound.value}"
    )

    n, m = answer.prefill_workers, answer.decode_workers
    plans = [("solver", n, m)]
    if n > 1:
        plans.append(("one prefill fewer", n - 1, m))
    if m > 1:
        plans.append(("one decode fewer", n, m - 1))
    lines = []
    for label, p, d in plans:
        ev = evaluate(
            model, prefill_workers=p, decode_workers=d, arrival_rate_rps=rate, ca2=ca2, slo=slo
        )
        config = ClusterConfig(
            prefill_workers=p,
            decode_workers=d,
            profile=profile,
            token_budget=model.token_budget,
            kv_link_bytes_per_s=link.bytes_per_s,
        )
        started = time.perf_counter()
        results = Cluster(config, trace).run()
        wall = time.perf_counter() - started
        summary = results.summary(ttft_slo_s=slo.ttft_p99_s, tpot_slo_s=slo.tpot_p99_s)
        print(
            f"  simulated the hour on {p}+{d} workers in {wall:.1f} s "
            f"({trace.duration_s / wall:.0f}x real time)"
        )
        lines.append(
            Line(
                label=label,
                prefill=p,
                decode=d,
                ttft_pred_s=ev.prefill.p99_s,
                ttft_sim_s=summary.ttft_p99_s,
                tpot_pred_s=ev.decode.p99_s,
                tpot_sim_s=summary.tpot_p99_s,
                attainment=summary.slo_attainment,
                gpu_hours=summary.gpu_hours,
            )
        )

    print("\nPredicted (model, busiest minute) vs simulated (the whole hour replayed):")
    print(
        f"{'allocation':<19}{'P':>3}{'D':>3} {'TTFT p99 pred':>14}{'sim':>8} "
        f"{'TPOT p99 pred ms':>17}{'sim':>8} {'SLO attained':>13} {'GPU-h':>7}"
    )
    for ln in lines:
        attained = "-" if ln.attainment is None else f"{ln.attainment:.2%}"
        print(
            f"{ln.label:<19}{ln.prefill:>3}{ln.decode:>3} {_fmt_s(ln.ttft_pred_s):>14}"
            f"{_fmt_s(ln.ttft_sim_s):>8} {_fmt_s(ln.tpot_pred_s, 1e3):>17}"
            f"{_fmt_s(ln.tpot_sim_s, 1e3):>8} {attained:>13} {ln.gpu_hours:>7.1f}"
        )
    print(
        "\nSLO attained = share of requests meeting both SLOs. The model sizes for the busiest "
        "minute;\nthe replay spans the whole hour, so its P99s sit below the prediction."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
