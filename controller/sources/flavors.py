"""The PromQL of each metrics flavour: which engine's metric names the observation reads.

A flavour is one query template per measurement. Templates are ``string.Template``
text with four variables, filled in by ``controller.sources.prometheus``:

- ``$window``: the measurement window as a PromQL duration (``30s``);
- ``$selector``: the source's own label matchers (``namespace="llm"``, may be empty);
- ``$prefill`` / ``$decode``: ``$selector`` plus the pool's matchers
  (``MetricsConfig.prefill_selector`` / ``decode_selector``, ``pool="prefill"`` by
  default), i.e. the series of that pool's instances.

In a disaggregated deployment every measurement is read from the pool whose metric
means what SARA's does (docs/engines.md explains each choice):

=====================  =====================  ======================================
measurement            pool                   why
=====================  =====================  ======================================
arrival rate, ca²      prefill                every request passes one prefill
                                              instance once (a decode pool would
                                              count it too: read only one)
TTFT P99               prefill                the queueing and prefill time the
                                              prefill pool's size sets
TPOT P99               decode                 the decode steps
prompt lengths         prefill                the prompts the prefill pool computes
output lengths         decode                 prefill instances generate one token
prefill queue depth    prefill                requests waiting for a prefill
KV usage               decode                 where the KV cache lives while decoding
=====================  =====================  ======================================

The engine tables are taken from the engines' sources, at the versions below
(``tests/controller/test_sources_flavors.py`` exports exactly these names, labels and
buckets and checks the queries against a real Prometheus):

- vLLM 0.12 (V1 engine), ``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``;
- SGLang main at commit 00ae9c1 (the 0.5 series),
  ``python/sglang/srt/metrics/collector.py``, ``TokenizerMetricsCollector`` and
  ``SchedulerMetricsCollector``.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.config import CUSTOM_QUERY_FIELDS, MetricsConfig, MetricsFlavor


@dataclass(frozen=True, kw_only=True)
class FlavorQueries:
    """One template per measurement (the variables are in the module's docstring)."""

    arrival_rate: str  # requests/s over $window, one scalar
    arrival_samples: str  # a range vector: the raw samples of every request counter
    ttft_p99: str  # seconds, one scalar
    tpot_p99: str  # seconds, one scalar
    prompt_buckets: str  # a vector by le: requests per prompt-length bucket
    output_buckets: str  # a vector by le: requests per output-length bucket
    prefill_queue_depth: str  # requests, one scalar
    kv_usage: str  # a fraction in [0, 1], one scalar

    def __post_init__(self) -> None:
        for name, text in vars(self).items():
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{name}: must be a non-empty PromQL template, got {text!r}")


def _p99(histogram: str, pool: str) -> str:
    return f"histogram_quantile(0.99, sum by (le) (rate({histogram}_bucket{{{pool}}}[$window])))"


def _buckets(histogram: str, pool: str) -> str:
    return f"sum by (le) (increase({histogram}_bucket{{{pool}}}[$window]))"


# SARA's router counts every request once and measures TTFT and TPOT where the client
# sees them; only the workers' gauges need the pool.
SARA = FlavorQueries(
    arrival_rate="sum(rate(sara_requests_total{$selector}[$window]))",
    arrival_samples="sara_requests_total{$selector}[$window]",
    ttft_p99=_p99("sara_ttft_seconds", "$selector"),
    tpot_p99=_p99("sara_tpot_seconds", "$selector"),
    prompt_buckets=_buckets("sara_prompt_tokens", "$selector"),
    output_buckets=_buckets("sara_output_tokens", "$selector"),
    prefill_queue_depth="sum(sara_worker_queue_depth{$prefill})",
    kv_usage="avg(sara_worker_kv_utilization{$decode})",
)

# vLLM 0.12. Every series has the labels model_name and engine (the engine-core index
# of a data-parallel instance); request_success also has finished_reason (stop,
# length, abort, error). Requests are counted when they finish, a TTFT after they
# arrive: over a 30 s window the rate lags the arrivals by that much.
# vllm:request_time_per_output_token_seconds is the per-request mean TPOT (SARA's
# definition); vllm:inter_token_latency_seconds (named time_per_output_token_seconds
# before 0.11) weighs every token, not every request.
VLLM = FlavorQueries(
    arrival_rate="sum(rate(vllm:request_success_total{$prefill}[$window]))",
    arrival_samples="vllm:request_success_total{$prefill}[$window]",
    ttft_p99=_p99("vllm:time_to_first_token_seconds", "$prefill"),
    tpot_p99=_p99("vllm:request_time_per_output_token_seconds", "$decode"),
    prompt_buckets=_buckets("vllm:request_prompt_tokens", "$prefill"),
    output_buckets=_buckets("vllm:request_generation_tokens", "$decode"),
    prefill_queue_depth="sum(vllm:num_requests_waiting{$prefill})",
    kv_usage="avg(vllm:kv_cache_usage_perc{$decode})",
)

# SGLang (0.5 series). Labels: model_name (plus the scheduler's tp_rank/pp_rank and
# engine_type on its gauges). num_requests_total counts finished requests. There is
# no per-request TPOT histogram: inter_token_latency_seconds counts each token once
# (older releases: sglang:time_per_output_token_seconds). The length histograms exist
# only with --collect-tokens-histogram; token_usage is the KV pool's used fraction.
SGLANG = FlavorQueries(
    arrival_rate="sum(rate(sglang:num_requests_total{$prefill}[$window]))",
    arrival_samples="sglang:num_requests_total{$prefill}[$window]",
    ttft_p99=_p99("sglang:time_to_first_token_seconds", "$prefill"),
    tpot_p99=_p99("sglang:inter_token_latency_seconds", "$decode"),
    prompt_buckets=_buckets("sglang:prompt_tokens_histogram", "$prefill"),
    output_buckets=_buckets("sglang:generation_tokens_histogram", "$decode"),
    prefill_queue_depth="sum(sglang:num_queue_reqs{$prefill})",
    kv_usage="avg(sglang:token_usage{$decode})",
)

BUILT_IN: dict[MetricsFlavor, FlavorQueries] = {
    MetricsFlavor.SARA: SARA,
    MetricsFlavor.VLLM: VLLM,
    MetricsFlavor.SGLANG: SGLANG,
}


def flavor_queries(metrics: MetricsConfig) -> FlavorQueries:
    """The templates of ``metrics``'s flavour (the config's own for ``custom``)."""
    if metrics.flavor is MetricsFlavor.CUSTOM:
        templates = {name: getattr(metrics, name) for name in CUSTOM_QUERY_FIELDS}
        return FlavorQueries(**{name.removesuffix("_query"): t for name, t in templates.items()})
    return BUILT_IN[metrics.flavor]


def join_matchers(*parts: str) -> str:
    """Label matchers joined with commas, empty parts left out."""
    return ",".join(part.strip().strip(",") for part in parts if part.strip().strip(","))
