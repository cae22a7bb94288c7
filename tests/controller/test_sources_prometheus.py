"""PrometheusSource against a real Prometheus scraping a test router and a worker.

The router is driven at a known rate with known TTFT, TPOT and length
distributions; Prometheus (the Debian 2.42 binary) scrapes every second; the
source's measurements are checked against the driven values. Failure cases (nothing
listening, a hung server, a selector that matches nothing, a bad query) must give
``None`` fields, never exceptions.
"""

from __future__ import annotations

import itertools
import logging
import math
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from controller.histograms import histogram_quantile
from controller.observation import Observation, PoolObservation
from controller.policy.forecast import RecordedArrivals
from controller.sources import PrometheusSource
from controller.sources.prometheus import (
    ARRIVAL_RATE_QUERY,
    PROMPT_BUCKETS_QUERY,
    TTFT_P99_QUERY,
    promql_duration,
    render,
)
from queueing.pools import Pool
from tests.controller.conftest_sources import (
    PROMPT_BUCKETS_TOKENS,
    RouterExporter,
    WorkerExporter,
    closed_port,
    silent_server,
)

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
needs_prometheus = pytest.mark.skipif(
    not Path(PROMETHEUS).exists(),
    reason="the prometheus binary is not installed (Debian package `prometheus`; CI installs it)",
)

RATE_RPS = 100.0
WINDOW_S = 8.0
BURST_WINDOW_S = 3.0
SCV_STEP_S = 2.0
LEVELS = 100  # the driven values cycle through 100 evenly spaced levels
# TTFT uniform on (0.2, 0.4] s: half in the (0.2, 0.3] bucket, half in (0.3, 0.4].
TTFT_LOW_S, TTFT_HIGH_S = 0.2, 0.4
TPOT_LOW_S, TPOT_HIGH_S = 0.02, 0.06
PROMPT_MAX, OUTPUT_MAX = 1024, 256
REPLICAS = {
    Pool.PREFILL: PoolObservation(current_replicas=2, ready_replicas=2),
    Pool.DECODE: PoolObservation(current_replicas=3, ready_replicas=1),
}


def uniform_p99(low: float, high: float) -> float:
    return low + 0.99 * (high - low)


def level(i: int, stride: int) -> float:
    """A fraction in (0, 1): request i's level; every 100 requests visit each level once."""
    return ((i * stride) % LEVELS + 0.5) / LEVELS


class Traffic:
    """Requests at exactly ``RATE_RPS`` since ``start``, recorded on the router when it
    is scraped: each scrape sees every request due by then, however the threads are
    scheduled, so the counts Prometheus stores are those of evenly spaced arrivals."""

    def __init__(self, router: RouterExporter) -> None:
        self._router = router
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._sent = 0

    def catch_up(self) -> None:
        with self._lock:
            due = int((time.monotonic() - self._start) * RATE_RPS)
            for i in range(self._sent, due):
                self._router.record(
                    ttft_s=TTFT_LOW_S + (TTFT_HIGH_S - TTFT_LOW_S) * level(i, 37),
                    tpot_s=TPOT_LOW_S + (TPOT_HIGH_S - TPOT_LOW_S) * level(i, 41),
                    prompt=math.ceil(PROMPT_MAX * level(i, 43)),
                    output=math.ceil(OUTPUT_MAX * level(i, 47)),
                )
            self._sent = max(self._sent, due)


@dataclass
class Stack:
    url: str
    router: RouterExporter
    prefill: WorkerExporter
    decode: WorkerExporter


def api(url: str, promql: str, **params: str) -> dict[str, object]:
    response = httpx.get(f"{url}/api/v1/query", params={"query": promql, **params}, timeout=5)
    response.raise_for_status()
    body: dict[str, object] = response.json()
    return body


