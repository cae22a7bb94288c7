"""The randomised half of ``bench/model_fidelity.py`` (``--random``): drawn cases.

Cases come from ``sim.fidelity.draw_cases`` (length families, profiles, pool sizes
1-64, utilisation 0.1-0.9, arrival SCV 1, 2, 4), each simulated over independent
replications. Prints one row per case, then per arrival class the distribution of
|error| of the P99 TTFT and TPOT (median, 90th, 95th percentile, max) and the share
within 10 % and 15 %, and the decision exactness: how often the solver's smallest
pool equals the simulator's at a drawn SLO, and the worst miss.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from queueing.catalog import MODELS, resolve_profile
from queueing.profile import IterationProfile
from sim.fidelity import CaseResult, Decision, draw_cases, run_case

PROFILES = (
    "llama-3-8b@h100-sxm",
    "llama-2-70b-tp4@h100-sxm",
    "mistral-7b@a100-80g",
    "llama-2-7b@h200",
    "llama-3-8b@l40s",
)
LONG_PROFILES = ("mistral-7b@h100-sxm",)


def max_context(profile: IterationProfile) -> int:
    return MODELS[profile.model].max_context_tokens


def requests_for(workers: int, base: int) -> int:
    """Requests per replication: more for larger pools, whose P99 needs more
    arrivals per worker to leave the warm-up behind."""
    return base + 250 * workers


def _run(args: tuple[object, ...]) -> CaseResult:
    case, samples, base, replications = args
    return run_case(
        case,  # type: ignore[arg-type]
        samples,  # type: ignore[arg-type]
        requests=requests_for(case.prefill_workers, base),  # type: ignore[attr-defined]
        replications=replications,  # type: ignore[arg-type]
    )


def _q(values: Sequence[float], q: float) -> float:
    return float(np.quantile(np.asarray(values), q))


def error_summary(label: str, errors: Sequence[float]) -> str:
    a = [abs(e) for e in errors]
    within10 = sum(e <= 0.10 for e in a) / len(a)
    within15 = sum(e <= 0.15 for e in a) / len(a)
    return (
        f"{label:<26} n {len(a):>3}  |err| median {100 * statistics.median(a):5.1f}%  "
        f"p90 {100 * _q(a, 0.9):5.1f}%  p95 {100 * _q(a, 0.95):5.1f}%  max {100 * max(a):5.1f}%"
        f"  within 10% {within10:6.1%}  within 15% {within15:6.1%}"
    )


def decision_summary(label: str, decisions: Sequence[Decision]) -> str:
    decided = [d for d in decisions if d.simulated is not None]
    hits = sum(d.solver == d.simulated for d in decided)
    misses = [
        (d.solver - d.simulated) if d.solver is not None else None
        for d in decided
        if d.solver != d.simulated
    ]
    numeric = [x for x in misses if x is not None]
    fewer = min([x for x in numeric if x < 0], default=0)
    more = max([x for x in numeric if x > 0], default=0)
    infeasible = sum(x is None for x in misses)
    share = hits / len(decided) if decided else float("nan")
    return (
        f"{label:<8} decided {len(decided):>3} of {len(decisions):>3}: solver = simulator "
        f"{hits}/{len(decided)} ({share:.1%}); worst fewer {fewer:+d}, worst more {more:+d}"
        + (f", solver infeasible {infeasible}" if infeasible else "")
    )


def main(*, seed: int, cases: int, requests: int, replications: int, jobs: int) -> None:
    profiles = [resolve_profile(name) for name in PROFILES]
    long_profiles = [resolve_profile(name) for name in LONG_PROFILES]
    contexts = {p.name: max_context(p) for p in (*profiles, *long_profiles)}
    drawn = draw_cases(
        cases,
        profiles=profiles,
        long_profiles=long_profiles,
        max_context=contexts,
        rng=np.random.default_rng(seed),
    )
    work = [(case, samples, requests, replications) for case, samples in drawn]
    # Largest pools first, so the slowest cases do not finish last on one core.
    work.sort(key=lambda w: -w[0].prefill_workers)  # type: ignore[attr-defined]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        results = sorted(pool.map(_run, work), key=lambda r: r.case.index)

    print(
        f"seed {seed}; {cases} cases; {replications} replications of {requests} + 250 N "
        "requests; errors = predicted / mean simulated P99 - 1; ci% = 95 % t half-width"
    )
    print(
        f"{'#':>3} {'family / mix':<44}{'profile':<26}{'ca2':>4}{'u':>6}{'N':>4}{'M':>4} "
        f"{'TTFT pred':>10}{'sim':>9}{'ci%':>6}{'err%':>7} "
        f"{'TPOT ms':>9}{'sim':>8}{'ci%':>6}{'err%':>7}  {'N sim/sol':>9} {'M sim/sol':>9}"
    )

    def dec(d: Decision | None) -> str:
        if d is None:
            return "-"
        s = "?" if d.simulated is None else str(d.simulated)
        return f"{s}/{d.solver if d.solver is not None else 'inf'}"

    for r in results:
        c = r.case
        print(
            f"{c.index:>3} {c.label[:43]:<44}{c.profile.name:<26}{c.ca2:>4.0f}"
            f"{c.utilisation:>6.2f}{c.prefill_workers:>4}{r.decode_workers:>4} "
            f"{r.ttft_pred_s:>10.4f}{r.ttft_sim.mean_s:>9.4f}{100 * r.ttft_sim.relative_ci:>6.1f}"
            f"{100 * r.ttft_err:>+7.1f} "
            f"{1e3 * r.tpot_pred_s:>9.2f}{1e3 * r.tpot_sim.mean_s:>8.2f}"
            f"{100 * r.tpot_sim.relative_ci:>6.1f}{100 * r.tpot_err:>+7.1f}  "
            f"{dec(r.prefill_decision):>9} {dec(r.decode_decision):>9}"
        )
    print()
    for ca2 in (1.0, 2.0, 4.0):
        chosen = [r for r in results if r.case.ca2 == ca2]
        if not chosen:
            continue
        tag = "Poisson" if ca2 == 1.0 else f"ca2 {ca2:g}"
        low = [r for r in chosen if r.case.utilisation <= 0.85]
        if low:
            print(error_summary(f"{tag}, u<=0.85 TTFT", [r.ttft_err for r in low]))
            print(error_summary(f"{tag}, u<=0.85 TPOT", [r.tpot_err for r in low]))
        high = [r for r in chosen if r.case.utilisation > 0.85]
        if high:
            both = [e for r in high for e in (r.ttft_err, r.tpot_err)]
            print(error_summary(f"{tag}, u>0.85 both", both))
    print(
        error_summary("all, TTFT and TPOT", [e for r in results for e in (r.ttft_err, r.tpot_err)])
    )
    print()
    prefill = [r.prefill_decision for r in results if r.prefill_decision is not None]
    decode = [r.decode_decision for r in results if r.decode_decision is not None]
    print(decision_summary("prefill", prefill))
    print(decision_summary("decode", decode))
    print(decision_summary("both", prefill + decode))
