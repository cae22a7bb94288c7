"""The randomised half of ``bench/model_fidelity.py`` (``--random``): drawn cases.

Cases come from ``sim.fidelity.draw_cases`` (length families, profiles, pool sizes
1-64, utilisation 0.1-0.9, arrival SCV 1, 2, 4), each simulated over independent
replications of (base + 250 N) x max(1, ca2) requests (``requests_for``); a case
whose pools the simulator cannot yet tell from the pools one smaller gets more
replications, up to ``BOUNDARY_REPLICATIONS`` times as many. Prints one row per
case, then per arrival class the distribution of |error| of the P99 TTFT and TPOT
(median, 90th, 95th percentile, max) and the share within 10 % and 15 % — strictly,
and in brackets counting a case as within when |error| <= bound + the simulator's
relative 95 % half-width (the simulator cannot tell it from the bound) — and the
decision exactness: how often the solver's smallest pool equals the simulator's at
a drawn SLO, and the worst miss.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from queueing.catalog import MODELS, resolve_profile
from queueing.lengths import LengthSamples
from queueing.profile import IterationProfile
from queueing.solver import CapacityModel
from sim.cluster import ClusterConfig
from sim.fidelity import (
    LINK,
    WIDE_INTERVAL,
    Case,
    CaseResult,
    Decision,
    Measured,
    Transient,
    decode_workers_for,
    draw_cases,
    rescored,
    run_case,
    simulated_departures,
)
from sim.workload import gamma_arrivals, synthesize
from workers.scheduler import StepPlan

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


# Near the boundary a case gets up to this many times its replications.
BOUNDARY_REPLICATIONS = 3
# A case whose simulated P99 has a wide interval (``sim.fidelity.WIDE_INTERVAL``) gets
# replications up to this many measured requests at its own pools (at least as many
# as near the boundary): a computing budget, which buys many replications where one
# is cheap (few workers, where a P99 is the noisiest) and few where it is not.
WIDE_REQUEST_BUDGET = 200_000


def requests_for(workers: int, base: int, ca2: float) -> int:
    """Requests per replication: more for larger pools, whose P99 needs more
    arrivals per worker to leave the warm-up behind, and ca2 times more for bursty
    arrivals, whose counts vary ca2 times as much (the index of dispersion of a
    renewal process tends to ca2), so that a replication holds as many independent
    bursts' worth of tail as a Poisson one. A short bursty run's P99 is biased low:
    it misses the rare large bursts that set the long-run P99."""
    return math.ceil((base + 250 * workers) * max(1.0, ca2))


def _run(args: tuple[Case, LengthSamples, int, int]) -> CaseResult:
    case, samples, base, replications = args
    requests = requests_for(case.prefill_workers, base, case.ca2)
    return run_case(
        case,
        samples,
        requests=requests,
        replications=replications,
        max_replications=BOUNDARY_REPLICATIONS * replications,
        max_wide_replications=WIDE_REQUEST_BUDGET // requests,
    )


def _q(values: Sequence[float], q: float) -> float:
    return float(np.quantile(np.asarray(values), q))


def error_summary(label: str, errors: Sequence[float], cis: Sequence[float]) -> str:
    """|error| percentiles and the share within 10 % and 15 %: strictly (the point
    estimate), and in brackets allowing the simulator's relative 95 % half-width
    (|error| <= bound + ci: the simulator cannot tell the prediction from the bound)."""
    a = [abs(e) for e in errors]
    ci = [c if math.isfinite(c) else 0.0 for c in cis]

    def share(bound: float, slack: bool) -> float:
        return sum(e <= bound + (c if slack else 0.0) for e, c in zip(a, ci, strict=True)) / len(a)

    return (
        f"{label:<26} n {len(a):>3}  |err| median {100 * statistics.median(a):5.1f}%  "
        f"p90 {100 * _q(a, 0.9):5.1f}%  p95 {100 * _q(a, 0.95):5.1f}%  max {100 * max(a):5.1f}%"
        f"  within 10% {share(0.10, False):6.1%} ({share(0.10, True):6.1%})"
        f"  within 15% {share(0.15, False):6.1%} ({share(0.15, True):6.1%})"
    )


def summary(label: str, results: Sequence[CaseResult], *, ttft: bool, tpot: bool) -> str:
    errors: list[float] = []
    cis: list[float] = []
    for r in results:
        if ttft:
            errors.append(r.ttft_err)
            cis.append(r.ttft_sim.relative_ci)
        if tpot:
            errors.append(r.tpot_err)
            cis.append(r.tpot_sim.relative_ci)
    return error_summary(label, errors, cis)


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


def _dec(d: Decision | None) -> str:
    if d is None:
        return "-"
    s = "?" if d.simulated is None else str(d.simulated)
    return f"{s}/{d.solver if d.solver is not None else 'inf'}"


def row(r: CaseResult) -> str:
    """One case's line of the table."""
    c = r.case
    return (
        f"{c.index:>3} {c.label[:43]:<44}{c.profile.name:<26}{c.ca2:>4.0f}"
        f"{c.utilisation:>6.2f}{c.prefill_workers:>4}{r.decode_workers:>4} "
        f"{r.ttft_pred_s:>10.4f}{r.ttft_sim.estimate_s:>9.4f}{100 * r.ttft_sim.relative_ci:>6.1f}"
        f"{100 * r.ttft_err:>+7.1f} "
        f"{1e3 * r.tpot_pred_s:>9.2f}{1e3 * r.tpot_sim.estimate_s:>8.2f}"
        f"{100 * r.tpot_sim.relative_ci:>6.1f}{100 * r.tpot_err:>+7.1f}  "
        f"{_dec(r.prefill_decision):>9} {_dec(r.decode_decision):>9}{r.replications:>5}"
    )


