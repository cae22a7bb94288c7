"""The vLLM and SGLang flavours against a real Prometheus scraping engine-shaped pools.

One stream of requests is recorded three times, as SARA's router and workers, as a
vLLM prefill/decode pair and as an SGLang prefill/decode pair export it: names,
types, labels and bucket boundaries as in each engine's source (the tables below,
with their versions). Prometheus (the Debian binary) scrapes all of them every
second, attaching a ``pool`` label to the engines' instances as a PodMonitor's
relabelling would. Each flavour must then populate every observation field, each
P99 must be what PromQL's interpolation gives on that engine's buckets for the
driven distribution (computed here from the distribution's CDF, independently of
the code), and the policy must decide the same pool sizes as on SARA's own metrics.
"""

from __future__ import annotations

import math
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client import Counter, Gauge, Histogram

from controller.config import ControllerConfig, MetricsConfig, MetricsFlavor
from controller.observation import Observation, PoolObservation
from controller.policy import CapacityModels, ControllerState, decide
from controller.sources import PrometheusSource
from queueing.pools import Pool
from tests.controller.conftest_sources import (
    OUTPUT_BUCKETS_TOKENS,
    PROMPT_BUCKETS_TOKENS,
    TPOT_BUCKETS_S,
    TTFT_BUCKETS_S,
    RouterExporter,
    WorkerExporter,
    _Exporter,
    closed_port,
)
from tests.controller.test_sources_prometheus import PROMETHEUS, wait_until

RATE_RPS = 50.0
WINDOW_S = 8.0
LEVELS = 100
# Latencies uniform on ranges that each engine's buckets resolve differently.
TTFT_LOW_S, TTFT_HIGH_S = 0.2, 0.9
TPOT_LOW_S, TPOT_HIGH_S = 0.012, 0.09
PROMPT_MAX, OUTPUT_MAX = 1024, 256
MAX_MODEL_LEN = 4096
REPLICAS = {
    Pool.PREFILL: PoolObservation(current_replicas=2, ready_replicas=2),
    Pool.DECODE: PoolObservation(current_replicas=2, ready_replicas=2),
}


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's length buckets: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    out, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


# -- the engines' tables -------------------------------------------------------------------

# vLLM 0.12, vllm/v1/metrics/loggers.py (PrometheusStatLogger): labels model_name, engine.
VLLM_TTFT_BUCKETS_S = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                       2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
VLLM_TPOT_BUCKETS_S = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                       2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
VLLM_LABELS = ("model_name", "engine")
# SGLang main at 00ae9c1 (0.5 series), python/sglang/srt/metrics/collector.py: the
# TokenizerMetricsCollector's default buckets; label model_name.
SGLANG_TTFT_BUCKETS_S = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
SGLANG_ITL_BUCKETS_S = [0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035,
                        0.040, 0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000,
                        4.000, 6.000, 8.000]  # fmt: skip
SGLANG_TOKENS_BUCKETS = [100, 300, 500, 700, 1000, 1500, 2000, 3000, 4000, 5000, 6000, 7000,
                         8000, 9000, 10000, 12000, 15000, 20000, 22000, 25000, 30000, 35000,
                         40000, 66000, 99000, 132000, 300000, 600000, 900000, 1100000]  # fmt: skip


@dataclass(frozen=True)
class Request:
    ttft_s: float
    tpot_s: float
    prompt: int
    output: int


