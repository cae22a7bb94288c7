"""Held-out workloads: `sara` against `static-peak` on shapes the bench's seven do not hold.

The defaults were chosen on ``bench/policy_quality.py``'s workloads; these twelve were
drawn afterwards, with seeds, rates, ratios, profiles and SLOs that none of those
uses, to see whether a change that helps there helps elsewhere:

- three steps: 2x at 15 req/s (Poisson, llama-3-8b on H100, SLOs 1 s / 50 ms), 4x
  at 6 req/s with Gamma SCV 3 (llama-3-8b on A100-80GB, 1.5 s / 80 ms), and 2.5x at
  4 req/s on llama-3.1-70b TP4 on H100 (2 s / 0.1 s; a 101-s start-up), each after
  10 minutes and held for 15;
- two ramps over 10 minutes after 5 calm ones (Gamma SCV 2): 3 -> 12 req/s on the
  70B profile and 5 -> 40 req/s on the 8B one;
- three shapes where the load falls as well as rises, drawn later to judge changes to
  scale-down: a fall 12 -> 3 req/s over 10 minutes after 5 at 12 (70B, Gamma SCV 2);
  two 15-minute sinusoidal cycles between 4 and 20 req/s (llama-3-8b on A100-80GB,
  Gamma SCV 3); a square wave alternating 2 minutes at 6 req/s and 2 at 18 for 30
  minutes (Poisson, llama-3-8b on H100), whose load leaves and comes back within a
  few start-ups;
- two switches of the length mix at a constant 3 req/s (Gamma SCV 2, llama-3.1-70b
  TP4 on H100, SLOs 10 s / 0.1 s), drawn to judge the pooled mix's prompt test:
  ShareGPT's lengths (mean prompt 2,340 tokens) for 15 minutes, then the
  long-context ones of the bench's `long` (k arXiv documents, mean 6,420), and the
  same the other way round;
- two real traces played backwards in time (each request keeps its lengths; the
  arrivals are mirrored about the last one), so their falls become rises and their
  clusters come in another order: the Azure conversation trace at 2.5x the rate
  (`conv`'s profile and SLOs, llama-3.1-70b TP4 on A100-80GB, 2 s / 0.1 s), whose
  mirrored ramp comes in two steps of about 30 %, and the Azure code trace at 1.5x
  (llama-3.1-70b TP4 on H100, 2 s / 0.1 s).

ShareGPT lengths for the synthetic shapes. Prints attainment, GPU-hours, scale events and lost
requests per workload and policy (about 42 s on one core; 125 s with threshold and the oracle):

    .venv/bin/python bench/policy_heldout.py [--policies sara,static-peak]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from policy_quality import TRACES, _long_context_lengths, _scenario, _time_changed

from queueing.lengths import LengthSamples
from queueing.solver import SloTargets
from sim.backtest import run_backtest
from sim.policies import Scenario, make_policy
from sim.trace import Trace
from sim.trace_io import load_lengths, load_trace
from sim.workload import gamma_arrivals, synthesize

SHAREGPT = TRACES / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
FAST = SloTargets(ttft_p99_s=1.0, tpot_p99_s=0.05)
RELAXED = SloTargets(ttft_p99_s=1.5, tpot_p99_s=0.08)
LARGE = SloTargets(ttft_p99_s=2.0, tpot_p99_s=0.1)
# Prompts to ~128k tokens take seconds to prefill on their own.
LONG_CONTEXT = SloTargets(ttft_p99_s=10.0, tpot_p99_s=0.1)


def step(*, ratio: float, base_rps: float, ca2: float, seed: int) -> Trace:
    """``base_rps`` for 10 minutes, then ``ratio`` times it for 15."""
    rng = np.random.default_rng(seed)
    arrivals = np.concatenate(
        [
            gamma_arrivals(rate_rps=base_rps, ca2=ca2, duration_s=600.0, rng=rng),
            600.0 + gamma_arrivals(rate_rps=base_rps * ratio, ca2=ca2, duration_s=900.0, rng=rng),
        ]
    )
    source = f"ShareGPT lengths, {base_rps:g} req/s then {ratio:g}x at 600 s, SCV {ca2:g}"
    return synthesize(arrival_s=arrivals, lengths=load_lengths(SHAREGPT), rng=rng, source=source)


def ramp(*, low_rps: float, high_rps: float, seed: int) -> Trace:
    """``low_rps`` for 5 minutes, a straight ramp to ``high_rps`` over 10, then 10 more."""
    rng = np.random.default_rng(seed)

    def rate(t: np.ndarray) -> np.ndarray:
        return low_rps + (high_rps - low_rps) * np.clip((t - 300.0) / 600.0, 0.0, 1.0)

    arrivals = _time_changed(rate, duration_s=1500.0, ca2=2.0, rng=rng)
    source = f"ShareGPT lengths, a ramp {low_rps:g} -> {high_rps:g} req/s, SCV 2"
    return synthesize(arrival_s=arrivals, lengths=load_lengths(SHAREGPT), rng=rng, source=source)


def cycle(*, low_rps: float, high_rps: float, period_s: float, ca2: float, seed: int) -> Trace:
    """Two periods of a sinusoid between ``low_rps`` and ``high_rps``, from the trough."""
    rng = np.random.default_rng(seed)
    mid, half = (high_rps + low_rps) / 2.0, (high_rps - low_rps) / 2.0

    def rate(t: np.ndarray) -> np.ndarray:
        return mid - half * np.cos(2.0 * np.pi * t / period_s)

    arrivals = _time_changed(rate, duration_s=2.0 * period_s, ca2=ca2, rng=rng)
    source = f"ShareGPT lengths, a {period_s:g}-s cycle {low_rps:g}-{high_rps:g} req/s, SCV {ca2:g}"
    return synthesize(arrival_s=arrivals, lengths=load_lengths(SHAREGPT), rng=rng, source=source)


def square(*, low_rps: float, high_rps: float, half_period_s: float, seed: int) -> Trace:
    """Poisson arrivals alternating ``half_period_s`` at ``low_rps`` and at ``high_rps``
    for 30 minutes, from the low level."""
    rng = np.random.default_rng(seed)

    def rate(t: np.ndarray) -> np.ndarray:
        high = np.floor(t / half_period_s) % 2 == 1
        return np.where(high, high_rps, low_rps)

    arrivals = _time_changed(rate, duration_s=1800.0, ca2=1.0, rng=rng)
    source = f"ShareGPT lengths, {low_rps:g} / {high_rps:g} req/s every {half_period_s:g} s"
    return synthesize(arrival_s=arrivals, lengths=load_lengths(SHAREGPT), rng=rng, source=source)


def switched(
    first: LengthSamples, second: LengthSamples, *, rate_rps: float, ca2: float, seed: int
) -> Trace:
    """Gamma arrivals at ``rate_rps`` for 30 minutes, each request's lengths drawn from
    ``first`` for the first 15 and from ``second`` after: the rate never moves, the
    work each request brings does."""
    rng = np.random.default_rng(seed)
    arrivals = gamma_arrivals(rate_rps=rate_rps, ca2=ca2, duration_s=1800.0, rng=rng)
    after = arrivals >= 900.0
    prompt = np.empty(len(arrivals), dtype=np.int64)
    output = np.empty(len(arrivals), dtype=np.int64)
    for mix, chosen in ((first, ~after), (second, after)):
        rows = rng.integers(0, len(mix.prompt_tokens), size=int(chosen.sum()))
        prompt[chosen] = mix.prompt_tokens[rows]
        output[chosen] = mix.output_tokens[rows]
    return Trace(
        arrival_s=arrivals,
        prompt_tokens=prompt,
        output_tokens=output,
        source=f"{first.source} then {second.source} at 900 s, {rate_rps:g} req/s, SCV {ca2:g}",
    )


def mirrored(name: str, *, speedup: float) -> Trace:
    """A bundled trace at ``speedup`` times its rate, played backwards: request i
    arrives at (last arrival - its arrival), with its own lengths."""
    trace = load_trace(TRACES / name, speedup=speedup)
    end = float(trace.arrival_s.max())
    order = np.argsort(end - trace.arrival_s, kind="stable")
    return Trace(
        arrival_s=(end - trace.arrival_s)[order],
        prompt_tokens=trace.prompt_tokens[order],
        output_tokens=trace.output_tokens[order],
        source=f"{trace.source}, played backwards",
    )


def workloads() -> dict[str, tuple[Trace, Scenario]]:
    return {
        "step 2x, 8B": (
            step(ratio=2.0, base_rps=15.0, ca2=1.0, seed=101),
            _scenario("llama-3-8b@h100-sxm", FAST),
        ),
        "step 4x, SCV 3": (
            step(ratio=4.0, base_rps=6.0, ca2=3.0, seed=102),
            _scenario("llama-3-8b@a100-80g", RELAXED),
        ),
        "step 2.5x, 70B": (
            step(ratio=2.5, base_rps=4.0, ca2=1.0, seed=103),
            _scenario("llama-3.1-70b-tp4@h100-sxm", LARGE),
        ),
        "ramp 3-12, 70B": (
            ramp(low_rps=3.0, high_rps=12.0, seed=104),
            _scenario("llama-3.1-70b-tp4@h100-sxm", LARGE),
        ),
        "ramp 5-40, 8B": (
            ramp(low_rps=5.0, high_rps=40.0, seed=105),
            _scenario("llama-3-8b@h100-sxm", FAST),
        ),
        "fall 12-3, 70B": (
            ramp(low_rps=12.0, high_rps=3.0, seed=106),
            _scenario("llama-3.1-70b-tp4@h100-sxm", LARGE),
        ),
        "cycle 4-20, 8B": (
            cycle(low_rps=4.0, high_rps=20.0, period_s=900.0, ca2=3.0, seed=107),
            _scenario("llama-3-8b@a100-80g", RELAXED),
        ),
        "square 6/18, 8B": (
            square(low_rps=6.0, high_rps=18.0, half_period_s=120.0, seed=108),
            _scenario("llama-3-8b@h100-sxm", FAST),
        ),
        "prompts 2.7x": (
            switched(
                load_lengths(SHAREGPT),
                _long_context_lengths(np.random.default_rng(109), 20_000),
                rate_rps=3.0,
                ca2=2.0,
                seed=110,
            ),
            _scenario("llama-3.1-70b-tp4@h100-sxm", LONG_CONTEXT),
        ),
        "prompts / 2.7": (
            switched(
                _long_context_lengths(np.random.default_rng(111), 20_000),
                load_lengths(SHAREGPT),
                rate_rps=3.0,
                ca2=2.0,
                seed=112,
            ),
            _scenario("llama-3.1-70b-tp4@h100-sxm", LONG_CONTEXT),
        ),
        "conv backwards": (
            mirrored("AzureLLMInferenceTrace_conv.csv", speedup=2.5),
            _scenario("llama-3.1-70b-tp4@a100-80g", LARGE),
        ),
        "code backwards": (
            mirrored("AzureLLMInferenceTrace_code.csv", speedup=1.5),
            _scenario("llama-3.1-70b-tp4@h100-sxm", LARGE),
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="sara,static-peak")
    args = parser.parse_args()
    names = [n for n in args.policies.split(",") if n]
    print(f"{'workload':16} {'policy':14} {'attainment':>10} {'GPU-h':>7} {'events P/D':>11} lost")
    for name, (trace, scenario) in workloads().items():
        for policy in names:
            result = run_backtest(trace, make_policy(policy, trace, scenario), scenario)
            out = result.as_dict(series=False)
            events = f"{out['scale_events']['prefill']}/{out['scale_events']['decode']}"
            print(
                f"{name:16} {policy:14} {100 * out['slo_attainment']:9.2f} % "
                f"{out['gpu_hours']:7.2f} {events:>11} {out['lost_requests']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
