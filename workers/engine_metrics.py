"""A worker's measurements exposed as vLLM or SGLang would expose them.

``sara worker --metrics-flavor vllm|sglang`` makes a worker (emulated or torch) look,
to Prometheus, like an instance of that engine in a prefill/decode deployment, so the
controller's ``vllm`` and ``sglang`` flavours (``controller/sources/flavors.py``) can
be run end to end against SARA's own pools. ``WorkerMetrics`` records every event once
(``workers/worker_metrics.py``) and hands it to the flavour's ``EngineExposition``,
which only names, labels and buckets it: no value is synthesised.

The families, types, label names and bucket bounds are the engines' own, from their
sources at the versions ``controller/sources/flavors.py`` reads:

=======  ==========================================  =========================================
engine   source                                      what is taken from it
=======  ==========================================  =========================================
vLLM     0.12, ``vllm/v1/metrics/loggers.py``        ``PrometheusStatLogger.__init__``: names,
                                                     labels ``model_name``, ``engine``
                                                     (+ ``finished_reason``), buckets;
                                                     ``build_1_2_5_buckets(max_model_len)``
vLLM     0.12, ``vllm/v1/metrics/stats.py``          ``mean_time_per_output_token``: decode
                                                     time over generated tokens - 1, 0 for one
vLLM     0.12, ``vllm/v1/engine/__init__.py``        ``finished_reason`` values: stop, length,
                                                     abort, error
SGLang   main 00ae9c1, ``python/sglang/srt/``        ``TokenizerMetricsCollector`` (label
         ``metrics/collector.py``                    ``model_name``, default buckets,
                                                     ``--collect-tokens-histogram``
                                                     histograms) and
                                                     ``SchedulerMetricsCollector`` gauges
SGLang   main 00ae9c1, ``python/sglang/srt/``        the scheduler's labels: ``model_name``,
         ``managers/scheduler.py`` (init_metrics)    ``engine_type`` (prefill, decode),
                                                     ``tp_rank``, ``pp_rank``, ``moe_ep_rank``
=======  ==========================================  =========================================

Only the families SARA's flavours read and those fed by the same events are exported
(no prefix-cache, LoRA, speculative-decoding or grammar families: SARA has none of
those features; not vLLM's per-step token counters, which count a P/D decode
instance's prompt tokens by what its KV connector loaded). The SGLang length
histograms are always exported (SGLang needs ``--collect-tokens-histogram`` for them).

What each pool's worker records, as the engine's instance of that role would:

- prefill: TTFT from the request's arrival at the router (``arrival_s``) to the first
  token's publication, the queueing in the pool's stream included; one generated
  token; requests counted when handed to decode (vLLM ``finished_reason="length"``: a
  vLLM prefill instance runs each request with ``max_tokens=1``); waiting and running
  requests of its engine and its KV usage.
- decode: the request's output length counting the first token it was handed; the
  gaps between its tokens (inter-token latency), the first from the hand-off; the
  per-request mean gap ``(last token - hand-off) / (tokens - 1)`` (vLLM's
  ``request_time_per_output_token``; SARA's router measures the same from the first
  token it read); its own first token's latency after the hand-off as its TTFT (not
  the client's: the flavours read TTFT from the prefill pool); its KV usage.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controller.config import MetricsFlavor
from queueing.pools import Pool

# -- vLLM 0.12, vllm/v1/metrics/loggers.py ---------------------------------------------------

VLLM_LABELS = ("model_name", "engine")
VLLM_TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# inter_token_latency_seconds and request_time_per_output_token_seconds share these.
VLLM_TPOT_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
VLLM_REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
VLLM_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
VLLM_FINISHED_REASONS = ("stop", "length", "abort", "error")  # vllm/v1/engine FinishReason


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's length buckets: 1, 2, 5, 10, 20, 50, ... while at most ``max_value``."""
    out: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


# -- SGLang main 00ae9c1, python/sglang/srt/metrics/collector.py ----------------------------

SGLANG_TOKENIZER_LABELS = ("model_name",)
SGLANG_SCHEDULER_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
SGLANG_TTFT_BUCKETS_S = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400,
)  # fmt: skip
SGLANG_ITL_BUCKETS_S = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
    0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip
