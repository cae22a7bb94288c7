"""Observations without Prometheus: scrape the router's and workers' ``/metrics`` directly.

Every ``observe`` (and every extra ``scrape``) reads each URL once and keeps a
snapshot ``(time, which URLs answered, every counter, bucket and gauge value)`` in a
ring. Windowed quantities are differences between the newest snapshot and a
reference snapshot about a window older:

- the reference is the snapshot whose age is closest to the window among those aged
  at least ``(1 - JITTER) * window`` (so a loop ticking every ``window`` seconds,
  give or take, always finds one) and at most ``MAX_SPAN * window`` (an older pair
  would not measure that window); none: the quantity is ``None``;
- each series' increase is reset-corrected over every snapshot in between (a drop
  is a restart, as in Prometheus's ``rate``) and divided by the time it actually
  spans: no extrapolation to the window's edges, unlike Prometheus;
- a series only counts if its URL answered this tick; a series from a URL that was
  down at the reference starts at its first later answer, and is left out if that
  leaves it less than half the window; a series that is absent from an answer is 0
  there (it had not been created yet, or the process restarted).

The burst rate and ca² need snapshots closer together than the control interval:
call ``scrape()`` between ticks (e.g. every second) for them; with one snapshot per
tick they are ``None``.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from controller.counters import (
    CounterSample,
    corrected_increase,
    cumulative_arrivals,
    interarrival_scv,
)
from controller.histograms import (
    DEFAULT_SAMPLES,
    histogram_count,
    histogram_quantile,
    length_samples,
)
from controller.observation import Observation, PoolObservation
from controller.sources.base import FailureLog, MeasurementUnavailable, pool_replicas
from queueing.pools import Pool

logger = logging.getLogger(__name__)

REQUESTS = "sara_requests_total"
TTFT_BUCKETS = "sara_ttft_seconds_bucket"
TPOT_BUCKETS = "sara_tpot_seconds_bucket"
PROMPT_BUCKETS = "sara_prompt_tokens_bucket"
OUTPUT_BUCKETS = "sara_output_tokens_bucket"
QUEUE_DEPTH = "sara_worker_queue_depth"
_KEPT = frozenset(
    {REQUESTS, TTFT_BUCKETS, TPOT_BUCKETS, PROMPT_BUCKETS, OUTPUT_BUCKETS, QUEUE_DEPTH}
)

JITTER = 0.1  # a reference snapshot may be this fraction of the window younger
MAX_SPAN = 2.0  # ... and at most this many windows older
MIN_COVERAGE = 0.5  # a series must span this fraction of the window to count
MAX_SNAPSHOTS = 10_000  # a guard against a runaway scrape loop

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs


@dataclass(frozen=True)
class SeriesKey:
    url: str
    name: str  # the sample name, e.g. sara_ttft_seconds_bucket
    labels: Labels


@dataclass(frozen=True)
class Snapshot:
    time_s: float
    answered: frozenset[str]  # URLs scraped successfully
    values: Mapping[SeriesKey, float]

    def value(self, key: SeriesKey) -> float | None:
        """The series' value here; 0 if its URL answered without it; None if it was down."""
        if key.url not in self.answered:
            return None
        return self.values.get(key, 0.0)


