"""The shared histogram code: PromQL's histogram_quantile, and samples from buckets."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.histograms import (
    Bucket,
    bucket_samples,
    histogram_quantile,
    length_samples,
)

INF = math.inf
# 10 observations <= 1, 20 in (1, 2], 10 in (2, 4], none above.
BASIC: list[Bucket] = [(1, 10), (2, 30), (4, 40), (INF, 40)]


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        (0.0, BASIC, 0.0),  # the first bucket starts at 0
        (0.25, BASIC, 1.0),  # rank 10: the top of the first bucket
        (0.5, BASIC, 1.5),  # rank 20: 10 of the 20 in (1, 2]
        (0.9, BASIC, 3.2),  # rank 36: 6 of the 10 in (2, 4]
        (1.0, BASIC, 4.0),
        # Unsorted input, and a bound given twice (merged by summing, as PromQL does).
        (0.5, [(INF, 40), (4, 40), (2, 30), (1, 4), (1, 6)], 1.5),
        # A rank in the +Inf bucket answers the highest finite bound.
        (0.99, [(1, 5), (2, 10), (INF, 20)], 2.0),
        # Non-monotonic counts are lifted: (2, 8) counts as (2, 10).
        (0.5, [(1, 10), (2, 8), (4, 40), (INF, 40)], 2 + 2 * 10 / 30),
        # A first bucket at or below zero answers its bound.
        (0.25, [(-1, 5), (1, 10), (INF, 10)], -1.0),
        # Rates work as well as counts: only the proportions matter.
        (0.9, [(1, 0.25), (2, 0.75), (4, 1.0), (INF, 1.0)], 3.2),
    ],
)
def test_the_quantile_interpolates_like_promql(
    q: float, buckets: list[Bucket], expected: float
) -> None:
    assert histogram_quantile(q, buckets) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "buckets",
    [
        [(1, 10), (2, 30)],  # no +Inf bucket
        [(INF, 10)],  # only +Inf
        [(1, 0), (2, 0), (INF, 0)],  # no observations
        [(1, math.nan), (INF, 3)],  # a NaN count
        [],
    ],
    ids=["no +Inf", "only +Inf", "empty", "NaN", "nothing"],
)
def test_the_quantile_is_none_where_promql_answers_nan(buckets: list[Bucket]) -> None:
    assert histogram_quantile(0.99, buckets) is None
    assert bucket_samples(buckets) is None


@pytest.mark.parametrize("q", [-0.1, 1.1, math.nan])
def test_a_quantile_outside_zero_one_is_a_programming_error(q: float) -> None:
    with pytest.raises(ValueError, match=r"^q:"):
        histogram_quantile(q, BASIC)


def test_the_quantile_of_uniform_observations_matches_the_closed_form() -> None:
    # 1000 observations spread evenly over (0.2, 0.4], in buckets 0.1 wide.
    values = 0.2 + 0.2 * (np.arange(1000) + 0.5) / 1000
    bounds = [round(0.1 * i, 1) for i in range(1, 11)] + [INF]
    buckets = [(b, float(np.sum(values <= b))) for b in bounds]
    for q in (0.5, 0.9, 0.99):
        assert histogram_quantile(q, buckets) == pytest.approx(0.2 + 0.2 * q, rel=1e-9)


@st.composite
def histograms(draw: st.DrawFn) -> tuple[list[float], list[int]]:
    """Integer bounds and per-bucket counts (nothing above the last finite bound)."""
    widths = draw(st.lists(st.integers(1, 1000), min_size=1, max_size=12))
    counts = draw(st.lists(st.integers(0, 500), min_size=len(widths), max_size=len(widths)))
    if sum(counts) == 0:
        counts[-1] = 1
    return [float(b) for b in np.cumsum(widths)], counts


@given(histograms(), st.integers(1, 2000))
def test_samples_keep_each_buckets_share_to_within_one(
    histogram: tuple[list[float], list[int]], n: int
) -> None:
    bounds, counts = histogram
    cumulative = np.cumsum(counts)
    buckets = [*zip(bounds, cumulative.tolist(), strict=True), (INF, int(cumulative[-1]))]
    samples = bucket_samples(buckets, n=n)
    assert samples is not None and len(samples) == n
    assert np.all(np.diff(samples) >= 0)
    # A sample belongs to the first bucket whose bound is >= it (the `le` rule).
    per_bucket = np.bincount(np.searchsorted(bounds, samples, side="left"), minlength=len(bounds))
    assert len(per_bucket) == len(bounds)  # none above the last finite bound
    shares = n * np.array(counts) / cumulative[-1]
    assert np.all(np.abs(per_bucket - shares) <= 1.0 + 1e-9)


def test_samples_spread_evenly_inside_a_bucket() -> None:
    samples = bucket_samples([(100, 0), (200, 10), (INF, 10)], n=10)
    assert samples is not None
    np.testing.assert_allclose(samples, 100 + 10 * (np.arange(10) + 0.5))


def test_samples_in_the_inf_bucket_sit_at_the_highest_finite_bound() -> None:
    samples = bucket_samples([(10, 5), (20, 5), (INF, 10)], n=10)
    assert samples is not None
    assert np.sum(samples == 20) == 5
    assert np.all(samples[:5] <= 10)


def test_lengths_are_whole_tokens_in_their_buckets_paired_in_quantile_order() -> None:
    prompt: list[Bucket] = [(128, 30), (512, 90), (2048, 100), (INF, 100)]
    output: list[Bucket] = [(0, 0), (64, 50), (256, 100), (INF, 100)]
    lengths = length_samples(prompt, output, source="test", requests=400, n=200)
    assert lengths is not None and len(lengths) == 200 and lengths.source == "test"
    for values, buckets in ((lengths.prompt_tokens, prompt), (lengths.output_tokens, output)):
        assert values.dtype == np.int64 and values.min() >= 1
        bounds = [b for b, _ in buckets if b != INF]
        per_bucket = np.bincount(np.searchsorted(bounds, values), minlength=len(bounds))
        expected = np.diff([0, *(c for _, c in buckets[: len(bounds)])]) * 2
        np.testing.assert_array_equal(per_bucket, expected)
    # Comonotone: the i-th shortest prompt goes with the i-th shortest output.
    assert np.all(np.diff(lengths.prompt_tokens) >= 0)
    assert np.all(np.diff(lengths.output_tokens) >= 0)


def test_lengths_are_none_when_either_histogram_is_empty() -> None:
    empty: list[Bucket] = [(128, 0), (INF, 0)]
    full: list[Bucket] = [(128, 5), (INF, 5)]
    assert length_samples(empty, full, source="test", requests=5) is None
    assert length_samples(full, empty, source="test", requests=5) is None
    assert length_samples(full, full, source="test", requests=0) is None


def test_lengths_in_a_bucket_at_or_below_zero_are_one_token() -> None:
    lengths = length_samples(
        [(0, 3), (INF, 3)], [(0, 3), (INF, 3)], source="test", requests=3.0, n=4
    )
    assert lengths is not None
    assert lengths.prompt_tokens.tolist() == [1, 1, 1]


def test_a_window_gives_one_pair_per_request_it_finished_reaching_its_extremes() -> None:
    # Five requests: five pairs, so the window weighs five in a pooled mix, spread from
    # the reconstruction's lowest to its highest quantile.
    prompt: list[Bucket] = [(100, 1), (1000, 4), (4000, 5), (INF, 5)]
    output: list[Bucket] = [(10, 1), (100, 4), (500, 5), (INF, 5)]
    five = length_samples(prompt, output, source="test", requests=5.2)
    assert five is not None and len(five) == 5
    every = bucket_samples(output)
    assert every is not None
    assert five.output_tokens.min() == math.ceil(every[0])
    assert five.output_tokens.max() == math.ceil(every[-1])  # the top bucket is kept
    # A busy window is capped at n; a fraction of a request still counts as one.
    busy = length_samples(prompt, output, source="test", requests=10_000, n=300)
    assert busy is not None and len(busy) == 300
    tiny = length_samples(prompt, output, source="test", requests=0.3)
    assert tiny is not None and len(tiny) == 1


def test_pooled_windows_weigh_by_their_requests_as_exact_samples_do() -> None:
    # A quiet window (10 short requests) and a busy one (190 long ones): pooled, the
    # mean output is the requests' mean, as the windows' exact samples would give.
    quiet: list[Bucket] = [(50, 10), (INF, 10)]
    busy: list[Bucket] = [(50, 0), (400, 190), (INF, 190)]
    pooled = np.concatenate(
        [
            w.output_tokens
            for w in (
                length_samples(quiet, quiet, source="quiet", requests=10),
                length_samples(busy, busy, source="busy", requests=190),
            )
            if w is not None
        ]
    )
    quiet_mean, busy_mean = 25.0, 225.0  # uniform within each bucket
    exact = (10 * quiet_mean + 190 * busy_mean) / 200
    assert pooled.mean() == pytest.approx(exact, rel=0.01)


def test_n_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"^n:"):
        bucket_samples(BASIC, n=0)
