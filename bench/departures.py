"""The prefill pool's departures against QNA's linking equation.

The decode pool's arrivals are the prefill pool's departures
(``PrefillModel.departure_scv``). For a few pool sizes, loads and arrival SCVs this
prints the SCV of the gaps between first tokens in the simulated chunked-prefill pool
(three runs, mean and spread) beside the equation's c_d².

    .venv/bin/python bench/departures.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from queueing.catalog import resolve_profile
from queueing.lengths import LengthSamples
from queueing.solver import CapacityModel
from sim.fidelity import simulated_departure_scv

# (prefill workers, utilisation, arrival SCV)
CASES = ((1, 0.7, 1.0), (1, 0.7, 4.0), (4, 0.5, 4.0), (4, 0.75, 4.0), (2, 0.8, 8.0), (8, 0.8, 4.0))
REQUESTS = 20_000
RUNS = 3


def main() -> None:
    profile = resolve_profile("llama-3.1-8b@h100-sxm")
    rng = np.random.default_rng(7)
    samples = LengthSamples(
        prompt_tokens=np.clip(rng.lognormal(np.log(1000), 0.7, 5000), 8, 12000).astype(np.int64),
        output_tokens=np.clip(rng.lognormal(np.log(130), 0.9, 5000), 2, 2000).astype(np.int64),
        source="lognormal(median 1000, sigma 0.7)",
    )
    model = CapacityModel.build(samples, profile, tpot_slo_s=0.05)
    print(
        f"{samples.source} prompts on {profile.name}, solo service SCV "
        f"{model.prefill.service_scv:.2f}; {RUNS} runs of {REQUESTS} requests"
    )
    print("   N     u   ca2   simulated SCV        c_d^2")
    for workers, utilisation, ca2 in CASES:
        rate = utilisation * workers / model.prefill.mean_service_s
        runs = [
            simulated_departure_scv(
                samples,
                profile,
                token_budget=model.token_budget,
                workers=workers,
                rate=rate,
                ca2=ca2,
                requests=REQUESTS,
                rng=np.random.default_rng([1, run]),
            )
            for run in range(RUNS)
        ]
        predicted = model.prefill.departure_scv(workers=workers, arrival_rate_rps=rate, ca2=ca2)
        print(
            f"{workers:4d}  {utilisation:.2f}  {ca2:4g}   "
            f"{np.mean(runs):6.3f} +- {np.std(runs):.3f}   {predicted:6.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