def wait_until(predicate: object, *, timeout_s: float, what: str) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (httpx.HTTPError, ValueError):
            # Not up yet: refused, or, while its TSDB still starts, answered with a
            # plain-text "Service Unavailable" that is not JSON.
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not Path(PROMETHEUS).exists():
        pytest.skip("the prometheus binary is not installed (CI installs the Debian package)")
    router, prefill, decode = RouterExporter(), WorkerExporter("prefill"), WorkerExporter("decode")
    prefill.queue_depth.set(3)
    decode.queue_depth.set(7)
    prefill.kv_utilization.set(0.9)  # not read: KV usage is the decode pool's
    decode.kv_utilization.set(0.25)
    router.before_scrape = Traffic(router).catch_up
    workdir = tmp_path_factory.mktemp("prometheus")
    targets = ", ".join(f"'127.0.0.1:{e.port}'" for e in (router, prefill, decode))
    (workdir / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: sara\n    static_configs:\n      - targets: [{targets}]\n"
    )
    port = closed_port()
    url = f"http://127.0.0.1:{port}"
    log = (workdir / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(
            lambda: httpx.get(f"{url}/-/ready", timeout=1).status_code == 200,
            timeout_s=20,
            what="Prometheus to be ready",
        )

        def enough_samples() -> bool:
            # Every target scraped, and a full window of request-counter samples.
            up = api(url, 'sum(up{job="sara"})')["data"]
            samples = api(url, f"count_over_time(sara_requests_total[{WINDOW_S:g}s])")["data"]
            assert isinstance(up, dict) and isinstance(samples, dict)
            return (
                bool(up["result"])
                and float(up["result"][0]["value"][1]) == 3
                and bool(samples["result"])
                and float(samples["result"][0]["value"][1]) >= WINDOW_S
            )

        wait_until(enough_samples, timeout_s=30, what=f"{WINDOW_S:g} s of scraped samples")
        yield Stack(url=url, router=router, prefill=prefill, decode=decode)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        for exporter in (router, prefill, decode):
            exporter.stop()


def source(url: str, **kwargs: object) -> PrometheusSource:
    options: dict[str, object] = {
        "window_s": WINDOW_S,
        "burst_window_s": BURST_WINDOW_S,
        "scv_step_s": SCV_STEP_S,
        "timeout_s": 5.0,
    }
    options.update(kwargs)
    return PrometheusSource(url, **options)  # type: ignore[arg-type]


def measured_fields(observation: Observation) -> dict[str, object]:
    names = (
        "arrival_rate_rps",
        "burst_arrival_rate_rps",
        "interarrival_scv",
        "lengths",
        "ttft_p99_s",
        "tpot_p99_s",
        "prefill_queue_depth",
        "kv_usage_fraction",
    )
    return {name: getattr(observation, name) for name in names}


# -- against the running stack ------------------------------------------------------------


@needs_prometheus
def test_the_measurements_match_the_driven_traffic(stack: Stack) -> None:
    with source(stack.url) as prom:
        observation = prom.observe(now_s=1234.5, replicas=REPLICAS)
        assert prom.failing == {}

    assert observation.time_s == 1234.5
    assert observation.prefill is REPLICAS[Pool.PREFILL]
    assert observation.decode is REPLICAS[Pool.DECODE]
    assert observation.arrival_rate_rps == pytest.approx(RATE_RPS, rel=0.05)
    assert observation.burst_arrival_rate_rps == pytest.approx(RATE_RPS, rel=0.1)
    # Histogram P99s interpolate linearly inside the bucket, exact for uniform values.
    assert observation.ttft_p99_s == pytest.approx(uniform_p99(TTFT_LOW_S, TTFT_HIGH_S), rel=0.01)
    assert observation.tpot_p99_s == pytest.approx(uniform_p99(TPOT_LOW_S, TPOT_HIGH_S), rel=0.01)
    # Evenly spaced arrivals are far more regular than Poisson (ca² = 1).
    assert observation.interarrival_scv is not None
    assert observation.interarrival_scv < 0.2
    # The arrivals themselves, from the same samples: evenly spaced at the driven rate,
    # so each scrape interval holds its length times the rate (up to how late in its
    # scrape the router counted them), and the whole span exactly that.
    counts = observation.arrival_counts
    assert counts is not None
    span_s = counts[-1][0] - counts[0][0]
    assert span_s >= 0.8 * WINDOW_S
    assert counts[-1][1] == pytest.approx(RATE_RPS * span_s, rel=0.02)
    for (t0, n0), (t1, n1) in itertools.pairwise(counts):
        assert (n1 - n0) == pytest.approx(RATE_RPS * (t1 - t0), rel=0.1, abs=1.0)
    assert observation.prefill_queue_depth == 3
    assert observation.kv_usage_fraction == 0.25


@needs_prometheus
def test_the_arrival_history_warm_starts_the_forecasters_record(stack: Stack) -> None:
    # The last full window of driven traffic, read back as a query_range of the
    # arrival rate at 2-s steps: every step near the driven rate, and a record
    # seeded from it counts rate x span arrivals over it.
    step_s = 2.0
    now_s = time.time()
    with source(stack.url) as prom:
        points = prom.arrival_history(start_s=now_s - WINDOW_S + step_s, end_s=now_s, step_s=step_s)
    assert len(points) >= 3
    assert [t for t, _ in points] == sorted(t for t, _ in points)
    for _, rate in points:
        assert rate == pytest.approx(RATE_RPS, rel=0.1)
    record = RecordedArrivals(keep_s=3600.0)
    assert record.seed(points, window_s=step_s) == len(points)
    first, last = points[0][0] - step_s, points[-1][0]
    count = record.count_between(first, last)
    assert count == pytest.approx(RATE_RPS * (last - first), rel=0.1)


@needs_prometheus
def test_the_reconstructed_lengths_keep_the_bucket_shares(stack: Stack) -> None:
    # Half the window's RATE_RPS x WINDOW_S = 800 requests: a window gives one pair per
    # request it finished, at most n_length_samples, and a loaded machine's exporters
    # may finish a few fewer than they were driven to.
    with source(stack.url, n_length_samples=400) as prom:
        lengths = prom.observe(now_s=0.0, replicas=REPLICAS).lengths
    assert lengths is not None and len(lengths) == 400
    # Prompts are uniform on 1..1024: each of the 8 buckets holds an eighth.
    edges = (0, *PROMPT_BUCKETS_TOKENS)
    shares = np.histogram(lengths.prompt_tokens, bins=np.array(edges) + 0.5)[0] / len(lengths)
    np.testing.assert_allclose(shares, 1 / 8, atol=0.02)
    assert lengths.prompt_tokens.mean() == pytest.approx((1 + PROMPT_MAX) / 2, rel=0.03)
    assert lengths.output_tokens.mean() == pytest.approx((1 + OUTPUT_MAX) / 2, rel=0.03)
    assert lengths.output_tokens.min() >= 1 and lengths.output_tokens.max() <= OUTPUT_MAX
    # Paired in quantile order: both columns ascend together.
    assert np.all(np.diff(lengths.prompt_tokens) >= 0)
    assert np.all(np.diff(lengths.output_tokens) >= 0)


@needs_prometheus
def test_the_shared_histogram_quantile_agrees_with_promql(stack: Stack) -> None:
    at = str(time.time() - 1.0)  # one fixed evaluation time for both queries
    window = promql_duration(WINDOW_S)
    buckets = api(stack.url, f"sum by (le) (rate(sara_ttft_seconds_bucket[{window}]))", time=at)[
        "data"
    ]
    promql = api(stack.url, render(TTFT_P99_QUERY, selector="", window_s=WINDOW_S), time=at)
    assert isinstance(buckets, dict) and isinstance(promql["data"], dict)
    ours = histogram_quantile(
        0.99, [(float(s["metric"]["le"]), float(s["value"][1])) for s in buckets["result"]]
    )
    theirs = float(promql["data"]["result"][0]["value"][1])
    assert ours == pytest.approx(theirs, rel=1e-12)


@needs_prometheus
def test_every_rendered_query_is_valid_promql_with_and_without_a_selector(stack: Stack) -> None:
    for selector in ("", 'job="sara"'):
        with source(stack.url, selector=selector) as prom:
            for name, promql in prom.queries.items():
                assert api(stack.url, promql)["status"] == "success", name
    # The documented templates are what the source sends.
    assert render(ARRIVAL_RATE_QUERY, selector='job="sara"', window_s=30) == (
        'sum(rate(sara_requests_total{job="sara"}[30s]))'
    )
    assert render(PROMPT_BUCKETS_QUERY, selector="", window_s=2.5) == (
        "sum by (le) (increase(sara_prompt_tokens_bucket{}[2500ms]))"
    )


@needs_prometheus
def test_a_selector_that_matches_nothing_gives_none_fields(stack: Stack) -> None:
    with source(stack.url, selector='job="no-such-job"') as prom:
        observation = prom.observe(now_s=0.0, replicas=REPLICAS)
        assert set(prom.failing.values()) == {"empty result"}
    assert all(value is None for value in measured_fields(observation).values())


@needs_prometheus
def test_a_query_prometheus_rejects_gives_none_fields(stack: Stack) -> None:
    with source(stack.url, selector='job=~"("') as prom:  # an invalid regular expression
        observation = prom.observe(now_s=0.0, replicas=REPLICAS)
        assert all(reason.startswith("HTTP 400: bad_data") for reason in prom.failing.values())
    assert all(value is None for value in measured_fields(observation).values())


# -- without a Prometheus -----------------------------------------------------------------


def test_an_unreachable_prometheus_gives_none_fields_and_one_warning_per_query(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="controller.sources")
    with source(f"http://127.0.0.1:{closed_port()}") as prom:
        first = prom.observe(now_s=0.0, replicas=REPLICAS)
        second = prom.observe(now_s=30.0, replicas=REPLICAS)
        queries = set(prom.queries.values())
    for observation in (first, second):
        assert all(value is None for value in measured_fields(observation).values())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(queries)  # the second tick repeats them at debug level only
    assert {next(q for q in queries if w.endswith(q)) for w in warnings} == queries
    assert all("unreachable: ConnectError" in w for w in warnings)


def test_a_hung_prometheus_times_out_into_none_fields_within_one_timeout() -> None:
    with silent_server() as port, source(f"http://127.0.0.1:{port}", timeout_s=0.5) as prom:
        started = time.monotonic()
        observation = prom.observe(now_s=0.0, replicas=REPLICAS)
        elapsed = time.monotonic() - started
        assert set(prom.failing.values()) == {"timed out"}
    assert all(value is None for value in measured_fields(observation).values())
    assert elapsed < 2.0  # the queries run concurrently: one timeout, not eight


def test_a_missing_pool_in_replicas_is_a_programming_error() -> None:
    with (
        source(f"http://127.0.0.1:{closed_port()}") as prom,
        pytest.raises(ValueError, match="replicas: no entry for pool"),
    ):
        prom.observe(now_s=0.0, replicas={Pool.PREFILL: REPLICAS[Pool.PREFILL]})


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"window_s": 0}, "window_s"),
        ({"burst_window_s": math.nan}, "burst_window_s"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"scv_step_s": math.inf}, "scv_step_s"),
        ({"selector": '{job="x"}'}, "selector"),
        ({"n_length_samples": 0}, "n_length_samples"),
    ],
)
def test_invalid_settings_are_rejected_naming_the_field(
    kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        PrometheusSource("http://127.0.0.1:9090", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("seconds", "literal"), [(30, "30s"), (5.0, "5s"), (2.5, "2500ms"), (0.001, "1ms")]
)
def test_windows_render_as_promql_durations(seconds: float, literal: str) -> None:
    assert promql_duration(seconds) == literal
