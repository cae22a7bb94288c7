"""A request beyond the model's context is rejected the same way by the router, the
simulator and the capacity model: prompt + output tokens > max_context_tokens."""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import replace

import numpy as np
import pytest

from queueing.lengths import LengthSamples
from queueing.profile import IterationProfile, ProfileError
from queueing.solver import CapacityModel
from sim.cluster import Cluster, ClusterConfig
from sim.trace import Trace
from tests.profiles import TEST_8B
from workers.router import ApiError, CompletionBody, Router, RouterConfig
from workers.router_metrics import RouterMetrics

# A 64-token context, small enough to write the boundary cases out by hand.
CONTEXT = 64
PROFILE = replace(TEST_8B, max_context_tokens=CONTEXT)
# (prompt, output) around the boundary, and whether each fits.
REQUESTS = [((10, 5), True), ((60, 4), True), ((60, 5), False), ((63, 1), True), ((64, 1), False)]


def _router_accepts(prompt: int, output: int) -> bool:
    router = Router(
        RouterConfig(redis_url="redis://127.0.0.1:1/0", max_context_tokens=CONTEXT),
        tokenize=lambda text: [1] * len(text),
        detokenize=lambda ids: "",
        metrics=RouterMetrics(),
        clock=lambda: 0.0,
        wall_clock=lambda: 0.0,
        new_seed=lambda: 1,
    )
    try:
        checked = router.check(CompletionBody(prompt=[1] * prompt, max_tokens=output))
        if inspect.isawaitable(checked):
            asyncio.run(_awaited(checked))
    except ApiError:
        return False
    return True


async def _awaited(awaitable: object) -> object:
    return await awaitable  # type: ignore[misc]


def _simulated(
    prompts: list[int], outputs: list[int], profile: IterationProfile = PROFILE
) -> Cluster:
    n = len(prompts)
    trace = Trace(
        arrival_s=np.arange(n, dtype=np.float64),
        prompt_tokens=np.array(prompts, dtype=np.int64),
        output_tokens=np.array(outputs, dtype=np.int64),
        source="boundary cases",
    )
    config = ClusterConfig(
        prefill_workers=1,
        decode_workers=1,
        profile=profile,
        token_budget=256,
        kv_link_bytes_per_s=50e9,
    )
    return Cluster(config, trace)


def test_router_simulator_and_model_reject_exactly_the_requests_beyond_the_context() -> None:
    prompts = [p for (p, _), _ in REQUESTS]
    outputs = [o for (_, o), _ in REQUESTS]
    fits = [ok for _, ok in REQUESTS]

    assert [_router_accepts(p, o) for p, o in zip(prompts, outputs, strict=True)] == fits

    cluster = _simulated(prompts, outputs)
    results = cluster.run()
    assert list(~cluster.rejected) == fits
    assert list(np.isfinite(results.first_token_s)) == fits
    assert list(np.isfinite(results.finish_s)) == fits

    samples = LengthSamples(
        prompt_tokens=np.array(prompts, dtype=np.int64),
        output_tokens=np.array(outputs, dtype=np.int64),
        source="boundary cases",
    )
    model = CapacityModel.build(samples, PROFILE, tpot_slo_s=0.1)
    assert model.rejected_share == pytest.approx(fits.count(False) / len(fits))
    # Of a demand of this mix, the pools serve the requests that fit (the router does
    # not count the others as demand; a simulated demand must be thinned).
    assert model.admitted_rate_rps(10.0) == pytest.approx(10.0 * fits.count(True) / len(fits))
    # The model plans for the accepted requests only: its longest prompt is 63 tokens.
    longest_alone = model.prefill.floor_quantile_s(0.999)
    assert longest_alone == pytest.approx(
        PROFILE.t0_s + PROFILE.t_tok_s * 63 + PROFILE.t_attn_s * 63 * 64 / 2
    )


def test_a_mix_entirely_beyond_the_context_is_an_error_naming_the_field() -> None:
    samples = LengthSamples(
        prompt_tokens=np.array([100], dtype=np.int64),
        output_tokens=np.array([10], dtype=np.int64),
        source="too long",
    )
    with pytest.raises(ValueError, match="max_context_tokens"):
        CapacityModel.build(samples, PROFILE, tpot_slo_s=0.1)


def test_a_profile_without_a_context_accepts_any_length_its_kv_holds() -> None:
    cluster = _simulated([10_000], [10], TEST_8B)
    assert not cluster.rejected.any()
    assert np.isfinite(cluster.run().finish_s).all()


def test_a_context_below_two_tokens_is_rejected_naming_the_field() -> None:
    with pytest.raises(ProfileError, match="max_context_tokens"):
        replace(TEST_8B, max_context_tokens=1)
    document = PROFILE.to_json()
    assert IterationProfile.from_json(document) == PROFILE
