"""Run summaries: hand-computed percentiles, SLO attainment and lost requests."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sim.results import SimResults

NAN = math.nan


def results(
    *,
    arrival_s: list[float],
    first_token_s: list[float],
    finish_s: list[float],
    output_tokens: list[int],
    rejected: list[bool] | None = None,
) -> SimResults:
    n = len(arrival_s)
    return SimResults(
        arrival_s=np.asarray(arrival_s),
        prompt_tokens=np.full(n, 100, dtype=np.int64),
        output_tokens=np.asarray(output_tokens, dtype=np.int64),
        first_token_s=np.asarray(first_token_s),
        kv_ready_s=np.full(n, NAN),
        decode_start_s=np.full(n, NAN),
        finish_s=np.asarray(finish_s),
        rejected=np.asarray(rejected if rejected is not None else [False] * n, dtype=np.bool_),
        end_s=10.0,
        prefill_busy_s=3.0,
        prefill_serving_s=12.0,
        decode_busy_s=5.0,
        decode_serving_s=20.0,
        decode_iterations=40,
        decode_batch_token_total=100,
        prefill_queue_max=4,
        decode_queue_max=2,
        gpu_seconds=7200.0,
    )


FIVE = results(
    arrival_s=[0.0, 1.0, 2.0, 3.0, 4.0],
    first_token_s=[0.5, 1.2, 3.0, 3.1, NAN],  # the last one never got a first token
    finish_s=[0.5, 2.2, 4.0, 3.5, NAN],
    output_tokens=[1, 11, 3, 5, 2],
)


def test_tpot_spreads_the_decode_time_over_the_tokens_after_the_first() -> None:
    tpot = FIVE.tpot_s
    assert math.isnan(tpot[0])  # a single output token has no decode stage
    np.testing.assert_allclose(tpot[1:4], [(2.2 - 1.2) / 10, (4.0 - 3.0) / 2, (3.5 - 3.1) / 4])
    assert math.isnan(tpot[4])
    np.testing.assert_allclose(FIVE.ttft_s[:4], [0.5, 0.2, 1.0, 0.1])


def test_a_summary_interpolates_percentiles_linearly_between_sorted_values() -> None:
    s = FIVE.summary(ttft_slo_s=0.6, tpot_slo_s=0.2)
    # TTFTs sorted 0.1, 0.2, 0.5, 1.0: quantile q sits at position 3q.
    assert s.ttft_p50_s == pytest.approx(0.2 + 0.5 * (0.5 - 0.2))
    assert s.ttft_p90_s == pytest.approx(0.5 + 0.7 * (1.0 - 0.5))
    assert s.ttft_p99_s == pytest.approx(0.5 + 0.97 * (1.0 - 0.5))
    # TPOTs sorted 0.1, 0.1, 0.5: position 2q.
    assert s.tpot_p50_s == pytest.approx(0.1)
    assert s.tpot_p90_s == pytest.approx(0.1 + 0.8 * 0.4)
    assert s.tpot_p99_s == pytest.approx(0.1 + 0.98 * 0.4)


def test_slo_attainment_counts_requests_meeting_both_slos_and_lost_ones_as_misses() -> None:
    s = FIVE.summary(ttft_slo_s=0.6, tpot_slo_s=0.2)
    # Request 0 (one token) and requests 1 and 3 meet both; 2 misses TTFT; 4 is lost.
    assert s.slo_attainment == pytest.approx(3 / 5)
    assert (s.requests, s.completed, s.lost_requests) == (5, 4, 1)
    loose = FIVE.summary(ttft_slo_s=10.0, tpot_slo_s=10.0)
    assert loose.slo_attainment == pytest.approx(4 / 5)


def test_pool_statistics_are_ratios_of_the_totals() -> None:
    s = FIVE.summary(ttft_slo_s=1.0, tpot_slo_s=1.0)
    assert s.prefill_utilisation == pytest.approx(3.0 / 12.0)
    assert s.decode_utilisation == pytest.approx(5.0 / 20.0)
    assert s.decode_mean_batch == pytest.approx(100 / 40)
    assert (s.prefill_queue_max, s.decode_queue_max, s.gpu_hours) == (4, 2, 2.0)


def test_a_quantity_no_request_has_gives_no_percentile() -> None:
    only_first_tokens = results(
        arrival_s=[0.0, 1.0], first_token_s=[0.1, 1.3], finish_s=[0.1, 1.3], output_tokens=[1, 1]
    )
    s = only_first_tokens.summary(ttft_slo_s=0.2, tpot_slo_s=0.1)
    assert (s.tpot_p50_s, s.tpot_p90_s, s.tpot_p99_s) == (None, None, None)
    assert s.slo_attainment == pytest.approx(0.5)


@pytest.mark.parametrize(("ttft", "tpot", "field"), [(0.0, 1.0, "ttft_slo_s"), (1.0, NAN, "tpot")])
def test_a_summary_needs_positive_slos(ttft: float, tpot: float, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        FIVE.summary(ttft_slo_s=ttft, tpot_slo_s=tpot)


def test_per_request_arrays_of_different_lengths_are_rejected() -> None:
    with pytest.raises(ValueError, match="finish_s"):
        results(
            arrival_s=[0.0, 1.0], first_token_s=[0.1, 1.1], finish_s=[0.2], output_tokens=[1, 1]
        )


def test_a_request_beyond_the_context_is_rejected_not_lost_and_outside_the_attainment() -> None:
    # Five requests: the last was refused at arrival (no first token, never finished).
    r = results(
        arrival_s=[0.0, 1.0, 2.0, 3.0, 4.0],
        first_token_s=[0.5, 1.5, 2.5, 3.5, NAN],
        finish_s=[1.0, 2.0, 3.0, 9.0, NAN],
        output_tokens=[2, 2, 2, 2, 2],
        rejected=[False, False, False, False, True],
    )
    s = r.summary(ttft_slo_s=1.0, tpot_slo_s=1.0)
    assert (s.requests, s.rejected_requests, s.completed, s.lost_requests) == (5, 1, 4, 0)
    # Of the four admitted requests, the one with a 5.5-s TPOT missed: 3 of 4 met both.
    assert s.slo_attainment == 0.75
