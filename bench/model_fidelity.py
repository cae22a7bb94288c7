"""Model fidelity: predicted vs simulated P99 TTFT and P99 TPOT.

For each length mix (Azure conversation, Azure code, arXiv summarisation), profile,
arrival burstiness (ca2 = 1 Poisson, ca2 = 4 Gamma) and prefill utilisation, a
workload is generated with that rate, the capacity model predicts both P99s, and
the discrete-event simulator (running the real scheduler) measures them. The
prefill pool has 4 workers; the decode pool gets the fewest workers whose mean KV
use is at most the same utilisation (and whose P99 batch and KV fit).

``u_sim`` is the simulated prefill busy time over (workers x the arrival span).
The simulated P99 has sampling noise that an order-statistic interval understates
(queueing waits are autocorrelated), so each row is simulated with ``--replications``
independent seeds; the error is against the P99 of their measured requests pooled and
``ci%`` is the half-width of its 95 % sectioning interval, relative to it
(``sim.fidelity.quantile_measured``).

    .venv/bin/python bench/model_fidelity.py            # full table (~5 min, 2 cores)
    .venv/bin/python bench/model_fidelity.py --quick    # fewer requests and rows
    .venv/bin/python bench/model_fidelity.py --random   # drawn cases (bench/fidelity_random.py)
    .venv/bin/python bench/model_fidelity.py --random --quick
    .venv/bin/python bench/model_fidelity.py --random --save run.json   # keep the simulated half
    .venv/bin/python bench/model_fidelity.py --random --rescore run.json  # ... re-predicted now
    .venv/bin/python bench/model_fidelity.py --random --quick --probe-wait 6   # one case's P_w
    .venv/bin/python bench/model_fidelity.py --random --probe-burst 34   # TPOT against the SCV
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# One BLAS thread per process: these benches run a process per core, and a threaded
# LAPACK call (the prefill model's banded solve) then oversubscribes the cores and
# runs a hundred times slower. Set before numpy is first imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from queueing.catalog import resolve_profile
from queueing.solver import CapacityModel, KvLink
from sim.cluster import Cluster, ClusterConfig
from sim.fidelity import quantile_measured, steady_window, transient_s
from sim.trace_io import load_lengths
from sim.workload import gamma_arrivals, synthesize

ROOT = Path(__file__).resolve().parent.parent
MIXES = {
    "conv": ROOT / "data/traces/AzureLLMInferenceTrace_conv.csv",
    "code": ROOT / "data/traces/AzureLLMInferenceTrace_code.csv",
    "arxiv": ROOT / "data/traces/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
}
# (profile, TPOT SLO that sets the token budget)
PROFILES = {"llama-3-8b@h100-sxm": 0.05, "llama-2-70b-tp4@h100-sxm": 0.1}
UTILISATIONS = (0.3, 0.5, 0.7, 0.8, 0.85, 0.9)
PREFILL_WORKERS = 4
LINK = KvLink()


@dataclass(frozen=True, kw_only=True)
class Row:
    mix: str
    profile: str
    ca2: float
    utilisation: float
    decode_workers: int
    sim_utilisation: float
    ttft_pred_s: float
    ttft_sim_s: float
    ttft_ci: float
    tpot_pred_s: float
    tpot_sim_s: float
    tpot_ci: float

    @property
    def ttft_err(self) -> float:
        return self.ttft_pred_s / self.ttft_sim_s - 1.0

    @property
    def tpot_err(self) -> float:
        return self.tpot_pred_s / self.tpot_sim_s - 1.0


def decode_workers_for(model: CapacityModel, rate: float, ca2: float, u: float) -> int:
    m = 1
    while True:
        d = model.decode
        if d.is_stable(workers=m, arrival_rate_rps=rate):
            state = d.load(workers=m, arrival_rate_rps=rate, ca2=ca2, quantile=0.99)
            if (
                state.kv_utilisation <= u
                and state.kv_blocks_p99 <= d.kv_capacity_blocks
                and state.batch_p99 <= d.max_batch
            ):
                return m
        m += 1


def run_row(args: tuple[str, str, float, float, int, int]) -> Row:
    mix, profile_name, ca2, u, requests, replications = args
    profile = resolve_profile(profile_name)
    lengths = load_lengths(MIXES[mix])
    model = CapacityModel.build(lengths, profile, tpot_slo_s=PROFILES[profile_name], link=LINK)
    # The rate the pools serve (the model's); the simulator is offered the demand, of
    # which the requests beyond the profile's context are rejected.
    rate = u * PREFILL_WORKERS / model.prefill.mean_service_s
    demand = rate / (1.0 - model.rejected_share)
    m = decode_workers_for(model, rate, ca2, u)
    config = ClusterConfig(
        prefill_workers=PREFILL_WORKERS,
        decode_workers=m,
        profile=profile,
        token_budget=model.token_budget,
        kv_link_bytes_per_s=LINK.bytes_per_s,
    )
    ttft: list[np.ndarray] = []
    tpot: list[np.ndarray] = []
    busy: list[float] = []
    # Measured: the arrivals between a warm-up as long as the decode pool takes to
    # fill and a cool-down as long as it takes to drain (sim.fidelity.transient_s);
    # requests beyond the profile's context are rejected (no TTFT) and left out, as
    # the model leaves them out.
    transient = transient_s(model, lengths, decode_workers=m, rate=rate, ca2=ca2)
    duration_s = requests / demand / 0.95 + transient.warmup_s + transient.cooldown_s
    start_s, end_s = steady_window(duration_s, transient)
    for replication in range(replications):
        seed = zlib.crc32(repr((mix, profile_name, ca2, u, replication)).encode())
        rng = np.random.default_rng(seed)
        arrivals = gamma_arrivals(rate_rps=demand, ca2=ca2, duration_s=duration_s, rng=rng)
        trace = synthesize(arrival_s=arrivals, lengths=lengths, rng=rng, source=mix)
        results = Cluster(config, trace).run()
        steady = (trace.arrival_s >= start_s) & (trace.arrival_s < end_s)
        ttft.append(results.ttft_s[steady])
        tpot.append(results.tpot_s[steady])
        busy.append(results.prefill_busy_s / (PREFILL_WORKERS * trace.duration_s))
    ttft_sim = quantile_measured(ttft)
    tpot_sim = quantile_measured(tpot)
    kwargs = {"workers": PREFILL_WORKERS, "arrival_rate_rps": rate, "ca2": ca2, "quantile": 0.99}
    return Row(
        mix=mix,
        profile=profile_name,
        ca2=ca2,
        utilisation=u,
        decode_workers=m,
        sim_utilisation=statistics.fmean(busy),
        ttft_pred_s=model.prefill.ttft_quantile_s(**kwargs),
        ttft_sim_s=ttft_sim.estimate_s,
        ttft_ci=ttft_sim.relative_ci,
        tpot_pred_s=model.decode.tpot_quantile_s(
            workers=m, arrival_rate_rps=rate, ca2=ca2, quantile=0.99
        ),
        tpot_sim_s=tpot_sim.estimate_s,
        tpot_ci=tpot_sim.relative_ci,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and rows")
    parser.add_argument("--requests", type=int, default=15_000, help="per replication")
    parser.add_argument("--replications", type=int, default=6)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--random", action="store_true", help="drawn cases instead of the table")
    parser.add_argument("--seed", type=int, default=2026, help="--random: the cases' seed")
    parser.add_argument("--cases", type=int, default=60, help="--random: how many cases")
    parser.add_argument(
        "--only",
        type=lambda text: sorted({int(i) for i in text.split(",")}),
        metavar="I,J,...",
        help="--random: run only these cases of the drawn set (same draws, same seeds)",
    )
    parser.add_argument(
        "--save",
        type=Path,
        metavar="PATH",
        help="--random: also write the run's simulated half to PATH (JSON, for --rescore)",
    )
    parser.add_argument(
        "--rescore",
        type=Path,
        metavar="PATH",
        help="--random: the table of a run saved with --save, predicted by the model now",
    )
    parser.add_argument(
        "--probe-wait",
        type=int,
        metavar="INDEX",
        help="--random: case INDEX's probability of waiting, simulated and modelled",
    )
    parser.add_argument(
        "--workers",
        type=lambda text: [int(i) for i in text.split(",")],
        metavar="N,M,...",
        help="--probe-wait: the prefill pool sizes to probe (default: the case's own)",
    )
    parser.add_argument(
        "--probe-departures",
        type=int,
        metavar="INDEX",
        help="--random: case INDEX's decode arrivals' dispersion, modelled and measured",
    )
    parser.add_argument(
        "--probe-burst",
        type=int,
        metavar="INDEX",
        help="--random: case INDEX's P99 TTFT and TPOT at arrival SCV 1, 2, 4 and 8",
    )
    args = parser.parse_args()
    if args.random:
        import fidelity_random

        cases = 16 if args.quick else args.cases
        # Each probe looks at one drawn case (the same draws as the bench's).
        probes = {
            "probe_burst": lambda index: fidelity_random.probe_burst(
                seed=args.seed, cases=cases, index=index, requests=4_000, replications=4
            ),
            "probe_departures": lambda index: fidelity_random.probe_departures(
                seed=args.seed, cases=cases, index=index, requests=40_000
            ),
            "probe_wait": lambda index: fidelity_random.probe_wait(
                seed=args.seed, cases=cases, index=index, requests=20_000, workers=args.workers
            ),
        }
        for option, probe in probes.items():
            if getattr(args, option) is not None:
                probe(getattr(args, option))
                return
        if args.rescore is not None:
            fidelity_random.rescore(args.rescore)
            return
        fidelity_random.main(
            seed=args.seed,
            cases=cases,
            requests=2_000 if args.quick else 4_000,
            replications=3 if args.quick else 4,
            jobs=args.jobs,
            only=args.only,
            save=args.save,
        )
        return
    requests = 6_000 if args.quick else args.requests
    replications = 1 if args.quick else args.replications
    utils = (0.5, 0.85) if args.quick else UTILISATIONS
    jobs = [
        (mix, profile, ca2, u, requests, replications)
        for mix in MIXES
        for profile in PROFILES
        for ca2 in (1.0, 4.0)
        for u in utils
    ]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(run_row, jobs))

    print(
        f"prefill workers {PREFILL_WORKERS}; {replications} replications x {requests} "
        "requests per row; errors are predicted / simulated - 1 (replications pooled)"
    )
    header = (
        f"{'mix':<6}{'profile':<26}{'ca2':>4}{'u':>6}{'u_sim':>7}{'M':>4} "
        f"{'TTFT pred':>10}{'sim':>9}{'ci%':>6}{'err%':>7} "
        f"{'TPOT pred ms':>13}{'sim':>8}{'ci%':>6}{'err%':>7}"
    )
    print(header)
    for r in rows:
        print(
            f"{r.mix:<6}{r.profile:<26}{r.ca2:>4.0f}{r.utilisation:>6.2f}"
            f"{r.sim_utilisation:>7.3f}{r.decode_workers:>4} "
            f"{r.ttft_pred_s:>10.4f}{r.ttft_sim_s:>9.4f}{100 * r.ttft_ci:>6.1f}"
            f"{100 * r.ttft_err:>+7.1f} "
            f"{1e3 * r.tpot_pred_s:>13.2f}{1e3 * r.tpot_sim_s:>8.2f}{100 * r.tpot_ci:>6.1f}"
            f"{100 * r.tpot_err:>+7.1f}"
        )

    def report(label: str, selected: list[Row]) -> None:
        if not selected:
            return
        errs = [abs(e) for r in selected for e in (r.ttft_err, r.tpot_err)]
        ttft = [abs(r.ttft_err) for r in selected]
        tpot = [abs(r.tpot_err) for r in selected]
        print(
            f"{label}: rows {len(selected)}; |err| max {100 * max(errs):.1f}% "
            f"median {100 * statistics.median(errs):.1f}% "
            f"(TTFT max {100 * max(ttft):.1f}% median {100 * statistics.median(ttft):.1f}%, "
            f"TPOT max {100 * max(tpot):.1f}% median {100 * statistics.median(tpot):.1f}%)"
        )

    report("Poisson, u <= 0.85", [r for r in rows if r.ca2 == 1.0 and r.utilisation <= 0.85])
    report("Poisson, u = 0.9  ", [r for r in rows if r.ca2 == 1.0 and r.utilisation > 0.85])
    report("Bursty ca2=4, all ", [r for r in rows if r.ca2 == 4.0])


if __name__ == "__main__":
    main()
