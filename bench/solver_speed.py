"""Solver speed: the median time of one full solve (both pools), beside a naive scan.

The reference, measured in the same run on the same model, is the obvious
implementation: try 1, 2, 3, ... workers per pool and compute the predicted P99 at
each count until it meets the target. The bisection solver must give the same answer
(checked) in a fraction of the time; its absolute median should be well under 1 ms.

Every timed call asks at its own arrival rate (the nominal one times 1 + i * 1e-9),
as successive controller ticks do: the model keeps what it computed for a rate
(the exact one-worker wait, the burst factor, the atoms of the last few pool
states), and a call repeated at one rate would time those lookups, not a solve.

    .venv/bin/python bench/solver_speed.py
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from queueing.catalog import resolve_profile
from queueing.lengths import LengthSamples
from queueing.solver import CapacityModel, SloTargets, SolveResult, solve
from sim.trace_io import load_trace

ROOT = Path(__file__).resolve().parent.parent
SLO = SloTargets(ttft_p99_s=1.0, tpot_p99_s=0.05)
HEADROOM = 0.1


def naive_scan(model: CapacityModel, rate: float, ca2: float) -> tuple[int, int]:
    ttft_target = SLO.ttft_p99_s / (1 + HEADROOM)
    tpot_target = SLO.tpot_p99_s / (1 + HEADROOM)
    n = 1
    while True:
        if model.prefill.utilisation(workers=n, arrival_rate_rps=rate) < 1 and (
            model.prefill.ttft_quantile_s(workers=n, arrival_rate_rps=rate, ca2=ca2, quantile=0.99)
            <= ttft_target
        ):
            break
        n += 1
    m = 1
    while True:
        d = model.decode
        if d.is_stable(workers=m, arrival_rate_rps=rate):
            state = d.load(workers=m, arrival_rate_rps=rate, ca2=ca2, quantile=0.99)
            if (
                state.kv_blocks_p99 <= d.kv_capacity_blocks
                and state.batch_p99 <= d.max_batch
                and d.tpot_quantile_s(workers=m, arrival_rate_rps=rate, ca2=ca2, quantile=0.99)
                <= tpot_target
            ):
                break
        m += 1
    return n, m


def median_s(fn: Callable[[float], object], rate: float, repeats: int) -> float:
    """The median seconds of ``fn(r)``, each call at its own rate r near ``rate``."""
    times = []
    for i in range(repeats):
        r = rate * (1.0 + (i + 1) * 1e-9)
        t = time.perf_counter()
        fn(r)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    trace = load_trace(ROOT / "data/traces/AzureLLMInferenceTrace_conv.csv")
    lengths = LengthSamples(
        prompt_tokens=trace.prompt_tokens, output_tokens=trace.output_tokens, source=trace.source
    )
    model = CapacityModel.build(
        lengths, resolve_profile("llama-3-8b@h100-sxm"), tpot_slo_s=SLO.tpot_p99_s
    )
    ca2 = 1.2
    print("Azure conversation lengths, llama-3-8b@h100-sxm, SLO P99 TTFT 1 s / TPOT 50 ms")
    print(
        f"{'rate rps':>9} {'prefill':>8} {'decode':>7} {'solve median':>13} "
        f"{'naive median':>13} {'speed-up':>9}"
    )
    worst = 0.0
    for rate in (5.0, 50.0, 500.0, 5000.0, 28000.0):
        result: SolveResult = solve(
            model, arrival_rate_rps=rate, ca2=ca2, slo=SLO, headroom=HEADROOM
        )
        expected = naive_scan(model, rate, ca2)
        got = (result.prefill_workers, result.decode_workers)
        if got != expected:
            raise SystemExit(f"solver answer {got} != naive scan {expected} at {rate} rps")
        fast = median_s(
            lambda r: solve(model, arrival_rate_rps=r, ca2=ca2, slo=SLO, headroom=HEADROOM),
            rate,
            200,
        )
        slow = median_s(lambda r: naive_scan(model, r, ca2), rate, 3 if rate > 100 else 20)
        worst = max(worst, fast)
        print(
            f"{rate:>9.0f} {got[0]:>8} {got[1]:>7} {fast * 1e3:>10.3f} ms "
            f"{slow * 1e3:>10.1f} ms {slow / fast:>8.0f}x"
        )
    print(f"slowest median solve: {worst * 1e3:.3f} ms (target: well under 1 ms)")


if __name__ == "__main__":
    main()
