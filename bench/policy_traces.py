"""The two bundled Azure traces at rates, directions and profiles the bench does not use.

``bench/policy_quality.py`` replays the conversation trace at 2.5x on a 70B model on
A100s and the code trace as recorded on H100s. Here both run at 0.7x, 1.5x and 2x their
recorded rate, forwards and played backwards (each request keeps its lengths; the
arrivals are mirrored about the last one, so falls become rises and the clusters come
in another order), on llama-3.1-70b TP4 on H100 and on llama-3-8b on A100-80GB, SLOs
2 s / 0.1 s: 24 runs of real traffic shapes, to see whether a change made on the
bench holds on the same kind of traffic at other scales. Prints attainment,
GPU-hours, scale events per hour of each pool and lost requests per run and policy
(about 35 s for ``sara`` with two processes):

    .venv/bin/python bench/policy_traces.py [--policies sara,static-peak] [--jobs 2]
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from policy_heldout import mirrored
from policy_quality import TRACES, _scenario

from queueing.solver import SloTargets
from sim.backtest import run_backtest
from sim.policies import make_policy
from sim.trace_io import load_trace

TRACE_FILES = {
    "code": "AzureLLMInferenceTrace_code.csv",
    "conv": "AzureLLMInferenceTrace_conv.csv",
}
SPEEDUPS = (0.7, 1.5, 2.0)
PROFILES = ("llama-3.1-70b-tp4@h100-sxm", "llama-3-8b@a100-80g")
SLO = SloTargets(ttft_p99_s=2.0, tpot_p99_s=0.1)

Task = tuple[str, float, bool, str, str]


def run(task: Task) -> str:
    name, speedup, backwards, profile, policy = task
    file = TRACE_FILES[name]
    trace = (
        mirrored(file, speedup=speedup) if backwards else load_trace(TRACES / file, speedup=speedup)
    )
    scenario = _scenario(profile, SLO)
    result = run_backtest(trace, make_policy(policy, trace, scenario), scenario)
    events = result.scale_events_per_hour
    label = f"{name} {speedup:g}x {'backwards' if backwards else 'forwards'}"
    return (
        f"{label:20} {profile:27} {policy:12} {100 * result.summary.slo_attainment:9.2f} % "
        f"{result.summary.gpu_hours:7.2f} {events['prefill']:6.1f} {events['decode']:6.1f} "
        f"{result.summary.lost_requests:4d}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="sara")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    tasks: list[Task] = [
        (name, speedup, backwards, profile, policy)
        for name in TRACE_FILES
        for speedup in SPEEDUPS
        for backwards in (False, True)
        for profile in PROFILES
        for policy in policies
    ]
    print(
        f"{'trace':20} {'profile':27} {'policy':12} {'attainment':>10} {'GPU-h':>7} "
        f"{'ev/h P':>6} {'ev/h D':>6} lost"
    )
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        for line in pool.map(run, tasks):
            print(line, flush=True)


if __name__ == "__main__":
    main()