SGLANG_E2E_BUCKETS_S = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200,
    1800, 2400,
)  # fmt: skip
SGLANG_TOKENS_BUCKETS = (
    100, 300, 500, 700, 1000, 1500, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 10000,
    12000, 15000, 20000, 22000, 25000, 30000, 35000, 40000, 66000, 99000, 132000, 300000,
    600000, 900000, 1100000,
)  # fmt: skip


class RequestEnd(enum.Enum):
    """How a request left this worker, in the engines' terms."""

    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens reached (a prefill instance's one token included)
    ABORT = "abort"  # cancelled or expired before the end
    ERROR = "error"  # ended with an error event


@dataclass(frozen=True, kw_only=True)
class EndedRequest:
    """One request as it left this worker.

    ``output_tokens``: the request's tokens so far (1 on a prefill worker, all of them
    on a decode worker). ``e2e_s``: from the arrival at the router to the end.
    ``tpot_s``: the per-request mean gap between tokens (decode); ``None`` where this
    worker did not time the tokens (a prefill worker, a request it did not serve).
    """

    end: RequestEnd
    prompt_tokens: int
    output_tokens: int
    e2e_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.end, RequestEnd):
            raise ValueError(f"end: expected a RequestEnd, got {self.end!r}")
        for name in ("prompt_tokens", "output_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected an integer >= 0, got {value!r}")
        for name in ("e2e_s", "tpot_s"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name}: expected seconds >= 0 or None, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class EngineIdentity:
    """What the engine's labels and length buckets need: the served model's name and
    its context (vLLM's ``max_model_len``), and the worker's pool (SGLang's
    ``engine_type``)."""

    model_name: str
    max_model_len: int
    pool: Pool

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name: expected a non-empty name, got {self.model_name!r}")
        if isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int):
            raise ValueError(f"max_model_len: expected an integer >= 1, got {self.max_model_len!r}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len: expected an integer >= 1, got {self.max_model_len}")
        if not isinstance(self.pool, Pool):
            raise ValueError(f"pool: expected a Pool, got {self.pool!r}")


class EngineExposition(ABC):
    """An engine's metric families for one worker's events (see the module docstring)."""

    @abstractmethod
    def first_token(self, ttft_s: float) -> None:
        """This worker's first token of a request, ``ttft_s`` after its arrival here."""

    @abstractmethod
    def token_gaps(self, gaps_s: Sequence[float]) -> None:
        """Gaps before each token this worker generated (one per token)."""

    @abstractmethod
    def ended(self, request: EndedRequest) -> None:
        """A request left this worker."""

    @abstractmethod
    def stepped(self, batch_tokens: int) -> None:
        """One engine step over ``batch_tokens`` tokens."""

    @abstractmethod
    def gauges(self, *, waiting: int, running: int, kv_usage: float) -> None:
        """The engine's state now: requests not yet started, running, KV fraction used."""


class VllmExposition(EngineExposition):
    """vLLM 0.12's ``PrometheusStatLogger`` families for one engine core (``engine="0"``)."""

    def __init__(self, identity: EngineIdentity, registry: CollectorRegistry) -> None:
        r, names = registry, VLLM_LABELS
        values = (identity.model_name, "0")
        lengths = build_1_2_5_buckets(identity.max_model_len)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(*values)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Requests in execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=r,
        )
        # vLLM creates one series per finish reason at start: rate() is 0, not absent.
        self.success = {reason: success.labels(*values, reason) for reason in VLLM_FINISHED_REASONS}
        self.prompt_hist = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", lengths
        )
        self.generation_hist = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", lengths
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            VLLM_ITERATION_TOKENS_BUCKETS,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            VLLM_TTFT_BUCKETS_S,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            VLLM_TPOT_BUCKETS_S,
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            VLLM_TPOT_BUCKETS_S,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            VLLM_REQUEST_LATENCY_BUCKETS_S,
        )

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def token_gaps(self, gaps_s: Sequence[float]) -> None:
        for gap_s in gaps_s:
            self.itl.observe(gap_s)

    def ended(self, request: EndedRequest) -> None:
        self.success[request.end.value].inc()
        # vLLM observes the lengths and timings of every finished request, aborted too.
        self.prompt_hist.observe(request.prompt_tokens)
        self.generation_hist.observe(request.output_tokens)
        if request.e2e_s is not None:
            self.e2e.observe(request.e2e_s)
        # stats.py: 0 when the request generated one token (a prefill instance's).
        if request.tpot_s is not None:
            self.tpot.observe(request.tpot_s)
        elif request.output_tokens <= 1:
            self.tpot.observe(0.0)

    def stepped(self, batch_tokens: int) -> None:
        self.iteration_tokens.observe(batch_tokens)

    def gauges(self, *, waiting: int, running: int, kv_usage: float) -> None:
        self.waiting.set(waiting)
        self.running.set(running)
        self.kv_usage.set(kv_usage)


