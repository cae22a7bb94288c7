"""decide() speed: the median latency of one controller tick, both solves included.

The reference, measured in the same run, is one bare ``queueing.solver.solve`` call
on the same model and load: decide() adds the smoothing, calibration, safety check,
stabilisation and the predictions it publishes. Target: median under 2 ms.

    .venv/bin/python bench/decide_speed.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.config import ControllerConfig, SloConfig
from controller.observation import Observation, PoolObservation
from controller.policy import CapacityModels, ControllerState, decide
from queueing.catalog import resolve_profile
from queueing.lengths import LengthSamples
from queueing.pools import Pool
from queueing.solver import SloTargets, solve
from sim.trace_io import load_lengths

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    full = load_lengths(ROOT / "data/traces/AzureLLMInferenceTrace_conv.csv")
    rng = np.random.default_rng(0)
    rows = rng.choice(len(full), size=1000, replace=False)
    lengths = LengthSamples(
        prompt_tokens=full.prompt_tokens[rows],
        output_tokens=full.output_tokens[rows],
        source="conv sample",
    )
    config = ControllerConfig(
        profile="llama-2-70b-tp4@h100-sxm", slo=SloConfig(ttft_p99_s=1.0, tpot_p99_s=0.1)
    )
    profile = resolve_profile(config.profile)
    print(f"{'rate rps':>9} {'targets':>9} {'decide median':>14} {'bare solve':>11} {'ratio':>6}")
    worst = 0.0
    for rate in (5.0, 50.0, 500.0):
        state = ControllerState()
        models = CapacityModels()
        current = (1, 1)
        times = []
        t = 0.0
        for i in range(300):
            obs = Observation(
                time_s=t,
                prefill=PoolObservation(current_replicas=current[0], ready_replicas=current[0]),
                decode=PoolObservation(current_replicas=current[1], ready_replicas=current[1]),
                arrival_rate_rps=rate * (1 + 0.1 * np.sin(i / 7)),
                burst_arrival_rate_rps=rate,
                interarrival_scv=1.2,
                lengths=lengths,
            )
            started = time.perf_counter()
            d = decide(obs, state, config, now_s=t, models=models)
            elapsed = time.perf_counter() - started
            if i >= 20:  # after the first model build and the ramp-up
                times.append(elapsed)
            state = d.state
            if d.actuate:
                current = (d.target(Pool.PREFILL), d.target(Pool.DECODE))
            t += config.interval_s
        model = models.get(lengths, profile, config)
        slo = SloTargets(ttft_p99_s=1.0, tpot_p99_s=0.1)
        bare = []
        for _ in range(200):
            started = time.perf_counter()
            solve(model, arrival_rate_rps=rate, ca2=1.2, slo=slo, headroom=config.headroom)
            bare.append(time.perf_counter() - started)
        med, ref = statistics.median(times), statistics.median(bare)
        worst = max(worst, med)
        print(
            f"{rate:>9.0f} {current[0]:>4}+{current[1]:<4} {med * 1e3:>11.3f} ms "
            f"{ref * 1e3:>8.3f} ms {med / ref:>5.1f}x"
        )
    print(f"slowest median decide(): {worst * 1e3:.3f} ms (target < 2 ms)")


if __name__ == "__main__":
    main()
