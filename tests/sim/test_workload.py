"""Generated workloads match their closed forms; transformations keep what they promise.

Statistical checks use intervals of four (or five) standard errors around the
theoretical value, so a correct implementation fails with probability well under
1e-4 per check whatever the seed.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.lengths import LengthSamples
from sim.trace import FloatArray, Trace, TraceError
from sim.trace_io import load_lengths, load_trace
from sim.workload import (
    TraceStats,
    diurnal_arrivals,
    gamma_arrivals,
    poisson_arrivals,
    scale_rate,
    summarize,
    synthesize,
    time_slice,
)

BUNDLED = Path(__file__).parents[2] / "data" / "traces"
AZURE_CONV = BUNDLED / "AzureLLMInferenceTrace_conv.csv"
AZURE_CODE = BUNDLED / "AzureLLMInferenceTrace_code.csv"
ARXIV = BUNDLED / "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    # A different, reproducible stream per test; the checks hold for any stream.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="module")
def conv() -> Trace:
    return load_trace(AZURE_CONV)


def assert_within(value: float, expected: float, sigma: float, *, k: float = 4.0) -> None:
    assert abs(value - expected) <= k * sigma, f"{value} not within {k} x {sigma} of {expected}"


def scv(gaps: FloatArray) -> float:
    return float(gaps.var() / gaps.mean() ** 2)


def scv_standard_error(gaps: FloatArray) -> float:
    """Delta-method standard error of the sample SCV of iid gaps, from their moments.

    SCV = s^2 / m^2, so Var(SCV) / SCV^2 ~ [Var(s^2) / s^4 + 4 Var(m) / m^2
    - 4 Cov(s^2, m) / (s^2 m)] with Var(s^2) = (mu4 - s^4) / n, Var(m) = s^2 / n and
    Cov(s^2, m) = mu3 / n.
    """
    n = len(gaps)
    m = gaps.mean()
    centred = gaps - m
    var = float(np.mean(centred**2))
    mu3 = float(np.mean(centred**3))
    mu4 = float(np.mean(centred**4))
    relative_var = ((mu4 - var**2) / var**2 + 4 * var / m**2 - 4 * mu3 / (var * m)) / n
    return scv(gaps) * math.sqrt(relative_var)


def per_minute(arrival_s: FloatArray, duration_s: float) -> FloatArray:
    counts, _ = np.histogram(
        arrival_s, bins=int(duration_s // 60), range=(0, duration_s // 60 * 60)
    )
    return counts.astype(np.float64)


# --- arrival processes ---------------------------------------------------------------

ArrivalMaker = Callable[[float, np.random.Generator], FloatArray]

MAKERS: dict[str, ArrivalMaker] = {
    "poisson": lambda d, g: poisson_arrivals(rate_rps=3.0, duration_s=d, rng=g),
    "gamma_smooth": lambda d, g: gamma_arrivals(rate_rps=3.0, ca2=0.2, duration_s=d, rng=g),
    "gamma_bursty": lambda d, g: gamma_arrivals(rate_rps=3.0, ca2=30.0, duration_s=d, rng=g),
    "diurnal": lambda d, g: diurnal_arrivals(
        mean_rate_rps=3.0, peak_to_trough=10.0, period_s=50.0, duration_s=d, ca2=3.0, rng=g
    ),
}


@pytest.mark.parametrize("maker", MAKERS.values(), ids=MAKERS.keys())
@settings(max_examples=40, deadline=None)
@given(duration_s=st.floats(0.01, 500.0), seed=st.integers(0, 2**32 - 1))
def test_every_arrival_process_gives_sorted_times_inside_the_window(
    maker: ArrivalMaker, duration_s: float, seed: int
) -> None:
    arrival_s = maker(duration_s, np.random.default_rng(seed))
    assert arrival_s.dtype == np.float64
    assert np.all(np.diff(arrival_s) >= 0)
    assert np.all((arrival_s >= 0) & (arrival_s < duration_s))


def test_a_poisson_process_has_the_requested_count_mean_gap_and_unit_scv(
    rng: np.random.Generator,
) -> None:
    rate_rps, duration_s = 20.0, 5000.0
    arrival_s = poisson_arrivals(rate_rps=rate_rps, duration_s=duration_s, rng=rng)
    expected = rate_rps * duration_s
    assert_within(len(arrival_s), expected, math.sqrt(expected))
    gaps = np.diff(arrival_s)
    assert_within(gaps.mean(), 1 / rate_rps, (1 / rate_rps) / math.sqrt(len(gaps)))
    # Exponential gaps: the sample SCV has relative standard error sqrt(4 / n).
    assert_within(scv(gaps), 1.0, math.sqrt(4 / len(gaps)))


@pytest.mark.parametrize("ca2", [0.25, 1.0, 4.0, 16.0])
def test_gamma_gaps_have_mean_one_over_rate_and_the_requested_scv(
    rng: np.random.Generator, ca2: float
) -> None:
    rate_rps = 10.0
    arrival_s = gamma_arrivals(rate_rps=rate_rps, ca2=ca2, duration_s=20_000.0, rng=rng)
    gaps = np.diff(arrival_s)
    n = len(gaps)
    assert_within(gaps.mean(), 1 / rate_rps, math.sqrt(ca2) / rate_rps / math.sqrt(n))
    # For Gamma gaps the delta method gives Var(SCV) / SCV^2 = 2 (1 + ca2) / n.
    assert_within(scv(gaps), ca2, ca2 * math.sqrt(2 * (1 + ca2) / n))


def test_a_gamma_process_starts_in_equilibrium_so_a_short_window_holds_rate_times_width(
    rng: np.random.Generator,
) -> None:
    # Had the first gap been an ordinary Gamma gap, the mean count in [0, w) would be
    # near the renewal function w * rate + (ca2 - 1) / 2 = 2 + 4, not 2.
    rate_rps, ca2, window_s, runs = 1.0, 9.0, 2.0, 4000
    counts = np.array(
        [
            len(gamma_arrivals(rate_rps=rate_rps, ca2=ca2, duration_s=window_s, rng=rng))
            for _ in range(runs)
        ]
    )
    assert_within(counts.mean(), rate_rps * window_s, counts.std() / math.sqrt(runs))


def test_a_diurnal_process_follows_the_integrated_sinusoidal_rate(
    rng: np.random.Generator,
) -> None:
    mean_rps, ratio, period_s, ca2 = 20.0, 4.0, 3600.0, 2.0
    arrival_s = diurnal_arrivals(
        mean_rate_rps=mean_rps,
        peak_to_trough=ratio,
        period_s=period_s,
        duration_s=2 * period_s,
        ca2=ca2,
        rng=rng,
    )
    a = (ratio - 1) / (ratio + 1)
    omega = 2 * math.pi / period_s

    def cumulative(t: float) -> float:
        return mean_rps * (t - a / omega * math.sin(omega * t))

    edges = np.linspace(0.0, 2 * period_s, 25)
    counts, _ = np.histogram(arrival_s, bins=edges)
    for lo, hi, count in zip(edges[:-1], edges[1:], counts, strict=True):
        expected = cumulative(hi) - cumulative(lo)
        # A renewal count over many gaps has variance ~ ca2 x its mean.
        assert_within(count, expected, math.sqrt(ca2 * expected), k=5.0)
    # The peak (half a period in) is `ratio` times the trough (t = 0): the two
    # 600-s spans around each, in counts, against their closed-form expectations.
    trough = counts[0] + counts[-1]
    peak = counts[5] + counts[6]
    expected_trough = cumulative(300.0) + cumulative(7200.0) - cumulative(6900.0)
    expected_peak = cumulative(2100.0) - cumulative(1500.0)
    expected_ratio = expected_peak / expected_trough
    relative_sigma = math.sqrt(ca2 / expected_peak + ca2 / expected_trough)
    assert_within(peak / trough, expected_ratio, expected_ratio * relative_sigma)


def test_a_flat_diurnal_process_with_unit_scv_is_poisson(rng: np.random.Generator) -> None:
    arrival_s = diurnal_arrivals(
        mean_rate_rps=5.0, peak_to_trough=1.0, period_s=100.0, duration_s=10_000.0, ca2=1.0, rng=rng
    )
    gaps = np.diff(arrival_s)
    assert_within(len(arrival_s), 50_000, math.sqrt(50_000))
    assert_within(scv(gaps), 1.0, math.sqrt(4 / len(gaps)))


BAD_ARGUMENTS: list[tuple[Callable[..., Any], dict[str, Any], str]] = [
    (poisson_arrivals, {"rate_rps": 0.0, "duration_s": 1.0}, "rate_rps"),
    (poisson_arrivals, {"rate_rps": 1.0, "duration_s": -1.0}, "duration_s"),
    (poisson_arrivals, {"rate_rps": float("nan"), "duration_s": 1.0}, "rate_rps"),
    (gamma_arrivals, {"rate_rps": 1.0, "ca2": 0.0, "duration_s": 1.0}, "ca2"),
    (gamma_arrivals, {"rate_rps": 1.0, "ca2": float("inf"), "duration_s": 1.0}, "ca2"),
    (
        diurnal_arrivals,
        {
            "mean_rate_rps": 1.0,
            "peak_to_trough": 0.5,
            "period_s": 1.0,
            "duration_s": 1.0,
            "ca2": 1.0,
        },
        "peak_to_trough",
    ),
    (
        diurnal_arrivals,
        {
            "mean_rate_rps": 1.0,
            "peak_to_trough": 2.0,
            "period_s": 0.0,
            "duration_s": 1.0,
            "ca2": 1.0,
        },
        "period_s",
    ),
    (
        diurnal_arrivals,
        {
            "mean_rate_rps": -1.0,
            "peak_to_trough": 2.0,
            "period_s": 1.0,
            "duration_s": 1.0,
            "ca2": 1.0,
        },
        "mean_rate_rps",
    ),
]


@pytest.mark.parametrize(
    ("function", "kwargs", "field"),
    BAD_ARGUMENTS,
    ids=[f"{f.__name__}-{field}" for f, _, field in BAD_ARGUMENTS],
)
def test_a_bad_argument_is_rejected_by_name(
    rng: np.random.Generator, function: Callable[..., Any], kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        function(**kwargs, rng=rng)


# --- synthesize ----------------------------------------------------------------------


def test_synthesized_requests_keep_the_samples_prompt_output_pairs(
    rng: np.random.Generator,
) -> None:
    # Perfectly anti-correlated pairs: sampling the columns independently would mix them.
    lengths = LengthSamples(
        prompt_tokens=np.array([1, 10, 100, 1000]),
        output_tokens=np.array([4, 3, 2, 1]),
        source="pairs",
    )
    arrival_s = poisson_arrivals(rate_rps=100.0, duration_s=400.0, rng=rng)
    trace = synthesize(arrival_s=arrival_s, lengths=lengths, rng=rng, source="test")
    np.testing.assert_array_equal(trace.arrival_s, arrival_s)
    assert trace.source == "test"
    pairs = {(1, 4), (10, 3), (100, 2), (1000, 1)}
    assert (
        set(zip(trace.prompt_tokens.tolist(), trace.output_tokens.tolist(), strict=True)) <= pairs
    )
    # Rows are drawn uniformly: each is a Binomial(n, 1/4) count.
    n = len(trace)
    for prompt in (1, 10, 100, 1000):
        count = int(np.sum(trace.prompt_tokens == prompt))
        assert_within(count, n / 4, math.sqrt(n * 0.25 * 0.75))


def test_synthesizing_from_arxiv_keeps_its_length_correlation(rng: np.random.Generator) -> None:
    lengths = load_lengths(ARXIV)
    arrival_s = np.sort(rng.uniform(0, 1000, size=len(lengths)))
    trace = synthesize(arrival_s=arrival_s, lengths=lengths, rng=rng, source="arxiv")
    source_r = np.corrcoef(np.log(lengths.prompt_tokens), np.log(lengths.output_tokens))[0, 1]
    drawn_r = np.corrcoef(np.log(trace.prompt_tokens), np.log(trace.output_tokens))[0, 1]
    # Fisher z: a sample correlation has standard error ~ 1 / sqrt(n - 3) in z units;
    # resampling plus the source's own sampling: at most twice that.
    assert_within(np.arctanh(drawn_r), np.arctanh(source_r), 2 / math.sqrt(len(lengths) - 3))


def test_synthesize_rejects_unsorted_arrivals(rng: np.random.Generator) -> None:
    lengths = LengthSamples(prompt_tokens=np.array([5]), output_tokens=np.array([6]), source="one")
    with pytest.raises(TraceError, match="arrival_s"):
        synthesize(arrival_s=np.array([2.0, 1.0]), lengths=lengths, rng=rng, source="x")


# --- scale_rate ----------------------------------------------------------------------


@pytest.mark.parametrize("factor", [0.1, 0.5, 1.0, 2.0, 2.5, 7.3])
def test_scaling_the_rate_multiplies_the_request_count(
    conv: Trace, rng: np.random.Generator, factor: float
) -> None:
    n = len(conv)
    scaled = scale_rate(conv, factor, rng)
    if factor < 1:
        sigma = math.sqrt(n * factor * (1 - factor))
    else:
        frac = factor - math.floor(factor)
        sigma = math.sqrt(n * frac * (1 - frac))
    assert abs(len(scaled) - factor * n) <= 4 * sigma + 1e-9
    # Same time axis, no request outside the original span.
    assert scaled.arrival_s.min() >= conv.arrival_s[0]
    assert scaled.arrival_s.max() <= conv.arrival_s[-1]


@pytest.mark.parametrize("path", [AZURE_CONV, AZURE_CODE], ids=["conv", "code"])
def test_a_large_factor_keeps_the_per_minute_rate_profile(
    rng: np.random.Generator, path: Path
) -> None:
    trace = load_trace(path)
    scaled = scale_rate(trace, 10.0, rng)
    before = per_minute(trace.arrival_s, trace.duration_s)
    after = per_minute(scaled.arrival_s, trace.duration_s)
    assert np.corrcoef(before, after)[0, 1] > 0.99


def test_an_integer_factor_copies_every_request_with_its_lengths_that_many_times(
    conv: Trace, rng: np.random.Generator
) -> None:
    scaled = scale_rate(conv, 3.0, rng)
    original = np.unique(
        np.stack([conv.prompt_tokens, conv.output_tokens]), axis=1, return_counts=True
    )
    copied = np.unique(
        np.stack([scaled.prompt_tokens, scaled.output_tokens]), axis=1, return_counts=True
    )
    np.testing.assert_array_equal(copied[0], original[0])
    np.testing.assert_array_equal(copied[1], 3 * original[1])
    # Every original arrival is still there.
    assert np.all(np.isin(conv.arrival_s, scaled.arrival_s))


def test_a_factor_of_one_returns_the_same_requests(conv: Trace, rng: np.random.Generator) -> None:
    same = scale_rate(conv, 1.0, rng)
    np.testing.assert_array_equal(same.arrival_s, conv.arrival_s)
    np.testing.assert_array_equal(same.prompt_tokens, conv.prompt_tokens)


def test_thinning_a_renewal_process_gives_the_closed_form_scv(rng: np.random.Generator) -> None:
    # Keeping each arrival with probability p makes each gap a Geometric(p) sum of
    # gaps: SCV = p * ca2 + 1 - p.
    ca2, p = 4.0, 0.25
    arrival_s = gamma_arrivals(rate_rps=50.0, ca2=ca2, duration_s=4000.0, rng=rng)
    lengths = LengthSamples(prompt_tokens=np.array([1]), output_tokens=np.array([1]), source="unit")
    trace = synthesize(arrival_s=arrival_s, lengths=lengths, rng=rng, source="gamma")
    gaps = np.diff(scale_rate(trace, p, rng).arrival_s)
    assert_within(scv(gaps), p * ca2 + 1 - p, scv_standard_error(gaps))


@pytest.mark.parametrize("factor", [0.0, -2.0, float("nan"), float("inf")])
def test_a_factor_that_is_not_a_finite_positive_number_is_rejected(
    conv: Trace, rng: np.random.Generator, factor: float
) -> None:
    with pytest.raises(ValueError, match=r"^factor:"):
        scale_rate(conv, factor, rng)


def test_scaling_an_empty_or_single_request_trace_stays_in_its_span(
    rng: np.random.Generator,
) -> None:
    one = Trace(
        arrival_s=np.array([0.0]),
        prompt_tokens=np.array([5]),
        output_tokens=np.array([6]),
        source="one",
    )
    tripled = scale_rate(one, 3.0, rng)
    np.testing.assert_array_equal(tripled.arrival_s, [0.0, 0.0, 0.0])
    empty = Trace(
        arrival_s=np.array([]),
        prompt_tokens=np.array([], dtype=np.int64),
        output_tokens=np.array([], dtype=np.int64),
        source="empty",
    )
    assert len(scale_rate(empty, 5.0, rng)) == 0


# --- time_slice ----------------------------------------------------------------------


def test_a_slice_holds_the_requests_of_its_window_rebased_to_its_start(conv: Trace) -> None:
    start_s, end_s = 600.0, 1200.0
    inside = (conv.arrival_s >= start_s) & (conv.arrival_s < end_s)
    part = time_slice(conv, start_s=start_s, end_s=end_s)
    np.testing.assert_allclose(part.arrival_s, conv.arrival_s[inside] - start_s)
    np.testing.assert_array_equal(part.prompt_tokens, conv.prompt_tokens[inside])
    np.testing.assert_array_equal(part.output_tokens, conv.output_tokens[inside])
    assert np.all((part.arrival_s >= 0) & (part.arrival_s < end_s - start_s))


def test_consecutive_slices_partition_the_trace(conv: Trace) -> None:
    edges = np.arange(0.0, conv.arrival_s[-1] + 300.0, 300.0)
    sizes = [len(time_slice(conv, start_s=a, end_s=b)) for a, b in itertools.pairwise(edges)]
    assert sum(sizes) == len(conv)


def test_a_quiet_window_gives_an_empty_slice() -> None:
    trace = Trace(
        arrival_s=np.array([0.0, 100.0]),
        prompt_tokens=np.array([1, 2]),
        output_tokens=np.array([3, 4]),
        source="two",
    )
    assert len(time_slice(trace, start_s=10.0, end_s=20.0)) == 0


@pytest.mark.parametrize(
    ("start_s", "end_s", "bound"),
    [
        (-1.0, 10.0, "start_s"),
        (float("nan"), 10.0, "start_s"),
        (10.0, 10.0, "end_s"),
        (10.0, 5.0, "end_s"),
        (0.0, float("inf"), "end_s"),
        (1e6, 2e6, "start_s"),
    ],
)
def test_a_bad_bound_is_named(conv: Trace, start_s: float, end_s: float, bound: str) -> None:
    with pytest.raises(ValueError, match=rf"^{bound}:"):
        time_slice(conv, start_s=start_s, end_s=end_s)


# --- summarize -----------------------------------------------------------------------


def test_the_azure_conv_summary_matches_the_published_figures(conv: Trace) -> None:
    stats = summarize(conv)
    assert stats.requests == 19_366
    # Published: about 5.4-5.5 requests/s over the hour, prompts ~1,155 tokens and
    # outputs ~211 tokens on average. Means within four standard errors.
    assert stats.mean_rate_rps is not None and 5.2 <= stats.mean_rate_rps <= 5.8
    n = len(conv)
    assert_within(stats.prompt_mean_tokens, 1155, conv.prompt_tokens.std() / math.sqrt(n))
    assert_within(stats.output_mean_tokens, 211, conv.output_tokens.std() / math.sqrt(n))
    # Right-skewed lengths: median below mean, P99 far above it.
    assert stats.prompt_p50_tokens < stats.prompt_mean_tokens < stats.prompt_p99_tokens
    assert stats.output_p50_tokens < stats.output_mean_tokens < stats.output_p99_tokens
    assert stats.busiest_minute_rps > stats.mean_rate_rps


def test_the_azure_code_trace_is_far_burstier_than_poisson() -> None:
    stats = summarize(load_trace(AZURE_CODE))
    assert stats.interarrival_scv is not None and stats.interarrival_scv > 10


def test_the_summary_of_a_poisson_trace_recovers_its_rate_and_unit_scv(
    rng: np.random.Generator,
) -> None:
    rate_rps = 8.0
    arrival_s = poisson_arrivals(rate_rps=rate_rps, duration_s=20_000.0, rng=rng)
    lengths = LengthSamples(
        prompt_tokens=np.arange(1, 101), output_tokens=np.full(100, 7), source="uniform"
    )
    stats = summarize(synthesize(arrival_s=arrival_s, lengths=lengths, rng=rng, source="p"))
    n = stats.requests
    assert stats.mean_rate_rps is not None and stats.interarrival_scv is not None
    assert_within(stats.mean_rate_rps, rate_rps, rate_rps / math.sqrt(n))
    assert_within(stats.interarrival_scv, 1.0, math.sqrt(4 / n))
    # Prompts uniform on 1..100: mean 50.5, standard deviation sqrt((100^2 - 1) / 12).
    assert_within(stats.prompt_mean_tokens, 50.5, math.sqrt((100**2 - 1) / 12 / n))
    assert stats.output_mean_tokens == stats.output_p50_tokens == stats.output_p99_tokens == 7


def test_length_percentiles_interpolate_between_order_statistics() -> None:
    trace = Trace(
        arrival_s=np.arange(100.0),
        prompt_tokens=np.arange(1, 101),
        output_tokens=np.full(100, 3),
        source="ramp",
    )
    stats = summarize(trace)
    assert stats.prompt_mean_tokens == pytest.approx(50.5)
    assert stats.prompt_p50_tokens == pytest.approx(50.5)
    assert stats.prompt_p99_tokens == pytest.approx(1 + 0.99 * 99)
    assert stats.mean_rate_rps == pytest.approx(1.0)
    assert stats.interarrival_scv == pytest.approx(0.0)


def test_the_busiest_minute_is_the_fullest_sixty_second_window() -> None:
    trace = Trace(
        arrival_s=np.array([0.0, 100.0, 110.0, 159.9, 160.0, 400.0]),
        prompt_tokens=np.ones(6, dtype=np.int64),
        output_tokens=np.ones(6, dtype=np.int64),
        source="clusters",
    )
    # [100, 160) holds three; [110, 170) holds three too; no window holds four.
    assert summarize(trace).busiest_minute_rps == pytest.approx(3 / 60)


def test_a_single_request_has_no_rate_or_scv() -> None:
    trace = Trace(
        arrival_s=np.array([0.0]),
        prompt_tokens=np.array([9]),
        output_tokens=np.array([2]),
        source="one",
    )
    stats = summarize(trace)
    assert stats.mean_rate_rps is None
    assert stats.interarrival_scv is None
    assert stats.busiest_minute_rps == pytest.approx(1 / 60)


def test_an_empty_trace_has_no_summary() -> None:
    empty = Trace(
        arrival_s=np.array([]),
        prompt_tokens=np.array([], dtype=np.int64),
        output_tokens=np.array([], dtype=np.int64),
        source="empty",
    )
    with pytest.raises(TraceError, match="no requests"):
        summarize(empty)


def test_trace_stats_name_a_bad_field() -> None:
    good: dict[str, Any] = {
        "requests": 2,
        "duration_s": 1.0,
        "mean_rate_rps": 1.0,
        "interarrival_scv": None,
        "busiest_minute_rps": 2 / 60,
        "prompt_mean_tokens": 5.0,
        "prompt_p50_tokens": 5.0,
        "prompt_p99_tokens": 5.0,
        "output_mean_tokens": 5.0,
        "output_p50_tokens": 5.0,
        "output_p99_tokens": 5.0,
    }
    TraceStats(**good)
    with pytest.raises(ValueError, match=r"^duration_s:"):
        TraceStats(**{**good, "duration_s": -1.0})
    with pytest.raises(ValueError, match=r"^requests:"):
        TraceStats(**{**good, "requests": 0})


# --- LengthSamples -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "output", "field"),
    [
        (np.array([1, 2]), np.array([1]), "output_tokens"),
        (np.array([0, 2]), np.array([1, 1]), "prompt_tokens"),
        (np.array([], dtype=np.int64), np.array([], dtype=np.int64), "prompt_tokens"),
        (np.array([1.5]), np.array([1]), "prompt_tokens"),
    ],
    ids=["mismatched", "zero", "empty", "float"],
)
def test_length_samples_name_a_bad_field(
    prompt: npt.NDArray[Any], output: npt.NDArray[Any], field: str
) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        LengthSamples(prompt_tokens=prompt, output_tokens=output, source="bad")
