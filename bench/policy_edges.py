"""Edge and unseen shapes: does the controller run through them, and where does it stand?

Drawn after the bench's seven and the held-out twelve (``bench/policy_heldout.py``),
with seeds, profiles and SLOs that neither uses, to look for what breaks rather than
to tune: shapes a deployment meets and a back-test rarely holds. Each row is one
policy on one workload (attainment, GPU-hours, scale events per hour per pool, lost
requests); a workload that raises is reported with its error and the run goes on.

Unseen traffic:

- the Azure conversation trace as recorded (1x) on llama-3.1-70b TP4 on H100
  (SLOs 3 s / 0.12 s); the Azure code trace at 3x on the same model on A100-80GB
  (2.5 s / 0.1 s), whose pools grow to tens of workers and then see silent windows;
- levels switching at random among 4, 10 and 16 req/s, each held an exponential
  120 s (a Markov-modulated Poisson process), llama-3-8b on H100 (1 s / 50 ms);
- Gamma arrivals of SCV 16 at a constant 2 req/s with the long-context prompts of
  the bench's ``long`` (70B on H100, 20 s / 0.1 s);
- a one-hour day (2-12 req/s, SCV 1.5) on mistral-7b on H100 (1.2 s / 60 ms);
- three 40-s spikes at 4x a base of 5 req/s, ten minutes apart (llama-3-8b on
  A100-80GB, 1.5 s / 80 ms): shorter than a start-up;
- a slow decline 20 -> 5 req/s over 40 minutes (SCV 2, llama-3-8b on H100);
- a ramp of arXiv summarisation requests 1.5 -> 4.5 req/s (70B on H100, 5 s / 0.1 s);
- the conversation trace at 1.5x played backwards on mistral-7b on A100-80GB.

Edges (llama-3-8b on H100 at 1 s / 50 ms unless said):

- a trickle of 0.02 req/s for 30 minutes (70B; most windows empty);
- ten silent minutes, then 8 req/s; 40 req/s with a silent stretch of 700 s;
- 150 req/s for ten minutes;
- 500 requests at the same instant, then 1 req/s;
- a phase of 400 s in which every request asks for a single token (scoring,
  ``max_tokens=1`` probes) between two of ordinary requests;
- prompts of one token; outputs of 2,000-7,000 tokens;
- a ramp 1 -> 10 req/s on L40S; on/off (200 s at 20 req/s, 400 s silent, SCV 4) on
  MI300X; a three-hour cycle 5-55 req/s on B200;
- the code trace's burstiness (SCV 30) at 12 req/s with ten silent minutes (70B on
  A100-80GB).

    .venv/bin/python bench/policy_edges.py [--policies sara,static-peak,threshold] [--jobs 2]
        [names...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from policy_heldout import FAST, RELAXED, SHAREGPT, mirrored
from policy_quality import ARXIV, SLO, TRACES, _long_context_lengths, _scenario, _time_changed

from queueing.lengths import LengthSamples
from queueing.solver import SloTargets
from sim.backtest import run_backtest
from sim.policies import Scenario, make_policy
from sim.trace import Trace
from sim.trace_io import load_lengths, load_trace
from sim.workload import synthesize

Rate = Callable[[np.ndarray], np.ndarray]


def shaped(
    rate: Rate, *, duration_s: float, ca2: float, seed: int, lengths: LengthSamples | None = None
) -> Trace:
    """Arrivals at ``rate(t)`` (Gamma gaps of SCV ``ca2`` in operational time) with
    ShareGPT's lengths unless given."""
    rng = np.random.default_rng(seed)
    arrivals = _time_changed(rate, duration_s=duration_s, ca2=ca2, rng=rng)
    mix = lengths if lengths is not None else load_lengths(SHAREGPT)
    return synthesize(arrival_s=arrivals, lengths=mix, rng=rng, source=f"shaped, seed {seed}")


def switching_levels(seed: int, *, duration_s: float = 2400.0) -> Rate:
    """A level drawn from 4, 10 and 16 req/s, each held an exponential 120 s."""
    rng = np.random.default_rng(seed)
    starts, levels, t = [], [], 0.0
    while t < duration_s:
        starts.append(t)
        levels.append(float(rng.choice([4.0, 10.0, 16.0])))
        t += float(rng.exponential(120.0))
    edges, values = np.array(starts), np.array(levels)
    return lambda x: values[np.searchsorted(edges, x, side="right") - 1]


def spikes(x: np.ndarray) -> np.ndarray:
    rate = np.full_like(x, 5.0)
    for start in (500.0, 1100.0, 1700.0):
        rate = np.where((x >= start) & (x < start + 40.0), 20.0, rate)
    return rate


