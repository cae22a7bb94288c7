"""ScrapeSource against test exporters on loopback, with an injected clock.

The exporters' counters are stepped between scrapes, so every windowed value has a
closed form: a rate is the increase over the seconds the snapshots span, a P99 of
uniform observations is where linear interpolation puts it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import numpy as np
import pytest

from controller.observation import Observation, PoolObservation
from controller.sources import ScrapeSource
from queueing.pools import Pool
from tests.controller.conftest_sources import (
    OUTPUT_BUCKETS_TOKENS,
    PROMPT_BUCKETS_TOKENS,
    RouterExporter,
    WorkerExporter,
    closed_port,
)

REPLICAS = {
    Pool.PREFILL: PoolObservation(current_replicas=2, ready_replicas=2),
    Pool.DECODE: PoolObservation(current_replicas=3, ready_replicas=3),
}
WINDOW_S = 30.0
MEASURED = (
    "arrival_rate_rps",
    "burst_arrival_rate_rps",
    "interarrival_scv",
    "lengths",
    "ttft_p99_s",
    "tpot_p99_s",
    "prefill_queue_depth",
)


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


@pytest.fixture
def router() -> Iterator[RouterExporter]:
    exporter = RouterExporter()
    yield exporter
    exporter.stop()


@pytest.fixture
def prefill() -> Iterator[WorkerExporter]:
    exporter = WorkerExporter("prefill")
    exporter.queue_depth.set(3)
    yield exporter
    exporter.stop()


@pytest.fixture
def decode() -> Iterator[WorkerExporter]:
    exporter = WorkerExporter("decode")
    exporter.queue_depth.set(7)
    yield exporter
    exporter.stop()


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make_source(clock: Clock, *exporters: RouterExporter | WorkerExporter) -> ScrapeSource:
    return ScrapeSource(
        [e.url for e in exporters], window_s=WINDOW_S, burst_window_s=5.0, clock=clock
    )


def observe(source: ScrapeSource, clock: Clock) -> Observation:
    return source.observe(now_s=clock.now_s, replicas=REPLICAS)


def send(router: RouterExporter, n: int, *, ttft_range: tuple[float, float] = (0.2, 0.4)) -> None:
    """n requests with TTFT, prompt and output lengths evenly spread over their ranges."""
    low, high = ttft_range
    for i in range(n):
        u = (i + 0.5) / n
        router.record(
            ttft_s=low + (high - low) * u,
            tpot_s=0.02 + 0.04 * u,
            prompt=math.ceil(1024 * u),
            output=math.ceil(256 * (1 - u)),
        )


def test_the_first_tick_has_no_window_yet_only_the_gauge(
    router: RouterExporter, prefill: WorkerExporter, decode: WorkerExporter, clock: Clock
) -> None:
    send(router, 10)
    with make_source(clock, router, prefill, decode) as source:
        observation = observe(source, clock)
    assert observation.prefill_queue_depth == 3  # the prefill pool's only: decode's is 7
    assert all(getattr(observation, name) is None for name in MEASURED[:-1])
    assert observation.time_s == clock.now_s
    assert observation.prefill is REPLICAS[Pool.PREFILL]


def test_rates_and_p99s_are_differences_over_the_window(
    router: RouterExporter, prefill: WorkerExporter, decode: WorkerExporter, clock: Clock
) -> None:
    send(router, 100, ttft_range=(0.0, 1.0))  # before the window: must not count
    with make_source(clock, router, prefill, decode) as source:
        observe(source, clock)
        send(router, 600)
        clock.advance(WINDOW_S)
        observation = observe(source, clock)

    assert observation.arrival_rate_rps == pytest.approx(600 / WINDOW_S, rel=1e-12)
    # Uniform on (0.2, 0.4] in buckets of 0.1: P99 = 0.2 + 0.99 * 0.2, as for the
    # continuous uniform distribution (linear interpolation is exact for it).
    assert observation.ttft_p99_s == pytest.approx(0.2 + 0.99 * 0.2, rel=1e-9)
    assert observation.tpot_p99_s == pytest.approx(0.02 + 0.99 * 0.04, rel=1e-9)
    # One snapshot per tick: no pair is a burst window apart, no sub-windows for ca².
    assert observation.burst_arrival_rate_rps is None
    assert observation.interarrival_scv is None


def test_lengths_come_from_the_windows_histograms(
    router: RouterExporter, prefill: WorkerExporter, clock: Clock
) -> None:
    with make_source(clock, router, prefill) as source:
        observe(source, clock)
        send(router, 800)
        clock.advance(WINDOW_S)
        lengths = observe(source, clock).lengths
    assert lengths is not None and len(lengths) == 500
    for values, bounds in (
        (lengths.prompt_tokens, PROMPT_BUCKETS_TOKENS),
        (lengths.output_tokens, OUTPUT_BUCKETS_TOKENS),
    ):
        counts = np.histogram(values, bins=np.array((0, *bounds)) + 0.5)[0]
        assert counts.sum() == 500
        assert np.all(np.abs(counts - 500 / 8) <= 1)  # 100 of 800 requests in each bucket


def test_burst_rate_and_ca2_from_scrapes_between_ticks(
    router: RouterExporter, clock: Clock
) -> None:
    per_second = [10] * 25 + [50] * 5  # a burst in the last five seconds
    with make_source(clock, router) as source:
        observe(source, clock)
        for n in per_second[:-1]:
            send(router, n)
            clock.advance(1.0)
            source.scrape()
        send(router, per_second[-1])
        clock.advance(1.0)
        observation = observe(source, clock)

    assert observation.arrival_rate_rps == pytest.approx(sum(per_second) / WINDOW_S, rel=1e-12)
    assert observation.burst_arrival_rate_rps == pytest.approx(50.0, rel=1e-12)
    # The burst in the newest sub-window may be a level that has just begun: it is set
    # apart, and the even counts before it have no dispersion about their level.
    assert observation.interarrival_scv == pytest.approx(0.0, abs=1e-12)
    # The same snapshots record when the arrivals came: each second's own count.
    assert observation.arrival_counts is not None
    increments = np.diff([n for _, n in observation.arrival_counts])
    assert increments.tolist() == per_second[-len(increments) :]


def test_a_burst_inside_the_window_is_dispersion_about_the_window_s_level(
    router: RouterExporter, clock: Clock
) -> None:
    per_second = [10] * 10 + [50] * 5 + [10] * 15  # five busy seconds, then calm again
    with make_source(clock, router) as source:
        observe(source, clock)
        for n in per_second:
            send(router, n)
            clock.advance(1.0)
            source.scrape()
        observation = observe(source, clock)
    # Too short to be a level: the counts in 5-s sub-windows, variance / mean.
    counts = np.add.reduceat(np.array(per_second, dtype=float), np.arange(0, 30, 5))
    expected = counts.var(ddof=1) / counts.mean()
    assert observation.interarrival_scv == pytest.approx(expected, rel=1e-9)


def test_evenly_spaced_arrivals_have_zero_ca2(router: RouterExporter, clock: Clock) -> None:
    with make_source(clock, router) as source:
        observe(source, clock)
        for _ in range(30):
            send(router, 20)
            clock.advance(1.0)
            source.scrape()
        observation = observe(source, clock)
    assert observation.interarrival_scv == pytest.approx(0.0, abs=1e-12)
    assert observation.arrival_rate_rps == pytest.approx(20.0, rel=1e-12)


def test_a_restarted_router_counts_as_a_counter_reset(router: RouterExporter, clock: Clock) -> None:
    send(router, 100)
    with make_source(clock, router) as source:
        observe(source, clock)
        send(router, 50)
        clock.advance(10.0)
        source.scrape()  # sees 150
        router.restart()  # the counter starts again at 0
        send(router, 20)
        clock.advance(20.0)
        observation = observe(source, clock)
    # 50 before the restart and 20 after it, never 20 - 150.
    assert observation.arrival_rate_rps == pytest.approx(70 / 30, rel=1e-12)
    assert observation.ttft_p99_s == pytest.approx(0.2 + 0.99 * 0.2, rel=0.05)


def test_a_reset_between_two_snapshots_counts_what_the_new_process_saw(
    router: RouterExporter, clock: Clock
) -> None:
    send(router, 100)
    with make_source(clock, router) as source:
        observe(source, clock)
        router.restart()
        send(router, 20)
        clock.advance(WINDOW_S)
        observation = observe(source, clock)
    assert observation.arrival_rate_rps == pytest.approx(20 / WINDOW_S, rel=1e-12)


def test_a_worker_that_is_down_is_skipped_and_warned_about_once(
    router: RouterExporter,
    prefill: WorkerExporter,
    decode: WorkerExporter,
    clock: Clock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="controller.sources")
    down = f"http://127.0.0.1:{closed_port()}/metrics"
    urls = [router.url, prefill.url, decode.url, down]
    with ScrapeSource(urls, window_s=WINDOW_S, clock=clock) as source:
        observe(source, clock)
        send(router, 300)
        clock.advance(WINDOW_S)
        observation = observe(source, clock)
        assert set(source.failing) == {down}
    assert observation.arrival_rate_rps == pytest.approx(300 / WINDOW_S, rel=1e-12)
    assert observation.prefill_queue_depth == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and down in warnings[0]


def test_a_router_that_is_down_this_tick_leaves_its_measurements_none(
    router: RouterExporter, prefill: WorkerExporter, clock: Clock
) -> None:
    with make_source(clock, router, prefill) as source:
        observe(source, clock)
        send(router, 300)
        router.available = False
        clock.advance(WINDOW_S)
        observation = observe(source, clock)
        assert set(source.failing.values()) == {"HTTP 503"}
    assert all(getattr(observation, name) is None for name in MEASURED[:-1])
    assert observation.prefill_queue_depth == 3


def test_a_router_down_at_the_windows_start_counts_from_its_next_answer(
    router: RouterExporter, prefill: WorkerExporter, clock: Clock
) -> None:
    with make_source(clock, router, prefill) as source:
        router.available = False
        observe(source, clock)
        router.available = True
        clock.advance(10.0)
        source.scrape()
        send(router, 200)
        clock.advance(20.0)
        covered = observe(source, clock)
    # Measured over the 20 s it was seen, which is at least half the window.
    assert covered.arrival_rate_rps == pytest.approx(200 / 20, rel=1e-12)


def test_a_router_seen_for_under_half_the_window_is_not_measured(
    router: RouterExporter, clock: Clock
) -> None:
    with make_source(clock, router) as source:
        router.available = False
        observe(source, clock)
        clock.advance(20.0)
        router.available = True
        source.scrape()
        send(router, 200)
        clock.advance(10.0)
        assert observe(source, clock).arrival_rate_rps is None


def test_when_every_url_fails_every_measurement_is_none(clock: Clock) -> None:
    urls = [f"http://127.0.0.1:{closed_port()}/metrics" for _ in range(2)]
    with ScrapeSource(urls, window_s=WINDOW_S, clock=clock) as source:
        for _ in range(3):
            observation = observe(source, clock)
            clock.advance(WINDOW_S)
        assert set(source.failing) == set(urls)
    assert all(getattr(observation, name) is None for name in MEASURED)


def test_several_routers_and_workers_are_summed(clock: Clock) -> None:
    routers = [RouterExporter(), RouterExporter()]
    workers = [WorkerExporter("prefill"), WorkerExporter("prefill"), WorkerExporter("decode")]
    try:
        for worker, depth in zip(workers, (3, 4, 9), strict=True):
            worker.queue_depth.set(depth)
        with make_source(clock, *routers, *workers) as source:
            observe(source, clock)
            send(routers[0], 90)
            send(routers[1], 60)
            clock.advance(WINDOW_S)
            observation = observe(source, clock)
    finally:
        for exporter in (*routers, *workers):
            exporter.stop()
    assert observation.arrival_rate_rps == pytest.approx(150 / WINDOW_S, rel=1e-12)
    assert observation.prefill_queue_depth == 7
    assert observation.ttft_p99_s == pytest.approx(0.2 + 0.99 * 0.2, rel=0.02)


def test_a_tick_a_little_early_still_finds_its_window(router: RouterExporter, clock: Clock) -> None:
    with make_source(clock, router) as source:
        observe(source, clock)
        send(router, 300)
        clock.advance(WINDOW_S - 0.5)  # loop jitter
        observation = observe(source, clock)
    assert observation.arrival_rate_rps == pytest.approx(300 / (WINDOW_S - 0.5), rel=1e-12)


def test_a_pair_more_than_two_windows_apart_is_not_a_measurement(
    router: RouterExporter, clock: Clock
) -> None:
    with make_source(clock, router) as source:
        observe(source, clock)
        send(router, 300)
        clock.advance(2 * WINDOW_S + 1)
        assert observe(source, clock).arrival_rate_rps is None


def test_a_clock_that_runs_backwards_is_a_programming_error(
    router: RouterExporter, clock: Clock
) -> None:
    with make_source(clock, router) as source:
        observe(source, clock)
        clock.advance(-1.0)
        with pytest.raises(ValueError, match=r"^clock:"):
            observe(source, clock)


def test_a_url_without_a_path_is_scraped_at_metrics(router: RouterExporter, clock: Clock) -> None:
    base = router.url.removesuffix("/metrics")
    with ScrapeSource([base], clock=clock) as source:
        assert source.urls == [router.url]
        source.scrape()
        assert source.failing == {}


def test_a_url_that_answers_404_is_a_failed_scrape(router: RouterExporter, clock: Clock) -> None:
    wrong = router.url.replace("/metrics", "/nothing")
    with ScrapeSource([wrong], clock=clock) as source:
        observe(source, clock)
        assert source.failing == {wrong: "HTTP 404"}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"urls": []}, "urls"),
        ({"urls": "http://127.0.0.1:1/metrics"}, "urls"),
        ({"window_s": -1}, "window_s"),
        ({"timeout_s": math.inf}, "timeout_s"),
        ({"n_length_samples": 0}, "n_length_samples"),
    ],
)
def test_invalid_settings_are_rejected_naming_the_field(
    kwargs: dict[str, object], field: str, clock: Clock
) -> None:
    options: dict[str, object] = {"urls": ["http://127.0.0.1:1/metrics"], "clock": clock}
    options.update(kwargs)
    with pytest.raises(ValueError, match=f"^{field}:"):
        ScrapeSource(**options)  # type: ignore[arg-type]
