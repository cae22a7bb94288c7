"""The capacity model stays within the fidelity bench's bound of the simulator on a
small seeded random set of mixes it was not developed against (``sim.fidelity``).

The bound is the one docs/model.md states for Poisson arrivals at u <= 0.85: P99
TTFT and P99 TPOT within 15 % either way, each widened by the simulator's 95 %
confidence half-width over independent replications, and a median |error| of at most
10 %. A model change that moves predictions away from the simulator by more than that
fails here (a 20 % bias on either P99 does).
"""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from queueing.catalog import MODELS, resolve_profile
from queueing.lengths import LengthSamples
from sim.fidelity import Case, CaseResult, Family, draw_cases, run_case

PROFILES = ("llama-3-8b@h100-sxm", "llama-2-70b-tp4@h100-sxm", "mistral-7b@a100-80g")
LONG_PROFILES = ("mistral-7b@h100-sxm",)
TTFT_BOUND = (-0.15, 0.15)
TPOT_BOUND = (-0.15, 0.15)
MEDIAN_BOUND = 0.10


@pytest.fixture(scope="module")
def results() -> list[CaseResult]:
    profiles = [resolve_profile(name) for name in PROFILES]
    long_profiles = [resolve_profile(name) for name in LONG_PROFILES]
    contexts = {p.name: MODELS[p.model].max_context_tokens for p in (*profiles, *long_profiles)}
    cases = draw_cases(
        8,
        profiles=profiles,
        long_profiles=long_profiles,
        max_context=contexts,
        rng=np.random.default_rng(7),
        max_utilisation=0.8,
        arrival_scvs=(1.0,),
        pool_sizes=(1, 2, 4, 8),
    )
    return [
        run_case(case, samples, requests=2500, replications=3, decisions=False)
        for case, samples in cases
    ]


def _within(predicted: float, mean: float, half_width: float, bound: tuple[float, float]) -> bool:
    return mean * (1 + bound[0]) - half_width <= predicted <= mean * (1 + bound[1]) + half_width


def test_every_case_is_within_the_bound_widened_by_the_simulators_interval(
    results: list[CaseResult],
) -> None:
    outside = [
        f"{r.case.label} N={r.case.prefill_workers} u={r.case.utilisation:.2f}: "
        f"TTFT {r.ttft_err:+.1%} (ci {r.ttft_sim.relative_ci:.1%}), "
        f"TPOT {r.tpot_err:+.1%} (ci {r.tpot_sim.relative_ci:.1%})"
        for r in results
        if not _within(r.ttft_pred_s, r.ttft_sim.estimate_s, r.ttft_sim.half_width_s, TTFT_BOUND)
        or not _within(r.tpot_pred_s, r.tpot_sim.estimate_s, r.tpot_sim.half_width_s, TPOT_BOUND)
    ]
    assert not outside, outside


def test_the_median_error_is_within_ten_percent(results: list[CaseResult]) -> None:
    errors = [abs(e) for r in results for e in (r.ttft_err, r.tpot_err)]
    assert statistics.median(errors) <= MEDIAN_BOUND


@pytest.mark.parametrize("workers", [6, 7])
def test_bursts_of_alike_long_prompts_on_a_lightly_loaded_pool_stay_within_the_bound(
    workers: int,
) -> None:
    # Alike prompts of about half the budget, arriving in bursts (ca2 = 4) at 12 % of
    # eight workers: a burst that finds every worker busy finds them busy with its own
    # earlier members, which free none early (GI/D/N, not GI/M/N). The model put such
    # a pool's P99 21-32 % low at six and seven workers before it priced that.
    rng = np.random.default_rng(43)
    prompts = np.clip(rng.lognormal(np.log(2700.0), 0.3, 4000), 64, 3900).astype(np.int64)
    outputs = np.clip(rng.lognormal(np.log(200.0), 0.5, 4000), 2, 2000).astype(np.int64)
    samples = LengthSamples(prompt_tokens=prompts, output_tokens=outputs, source="alike long")
    profile = resolve_profile("llama-2-7b@h200")
    case = Case(
        index=0,
        family=Family.LOGNORMAL,
        label="alike long prompts",
        profile=profile,
        tpot_slo_s=0.1,
        prefill_workers=workers,
        utilisation=0.12 * 8 / workers,
        ca2=4.0,
        seed=43,
    )
    r = run_case(case, samples, requests=5000, replications=3, decisions=False)
    assert _within(r.ttft_pred_s, r.ttft_sim.estimate_s, r.ttft_sim.half_width_s, TTFT_BOUND), (
        f"TTFT {r.ttft_err:+.1%} (ci {r.ttft_sim.relative_ci:.1%})"
    )