class VllmInstance(_Exporter):
    """One vLLM instance of a P/D pair (``role`` prefill: it generates one token)."""

    def __init__(self, role: str) -> None:
        self.role = role
        super().__init__()

    def _build(self) -> None:
        r, names = self.registry, VLLM_LABELS
        values = ("tiny", "0")
        lengths = build_1_2_5_buckets(MAX_MODEL_LEN)
        self.success = Counter(
            "vllm:request_success", "Finished.", [*names, "finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "TTFT.", names, buckets=VLLM_TTFT_BUCKETS_S,
            registry=r,
        ).labels(*values)  # fmt: skip
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "ITL.", names, buckets=VLLM_TPOT_BUCKETS_S,
            registry=r,
        ).labels(*values)  # fmt: skip
        self.tpot = Histogram(
            "vllm:request_time_per_output_token_seconds", "TPOT per request.", names,
            buckets=VLLM_TPOT_BUCKETS_S, registry=r,
        ).labels(*values)  # fmt: skip
        self.prompt = Histogram(
            "vllm:request_prompt_tokens", "Prompt.", names, buckets=lengths, registry=r
        ).labels(*values)
        self.generation = Histogram(
            "vllm:request_generation_tokens", "Output.", names, buckets=lengths, registry=r
        ).labels(*values)
        self.waiting = Gauge("vllm:num_requests_waiting", "Waiting.", names, registry=r)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV usage.", names, registry=r)
        self.waiting.labels(*values).set(3 if self.role == "prefill" else 7)
        self.kv.labels(*values).set(0.9 if self.role == "prefill" else 0.25)

    def record(self, request: Request) -> None:
        if self.role == "prefill":
            self.success.labels("tiny", "0", "length").inc()
            self.ttft.observe(request.ttft_s)
            self.prompt.observe(request.prompt)
            self.generation.observe(1)
            return
        self.success.labels("tiny", "0", "stop").inc()
        self.ttft.observe(0.003)  # the decode instance's own first token: not the TTFT
        self.prompt.observe(request.prompt)
        self.generation.observe(request.output)
        self.tpot.observe(request.tpot_s)
        for _ in range(request.output - 1):
            self.itl.observe(request.tpot_s)


class SglangInstance(_Exporter):
    """One SGLang server of a P/D pair, with --collect-tokens-histogram."""

    def __init__(self, role: str) -> None:
        self.role = role
        super().__init__()

    def _build(self) -> None:
        r, names = self.registry, ("model_name",)
        self.requests = Counter("sglang:num_requests", "Requests.", names, registry=r)
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds", "TTFT.", names, buckets=SGLANG_TTFT_BUCKETS_S,
            registry=r,
        ).labels("tiny")  # fmt: skip
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds", "ITL.", names, buckets=SGLANG_ITL_BUCKETS_S,
            registry=r,
        ).labels("tiny")  # fmt: skip
        self.prompt = Histogram(
            "sglang:prompt_tokens_histogram", "Prompt.", names, buckets=SGLANG_TOKENS_BUCKETS,
            registry=r,
        ).labels("tiny")  # fmt: skip
        self.generation = Histogram(
            "sglang:generation_tokens_histogram", "Output.", names,
            buckets=SGLANG_TOKENS_BUCKETS, registry=r,
        ).labels("tiny")  # fmt: skip
        self.queue = Gauge("sglang:num_queue_reqs", "Queue.", names, registry=r).labels("tiny")
        self.usage = Gauge("sglang:token_usage", "KV usage.", names, registry=r).labels("tiny")
        self.queue.set(3 if self.role == "prefill" else 7)
        self.usage.set(0.9 if self.role == "prefill" else 0.25)

    def record(self, request: Request) -> None:
        self.requests.labels("tiny").inc()
        if self.role == "prefill":
            self.ttft.observe(request.ttft_s)
            self.prompt.observe(request.prompt)
            self.generation.observe(1)
            return
        self.ttft.observe(request.ttft_s + 0.05)  # waits for the prefill and the transfer
        self.prompt.observe(request.prompt)
        self.generation.observe(request.output)
        for _ in range(request.output - 1):
            self.itl.observe(request.tpot_s)


def level(i: int, stride: int) -> float:
    return ((i * stride) % LEVELS + 0.5) / LEVELS


def request(i: int) -> Request:
    return Request(
        ttft_s=TTFT_LOW_S + (TTFT_HIGH_S - TTFT_LOW_S) * level(i, 37),
        tpot_s=TPOT_LOW_S + (TPOT_HIGH_S - TPOT_LOW_S) * level(i, 41),
        prompt=math.ceil(PROMPT_MAX * level(i, 43)),
        output=math.ceil(OUTPUT_MAX * level(i, 47)),
    )