def main(
    *,
    seed: int,
    cases: int,
    requests: int,
    replications: int,
    jobs: int,
    only: Sequence[int] | None = None,
    save: Path | None = None,
) -> None:
    """Draw ``cases`` cases from ``seed`` and run them (or only those indexed ``only``:
    the draws, and so each case's seed, do not depend on which are run); with ``save``,
    write the simulated half of every row there (``rescore`` reads it back)."""
    drawn = _drawn(seed, cases, only)
    work = [(case, samples, requests, replications) for case, samples in drawn]
    # Largest runs first, so the slowest cases do not finish last on one core.
    work.sort(key=lambda w: -requests_for(w[0].prefill_workers, requests, w[0].ca2))
    results: list[CaseResult] = []
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        # Each case to stderr as it finishes (a long run shows its progress).
        for future in as_completed([pool.submit(_run, w) for w in work]):
            results.append(future.result())
            print(row(results[-1]), file=sys.stderr, flush=True)
    results.sort(key=lambda r: r.case.index)
    if save is not None:
        save.write_text(
            json.dumps(
                {
                    "seed": seed,
                    "cases": cases,
                    "requests": requests,
                    "replications": replications,
                    "rows": [_simulated_half(r) for r in results],
                },
                indent=1,
            )
        )
    report(results, seed=seed, cases=cases, requests=requests, replications=replications)


def rescore(path: Path) -> None:
    """The table of a run saved with ``main(save=...)``: its simulated half as it was
    measured, the predictions and the solver's answers from the model as it is now
    (``sim.fidelity.rescored``; the same rows a new run would print, in seconds)."""
    saved = json.loads(path.read_text())
    rows = {int(r["index"]): r for r in saved["rows"]}
    drawn = _drawn(int(saved["seed"]), int(saved["cases"]), sorted(rows))
    results = [
        rescored(case, samples, _from_simulated_half(rows[case.index], case))
        for case, samples in drawn
    ]
    print(f"rescored from {path} (simulated half as saved, predictions from the model now)")
    report(
        results,
        seed=int(saved["seed"]),
        cases=int(saved["cases"]),
        requests=int(saved["requests"]),
        replications=int(saved["replications"]),
    )


