"""Observations from Prometheus's HTTP API (instant queries, ``/api/v1/query``).

The queries are the whole contract with the metrics (DESIGN §4). Their text comes
from the configured flavour (``controller.sources.flavors``: SARA's own metrics,
vLLM's, SGLang's, or templates in the config); docs/observation.md and
docs/engines.md list them with their meaning. They run concurrently, so a hung
Prometheus costs one ``timeout_s`` per tick, not one per query. Queries are
evaluated at Prometheus's "now": ``now_s`` is the controller's clock (possibly
monotonic) and is only stamped on the result.
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

from controller.config import MetricsConfig
from controller.counters import CounterSample, cumulative_arrivals, interarrival_scv
from controller.histograms import (
    DEFAULT_SAMPLES,
    Bucket,
    histogram_count,
    histogram_quantile,
)
from controller.histograms import length_samples as samples_from_buckets
from controller.observation import Observation, PoolObservation
from controller.sources.base import FailureLog, MeasurementUnavailable, pool_replicas
from controller.sources.flavors import SARA, flavor_queries, join_matchers
from queueing.pools import Pool

# The sara flavour's templates, by their historical names ($selector and $window).
ARRIVAL_RATE_QUERY = SARA.arrival_rate
TTFT_P99_QUERY = SARA.ttft_p99
TPOT_P99_QUERY = SARA.tpot_p99
PROMPT_BUCKETS_QUERY = SARA.prompt_buckets
OUTPUT_BUCKETS_QUERY = SARA.output_buckets
# Raw samples of every request counter (a range vector), for the ca² estimate.
ARRIVAL_SAMPLES_QUERY = SARA.arrival_samples
PREFILL_QUEUE_DEPTH_QUERY = SARA.prefill_queue_depth

logger = logging.getLogger(__name__)


def promql_duration(seconds: float) -> str:
    """A PromQL duration literal (whole milliseconds: PromQL has no fractions)."""
    ms = round(seconds * 1000)
    if ms < 1:
        raise ValueError(f"duration: must be at least 1 ms, got {seconds!r} s")
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def render(
    template: str,
    *,
    selector: str,
    window_s: float,
    prefill_selector: str = 'pool="prefill"',
    decode_selector: str = 'pool="decode"',
) -> str:
    """A query template with its selectors and window filled in: ``$selector`` is
    ``selector``, ``$prefill`` and ``$decode`` add each pool's matchers to it."""
    try:
        return Template(template).substitute(
            selector=join_matchers(selector),
            prefill=join_matchers(selector, prefill_selector),
            decode=join_matchers(selector, decode_selector),
            window=promql_duration(window_s),
        )
    except (KeyError, ValueError) as exc:
        raise ValueError(
            f"query template: only $window, $selector, $prefill and $decode may be "
            f"used ({exc}), got {template!r}"
        ) from exc


@dataclass(frozen=True)
class _Query:
    promql: str
    parse: Callable[[Mapping[str, Any]], Any]  # the API's ``data`` -> the field's value


