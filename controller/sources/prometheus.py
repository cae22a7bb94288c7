"""Observations from Prometheus's HTTP API (instant queries, ``/api/v1/query``).

The queries below are the whole contract with the metrics (DESIGN §4; listed with
their meaning in docs/observation.md). ``$selector`` is extra label matchers (e.g.
``namespace="prod"``, possibly empty) and ``$window`` a PromQL duration. They run
concurrently, so a hung Prometheus costs one ``timeout_s`` per tick, not one per query.
Queries are evaluated at Prometheus's "now": ``now_s`` is the controller's clock
(possibly monotonic) and is only stamped on the result.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from string import Template
from typing import Any

import httpx

from controller.observation import Observation, PoolObservation
from controller.sources.base import FailureLog, MeasurementUnavailable, pool_replicas
from controller.sources.counters import CounterSample, interarrival_scv
from controller.sources.histograms import DEFAULT_SAMPLES, Bucket, histogram_quantile
from controller.sources.histograms import length_samples as samples_from_buckets
from queueing.pools import Pool

ARRIVAL_RATE_QUERY = "sum(rate(sara_requests_total{$selector}[$window]))"
TTFT_P99_QUERY = (
    "histogram_quantile(0.99, sum by (le) (rate(sara_ttft_seconds_bucket{$selector}[$window])))"
)
TPOT_P99_QUERY = (
    "histogram_quantile(0.99, sum by (le) (rate(sara_tpot_seconds_bucket{$selector}[$window])))"
)
PROMPT_BUCKETS_QUERY = "sum by (le) (increase(sara_prompt_tokens_bucket{$selector}[$window]))"
OUTPUT_BUCKETS_QUERY = "sum by (le) (increase(sara_output_tokens_bucket{$selector}[$window]))"
# Raw samples of every request counter (a range vector), for the ca² estimate.
ARRIVAL_SAMPLES_QUERY = "sara_requests_total{$selector}[$window]"
PREFILL_QUEUE_DEPTH_QUERY = 'sum(sara_worker_queue_depth{pool="prefill",$selector})'

logger = logging.getLogger(__name__)


def promql_duration(seconds: float) -> str:
    """A PromQL duration literal (whole milliseconds: PromQL has no fractions)."""
    ms = round(seconds * 1000)
    if ms < 1:
        raise ValueError(f"duration: must be at least 1 ms, got {seconds!r} s")
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def render(template: str, *, selector: str, window_s: float) -> str:
    """One of the query templates above with its selector and window filled in."""
    return Template(template).substitute(selector=selector, window=promql_duration(window_s))


@dataclass(frozen=True)
class _Query:
    promql: str
    parse: Callable[[Mapping[str, Any]], Any]  # the API's ``data`` -> the field's value


class PrometheusSource:
    """An ``ObservationSource`` backed by PromQL instant queries.

    ``window_s``: the measurement window; ``burst_window_s``: the short window of the
    burst rate; ``scv_step_s``: the sub-window of the ca² estimate (use at least the
    scrape interval: sub-windows without a new sample are dropped).
    ``n_length_samples``: how many (prompt, output) pairs to reconstruct.
    An injected ``client`` is used as is and not closed by ``close()``.
    """

    def __init__(
        self,
        base_url: str,
        *,
        window_s: float = 30.0,
        burst_window_s: float = 5.0,
        timeout_s: float = 5.0,
        selector: str = "",
        scv_step_s: float = 5.0,
        n_length_samples: int = DEFAULT_SAMPLES,
        client: httpx.Client | None = None,
    ) -> None:
        for name, value in (
            ("window_s", window_s),
            ("burst_window_s", burst_window_s),
            ("timeout_s", timeout_s),
            ("scv_step_s", scv_step_s),
        ):
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
        if "{" in selector or "}" in selector:
            raise ValueError(f"selector: label matchers without braces, got {selector!r}")
        if n_length_samples < 1:
            raise ValueError(f"n_length_samples: must be >= 1, got {n_length_samples!r}")
        self._url = str(httpx.URL(base_url.rstrip("/") + "/api/v1/query"))
        self._timeout_s = float(timeout_s)
        self._scv_step_s = float(scv_step_s)
        self._n_samples = n_length_samples
        self._owns_client = client is None
        self._client = client if client is not None else httpx.Client()
        self._failures = FailureLog(logger)

        def q(template: str, window: float) -> str:
            return render(template, selector=selector, window_s=window)

        self._queries: dict[str, _Query] = {
            "arrival_rate_rps": _Query(q(ARRIVAL_RATE_QUERY, window_s), _single_value),
            "burst_arrival_rate_rps": _Query(q(ARRIVAL_RATE_QUERY, burst_window_s), _single_value),
            "interarrival_scv": _Query(q(ARRIVAL_SAMPLES_QUERY, window_s), self._scv),
            "ttft_p99_s": _Query(q(TTFT_P99_QUERY, window_s), _single_value),
            "tpot_p99_s": _Query(q(TPOT_P99_QUERY, window_s), _single_value),
            "prompt_buckets": _Query(q(PROMPT_BUCKETS_QUERY, window_s), _buckets),
            "output_buckets": _Query(q(OUTPUT_BUCKETS_QUERY, window_s), _buckets),
            "prefill_queue_depth": _Query(q(PREFILL_QUEUE_DEPTH_QUERY, window_s), _single_value),
        }

    @property
    def queries(self) -> Mapping[str, str]:
        """The rendered PromQL of each measurement, by name."""
        return {name: query.promql for name, query in self._queries.items()}

    @property
    def failing(self) -> Mapping[str, str]:
        """The queries that failed on the last tick they ran, and why."""
        return self._failures.failing

    def observe(self, *, now_s: float, replicas: Mapping[Pool, PoolObservation]) -> Observation:
        prefill, decode = pool_replicas(replicas)
        with ThreadPoolExecutor(max_workers=len(self._queries)) as executor:
            futures = {
                name: executor.submit(self._measure, query) for name, query in self._queries.items()
            }
            values: dict[str, Any] = {}
            for name, future in futures.items():
                try:
                    values[name] = future.result()
                    self._failures.succeeded(self._queries[name].promql)
                except MeasurementUnavailable as exc:
                    values[name] = None
                    self._failures.failed(self._queries[name].promql, str(exc))
        lengths = None
        if values["prompt_buckets"] is not None and values["output_buckets"] is not None:
            lengths = samples_from_buckets(
                values["prompt_buckets"],
                values["output_buckets"],
                source="prometheus histograms",
                n=self._n_samples,
            )
        return Observation(
            time_s=now_s,
            prefill=prefill,
            decode=decode,
            arrival_rate_rps=values["arrival_rate_rps"],
            burst_arrival_rate_rps=values["burst_arrival_rate_rps"],
            interarrival_scv=values["interarrival_scv"],
            lengths=lengths,
            ttft_p99_s=values["ttft_p99_s"],
            tpot_p99_s=values["tpot_p99_s"],
            prefill_queue_depth=values["prefill_queue_depth"],
        )

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> PrometheusSource:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- one query -----------------------------------------------------------------------

    def _measure(self, query: _Query) -> Any:
        return query.parse(self._fetch(query.promql))

    def _fetch(self, promql: str) -> Mapping[str, Any]:
        """The ``data`` of a successful answer; anything else is MeasurementUnavailable."""
        params = {"query": promql, "timeout": promql_duration(self._timeout_s)}
        try:
            response = self._client.get(self._url, params=params, timeout=self._timeout_s)
        except httpx.TimeoutException as exc:
            raise MeasurementUnavailable("timed out") from exc
        except httpx.RequestError as exc:
            raise MeasurementUnavailable(f"unreachable: {type(exc).__name__}") from exc
        try:
            body = response.json()
        except ValueError as exc:
            raise MeasurementUnavailable(f"HTTP {response.status_code}: not JSON") from exc
        if not isinstance(body, dict):
            raise MeasurementUnavailable(f"HTTP {response.status_code}: not a JSON object")
        if response.status_code != 200 or body.get("status") != "success":
            raise MeasurementUnavailable(
                f"HTTP {response.status_code}: {body.get('errorType')}: {body.get('error')}"
            )
        data = body.get("data")
        if not isinstance(data, dict):
            raise MeasurementUnavailable("malformed answer: no data object")
        return data

    def _scv(self, data: Mapping[str, Any]) -> float:
        scv = interarrival_scv(_series(data), step_s=self._scv_step_s)
        if scv is None:
            raise MeasurementUnavailable(
                f"fewer than 3 sub-windows of {self._scv_step_s:g} s, or no arrivals"
            )
        return scv


# -- the API's result shapes --------------------------------------------------------------


def _result(data: Mapping[str, Any], kind: str) -> list[Any]:
    if data.get("resultType") != kind or not isinstance(data.get("result"), list):
        raise MeasurementUnavailable(f"malformed answer: expected a {kind}")
    result: list[Any] = data["result"]
    if not result:
        raise MeasurementUnavailable("empty result")
    return result


def _number(text: Any) -> float:
    try:
        return float(text)
    except (TypeError, ValueError) as exc:
        raise MeasurementUnavailable(f"malformed answer: not a number: {text!r}") from exc


def _point(point: Any) -> tuple[float, float]:
    if not (isinstance(point, list) and len(point) == 2):
        raise MeasurementUnavailable(f"malformed answer: not a [time, value] pair: {point!r}")
    return _number(point[0]), _number(point[1])


def _single_value(data: Mapping[str, Any]) -> float:
    """The one finite value of a ``sum(...)`` or ``histogram_quantile`` answer."""
    result = _result(data, "vector")
    if len(result) != 1:
        raise MeasurementUnavailable(f"{len(result)} series, expected one")
    if not isinstance(result[0], dict):
        raise MeasurementUnavailable("malformed answer: a sample is not an object")
    _, value = _point(result[0].get("value"))
    if math.isnan(value):
        raise MeasurementUnavailable("NaN")
    if math.isinf(value):
        raise MeasurementUnavailable("+Inf" if value > 0 else "-Inf")
    return value


def _buckets(data: Mapping[str, Any]) -> list[Bucket]:
    """``(le, count)`` of a ``sum by (le)`` answer, checked to hold observations."""
    buckets: list[Bucket] = []
    for sample in _result(data, "vector"):
        if not isinstance(sample, dict) or not isinstance(sample.get("metric"), dict):
            raise MeasurementUnavailable("malformed answer: a sample is not an object")
        buckets.append((_number(sample["metric"].get("le")), _point(sample.get("value"))[1]))
    if histogram_quantile(0.5, buckets) is None:
        raise MeasurementUnavailable("no observations in the window (or no +Inf bucket)")
    return buckets


def _series(data: Mapping[str, Any]) -> list[list[CounterSample]]:
    """The raw samples of each series of a range-vector answer."""
    series: list[list[CounterSample]] = []
    for item in _result(data, "matrix"):
        if not isinstance(item, dict) or not isinstance(item.get("values"), list):
            raise MeasurementUnavailable("malformed answer: a series is not an object")
        series.append([_point(point) for point in item["values"]])
    return series