def all_at_once(seed: int) -> Trace:
    rng = np.random.default_rng(seed)
    arrivals = np.concatenate([np.full(500, 100.0), 200.0 + rng.exponential(1.0, 600).cumsum()])
    return synthesize(
        arrival_s=arrivals, lengths=load_lengths(SHAREGPT), rng=rng, source="500 at once"
    )


def single_token_phase(seed: int) -> Trace:
    """5 req/s of ShareGPT prompts for 1,200 s; from 400 to 800 s each asks for one token."""
    rng = np.random.default_rng(seed)
    arrivals = rng.exponential(0.2, 6000).cumsum()
    trace = synthesize(
        arrival_s=arrivals, lengths=load_lengths(SHAREGPT), rng=rng, source="single tokens"
    )
    outputs = trace.output_tokens.copy()
    outputs[(arrivals > 400.0) & (arrivals < 800.0)] = 1
    return Trace(
        arrival_s=trace.arrival_s,
        prompt_tokens=trace.prompt_tokens,
        output_tokens=outputs,
        source=trace.source,
    )


def fixed_lengths(
    seed: int, *, rate_rps: float, count: int, prompt: tuple[int, int], output: tuple[int, int]
) -> Trace:
    rng = np.random.default_rng(seed)
    return Trace(
        arrival_s=rng.exponential(1.0 / rate_rps, count).cumsum(),
        prompt_tokens=rng.integers(prompt[0], prompt[1] + 1, count),
        output_tokens=rng.integers(output[0], output[1] + 1, count),
        source=f"uniform lengths, seed {seed}",
    )


def _h100_8b(slo: SloTargets = FAST) -> Scenario:
    return _scenario("llama-3-8b@h100-sxm", slo)


