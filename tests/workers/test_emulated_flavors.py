"""Emulated workers exporting vLLM's and SGLang's metrics, scraped over HTTP.

A prefill and a decode worker (emulated engine, real Redis, real KV hand-off) serve
a known set of requests with ``--metrics-flavor vllm`` or ``sglang``; their
``/metrics`` is fetched over HTTP and parsed with prometheus_client's text parser.
Every family must have the name, type, label names and bucket bounds of the table
below, transcribed from the engine's source at the version named (independently of
the exporter's code), and the counts and sums must be those of the requests sent:
the values come from the workers' own events.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")

from prometheus_client.parser import text_string_to_metric_families

from controller.config import MetricsFlavor
from queueing.pools import Pool
from tests.profiles import TEST_8B
from tests.workers.test_emulated import collect, run
from workers.decode_worker import DecodeWorker
from workers.emulated import EmulatedEngine, EmulatedModel
from workers.engine_metrics import EngineIdentity
from workers.prefill_worker import PrefillWorker
from workers.protocol import KeySpace, PrefillRequest, Streams, connect
from workers.redis_util import RedisServer
from workers.transfer import RedisKvTransport
from workers.worker import Worker, WorkerSettings
from workers.worker_http import WorkerHttpServer
from workers.worker_metrics import WorkerMetrics

PREFIX = "flv"
MODEL_NAME = "llama-emulated"
CONTEXT = 4096
MODEL = EmulatedModel(vocab_size=32_000, max_position_embeddings=CONTEXT)
INF = math.inf

# -- the engines' tables, transcribed from their sources --------------------------------
# (type, label names, bucket upper bounds for histograms)

# vLLM 0.12, vllm/v1/metrics/loggers.py, PrometheusStatLogger.__init__: every family
# has labels model_name and engine; request_success adds finished_reason.
_V = ("model_name", "engine")
VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
             7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
VLLM_TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
             7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
VLLM_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# build_1_2_5_buckets(max_model_len) for a 4096-token context.
VLLM_LENGTHS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
VLLM_STEP_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
VLLM_TABLE: dict[str, tuple[str, tuple[str, ...], tuple[float, ...] | None]] = {
    "vllm:num_requests_running": ("gauge", _V, None),
    "vllm:num_requests_waiting": ("gauge", _V, None),
    "vllm:kv_cache_usage_perc": ("gauge", _V, None),
    "vllm:request_success": ("counter", (*_V, "finished_reason"), None),
    "vllm:request_prompt_tokens": ("histogram", _V, VLLM_LENGTHS),
    "vllm:request_generation_tokens": ("histogram", _V, VLLM_LENGTHS),
    "vllm:iteration_tokens_total": ("histogram", _V, VLLM_STEP_TOKENS),
    "vllm:time_to_first_token_seconds": ("histogram", _V, VLLM_TTFT),
    "vllm:inter_token_latency_seconds": ("histogram", _V, VLLM_TPOT),
    "vllm:request_time_per_output_token_seconds": ("histogram", _V, VLLM_TPOT),
    "vllm:e2e_request_latency_seconds": ("histogram", _V, VLLM_LATENCY),
}

# SGLang main 00ae9c1, python/sglang/srt/metrics/collector.py: the tokenizer manager's
# families carry model_name; the scheduler's gauges model_name, engine_type, tp_rank,
# pp_rank, moe_ep_rank (managers/scheduler.py init_metrics).
_S = ("model_name",)
_SCHED = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
SGLANG_TOKENS = (100, 300, 500, 700, 1000, 1500, 2000, 3000, 4000, 5000, 6000, 7000, 8000,
                 9000, 10000, 12000, 15000, 20000, 22000, 25000, 30000, 35000, 40000, 66000,
                 99000, 132000, 300000, 600000, 900000, 1100000)  # fmt: skip
SGLANG_TTFT = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
SGLANG_ITL = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
              0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000,
              8.000)  # fmt: skip
SGLANG_E2E = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
              1200, 1800, 2400)  # fmt: skip
SGLANG_TABLE: dict[str, tuple[str, tuple[str, ...], tuple[float, ...] | None]] = {
    "sglang:prompt_tokens": ("counter", _S, None),
    "sglang:generation_tokens": ("counter", _S, None),
    "sglang:num_requests": ("counter", _S, None),
    "sglang:num_aborted_requests": ("counter", _S, None),
    "sglang:prompt_tokens_histogram": ("histogram", _S, SGLANG_TOKENS),
    "sglang:generation_tokens_histogram": ("histogram", _S, SGLANG_TOKENS),
    "sglang:time_to_first_token_seconds": ("histogram", _S, SGLANG_TTFT),
    "sglang:inter_token_latency_seconds": ("histogram", _S, SGLANG_ITL),
    "sglang:e2e_request_latency_seconds": ("histogram", _S, SGLANG_E2E),
    "sglang:num_running_reqs": ("gauge", _SCHED, None),
    "sglang:num_queue_reqs": ("gauge", _SCHED, None),
    "sglang:token_usage": ("gauge", _SCHED, None),
}

TABLES = {MetricsFlavor.VLLM: VLLM_TABLE, MetricsFlavor.SGLANG: SGLANG_TABLE}

# Prompts of known lengths (token-id prompts: exact) and outputs; one ends at prefill.
ASKS = [(37, 12), (150, 9), (600, 20), (8, 1), (1200, 5), (64, 30)]


@dataclass
class Scraped:
    flavor: MetricsFlavor
    families: dict[Pool, dict[str, Any]]  # name -> prometheus_client Metric


def worker(pool: Pool, url: str, flavor: MetricsFlavor) -> tuple[Worker, WorkerHttpServer]:
    settings = WorkerSettings(
        worker_id=f"{pool.value}-{flavor.value}", pool=pool, token_budget=256, num_blocks=256,
        key_prefix=PREFIX, idle_block_ms=20, keepalive_interval_s=0.1, reclaim_interval_s=0.1,
    )  # fmt: skip
    identity = EngineIdentity(model_name=MODEL_NAME, max_model_len=CONTEXT, pool=pool)
    metrics = WorkerMetrics(pool, flavors=(flavor,), identity=identity)
    client = connect(url)
    cls: Any = PrefillWorker if pool is Pool.PREFILL else DecodeWorker
    engine = EmulatedEngine(
        TEST_8B, model=MODEL, token_budget=256, num_blocks=256, keep_finished_kv=True
    )
    w = cls(
        settings,
        engine=engine,
        transport=RedisKvTransport(client, key_prefix=f"{PREFIX}:kv"),
        client=client,
        metrics=metrics,
    )
    http = WorkerHttpServer(host="127.0.0.1", port=0, metrics=metrics.exposition,
                            readiness=w.readiness)  # fmt: skip
    return w, http.start()


@pytest.fixture(scope="module", params=[MetricsFlavor.VLLM, MetricsFlavor.SGLANG], ids=str)
def scraped(request: pytest.FixtureRequest) -> Iterator[Scraped]:
    flavor: MetricsFlavor = request.param
    server = RedisServer.start()
    try:
        streams = Streams(connect(server.url), KeySpace(PREFIX))
        streams.ensure_groups()
        pairs = [worker(pool, server.url, flavor) for pool in Pool]
        stop = threading.Event()
        threads = run([w for w, _ in pairs], stop)
        try:
            for i, (prompt, output) in enumerate(ASKS):
                now_s = time.time()
                streams.enqueue_prefill(
                    PrefillRequest(
                        request_id=f"flv-{i}", prompt_token_ids=tuple(range(3, 3 + prompt)),
                        max_tokens=output, arrival_s=now_s, deadline_s=now_s + 60,
                    )
                )  # fmt: skip
            for i, (_, output) in enumerate(ASKS):
                assert len(collect(streams, f"flv-{i}")) == output
        finally:
            stop.set()
            for t in threads:
                t.join(10)
        families = {}
        for (_, http), pool in zip(pairs, Pool, strict=True):
            text = httpx.get(f"http://{http.address}/metrics", timeout=5).text
            families[pool] = {f.name: f for f in text_string_to_metric_families(text)}
            http.stop()
        yield Scraped(flavor=flavor, families=families)
    finally:
        server.stop()


def label_names(family: Any) -> set[str]:
    return {k for s in family.samples for k in s.labels if k not in ("le",)}


def sample(family: Any, suffix: str, **labels: str) -> float:
    values = [
        s.value
        for s in family.samples
        if s.name == family.name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(values) == 1, (family.name, suffix, labels, family.samples)
    return float(values[0])


def test_every_family_has_the_engines_name_type_labels_and_buckets(scraped: Scraped) -> None:
    for pool in Pool:
        families = scraped.families[pool]
        for name, (kind, labels, buckets) in TABLES[scraped.flavor].items():
            assert name in families, f"{pool.value}: {name} missing"
            family = families[name]
            assert family.type == kind, (name, family.type)
            assert label_names(family) == set(labels), (name, label_names(family))
            if buckets is not None:
                bounds = sorted(
                    {float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")}
                )
                assert bounds == [float(b) for b in buckets] + [INF], name


def test_the_model_name_and_the_schedulers_engine_type_label_every_series(
    scraped: Scraped,
) -> None:
    for pool in Pool:
        for name in TABLES[scraped.flavor]:
            for s in scraped.families[pool][name].samples:
                assert s.labels["model_name"] == MODEL_NAME
                if "engine_type" in s.labels:
                    assert s.labels["engine_type"] == pool.value
                if "engine" in s.labels:
                    assert s.labels["engine"] == "0"


def test_the_counts_and_sums_are_those_of_the_requests_served(scraped: Scraped) -> None:
    prefill, decode = scraped.families[Pool.PREFILL], scraped.families[Pool.DECODE]
    n = len(ASKS)
    prompts = sum(p for p, _ in ASKS)
    decoded = [(p, o) for p, o in ASKS if o > 1]  # the others end at the prefill worker
    gaps = sum(o - 1 for _, o in decoded)
    if scraped.flavor is MetricsFlavor.VLLM:
        ttft, itl = "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"
        prompt_h, output_h = "vllm:request_prompt_tokens", "vllm:request_generation_tokens"
        tpot = prefill["vllm:request_time_per_output_token_seconds"]
        # A prefill instance generates one token each: vLLM's per-request TPOT is 0.
        assert sample(tpot, "_count") == n and sample(tpot, "_sum") == 0
        dtpot = decode["vllm:request_time_per_output_token_seconds"]
        assert sample(dtpot, "_count") == len(decoded) and sample(dtpot, "_sum") > 0
        success = prefill["vllm:request_success"]
        assert sample(success, "_total", finished_reason="length") == n
        for reason in ("stop", "abort", "error"):
            assert sample(success, "_total", finished_reason=reason) == 0
        assert sample(decode["vllm:request_success"], "_total", finished_reason="length") == len(
            decoded
        )
    else:
        ttft, itl = "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds"
        prompt_h, output_h = "sglang:prompt_tokens_histogram", "sglang:generation_tokens_histogram"
        assert sample(prefill["sglang:num_requests"], "_total") == n
        assert sample(decode["sglang:num_requests"], "_total") == len(decoded)
        assert sample(prefill["sglang:prompt_tokens"], "_total") == prompts
        assert sample(decode["sglang:generation_tokens"], "_total") == sum(o for _, o in decoded)
        assert sample(prefill["sglang:num_aborted_requests"], "_total") == 0
    # Every request's first token at the prefill worker; every later token's gap at
    # the decode worker; lengths: prompts where computed, outputs where generated.
    assert sample(prefill[ttft], "_count") == n and sample(prefill[ttft], "_sum") > 0
    assert sample(decode[ttft], "_count") == len(decoded)
    assert sample(decode[itl], "_count") == gaps and sample(decode[itl], "_sum") > 0
    assert sample(prefill[itl], "_count") == 0
    assert sample(prefill[prompt_h], "_sum") == prompts and sample(prefill[prompt_h], "_count") == n
    assert sample(prefill[output_h], "_sum") == n  # one token each
    assert sample(decode[output_h], "_sum") == sum(o for _, o in decoded)
    assert sample(decode[prompt_h], "_sum") == sum(p for p, _ in decoded)


def test_the_gauges_read_an_idle_engine_after_the_requests(scraped: Scraped) -> None:
    names = {
        MetricsFlavor.VLLM: ("vllm:num_requests_waiting", "vllm:num_requests_running",
                             "vllm:kv_cache_usage_perc"),
        MetricsFlavor.SGLANG: ("sglang:num_queue_reqs", "sglang:num_running_reqs",
                               "sglang:token_usage"),
    }[scraped.flavor]  # fmt: skip
    for pool in Pool:
        for name in names:
            assert sample(scraped.families[pool][name], "") == 0, (pool, name)


def test_a_worker_refuses_the_custom_flavour_and_an_engine_flavour_without_a_model() -> None:
    identity = EngineIdentity(model_name=MODEL_NAME, max_model_len=CONTEXT, pool=Pool.PREFILL)
    with pytest.raises(ValueError, match="metrics_flavor"):
        WorkerMetrics(Pool.PREFILL, flavors=(MetricsFlavor.CUSTOM,), identity=identity)
    with pytest.raises(ValueError, match="identity"):
        WorkerMetrics(Pool.PREFILL, flavors=(MetricsFlavor.VLLM,))
    with pytest.raises(ValueError, match="identity: pool"):
        WorkerMetrics(Pool.DECODE, flavors=(MetricsFlavor.VLLM,), identity=identity)
    with pytest.raises(ValueError, match="max_model_len"):
        EngineIdentity(model_name=MODEL_NAME, max_model_len=0, pool=Pool.DECODE)
