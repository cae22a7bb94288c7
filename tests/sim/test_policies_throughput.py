"""The throughput (Dynamo-style) planner's formula, checked by hand.

The profile has round numbers (t0 = 10 ms, 0.1 ms per token, 0.1 us per KV entry
read, no attention term), so every step can be redone on paper: the token budget
at a 0.1-s TPOT is the largest multiple of 16 with 0.01 + 1e-4 * B <= 0.1, i.e. 896.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from queueing.solver import SloTargets
from sim.cluster import ClusterSnapshot, PoolSnapshot
from sim.policies import Allocation, Predictor, Scenario, ThroughputPolicy
from sim.policies.throughput import decode_throughput_tps, predict, prefill_throughput_tps
from tests.profiles import TEST_8B

# The hand arithmetic needs the round numbers of the docstring: t0, t_tok and t_kv
# (0.12 s for 1000 tokens, 2e-4 s per sequence, 200 sequences, ...), no attention term
# (it would make the sums quadratic) and a 1e6-token KV cache (the cap test divides
# it). Everything else is the shared profile's.
PROFILE = replace(
    TEST_8B,
    name="round-numbers",
    t0_s=0.01,
    t_tok_s=1e-4,
    t_kv_s=1e-7,
    t_attn_s=0.0,
    kv_capacity_tokens=1_000_000,
)
SCENARIO = Scenario(profile=PROFILE, slo=SloTargets(ttft_p99_s=2.0, tpot_p99_s=0.1))
INTERVAL_S = 180.0


def test_the_budget_is_what_the_docstring_says() -> None:
    assert SCENARIO.token_budget == 896


def test_prefill_throughput_is_the_prompt_over_its_lone_prefill_time() -> None:
    # 1000 tokens in ceil(1000 / 896) = 2 iterations: 2 x 0.01 + 1000 x 1e-4 = 0.12 s.
    assert prefill_throughput_tps(PROFILE, 1000.0, 896) == pytest.approx(1000 / 0.12)


def test_decode_throughput_is_the_largest_batch_meeting_the_itl_over_its_iteration() -> None:
    # Per sequence 1e-4 + 1e-7 x 1000 = 2e-4 s; (0.05 - 0.01) / 2e-4 = 200 sequences;
    # an iteration of 200 takes 0.01 + 200 x 2e-4 = 0.05 s: 4000 tokens/s.
    got = decode_throughput_tps(
        PROFILE, itl_target_s=0.05, context_tokens=1000.0, reserved_tokens=2000.0, max_batch=896
    )
    assert got == pytest.approx(4000.0)
    # The KV cache caps the batch: 1e6 / 10,000 reserved tokens = 100 sequences.
    capped = decode_throughput_tps(
        PROFILE, itl_target_s=0.05, context_tokens=1000.0, reserved_tokens=10_000.0, max_batch=896
    )
    assert capped == pytest.approx(100 / (0.01 + 100 * 2e-4))


@pytest.mark.parametrize(
    ("history", "predictor", "expected"),
    [
        ([5.0, 7.0], Predictor.CONSTANT, 7.0),
        ([1.0, 2.0, 3.0, 4.0], Predictor.TREND, 5.0),
        ([10.0, 20.0], Predictor.TREND, 30.0),
        ([3.0, 2.0, 1.0, 0.0], Predictor.TREND, 0.0),  # never below zero
        ([4.0], Predictor.TREND, 4.0),  # one point: no trend yet
    ],
)
def test_the_predictors(history: list[float], predictor: Predictor, expected: float) -> None:
    assert predict(history, predictor) == pytest.approx(expected)


def interval_snapshot(
    *, rate_rps: float, isl: int, osl: int, ttft_s: float, itl_s: float, decode_serving: int
) -> ClusterSnapshot:
    arrivals = round(rate_rps * INTERVAL_S)
    completions = 500
    return ClusterSnapshot(
        time_s=INTERVAL_S,
        window_s=INTERVAL_S,
        prefill=PoolSnapshot(starting=0, serving=2, draining=0, busy=2, queue_length=0, running=2),
        decode=PoolSnapshot(
            starting=0, serving=decode_serving, draining=0, busy=1, queue_length=0, running=1
        ),
        arrived=arrivals,
        completed=completions,
        window_arrivals=arrivals,
        window_arrival_rate_rps=arrivals / INTERVAL_S,
        window_prompt_tokens=np.full(arrivals, isl, dtype=np.int64),
        window_output_tokens=np.full(completions, osl, dtype=np.int64),
        window_completed_prompt_tokens=np.full(completions, isl, dtype=np.int64),
        window_arrival_s=np.linspace(0.0, INTERVAL_S, arrivals),
        window_ttft_s=np.full(arrivals, ttft_s),
        window_tpot_s=np.full(completions, itl_s),
    )


class OneSnapshot:
    def __init__(self, snap: ClusterSnapshot) -> None:
        self.snap = snap
        self.now_s = snap.time_s

    def snapshot(self, *, window_s: float = 30.0) -> ClusterSnapshot:
        assert window_s == INTERVAL_S
        return self.snap


def test_one_adjustment_follows_the_documented_formula_step_by_step() -> None:
    policy = ThroughputPolicy(SCENARIO, Allocation(prefill=2, decode=2))
    snap = interval_snapshot(
        rate_rps=45.0, isl=1000, osl=301, ttft_s=0.06, itl_s=0.06, decode_serving=2
    )
    got = policy.tick(OneSnapshot(snap))  # type: ignore[arg-type]

    # Prefill: expected TTFT at ISL 1000 is the lone prefill, 0.12 s; observed 0.06 s,
    # so the correction is 0.5 and min(1, 0.5) halves the load:
    # 45 req/s x 1000 tokens x 0.5 / (1000 / 0.12 tokens/s) = 2.7 -> 3 workers.
    prefill_correction = 0.06 / 0.12
    prefill = math.ceil(45.0 * 1000 * min(1.0, prefill_correction) / (1000 / 0.12))
    assert prefill == 3

    # Decode: concurrency per worker by Little's law = 45 / 2 x 301 x 0.06 = 406.35;
    # context 1000 + 301 / 2 = 1150.5 tokens, so per sequence 1e-4 + 1e-7 x 1150.5 s;
    # expected ITL 0.01 + 406.35 x 2.1505e-4 = 0.0974 s, correction 0.06 / 0.0974 = 0.616,
    # ITL target 0.1 / 0.616 = 0.162 s: a batch of (0.162 - 0.01) / 2.1505e-4 = 708
    # (the KV cache would allow 1e6 / 1301 = 768), 708 / 0.1623 s = 4363 tokens/s;
    # 45 x 301 = 13,545 output tokens/s need 3.1 -> 4 workers.
    per_seq = 1e-4 + 1e-7 * 1150.5
    expected_itl = 0.01 + 406.35 * per_seq
    decode_correction = 0.06 / expected_itl
    target = 0.1 / decode_correction
    batch = math.floor((target - 0.01) / per_seq)
    assert batch == 708
    per_worker = batch / (0.01 + batch * per_seq)
    decode = math.ceil(45.0 * 301 / per_worker)
    assert decode == 4

    assert got == Allocation(prefill=prefill, decode=decode)
    assert policy.prefill_correction == pytest.approx(prefill_correction)
    assert policy.decode_correction == pytest.approx(decode_correction)


def test_the_trend_predictor_extrapolates_the_request_count_and_constant_does_not() -> None:
    def run(predictor: Predictor) -> Allocation | None:
        policy = ThroughputPolicy(SCENARIO, Allocation(prefill=1, decode=1), predictor=predictor)
        result = None
        # 30 then 45 req/s; TTFT at the expected 0.12 s (correction 1).
        for rate in (30.0, 45.0):
            snap = interval_snapshot(
                rate_rps=rate, isl=1000, osl=301, ttft_s=0.12, itl_s=0.06, decode_serving=2
            )
            result = policy.tick(OneSnapshot(snap))  # type: ignore[arg-type]
        return result

    constant, trend = run(Predictor.CONSTANT), run(Predictor.TREND)
    assert constant is not None and trend is not None
    # Constant: 45 x 1000 / 8333.3 = 5.4 -> 6. Trend: 60 x 1000 / 8333.3 = 7.2 -> 8.
    assert constant.prefill == 6
    assert trend.prefill == 8


def test_an_interval_without_requests_holds_the_pools() -> None:
    policy = ThroughputPolicy(SCENARIO, Allocation(prefill=2, decode=2))
    snap = interval_snapshot(
        rate_rps=0.0, isl=1000, osl=301, ttft_s=0.1, itl_s=0.04, decode_serving=2
    )
    assert policy.tick(OneSnapshot(snap)) is None  # type: ignore[arg-type]