class Traffic:
    """Requests at exactly RATE_RPS, recorded on every exporter when any is scraped."""

    def __init__(self, sinks: list[Callable[[Request], None]]) -> None:
        self._sinks = sinks
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._sent = 0

    def catch_up(self) -> None:
        with self._lock:
            due = int((time.monotonic() - self._start) * RATE_RPS)
            for i in range(self._sent, due):
                for sink in self._sinks:
                    sink(request(i))
            self._sent = max(self._sent, due)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not Path(PROMETHEUS).exists():
        pytest.skip("the prometheus binary is not installed (CI installs the Debian package)")
    router, sara_p, sara_d = RouterExporter(), WorkerExporter("prefill"), WorkerExporter("decode")
    sara_p.queue_depth.set(3)
    sara_d.queue_depth.set(7)
    sara_p.kv_utilization.set(0.9)
    sara_d.kv_utilization.set(0.25)
    vllm = {role: VllmInstance(role) for role in ("prefill", "decode")}
    sglang = {role: SglangInstance(role) for role in ("prefill", "decode")}

    def sara_record(r: Request) -> None:
        router.record(ttft_s=r.ttft_s, tpot_s=r.tpot_s, prompt=r.prompt, output=r.output)

    traffic = Traffic([sara_record, *(e.record for e in (*vllm.values(), *sglang.values()))])
    exporters: list[_Exporter] = [router, sara_p, sara_d, *vllm.values(), *sglang.values()]
    for exporter in exporters:
        exporter.before_scrape = traffic.catch_up

    def engine_job(name: str, pair: dict[str, VllmInstance] | dict[str, SglangInstance]) -> str:
        # The pool label a PodMonitor would copy from the pod's labels.
        text = f"  - job_name: {name}\n    static_configs:\n"
        for role, instance in pair.items():
            text += f"      - targets: ['127.0.0.1:{instance.port}']\n"
            text += f"        labels: {{pool: {role}}}\n"
        return text

    sara_targets = ", ".join(f"'127.0.0.1:{e.port}'" for e in (router, sara_p, sara_d))
    workdir = tmp_path_factory.mktemp("prometheus-flavors")
    (workdir / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
        f"  - job_name: sara\n    static_configs:\n      - targets: [{sara_targets}]\n"
        + engine_job("vllm", vllm)
        + engine_job("sglang", sglang)
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

        def enough_samples() -> bool:
            answer = httpx.get(
                f"{url}/api/v1/query",
                params={"query": f"min(count_over_time(up[{WINDOW_S:g}s]))"},
                timeout=2,
            ).json()["data"]["result"]
            up = httpx.get(f"{url}/api/v1/query", params={"query": "sum(up)"}, timeout=2)
            total = up.json()["data"]["result"]
            return (
                bool(answer)
                and float(answer[0]["value"][1]) >= WINDOW_S
                and bool(total)
                and float(total[0]["value"][1]) == len(exporters)
            )

        wait_until(enough_samples, timeout_s=40, what=f"{WINDOW_S:g} s of scraped samples")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        for exporter in exporters:
            exporter.stop()


def observe(url: str, flavor: MetricsFlavor) -> Observation:
    with PrometheusSource(
        url,
        window_s=WINDOW_S,
        burst_window_s=3.0,
        scv_step_s=2.0,
        selector=f'job="{flavor.value}"',
        metrics=MetricsConfig(flavor=flavor),
    ) as source:
        observation = source.observe(now_s=100.0, replicas=REPLICAS)
        assert source.failing == {}, source.failing
    return observation


def promql_p99(bounds: list[float], low: float, high: float) -> float:
    """histogram_quantile(0.99) of a uniform(low, high] sample on these bucket bounds:
    the bucket that holds rank 0.99 of the CDF, linearly interpolated inside it."""
    previous = 0.0
    for bound in bounds:
        cdf = min(max((bound - low) / (high - low), 0.0), 1.0)
        if cdf >= 0.99:
            below = min(max((previous - low) / (high - low), 0.0), 1.0)
            return previous + (bound - previous) * (0.99 - below) / (cdf - below)
        previous = bound
    raise AssertionError("the 0.99 quantile is beyond the last bucket")


EXPECTED_P99 = {
    MetricsFlavor.SARA: (list(TTFT_BUCKETS_S), list(TPOT_BUCKETS_S)),
    MetricsFlavor.VLLM: (VLLM_TTFT_BUCKETS_S, VLLM_TPOT_BUCKETS_S),
    MetricsFlavor.SGLANG: (SGLANG_TTFT_BUCKETS_S, SGLANG_ITL_BUCKETS_S),
}


def bucket_mean(bounds: list[int] | list[float], n_max: int) -> float:
    """The mean of lengths uniform on 1..n_max once each is spread evenly over its
    bucket (what reconstruction from a histogram gives), rounded up to whole tokens."""
    total, previous = 0.0, 0.0
    for bound in bounds:
        share = (min(bound, n_max) - min(previous, n_max)) / n_max
        total += share * ((previous + bound) / 2 + 0.5)
        previous = bound
    return total


LENGTH_BOUNDS = {
    MetricsFlavor.SARA: (list(PROMPT_BUCKETS_TOKENS), list(OUTPUT_BUCKETS_TOKENS)),
    MetricsFlavor.VLLM: (build_1_2_5_buckets(MAX_MODEL_LEN), build_1_2_5_buckets(MAX_MODEL_LEN)),
    MetricsFlavor.SGLANG: (SGLANG_TOKENS_BUCKETS, SGLANG_TOKENS_BUCKETS),
}


@pytest.mark.parametrize("flavor", [MetricsFlavor.VLLM, MetricsFlavor.SGLANG, MetricsFlavor.SARA])
def test_each_flavour_populates_every_field_from_the_right_pool(
    prometheus: str, flavor: MetricsFlavor
) -> None:
    observation = observe(prometheus, flavor)
    assert observation.arrival_rate_rps == pytest.approx(RATE_RPS, rel=0.05)
    assert observation.burst_arrival_rate_rps == pytest.approx(RATE_RPS, rel=0.1)
    assert observation.interarrival_scv is not None and observation.interarrival_scv < 0.2
    # The prefill pool's queue and the decode pool's KV cache, not the other pool's.
    assert observation.prefill_queue_depth == 3
    assert observation.kv_usage_fraction == 0.25
    ttft_bounds, tpot_bounds = EXPECTED_P99[flavor]
    # TTFT from the prefill instances (the decode instances' TTFT is different).
    assert observation.ttft_p99_s == pytest.approx(
        promql_p99(ttft_bounds, TTFT_LOW_S, TTFT_HIGH_S), rel=0.02
    )
    if flavor is MetricsFlavor.SGLANG:
        # Per token, not per request: long requests weigh more, but the driven TPOT
        # is independent of the length, so the token-weighted quantile is the same.
        assert observation.tpot_p99_s == pytest.approx(
            promql_p99(tpot_bounds, TPOT_LOW_S, TPOT_HIGH_S), rel=0.05
        )
    else:
        assert observation.tpot_p99_s == pytest.approx(
            promql_p99(tpot_bounds, TPOT_LOW_S, TPOT_HIGH_S), rel=0.02
        )
    lengths = observation.lengths
    assert lengths is not None
    # Outputs from the decode instances: the prefill instances report one token each.
    prompt_bounds, output_bounds = LENGTH_BOUNDS[flavor]
    assert lengths.output_tokens.mean() == pytest.approx(
        bucket_mean(output_bounds, OUTPUT_MAX), rel=0.03
    )
    assert lengths.prompt_tokens.mean() == pytest.approx(
        bucket_mean(prompt_bounds, PROMPT_MAX), rel=0.03
    )


def test_the_engine_flavours_decide_what_the_sara_flavour_decides(prometheus: str) -> None:
    config = ControllerConfig(profile="llama-3-8b@h100-sxm")
    targets = {}
    for flavor in (MetricsFlavor.SARA, MetricsFlavor.VLLM, MetricsFlavor.SGLANG):
        decision = decide(
            observe(prometheus, flavor),
            ControllerState(),
            config,
            now_s=100.0,
            models=CapacityModels(),
        )
        targets[flavor] = (decision.pools[Pool.PREFILL].target, decision.pools[Pool.DECODE].target)
    assert targets[MetricsFlavor.VLLM] == targets[MetricsFlavor.SARA]
    assert targets[MetricsFlavor.SGLANG] == targets[MetricsFlavor.SARA]
    assert targets[MetricsFlavor.SARA] != (1, 1)  # the traffic needs more than the minimum


def test_the_length_buckets_are_vllms_1_2_5_series() -> None:
    # The example of build_1_2_5_buckets's docstring in vLLM's source, and the bound.
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(MAX_MODEL_LEN)[-1] == 2000
    assert PROMPT_BUCKETS_TOKENS[-1] == PROMPT_MAX and OUTPUT_BUCKETS_TOKENS[-1] == OUTPUT_MAX
