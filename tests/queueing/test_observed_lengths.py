"""Observed length pairs are requests that fit the model's context.

A router rejects a request longer than the context before counting it, but pairs
rebuilt from two histograms in quantile order put the longest prompts with the longest
outputs; the capacity model drops over-context requests, and would drop exactly the
prompts a P99 TTFT is made of.
"""

from __future__ import annotations

import numpy as np
import pytest

from queueing.catalog import resolve_profile
from queueing.lengths import LengthSamples, observed_within_context
from queueing.pools import Pool
from queueing.solver import CapacityModel, evaluate_pool

PROFILE = resolve_profile("llama-2-70b-tp4@a100-80g")  # a 4,096-token context
CONTEXT = PROFILE.max_context_tokens


def demo_like_mix(seed: int = 5, n: int = 400) -> LengthSamples:
    """Prompts lognormal with 6 % clipped just under the context, each output fitting."""
    rng = np.random.default_rng(seed)
    prompt = np.minimum(np.exp(rng.normal(6.4, 0.8, n)), 3000).astype(np.int64)
    pile = rng.random(n) < 0.06
    output = rng.integers(20, 700, n)
    prompt[pile] = CONTEXT - output[pile]  # clipped to fit, as clients clip
    return LengthSamples(prompt_tokens=prompt, output_tokens=output, source="exact")


def ttft_p99_s(samples: LengthSamples) -> float:
    model = CapacityModel.build(samples, PROFILE, tpot_slo_s=0.1)
    p99 = evaluate_pool(
        model, Pool.PREFILL, workers=3, arrival_rate_rps=4.0, ca2=1.0, target_s=2.0
    ).p99_s
    assert p99 is not None
    return p99


def test_pairs_that_fit_are_left_as_they_are() -> None:
    exact = demo_like_mix()
    assert observed_within_context(exact, CONTEXT) is exact
    assert observed_within_context(exact, None) is exact


def test_quantile_ordered_marginals_keep_the_prompts_the_p99_is_made_of() -> None:
    exact = demo_like_mix()
    comonotone = LengthSamples(
        prompt_tokens=np.sort(exact.prompt_tokens),
        output_tokens=np.sort(exact.output_tokens),
        source="rebuilt",
    )
    assert CapacityModel.build(comonotone, PROFILE, tpot_slo_s=0.1).rejected_share > 0.03
    fitted = observed_within_context(comonotone, CONTEXT)
    assert np.all(fitted.prompt_tokens + fitted.output_tokens <= CONTEXT)
    np.testing.assert_array_equal(fitted.prompt_tokens, comonotone.prompt_tokens)
    assert CapacityModel.build(fitted, PROFILE, tpot_slo_s=0.1).rejected_share == 0.0
    # The prefill side sees prompts only: the same marginal, the same P99 TTFT as the
    # exact pairs; dropping the rebuilt over-context pairs would under-state it.
    assert ttft_p99_s(fitted) == pytest.approx(ttft_p99_s(exact), rel=0.02)
    assert ttft_p99_s(comonotone) < 0.85 * ttft_p99_s(exact)


def test_a_prompt_that_leaves_no_room_is_left_for_the_model_to_reject() -> None:
    mixed = LengthSamples(
        prompt_tokens=np.array([CONTEXT, CONTEXT - 10, 100]),
        output_tokens=np.array([50, 50, 50]),
        source="x",
    )
    fitted = observed_within_context(mixed, CONTEXT)
    assert fitted.prompt_tokens.tolist() == [CONTEXT, CONTEXT - 10, 100]
    assert fitted.output_tokens.tolist() == [50, 10, 50]
