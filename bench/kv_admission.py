"""The decode pool's KV limit: what the solver's P99-of-reserved-blocks rule forbids
against what the simulator's admission waits cost.

The solver refuses a decode pool whose P99 of reserved KV blocks per worker exceeds
the worker's capacity (``BindingConstraint.KV_CAPACITY``). In the simulator such a
pool does not fail: a request that finds no room waits at the head of the decode
queue until members finish, and the wait is spread over its output tokens in its
TPOT. For workload mixes of ``bench/policy_quality.py`` at a few rates, each on one
and two decode workers behind a prefill pool the solver sizes, this prints the
model's mean and P99 of reserved blocks beside the simulator's (sampled over the
steady part of the runs), the share of requests that waited for room longer than two
iterations and their mean wait, and the predicted P99 TPOT against the range of the
simulated one over ``SEEDS`` runs of ``REQUESTS`` requests (blocking comes in rare
episodes, so one run's P99 can be far from another's).

    .venv/bin/python bench/kv_admission.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from policy_quality import workload

from queueing.pools import Pool
from queueing.solver import evaluate_pool, solve
from sim.cluster import Cluster, ClusterConfig
from sim.policies.base import window_lengths
from sim.workload import gamma_arrivals, synthesize

# (workload, arrival rate req/s, arrival SCV)
CASES = (("weekly", 9.0, 2.0), ("long", 3.0, 1.0), ("long", 4.0, 1.0), ("long", 3.0, 9.0))
REQUESTS = 15_000
SEEDS = 4


def main() -> None:
    print(
        f"{'workload':8s} {'rps':>4s} {'ca2':>4s} {'N+M':>5s} {'bound':>12s} "
        f"{'KV mean model/sim':>18s} {'KV p99 model/sim':>17s} {'capacity':>8s} "
        f"{'waited':>7s} {'wait s':>6s} {'TPOT p99 ms pred/sim':>21s} {'SLO':>5s}"
    )
    for name, rate, ca2 in CASES:
        w = workload(name)
        lengths = window_lengths(w.trace, 0, len(w.trace.arrival_s))
        model = w.scenario.capacity_model(lengths)
        decode = model.decode
        slo = w.scenario.slo
        answer = solve(model, arrival_rate_rps=rate, ca2=ca2, slo=slo, headroom=0.15)
        n = answer.prefill_workers
        decode_ca2 = model.arrival_scv(
            Pool.DECODE, prefill_workers=n, arrival_rate_rps=rate, ca2=ca2
        )
        for m in (1, 2):
            state = decode.load(workers=m, arrival_rate_rps=rate, ca2=decode_ca2, quantile=0.99)
            predicted = evaluate_pool(
                model,
                Pool.DECODE,
                workers=m,
                arrival_rate_rps=rate,
                ca2=decode_ca2,
                target_s=slo.tpot_p99_s,
            )
            config = ClusterConfig(
                prefill_workers=n,
                decode_workers=m,
                profile=w.scenario.profile,
                token_budget=model.token_budget,
                kv_link_bytes_per_s=w.scenario.link.bytes_per_s,
            )
            reserved_mean, reserved_p99, waited_share, waits, tpot_p99 = [], [], [], [], []
            for seed in range(SEEDS):
                rng = np.random.default_rng(seed)
                duration_s = REQUESTS / rate
                arrivals = gamma_arrivals(rate_rps=rate, ca2=ca2, duration_s=duration_s, rng=rng)
                trace = synthesize(arrival_s=arrivals, lengths=lengths, rng=rng, source=name)
                results = Cluster(config, trace).run()
                lo_s, hi_s = 0.1 * duration_s, 0.95 * duration_s
                steady = (trace.arrival_s > lo_s) & (trace.arrival_s < hi_s)
                decoding = np.isfinite(results.finish_s) & (results.output_tokens >= 2)
                tokens = results.prompt_tokens + results.output_tokens
                blocks = np.ceil(tokens / config.block_size_tokens)[decoding]
                start = results.decode_start_s[decoding]
                finish = results.finish_s[decoding]
                # Reserved blocks over the pool at each admission and finish, read on a grid.
                times = np.concatenate([start, finish])
                order = np.argsort(times, kind="stable")
                level = np.cumsum(np.concatenate([blocks, -blocks])[order])
                grid = np.linspace(lo_s, hi_s, 20_000)
                reserved = level[np.searchsorted(times[order], grid, side="right") - 1]
                reserved_mean.append(float(reserved.mean()) / m)
                # One worker's P99 only where the pool is one worker.
                reserved_p99.append(float(np.quantile(reserved, 0.99)))
                wait = (results.decode_start_s - results.kv_ready_s)[steady & decoding]
                waited = wait > 2.0 * state.iteration_s
                waited_share.append(float(waited.mean()))
                waits.extend(wait[waited].tolist())
                tpot_p99.append(float(np.nanquantile(results.tpot_s[steady], 0.99)))
            sim_p99 = f"{np.mean(reserved_p99):.0f}" if m == 1 else "-"
            pred = "unstable" if predicted.p99_s is None else f"{predicted.p99_s * 1e3:.1f}"
            simulated = f"{min(tpot_p99) * 1e3:.1f}-{max(tpot_p99) * 1e3:.1f}"
            print(
                f"{name:8s} {rate:4.1f} {ca2:4.1f} {n:>2d}+{m:<2d} "
                f"{answer.decode_bound.value if m == answer.decode_workers else '':>12s} "
                f"{state.mean_batch * decode.reserved_blocks:>8.0f}/{np.mean(reserved_mean):<9.0f} "
                f"{state.kv_blocks_p99:>8.0f}/{sim_p99:<8s} {decode.kv_capacity_blocks:>8d} "
                f"{100 * np.mean(waited_share):6.2f}% {np.mean(waits) if waits else 0.0:6.2f} "
                f"{pred:>8s}/{simulated:<12s} {slo.tpot_p99_s * 1e3:5.0f}"
            )


if __name__ == "__main__":
    main()