class ScrapeSource:
    """An ``ObservationSource`` that scrapes Prometheus text from ``urls`` itself.

    ``urls``: scrape URLs (``/metrics`` is appended to one without a path).
    ``clock``: seconds, monotonic, stamps the snapshots (``now_s`` is only stamped on
    the ``Observation``). Windows, ``scv_step_s``, ``scv_span_s`` and
    ``n_length_samples`` as for ``PrometheusSource``: the snapshots are kept for the
    longest of them.
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        window_s: float = 30.0,
        burst_window_s: float = 5.0,
        timeout_s: float = 2.0,
        scv_step_s: float = 5.0,
        scv_span_s: float = 300.0,
        n_length_samples: int = DEFAULT_SAMPLES,
        clock: Callable[[], float],
        client: httpx.Client | None = None,
    ) -> None:
        if isinstance(urls, str) or not urls:
            raise ValueError(f"urls: expected a non-empty list of URLs, got {urls!r}")
        for name, value in (
            ("window_s", window_s),
            ("burst_window_s", burst_window_s),
            ("timeout_s", timeout_s),
            ("scv_step_s", scv_step_s),
            ("scv_span_s", scv_span_s),
        ):
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
        if n_length_samples < 1:
            raise ValueError(f"n_length_samples: must be >= 1, got {n_length_samples!r}")
        self._urls = [_scrape_url(url) for url in urls]
        self._window_s = float(window_s)
        self._burst_window_s = float(burst_window_s)
        self._timeout_s = float(timeout_s)
        self._scv_step_s = float(scv_step_s)
        self._scv_span_s = max(float(scv_span_s), self._window_s)
        self._n_samples = n_length_samples
        self._clock = clock
        self._owns_client = client is None
        self._client = client if client is not None else httpx.Client()
        self._failures = FailureLog(logger)
        self._ring: deque[Snapshot] = deque(maxlen=MAX_SNAPSHOTS)

    @property
    def urls(self) -> Sequence[str]:
        return list(self._urls)

    @property
    def failing(self) -> Mapping[str, str]:
        """The URLs that failed on their last scrape, and why."""
        return self._failures.failing

    # -- scraping ------------------------------------------------------------------------

    def scrape(self) -> Snapshot:
        """Read every URL now and keep the snapshot; a URL that fails is left out.

        The snapshot is timed at the middle of its reads: each exporter rendered its
        values somewhere between the request and the response, so a read slowed by a
        busy exporter moves the time by at most half its round trip (timed at the
        request, a window whose newest read was slow would count that delay's
        arrivals over the window's span)."""
        started_s = self._clock()
        if self._ring and started_s < self._ring[-1].time_s:
            raise ValueError(
                f"clock: went backwards from {self._ring[-1].time_s} to {started_s} (use a "
                "monotonic clock)"
            )
        with ThreadPoolExecutor(max_workers=min(16, len(self._urls))) as executor:
            futures = [(url, executor.submit(self._read, url)) for url in self._urls]
            answered: set[str] = set()
            values: dict[SeriesKey, float] = {}
            for url, future in futures:
                try:
                    values.update(future.result())
                except MeasurementUnavailable as exc:
                    self._failures.failed(url, str(exc))
                    continue
                self._failures.succeeded(url)
                answered.add(url)
        time_s = 0.5 * (started_s + self._clock())
        snapshot = Snapshot(time_s=time_s, answered=frozenset(answered), values=values)
        self._ring.append(snapshot)
        horizon = max(MAX_SPAN * max(self._window_s, self._burst_window_s), self._scv_span_s)
        while len(self._ring) > 1 and time_s - self._ring[0].time_s > horizon:
            self._ring.popleft()
        return snapshot

    def _read(self, url: str) -> dict[SeriesKey, float]:
        try:
            response = self._client.get(url, timeout=self._timeout_s)
        except httpx.TimeoutException as exc:
            raise MeasurementUnavailable("timed out") from exc
        except httpx.RequestError as exc:
            raise MeasurementUnavailable(f"unreachable: {type(exc).__name__}") from exc
        if response.status_code != 200:
            raise MeasurementUnavailable(f"HTTP {response.status_code}")
        try:
            return _parse(url, response.text)
        except ValueError as exc:  # the parser's only failure: malformed exposition text
            raise MeasurementUnavailable(f"malformed metrics text: {exc}") from exc

    # -- observing -----------------------------------------------------------------------

    def observe(self, *, now_s: float, replicas: Mapping[Pool, PoolObservation]) -> Observation:
        prefill, decode = pool_replicas(replicas)
        newest = self.scrape()
        window, burst = self._window_s, self._burst_window_s
        arrivals = self._rates(REQUESTS, window)
        burst_arrivals = self._rates(REQUESTS, burst)
        prompt = self._rates(PROMPT_BUCKETS, window)
        output = self._rates(OUTPUT_BUCKETS, window)
        lengths = None
        if prompt is not None and output is not None:
            finished = histogram_count(_by_le(output))  # per second, over the window
            lengths = length_samples(
                _by_le(prompt),
                _by_le(output),
                source="scraped histograms",
                requests=(finished or 0.0) * window,
                n=self._n_samples,
            )
        counters = self._request_counters(self._window_s)
        scv_counters = self._request_counters(self._scv_span_s)
        return Observation(
            time_s=now_s,
            prefill=prefill,
            decode=decode,
            arrival_rate_rps=None if arrivals is None else sum(arrivals.values()),
            burst_arrival_rate_rps=None if burst_arrivals is None else sum(burst_arrivals.values()),
            interarrival_scv=interarrival_scv(
                scv_counters, step_s=self._scv_step_s, window_s=self._window_s
            )
            if scv_counters
            else None,
            arrival_counts=cumulative_arrivals(counters) if counters else None,
            lengths=lengths,
            ttft_p99_s=self._p99(TTFT_BUCKETS),
            tpot_p99_s=self._p99(TPOT_BUCKETS),
            prefill_queue_depth=_gauge_sum(newest, QUEUE_DEPTH, {"pool": Pool.PREFILL.value}),
        )

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> ScrapeSource:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _reference(self, window_s: float) -> int | None:
        """Index in the ring of the snapshot that starts the window: of those aged
        ``[(1 - JITTER) * window, MAX_SPAN * window]``, the one closest to ``window``."""
        newest = self._ring[-1].time_s
        best: int | None = None
        for index in range(len(self._ring) - 2, -1, -1):
            age = newest - self._ring[index].time_s
            if age > MAX_SPAN * window_s:
                break
            if age < (1.0 - JITTER) * window_s:
                continue
            if best is None or abs(age - window_s) < abs(
                newest - self._ring[best].time_s - window_s
            ):
                best = index
            if age >= window_s:
                break  # older ones are only further from the window
        return best

    def _rates(self, name: str, window_s: float) -> dict[Labels, float] | None:
        """Per-second increase of every ``name`` series over the window, summed over URLs
        by their other labels; ``None`` if no series could be measured."""
        start = self._reference(window_s)
        if start is None:
            return None
        snapshots = list(self._ring)[start:]
        rates: dict[Labels, float] = {}
        for key in snapshots[-1].values:
            if key.name != name:
                continue
            points = [(s.time_s, v) for s in snapshots if (v := s.value(key)) is not None]
            span = points[-1][0] - points[0][0]
            if span < MIN_COVERAGE * window_s:
                continue
            values = [v for _, v in points]
            if not all(math.isfinite(v) for v in values):
                continue
            rates[key.labels] = rates.get(key.labels, 0.0) + corrected_increase(values) / span
        return rates or None

    def _p99(self, name: str) -> float | None:
        rates = self._rates(name, self._window_s)
        return None if rates is None else histogram_quantile(0.99, _by_le(rates))

    def _request_counters(self, span_s: float) -> list[list[CounterSample]]:
        """Each request counter's samples over the last ``span_s`` (the window for the
        arrivals' record, the SCV's span for its ca²)."""
        newest = self._ring[-1]
        recent = [s for s in self._ring if newest.time_s - s.time_s <= span_s]
        series: list[list[CounterSample]] = []
        for key in newest.values:
            if key.name == REQUESTS:
                series.append([(s.time_s, v) for s in recent if (v := s.value(key)) is not None])
        return series


def _scrape_url(url: str) -> str:
    parsed = httpx.URL(url)
    if parsed.path in ("", "/"):
        parsed = parsed.copy_with(path="/metrics")
    return str(parsed)


def _parse(url: str, text: str) -> dict[SeriesKey, float]:
    """The samples SARA reads, keyed by URL, sample name and labels."""
    values: dict[SeriesKey, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _KEPT:
                labels = tuple(sorted(sample.labels.items()))
                values[SeriesKey(url, sample.name, labels)] = float(sample.value)
    return values


def _by_le(rates: Mapping[Labels, float]) -> list[tuple[float, float]]:
    """(upper bound, rate) of bucket series, summed by ``le`` over other labels."""
    summed: dict[float, float] = {}
    for labels, rate in rates.items():
        le = dict(labels).get("le")
        if le is None:
            continue
        try:
            bound = float(le)
        except ValueError:  # not a histogram after all: no quantile rather than a wrong one
            return []
        summed[bound] = summed.get(bound, 0.0) + rate
    return list(summed.items())


def _gauge_sum(snapshot: Snapshot, name: str, match: Mapping[str, str]) -> float | None:
    """``sum(name{match})`` over the URLs that answered; None if no series matched."""
    found = [
        value
        for key, value in snapshot.values.items()
        if key.name == name and all(dict(key.labels).get(k) == v for k, v in match.items())
    ]
    if not found or not all(math.isfinite(v) for v in found):
        return None
    return sum(found)