class SglangExposition(EngineExposition):
    """SGLang's tokenizer-manager (per request) and scheduler (gauge) families."""

    def __init__(self, identity: EngineIdentity, registry: CollectorRegistry) -> None:
        r, names = registry, SGLANG_TOKENIZER_LABELS
        model = (identity.model_name,)
        # One scheduler: rank 0 of every parallel dimension.
        scheduler = (identity.model_name, identity.pool.value, "0", "0", "0")

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(*model)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(*model)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, SGLANG_SCHEDULER_LABELS, registry=r).labels(*scheduler)

        self.prompt_tokens = counter("sglang:prompt_tokens_total", "Prefill tokens processed.")
        self.generation_tokens = counter(
            "sglang:generation_tokens_total", "Generation tokens processed."
        )
        self.requests = counter("sglang:num_requests_total", "Number of requests processed.")
        self.aborted = counter("sglang:num_aborted_requests_total", "Number of requests aborted.")
        self.prompt_hist = histogram(
            "sglang:prompt_tokens_histogram", "Histogram of prompt token length.",
            SGLANG_TOKENS_BUCKETS,
        )  # fmt: skip
        self.generation_hist = histogram(
            "sglang:generation_tokens_histogram", "Histogram of generation token length.",
            SGLANG_TOKENS_BUCKETS,
        )  # fmt: skip
        self.ttft = histogram(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            SGLANG_TTFT_BUCKETS_S,
        )  # fmt: skip
        self.itl = histogram(
            "sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            SGLANG_ITL_BUCKETS_S,
        )  # fmt: skip
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in "
            "seconds", SGLANG_E2E_BUCKETS_S,
        )  # fmt: skip
        self.running = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.queue = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.token_usage = gauge("sglang:token_usage", "The token usage.")

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def token_gaps(self, gaps_s: Sequence[float]) -> None:
        for gap_s in gaps_s:
            self.itl.observe(gap_s)

    def ended(self, request: EndedRequest) -> None:
        if request.end is RequestEnd.ABORT:
            self.aborted.inc()
            return
        # observe_one_finished_request: the counters, e2e and the length histograms.
        self.requests.inc()
        self.prompt_tokens.inc(request.prompt_tokens)
        self.generation_tokens.inc(request.output_tokens)
        self.prompt_hist.observe(request.prompt_tokens)
        self.generation_hist.observe(request.output_tokens)
        if request.e2e_s is not None:
            self.e2e.observe(request.e2e_s)

    def stepped(self, batch_tokens: int) -> None:
        return  # SGLang has no per-step token histogram

    def gauges(self, *, waiting: int, running: int, kv_usage: float) -> None:
        self.queue.set(waiting)
        self.running.set(running)
        self.token_usage.set(kv_usage)


def engine_exposition(
    flavor: MetricsFlavor, identity: EngineIdentity, registry: CollectorRegistry
) -> EngineExposition | None:
    """The exposition of ``flavor``; ``None`` for ``sara`` (the ``sara_*`` families only).

    ``ValueError`` for ``custom``: a flavour of queries only, no engine exports it.
    """
    if flavor is MetricsFlavor.SARA:
        return None
    if flavor is MetricsFlavor.VLLM:
        return VllmExposition(identity, registry)
    if flavor is MetricsFlavor.SGLANG:
        return SglangExposition(identity, registry)
    raise ValueError(
        f"metrics_flavor: a worker exports sara, vllm or sglang metrics, got {flavor.value!r}"
    )