def _drawn(seed: int, cases: int, only: Sequence[int] | None) -> list[tuple[Case, LengthSamples]]:
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
    if only is None:
        return drawn
    unknown = sorted(set(only) - set(range(cases)))
    if unknown:
        raise SystemExit(f"--only: no case {unknown} among the {cases} drawn")
    return [(case, samples) for case, samples in drawn if case.index in set(only)]


def _simulated_half(r: CaseResult) -> dict[str, object]:
    """What a row measured in the simulator (and the case's seed, to check a reload)."""

    def decision(d: Decision | None) -> dict[str, object] | None:
        return None if d is None else {"slo_s": d.slo_s, "simulated": d.simulated}

    return {
        "index": r.case.index,
        "case_seed": r.case.seed,
        "decode_workers": r.decode_workers,
        "ttft_sim": [r.ttft_sim.estimate_s, r.ttft_sim.half_width_s],
        "tpot_sim": [r.tpot_sim.estimate_s, r.tpot_sim.half_width_s],
        "prefill_decision": decision(r.prefill_decision),
        "decode_decision": decision(r.decode_decision),
        "replications": r.replications,
        "transient_s": [r.transient.warmup_s, r.transient.cooldown_s],
    }


def _from_simulated_half(saved: dict[str, Any], case: Case) -> CaseResult:
    """A row from ``_simulated_half`` (no predictions yet: ``rescored`` adds them)."""
    if int(saved["case_seed"]) != case.seed:
        raise SystemExit(
            f"case {case.index}: saved with seed {saved['case_seed']}, drawn now with "
            f"{case.seed} (the draws changed since the run was saved)"
        )

    def decision(d: dict[str, Any] | None) -> Decision | None:
        return (
            None
            if d is None
            else Decision(slo_s=float(d["slo_s"]), simulated=d["simulated"], solver=None)
        )

    return CaseResult(
        case=case,
        decode_workers=int(saved["decode_workers"]),
        ttft_pred_s=math.nan,
        ttft_sim=Measured(estimate_s=saved["ttft_sim"][0], half_width_s=saved["ttft_sim"][1]),
        tpot_pred_s=math.nan,
        tpot_sim=Measured(estimate_s=saved["tpot_sim"][0], half_width_s=saved["tpot_sim"][1]),
        prefill_decision=decision(saved["prefill_decision"]),
        decode_decision=decision(saved["decode_decision"]),
        replications=int(saved["replications"]),
        transient=Transient(
            warmup_s=float(saved["transient_s"][0]), cooldown_s=float(saved["transient_s"][1])
        ),
    )


def report(
    results: Sequence[CaseResult], *, seed: int, cases: int, requests: int, replications: int
) -> None:
    """The table, the error distributions per arrival class and the decisions."""
    print(
        f"seed {seed}; {len(results)} of {cases} cases; {replications} replications (up to "
        f"{BOUNDARY_REPLICATIONS * replications} near the boundary, up to "
        f"{WIDE_REQUEST_BUDGET:,} requests while an interval is wider than "
        f"{100 * WIDE_INTERVAL:g} %: reps) of "
        f"({requests} + 250 N) x max(1, ca2) requests; errors = predicted / simulated P99 - 1 "
        "(the replications pooled); ci% = 95 % sectioning half-width"
    )
    print(
        f"{'#':>3} {'family / mix':<44}{'profile':<26}{'ca2':>4}{'u':>6}{'N':>4}{'M':>4} "
        f"{'TTFT pred':>10}{'sim':>9}{'ci%':>6}{'err%':>7} "
        f"{'TPOT ms':>9}{'sim':>8}{'ci%':>6}{'err%':>7}  {'N sim/sol':>9} {'M sim/sol':>9}"
        f"{'reps':>5}"
    )

    for r in results:
        print(row(r))
    print()
    for ca2 in (1.0, 2.0, 4.0):
        chosen = [r for r in results if r.case.ca2 == ca2]
        if not chosen:
            continue
        tag = "Poisson" if ca2 == 1.0 else f"ca2 {ca2:g}"
        low = [r for r in chosen if r.case.utilisation <= 0.85]
        if low:
            print(summary(f"{tag}, u<=0.85 TTFT", low, ttft=True, tpot=False))
            print(summary(f"{tag}, u<=0.85 TPOT", low, ttft=False, tpot=True))
        high = [r for r in chosen if r.case.utilisation > 0.85]
        if high:
            print(summary(f"{tag}, u>0.85 both", high, ttft=True, tpot=True))
    bursty = [r for r in results if r.case.ca2 > 1.0 and r.case.utilisation <= 0.85]
    if bursty:
        print(summary("ca2 2-4, u<=0.85 TTFT", bursty, ttft=True, tpot=False))
        print(summary("ca2 2-4, u<=0.85 TPOT", bursty, ttft=False, tpot=True))
    print(summary("all, TTFT and TPOT", results, ttft=True, tpot=True))
    print()
    prefill = [r.prefill_decision for r in results if r.prefill_decision is not None]
    decode = [r.decode_decision for r in results if r.decode_decision is not None]
    print(decision_summary("prefill", prefill))
    print(decision_summary("decode", decode))
    print(decision_summary("both", prefill + decode))