class PrometheusSource:
    """An ``ObservationSource`` backed by PromQL instant queries.

    ``window_s``: the measurement window; ``burst_window_s``: the short window of the
    burst rate; ``scv_step_s``: the sub-window of the ca² estimate (use at least the
    scrape interval: sub-windows without a new sample are dropped); ``scv_span_s``:
    how far back the request counters are read for it, to tell a change of level from
    a burst (the policy's ``lead_time.pool_s``, the span it pools the length mix over).
    ``n_length_samples``: how many (prompt, output) pairs to reconstruct.
    ``metrics``: the flavour (whose metric names) and the pools' label matchers.
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
        scv_span_s: float = 300.0,
        n_length_samples: int = DEFAULT_SAMPLES,
        metrics: MetricsConfig | None = None,
        client: httpx.Client | None = None,
    ) -> None:
        metrics = MetricsConfig() if metrics is None else metrics
        for name, value in (
            ("window_s", window_s),
            ("burst_window_s", burst_window_s),
            ("timeout_s", timeout_s),
            ("scv_step_s", scv_step_s),
            ("scv_span_s", scv_span_s),
        ):
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
        if "{" in selector or "}" in selector:
            raise ValueError(f"selector: label matchers without braces, got {selector!r}")
        if n_length_samples < 1:
            raise ValueError(f"n_length_samples: must be >= 1, got {n_length_samples!r}")
        self._url = str(httpx.URL(base_url.rstrip("/") + "/api/v1/query"))
        self._range_url = str(httpx.URL(base_url.rstrip("/") + "/api/v1/query_range"))
        self._timeout_s = float(timeout_s)
        self._scv_step_s = float(scv_step_s)
        self._window_s = float(window_s)
        self._n_samples = n_length_samples
        self._owns_client = client is None
        self._client = client if client is not None else httpx.Client()
        self._failures = FailureLog(logger)

        def q(template: str, window: float) -> str:
            return render(
                template,
                selector=selector,
                window_s=window,
                prefill_selector=metrics.prefill_selector,
                decode_selector=metrics.decode_selector,
            )

        flavor = flavor_queries(metrics)
        # The arrival rate over any window, for the forecaster's history.
        self._arrival_rate_over: Callable[[float], str] = lambda w: q(flavor.arrival_rate, w)
        self._queries: dict[str, _Query] = {
            "arrival_rate_rps": _Query(q(flavor.arrival_rate, window_s), _single_value),
            "burst_arrival_rate_rps": _Query(q(flavor.arrival_rate, burst_window_s), _single_value),
            "interarrival_scv": _Query(
                q(flavor.arrival_samples, max(window_s, scv_span_s)), self._scv
            ),
            "arrival_counts": _Query(q(flavor.arrival_samples, window_s), self._counts),
            "ttft_p99_s": _Query(q(flavor.ttft_p99, window_s), _single_value),
            "tpot_p99_s": _Query(q(flavor.tpot_p99, window_s), _single_value),
            "prompt_buckets": _Query(q(flavor.prompt_buckets, window_s), _buckets),
            "output_buckets": _Query(q(flavor.output_buckets, window_s), _buckets),
            "prefill_queue_depth": _Query(q(flavor.prefill_queue_depth, window_s), _single_value),
            "kv_usage_fraction": _Query(q(flavor.kv_usage, window_s), _single_value),
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
                requests=histogram_count(values["output_buckets"]) or 0.0,
                n=self._n_samples,
            )
        return Observation(
            time_s=now_s,
            prefill=prefill,
            decode=decode,
            arrival_rate_rps=values["arrival_rate_rps"],
            burst_arrival_rate_rps=values["burst_arrival_rate_rps"],
            interarrival_scv=values["interarrival_scv"],
            arrival_counts=values["arrival_counts"],
            lengths=lengths,
            ttft_p99_s=values["ttft_p99_s"],
            tpot_p99_s=values["tpot_p99_s"],
            prefill_queue_depth=values["prefill_queue_depth"],
            kv_usage_fraction=values["kv_usage_fraction"],
        )

    def arrival_history(
        self, *, start_s: float, end_s: float, step_s: float
    ) -> list[tuple[float, float]]:
        """The arrival rate over each ``step_s`` window ending at ``start_s + k step_s``
        up to ``end_s`` (a ``query_range`` of the arrival-rate query at that window),
        as (end of window, req/s) pairs: what a warm-starting forecaster reads instead
        of waiting a trend window, or a day, of its own ticks. Steps without a value
        are left out; an unanswered query raises ``MeasurementUnavailable``."""
        if not (math.isfinite(step_s) and step_s > 0):
            raise ValueError(f"step_s: must be a finite number > 0, got {step_s!r}")
        if not end_s > start_s:
            raise ValueError(f"end_s: must be after start_s {start_s!r}, got {end_s!r}")
        params = {
            "query": self._arrival_rate_over(step_s),
            "start": f"{start_s:.3f}",
            "end": f"{end_s:.3f}",
            "step": promql_duration(step_s),
            "timeout": promql_duration(self._timeout_s),
        }
        data = self._get(self._range_url, params)
        totals: dict[float, float] = {}
        for series in _result(data, "matrix"):
            if not isinstance(series, dict):
                raise MeasurementUnavailable("malformed answer: a series is not an object")
            for point in series.get("values", []):
                t, value = _point(point)
                if math.isfinite(value) and value >= 0:
                    totals[t] = totals.get(t, 0.0) + value
        return sorted(totals.items())

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
        return self._get(self._url, params)

    def _get(self, url: str, params: Mapping[str, str]) -> Mapping[str, Any]:
        try:
            response = self._client.get(url, params=params, timeout=self._timeout_s)
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
        """The request counters' ca² over the span (``interarrival_scv``)."""
        scv = interarrival_scv(_series(data), step_s=self._scv_step_s, window_s=self._window_s)
        if scv is None:
            raise MeasurementUnavailable(
                f"fewer than 3 sub-windows of {self._scv_step_s:g} s, or no arrivals"
            )
        return scv

    def _counts(self, data: Mapping[str, Any]) -> tuple[CounterSample, ...]:
        """The arrivals' record over the window (``cumulative_arrivals``)."""
        counts = cumulative_arrivals(_series(data))
        if counts is None:
            raise MeasurementUnavailable("fewer than 2 samples of the request counters")
        return counts


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
