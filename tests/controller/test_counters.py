"""Counters: reset-corrected increases and the inter-arrival SCV (index of dispersion).

The SCV estimates are checked on simulated arrival processes whose ca² is known in
closed form (Poisson: 1; gamma renewal with shape k: 1/k; evenly spaced: 0), within
a few standard errors of the estimator (about ca² · sqrt(2 / intervals)).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import pytest

from controller.counters import (
    CounterSample,
    corrected_increase,
    cumulative_arrivals,
    dispersion_index,
    interarrival_scv,
    level_robust_dispersion,
)


@pytest.mark.parametrize(
    ("values", "increase"),
    [
        ([], 0.0),
        ([5.0], 0.0),
        ([1.0, 2.0, 3.0], 2.0),
        ([4.0, 4.0], 0.0),
        ([10.0, 15.0, 3.0, 8.0], 13.0),  # restart after 15: 5 + 3 + 5
        ([10.0, 0.0], 0.0),  # restarted with nothing counted yet
    ],
)
def test_the_increase_counts_a_drop_as_a_restart(values: list[float], increase: float) -> None:
    assert corrected_increase(values) == increase


def test_with_equal_intervals_the_dispersion_is_variance_over_mean() -> None:
    counts = [12.0, 7.0, 30.0, 1.0, 9.0]
    expected = np.var(counts, ddof=1) / np.mean(counts)
    assert dispersion_index(counts, [5.0] * 5) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("counts", "durations"),
    [
        ([1.0, 2.0], [1.0, 1.0]),  # fewer than three intervals
        ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0]),  # no arrivals
        ([1.0, 2.0, 3.0], [0.0, 0.0, 1.0]),  # empty intervals are dropped
        ([1.0, math.nan, 3.0], [1.0, 1.0, 1.0]),
    ],
)
def test_the_dispersion_is_none_without_enough_data(
    counts: list[float], durations: list[float]
) -> None:
    assert dispersion_index(counts, durations) is None


def test_counts_and_durations_must_pair_up() -> None:
    with pytest.raises(ValueError, match=r"^durations_s:"):
        dispersion_index([1.0, 2.0, 3.0], [1.0, 1.0])


def scraped(
    arrivals: npt.NDArray[np.float64], *, every_s: float, until_s: float, phase_s: float = 0.0
) -> list[CounterSample]:
    """A counter of ``arrivals`` read every ``every_s`` seconds."""
    times = np.arange(phase_s, until_s, every_s)
    counts = np.searchsorted(arrivals, times, side="right")
    return [(float(t), float(c)) for t, c in zip(times, counts, strict=True)]


def renewal(gaps: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    arrivals: npt.NDArray[np.float64] = np.cumsum(gaps)
    return arrivals


RATE_RPS = 20.0
DURATION_S = 10_000.0


def within_standard_errors(estimate: float | None, truth: float, intervals: int) -> None:
    assert estimate is not None
    standard_error = max(truth, 0.05) * math.sqrt(2.0 / intervals)
    assert abs(estimate - truth) < 4 * standard_error, (estimate, truth)


@pytest.mark.parametrize(
    ("shape", "scrape_s", "step_s"),
    [
        (1.0, 1.0, 5.0),  # Poisson
        (1.0, 2.0, 5.0),  # a step that is not a multiple of the scrape interval
        (0.25, 1.0, 20.0),  # bursty: ca² = 4, long sub-windows
        (4.0, 1.0, 20.0),  # smoother than Poisson: ca² = 0.25
    ],
)
def test_gamma_renewal_arrivals_give_their_ca2(
    shape: float, scrape_s: float, step_s: float
) -> None:
    rng = np.random.default_rng(7)
    n = int(RATE_RPS * DURATION_S * 1.2)
    arrivals = renewal(rng.gamma(shape, 1.0 / (shape * RATE_RPS), size=n))
    samples = scraped(arrivals, every_s=scrape_s, until_s=DURATION_S)
    estimate = interarrival_scv([samples], step_s=step_s, window_s=6 * step_s)
    within_standard_errors(estimate, 1.0 / shape, int(DURATION_S / step_s))


def test_evenly_spaced_arrivals_have_no_dispersion() -> None:
    arrivals = renewal(np.full(2000, 0.05))  # 20 per second, exactly
    samples = scraped(arrivals, every_s=1.0, until_s=90.0, phase_s=0.025)
    assert interarrival_scv([samples], step_s=5.0, window_s=30.0) == pytest.approx(0.0, abs=1e-12)


def test_two_routers_read_at_different_moments_sum_to_the_whole_stream() -> None:
    rng = np.random.default_rng(11)
    arrivals = renewal(rng.exponential(1.0 / RATE_RPS, size=int(RATE_RPS * DURATION_S * 1.2)))
    to_first = rng.random(len(arrivals)) < 0.5
    series = [
        scraped(arrivals[to_first], every_s=1.0, until_s=DURATION_S, phase_s=0.3),
        scraped(arrivals[~to_first], every_s=1.0, until_s=DURATION_S, phase_s=0.7),
    ]
    within_standard_errors(
        interarrival_scv(series, step_s=5.0, window_s=30.0), 1.0, int(DURATION_S / 5)
    )


def with_a_restart() -> tuple[list[CounterSample], list[CounterSample]]:
    """A counter's readings, and the same readings had its process restarted just
    after the reading at 60 s (later readings count from 0)."""
    rng = np.random.default_rng(3)
    arrivals = renewal(rng.exponential(1.0 / RATE_RPS, size=4000))
    samples = scraped(arrivals, every_s=1.0, until_s=150.0)
    at_restart = dict(samples)[60.0]
    return samples, [(t, v if t <= 60.0 else v - at_restart) for t, v in samples]


def test_a_restart_does_not_change_the_estimate() -> None:
    samples, restarted = with_a_restart()
    assert interarrival_scv([restarted], step_s=5.0, window_s=30.0) == pytest.approx(
        interarrival_scv([samples], step_s=5.0, window_s=30.0), rel=1e-12
    )


def test_the_scv_is_none_with_too_short_a_history_or_no_arrivals() -> None:
    short = [(0.0, 0.0), (1.0, 5.0), (2.0, 9.0)]
    assert interarrival_scv([short], step_s=1.0, window_s=30.0) is None  # two sub-windows
    idle = [(float(t), 42.0) for t in range(60)]
    assert interarrival_scv([idle], step_s=5.0, window_s=30.0) is None
    assert interarrival_scv([], step_s=5.0, window_s=30.0) is None
    with pytest.raises(ValueError, match=r"^step_s:"):
        interarrival_scv([idle], step_s=0.0, window_s=30.0)


def test_one_counter_s_record_counts_every_arrival_up_to_each_sample() -> None:
    rng = np.random.default_rng(5)
    arrivals = renewal(rng.exponential(1.0 / RATE_RPS, size=3000))
    samples = scraped(arrivals, every_s=1.0, until_s=100.0, phase_s=0.4)
    counts = cumulative_arrivals([samples])
    assert counts is not None
    times = np.array([t for t, _ in counts])
    expected = np.searchsorted(arrivals, times, side="right") - np.searchsorted(
        arrivals, times[0], side="right"
    )
    assert [n for _, n in counts] == pytest.approx(expected.astype(float), abs=0)


def test_two_routers_records_sum_to_the_whole_stream_at_their_sample_times() -> None:
    rng = np.random.default_rng(13)
    arrivals = renewal(rng.exponential(1.0 / RATE_RPS, size=3000))
    to_first = rng.random(len(arrivals)) < 0.5
    first = scraped(arrivals[to_first], every_s=1.0, until_s=100.0, phase_s=0.3)
    second = scraped(arrivals[~to_first], every_s=1.0, until_s=100.0, phase_s=0.7)
    counts = cumulative_arrivals([first, second])
    assert counts is not None
    assert counts[0][0] == pytest.approx(0.7)  # from where both counters are read
    # Between two of the first router's readings, its own arrivals are exact and the
    # second's are those up to its reading just before each.

    def by_time(t_s: float) -> float:
        return next(n for s, n in counts if abs(s - t_s) < 1e-6)

    a, b = 10.3, 60.3
    own = np.count_nonzero((arrivals[to_first] > a) & (arrivals[to_first] <= b))
    other = np.count_nonzero((arrivals[~to_first] > a - 0.6) & (arrivals[~to_first] <= b - 0.6))
    assert by_time(b) - by_time(a) == own + other


def test_a_restart_does_not_break_the_record() -> None:
    samples, restarted = with_a_restart()
    assert cumulative_arrivals([restarted]) == cumulative_arrivals([samples])


def test_the_record_needs_two_readings_and_finite_values() -> None:
    assert cumulative_arrivals([[(0.0, 3.0)]]) is None
    assert cumulative_arrivals([]) is None
    assert cumulative_arrivals([[(0.0, 1.0), (1.0, math.nan)]]) is None


# -- a change of the rate is no dispersion ----------------------------------------------


def poisson(rng: np.random.Generator, rate_rps: float, start_s: float, end_s: float) -> np.ndarray:
    n = rng.poisson(rate_rps * (end_s - start_s))
    arrivals: np.ndarray = np.sort(rng.uniform(start_s, end_s, size=n))
    return arrivals


def on_off(rng: np.random.Generator) -> np.ndarray:
    """Poisson bursts at 25 req/s for 70 s after 130 s of near silence, five times
    over 1,000 s; the changes fall inside sub-windows (at 130.0 + 200 j + 2.5 s)."""
    parts = []
    for j in range(5):
        t0 = 200.0 * j
        parts += [poisson(rng, 0.05, t0, t0 + 132.5), poisson(rng, 25.0, t0 + 132.5, t0 + 200.0)]
    return np.concatenate(parts)


def test_bursts_after_silence_are_a_change_of_level_not_dispersion() -> None:
    # The arrivals of either level are Poisson (ca² 1); the plain index of dispersion
    # of the 5-s counts reads the levels' difference as burstiness.
    arrivals = on_off(np.random.default_rng(5))
    samples = scraped(arrivals, every_s=1.0, until_s=1000.0)
    estimate = interarrival_scv([samples], step_s=5.0, window_s=30.0)
    bursting = int(5 * 67.5 / 5)  # the sub-windows that hold arrivals
    within_standard_errors(estimate, 1.0, bursting)
    counts = np.diff([v for t, v in samples if t % 5.0 == 0.0])
    assert dispersion_index(counts, np.full(len(counts), 5.0)) > 20.0


def test_clusters_of_simultaneous_requests_stay_dispersion() -> None:
    # Compound Poisson: clusters at 1 per second, each of 10 simultaneous requests,
    # so every interval's count is 10 x Poisson: an index of dispersion of exactly 10.
    rng = np.random.default_rng(9)
    clusters = poisson(rng, 1.0, 0.0, 2000.0)
    arrivals = np.repeat(clusters, 10)
    samples = scraped(arrivals, every_s=1.0, until_s=2000.0)
    within_standard_errors(interarrival_scv([samples], step_s=5.0, window_s=30.0), 10.0, 400)


def test_a_level_that_began_in_the_newest_sub_window_is_not_read_as_dispersion() -> None:
    # The tick that first sees a burst cannot know it will last; a spike there is
    # taken as a level for one tick, and the Poisson before it is what is measured.
    rng = np.random.default_rng(13)
    arrivals = np.concatenate([poisson(rng, 4.0, 0.0, 297.0), poisson(rng, 40.0, 297.0, 300.0)])
    samples = scraped(arrivals, every_s=1.0, until_s=300.5)
    within_standard_errors(interarrival_scv([samples], step_s=5.0, window_s=30.0), 1.0, 60)


def test_each_window_is_judged_about_its_own_level() -> None:
    # Counts that change from window to window but are even inside each: no dispersion.
    counts = np.repeat([10.0, 20.0, 10.0, 30.0, 20.0], 6)
    assert dispersion_index(counts, np.full(30, 5.0)) > 3.0
    assert level_robust_dispersion(counts, np.full(30, 5.0), window_intervals=6) == 0.0


def test_the_level_robust_dispersion_is_the_plain_one_for_one_window() -> None:
    counts = [12.0, 7.0, 30.0, 1.0, 9.0, 14.0]
    expected = dispersion_index(counts, [5.0] * 6)
    assert level_robust_dispersion(counts, [5.0] * 6, window_intervals=6) == pytest.approx(
        expected, rel=1e-12
    )


def test_a_change_of_level_needs_a_degree_of_freedom_left_to_be_judged_by() -> None:
    # Three sub-windows of an even 50 req/s read by a jittery scrape: any split leaves
    # pieces of one sub-window, with no noise to measure a change against, so the
    # counts are judged as one level (the plain index), not as no estimate at all.
    counts, durations = [109.0, 111.0, 103.0], [2.19, 2.21, 2.06]
    expected = dispersion_index(counts, durations)
    assert expected is not None
    assert level_robust_dispersion(counts, durations, window_intervals=4) == pytest.approx(
        expected, rel=1e-12
    )


def test_a_burst_in_the_newest_sub_window_after_silence_is_a_change_not_dispersion() -> None:
    # Silent sub-windows then a burst just begun: the change is beyond doubt (judged
    # against the dispersion fitted without it), and what is left after it holds no
    # degree of freedom, so there is no estimate rather than the burst read as noise.
    counts, durations = [0.0] * 14 + [60.0], [2.0] * 15
    pooled = dispersion_index(counts, durations)
    assert pooled is not None and pooled > 10.0
    assert level_robust_dispersion(counts, durations, window_intervals=15) is None


def test_the_level_robust_dispersion_rejects_what_it_cannot_use() -> None:
    with pytest.raises(ValueError, match=r"^window_intervals:"):
        level_robust_dispersion([1.0, 2.0, 3.0], [1.0] * 3, window_intervals=0)
    with pytest.raises(ValueError, match=r"^window_s:"):
        interarrival_scv([[(0.0, 0.0), (10.0, 5.0)]], step_s=5.0, window_s=0.0)