def _drawn_case(*, seed: int, cases: int, index: int) -> tuple[Case, LengthSamples]:
    """Case ``index`` of the ``cases`` drawn from ``seed`` (the same draws as ``main``)."""
    return _drawn(seed, cases, [index])[0]


def probe_burst(*, seed: int, cases: int, index: int, requests: int, replications: int) -> None:
    """One drawn case at its own pools, under arrivals of SCV 1, 2, 4 and 8: the
    predicted and simulated P99 TTFT and TPOT. The decode pool's arrivals are the
    prefill pool's departures; a simulated TPOT that moves less with the SCV than the
    prediction shows how much of the arrivals' burstiness the prefill pool smooths
    away before the decode pool sees it. The TTFT rows try the case's mix and pools
    on arrival processes the drawn set did not give it."""
    import dataclasses

    case, samples = _drawn_case(seed=seed, cases=cases, index=index)
    model = CapacityModel.build(samples, case.profile, tpot_slo_s=case.tpot_slo_s, link=LINK)
    rate = case.utilisation * case.prefill_workers / model.prefill.mean_service_s
    decode = decode_workers_for(model, rate, case.ca2, case.utilisation)
    print(
        f"seed {seed} case {index}: {case.label}, {case.profile.name}, N {case.prefill_workers}, "
        f"M {decode} (held), u {case.utilisation:.2f}, drawn ca2 {case.ca2:g}"
    )
    for ca2 in (1.0, 2.0, 4.0, 8.0):
        result = run_case(
            dataclasses.replace(case, ca2=ca2),
            samples,
            requests=requests_for(case.prefill_workers, requests, ca2),
            replications=replications,
            decisions=False,
            decode_workers=decode,
        )
        print(
            f"  ca2 {ca2:g}: P99 TTFT predicted {result.ttft_pred_s:.4f} s, simulated "
            f"{result.ttft_sim.estimate_s:.4f} s +- {100 * result.ttft_sim.relative_ci:.1f} % "
            f"({100 * result.ttft_err:+.1f} %); P99 TPOT predicted "
            f"{1e3 * result.tpot_pred_s:.2f} ms, simulated "
            f"{1e3 * result.tpot_sim.estimate_s:.2f} ms "
            f"+- {100 * result.tpot_sim.relative_ci:.1f} % ({100 * result.tpot_err:+.1f} %)",
            flush=True,
        )