WORKLOADS: dict[str, Callable[[], tuple[Trace, Scenario]]] = {
    "conv 1x, 70B H100": lambda: (
        load_trace(TRACES / "AzureLLMInferenceTrace_conv.csv", speedup=1.0),
        _scenario("llama-3.1-70b-tp4@h100-sxm", SloTargets(ttft_p99_s=3.0, tpot_p99_s=0.12)),
    ),
    "code 3x, 70B A100": lambda: (
        load_trace(TRACES / "AzureLLMInferenceTrace_code.csv", speedup=3.0),
        _scenario("llama-3.1-70b-tp4@a100-80g", SloTargets(ttft_p99_s=2.5, tpot_p99_s=0.1)),
    ),
    "levels 4/10/16": lambda: (
        shaped(switching_levels(7), duration_s=2400.0, ca2=1.0, seed=8),
        _h100_8b(),
    ),
    "SCV 16, long": lambda: (
        shaped(
            lambda x: np.full_like(x, 2.0),
            duration_s=1800.0,
            ca2=16.0,
            seed=9,
            lengths=_long_context_lengths(np.random.default_rng(10), 20_000),
        ),
        _scenario("llama-3.1-70b-tp4@h100-sxm", SloTargets(ttft_p99_s=20.0, tpot_p99_s=0.1)),
    ),
    "1-h day, mistral": lambda: (
        shaped(
            lambda x: 7.0 - 5.0 * np.cos(2 * np.pi * x / 3600.0),
            duration_s=3600.0,
            ca2=1.5,
            seed=11,
        ),
        _scenario("mistral-7b@h100-sxm", SloTargets(ttft_p99_s=1.2, tpot_p99_s=0.06)),
    ),
    "spikes 4x 40 s": lambda: (
        shaped(spikes, duration_s=2100.0, ca2=1.0, seed=12),
        _scenario("llama-3-8b@a100-80g", RELAXED),
    ),
    "decline 20-5": lambda: (
        shaped(
            lambda x: 20.0 - 15.0 * np.clip(x / 2400.0, 0.0, 1.0),
            duration_s=2400.0,
            ca2=2.0,
            seed=13,
        ),
        _h100_8b(),
    ),
    "arXiv ramp, 70B": lambda: (
        shaped(
            lambda x: 1.5 + 3.0 * np.clip((x - 300.0) / 1200.0, 0.0, 1.0),
            duration_s=1800.0,
            ca2=2.0,
            seed=14,
            lengths=load_lengths(ARXIV),
        ),
        _scenario("llama-3.1-70b-tp4@h100-sxm", SloTargets(ttft_p99_s=5.0, tpot_p99_s=0.1)),
    ),
    "conv back 1.5x, 7B": lambda: (
        mirrored("AzureLLMInferenceTrace_conv.csv", speedup=1.5),
        _scenario("mistral-7b@a100-80g", RELAXED),
    ),
    "trickle 0.02": lambda: (
        shaped(lambda x: np.full_like(x, 0.02), duration_s=1800.0, ca2=1.0, seed=1),
        _scenario("llama-3.1-70b-tp4@h100-sxm", SLO),
    ),
    "silence, then 8": lambda: (
        shaped(lambda x: np.where(x < 600.0, 1e-4, 8.0), duration_s=1500.0, ca2=1.0, seed=2),
        _h100_8b(),
    ),
    "40, silence, 40": lambda: (
        shaped(
            lambda x: np.where((x > 600.0) & (x < 1300.0), 1e-4, 40.0),
            duration_s=1800.0,
            ca2=1.0,
            seed=6,
        ),
        _h100_8b(),
    ),
    "150 req/s": lambda: (
        shaped(lambda x: np.full_like(x, 150.0), duration_s=600.0, ca2=1.0, seed=7),
        _h100_8b(),
    ),
    "500 at once": lambda: (all_at_once(3), _h100_8b()),
    "single tokens": lambda: (single_token_phase(4), _h100_8b()),
    "1-token prompts": lambda: (
        fixed_lengths(9, rate_rps=10.0, count=8000, prompt=(1, 1), output=(1, 49)),
        _h100_8b(),
    ),
    "long outputs": lambda: (
        fixed_lengths(10, rate_rps=1.0, count=1500, prompt=(10, 200), output=(2000, 7000)),
        _h100_8b(),
    ),
    "ramp, L40S": lambda: (
        shaped(
            lambda x: 1.0 + 9.0 * np.clip(x / 1200.0, 0.0, 1.0), duration_s=1800.0, ca2=2.0, seed=21
        ),
        _scenario("llama-3-8b@l40s", SLO),
    ),
    "on/off, MI300X": lambda: (
        shaped(
            lambda x: np.where((x // 200.0) % 3 == 0, 1e-4, 20.0),
            duration_s=1800.0,
            ca2=4.0,
            seed=22,
        ),
        _scenario("mistral-7b@mi300x", FAST),
    ),
    "3-h cycle, B200": lambda: (
        shaped(
            lambda x: 30.0 - 25.0 * np.cos(2 * np.pi * x / 3600.0),
            duration_s=10800.0,
            ca2=1.5,
            seed=23,
        ),
        _scenario("llama-3-8b@b200", FAST),
    ),
    "SCV 30, silence": lambda: (
        shaped(
            lambda x: np.where((x > 300.0) & (x < 900.0), 1e-4, 12.0),
            duration_s=1500.0,
            ca2=30.0,
            seed=8,
        ),
        _scenario("llama-3.1-70b-tp4@a100-80g", SLO),
    ),
}


def run(task: tuple[str, tuple[str, ...]]) -> list[str]:
    name, policies = task
    try:
        trace, scenario = WORKLOADS[name]()
    except Exception as exc:  # a workload that cannot be built is a finding too
        return [f"{name:20} {'(trace)':14} raised {type(exc).__name__}: {exc}"]
    rows = []
    for policy in policies:
        try:
            result = run_backtest(trace, make_policy(policy, trace, scenario), scenario)
        except Exception as exc:  # report and go on: the bench looks for these
            rows.append(f"{name:20} {policy:14} raised {type(exc).__name__}: {exc}")
            continue
        out = result.as_dict(series=False)
        hours = out["duration_s"] / 3600.0
        events = out["scale_events"]
        rows.append(
            f"{name:20} {policy:14} {100 * out['slo_attainment']:9.2f} % "
            f"{out['gpu_hours']:8.2f} {events['prefill'] / hours:6.1f} "
            f"{events['decode'] / hours:6.1f} {out['lost_requests']:5d}"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="workloads (default: all)")
    parser.add_argument("--policies", default="sara,static-peak,threshold")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args()
    unknown = [n for n in args.names if n not in WORKLOADS]
    if unknown:
        parser.error(f"names: unknown workload(s) {unknown}; known: {list(WORKLOADS)}")
    policies = tuple(p for p in args.policies.split(",") if p)
    started = time.perf_counter()
    print(
        f"{'workload':20} {'policy':14} {'attainment':>11} {'GPU-h':>8} {'ev/h P':>6} "
        f"{'ev/h D':>6} {'lost':>5}"
    )
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for rows in pool.map(run, [(n, policies) for n in args.names or WORKLOADS]):
            print("\n".join(rows), flush=True)
    print(f"wall time: {time.perf_counter() - started:.1f} s with {args.jobs} processes")


if __name__ == "__main__":
    main()