def probe_departures(*, seed: int, cases: int, index: int, requests: int) -> None:
    """One drawn case's decode arrivals as its decode pool's batch sees them.

    The pool-wide mode of the decode batch carries the arrivals' dispersion: for an
    infinite-server queue the occupancy's variance over mean, d. The model takes d =
    1 + (c^2 - 1) kappa (Whitt's GI/G/inf factor), c^2 the prefill pool's departure
    SCV (QNA's linking equation), as for a renewal stream of that SCV whose lives are
    long beside its gaps. Here d is measured on an infinite-server queue whose lives
    are the mix's decode steps times the model's iteration time, fed by: a Gamma
    renewal stream of SCV c^2 (the model's assumption), the simulated prefill pool's
    departures (what the decode pool gets), and the arrivals themselves."""
    case, samples = _drawn_case(seed=seed, cases=cases, index=index)
    model = CapacityModel.build(samples, case.profile, tpot_slo_s=case.tpot_slo_s, link=LINK)
    n = case.prefill_workers
    rate = case.utilisation * n / model.prefill.mean_service_s
    c2 = model.prefill.departure_scv(workers=n, arrival_rate_rps=rate, ca2=case.ca2)
    decode = decode_workers_for(model, rate, case.ca2, case.utilisation)
    iteration_s = model.decode.load(
        workers=decode, arrival_rate_rps=rate, ca2=c2, quantile=0.5
    ).iteration_s
    steps = samples.output_tokens[samples.output_tokens >= 2].astype(np.float64) - 1.0
    rng = np.random.default_rng([case.seed, 3])

    def dispersion(arrival_s: np.ndarray) -> float:
        lives_s = rng.choice(steps, size=len(arrival_s)) * iteration_s
        at = rng.uniform(arrival_s[len(arrival_s) // 10], arrival_s[-1], 100_000)
        present = np.searchsorted(np.sort(arrival_s), at) - np.searchsorted(
            np.sort(arrival_s + lives_s), at
        )
        return float(present.var() / present.mean())

    renewal = np.cumsum(rng.gamma(1.0 / c2, c2 / rate, requests))
    departures = simulated_departures(
        samples,
        case.profile,
        token_budget=model.token_budget,
        workers=n,
        rate=rate,
        ca2=case.ca2,
        requests=requests,
        rng=rng,
    )
    arrivals = np.cumsum(rng.gamma(1.0 / case.ca2, case.ca2 / rate, requests))
    gaps = np.diff(departures)
    print(
        f"seed {seed} case {index}: {case.label}, {case.profile.name}, N {n}, M {decode}, "
        f"u {case.utilisation:.2f}, ca2 {case.ca2:g}; mean life "
        f"{steps.mean() * iteration_s:.2f} s, mean gap {1.0 / rate:.3f} s; departure SCV "
        f"{c2:.2f} modelled, {float(gaps.var() / gaps.mean() ** 2):.2f} "
        "simulated\n"
        f"  d model {model.decode._dispersion(c2):.3f}; measured: renewal of SCV c^2 "
        f"{dispersion(renewal):.3f}, simulated departures {dispersion(departures):.3f}, "
        f"the arrivals {dispersion(arrivals):.3f} (model for them "
        f"{model.decode._dispersion(case.ca2):.3f})"
    )


@dataclass(frozen=True, kw_only=True)
class _Waiting:
    """What one simulated run says about the prompts that wait (``_simulated_waiting``)."""

    share: float  # of arrivals that find no idle prefill worker
    queued_share: float  # ... and prompts queued ahead of them (a queue's excursion)
    p99_s: float  # P99 TTFT
    longer_share: float  # of those that waited: ran more iterations than alone
    ahead_budgets: float  # of those that waited: mean tokens ahead in their first iteration


def _simulated_waiting(
    case: Case, samples: LengthSamples, model: CapacityModel, *, rate: float, workers: int,
    requests: int,
) -> _Waiting:  # fmt: skip
    """One run of ``requests`` at ``workers`` prefill workers, its first 5 % left out,
    each prompt's first chunk recorded (the iteration that admits it)."""
    import sim.cluster

    config = ClusterConfig(
        prefill_workers=workers,
        decode_workers=decode_workers_for(model, rate, case.ca2, case.utilisation),
        profile=case.profile,
        token_budget=model.token_budget,
        kv_link_bytes_per_s=LINK.bytes_per_s,
    )
    rng = np.random.default_rng([case.seed, 0])
    duration_s = requests / rate
    arrivals = gamma_arrivals(
        rate_rps=rate / (1.0 - model.rejected_share), ca2=case.ca2, duration_s=duration_s, rng=rng
    )
    trace = synthesize(arrival_s=arrivals, lengths=samples, rng=rng, source=case.label)
    cluster = sim.cluster.Cluster(config, trace)
    count = len(trace.arrival_s)
    none_idle = np.zeros(count, dtype=bool)
    queue_ahead = np.zeros(count, dtype=bool)
    ahead = np.zeros(count)  # tokens before its first chunk in the iteration that admits it
    iterations = np.zeros(count)
    on_arrival = cluster._on_arrival
    start_iteration = cluster._start_prefill_iteration

    def recording(r: int) -> None:
        none_idle[r] = all(w.plan is not None for w in cluster._prefill)
        queue_ahead[r] = len(cluster._prefill_queue) > 0
        on_arrival(r)

    def admitting(worker: Any, plan: StepPlan) -> None:
        tokens = 0
        for chunk in plan.prefill_chunks:
            if chunk.start_token == 0:
                ahead[chunk.seq_id] = tokens
            iterations[chunk.seq_id] += 1
            tokens += chunk.num_tokens
        start_iteration(worker, plan)

    cluster._on_arrival = recording  # type: ignore[method-assign]
    cluster._start_prefill_iteration = admitting  # type: ignore[method-assign]
    results = cluster.run()
    steady = (trace.arrival_s >= 0.05 * duration_s) & np.isfinite(results.ttft_s)
    waited = steady & none_idle
    alone = np.ceil(trace.prompt_tokens / model.token_budget)
    return _Waiting(
        share=float(waited.sum() / steady.sum()),
        queued_share=float((waited & queue_ahead).sum() / steady.sum()),
        p99_s=float(np.quantile(results.ttft_s[steady], 0.99)),
        longer_share=float((iterations[waited] > alone[waited]).mean()),
        ahead_budgets=float(ahead[waited].mean() / model.token_budget),
    )


def probe_wait(
    *, seed: int, cases: int, index: int, requests: int, workers: Sequence[int] | None = None
) -> None:
    """One drawn case's probability of waiting: the share of arrivals that find no
    idle prefill worker in the simulator (one run of ``requests``, its first 5 %
    left out), against the model's P_w, and the run's P99 TTFT against the model's;
    of the prompts that waited, the share that ran more iterations than alone and
    their mean tokens ahead in the iteration that admitted them; at the case's own
    prefill pool or at each of ``workers``."""
    case, samples = _drawn_case(seed=seed, cases=cases, index=index)
    model = CapacityModel.build(samples, case.profile, tpot_slo_s=case.tpot_slo_s, link=LINK)
    rate = case.utilisation * case.prefill_workers / model.prefill.mean_service_s
    print(
        f"seed {seed} case {index}: {case.label}, {case.profile.name}, "
        f"ca2 {case.ca2:g}, {rate:.4g} req/s (u {case.utilisation:.2f} on "
        f"{case.prefill_workers} workers)"
    )
    for n in workers or [case.prefill_workers]:
        run = _simulated_waiting(case, samples, model, rate=rate, workers=n, requests=requests)
        tail = model.prefill.wait_tail(workers=n, arrival_rate_rps=rate, ca2=case.ca2)
        predicted_s = model.prefill.ttft_quantile_s(
            workers=n, arrival_rate_rps=rate, ca2=case.ca2, quantile=0.99
        )
        excursion = model.prefill.excursion(workers=n, arrival_rate_rps=rate)
        print(
            f"  N {n}: arrivals finding no idle prefill worker {run.share:.3f} simulated, "
            f"P_w {tail.wait_probability:.3f} model; of those, with prompts queued ahead: "
            f"X = queued / not {run.queued_share / (run.share - run.queued_share):.3f} "
            f"simulated, {excursion:.3f} model (theta D "
            f"{tail.decay_rate_per_s * model.prefill.iteration_s:.3g}); P99 TTFT "
            f"{run.p99_s:.4f} s simulated, {predicted_s:.4f} s model; of the prompts that "
            f"waited, {run.longer_share:.3f} ran more iterations than alone, with "
            f"{run.ahead_budgets:.3f} budgets ahead in their first on average",
            flush=True,
        )
