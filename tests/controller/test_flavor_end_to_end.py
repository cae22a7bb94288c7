"""The vLLM and SGLang flavours end to end: emulated pools that export them, a real Prometheus.

`sara router` and one emulated prefill and one decode worker (`sara worker --engine
emulated --metrics-flavor vllm,sglang`: beside their own `sara_worker_*` metrics they
export vLLM 0.12's and SGLang's families, from the same measurements) serve Poisson
traffic from the load generator; a real Prometheus scrapes them every second, putting
the `pool` label on each worker's series as a PodMonitor's relabelling would. The
controller's observation is then read from that one Prometheus with each flavour,
whose queries read only its own engine's names, and the policy decides on each:

- every observation field is populated by every flavour;
- the engine flavours decide the pool sizes the `sara` flavour decides, within the
  window's counting noise and their buckets' resolution: the targets the `sara`
  flavour decides with its rate and its ca² moved to either end of their 99.7 %
  intervals (N arrivals in the window: N ± 3·√N; the ca², a dispersion index of
  per-second counts: a χ² interval) and each of its lengths moved to either end of
  what the engine's coarser length buckets allow bound the others'. The engine
  flavours count the same requests at the prefill worker as they complete (a TTFT
  later), and know a length only to its bucket (vLLM's 200-500 and 500-1000 hold most
  of this mix's prompts), so a mix read from them can sit anywhere in those buckets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from scipy import stats

pytest.importorskip("torch")

from cli.loadgen import PlannedRequest, RequestResult, ResultStatus, run_load
from controller.config import ControllerConfig, MetricsConfig, MetricsFlavor, SloConfig
from controller.histograms import TOKEN_BUCKETS
from controller.observation import Observation, PoolObservation
from controller.policy import CapacityModels, ControllerState, decide
from controller.sources import PrometheusSource
from queueing.lengths import LengthSamples
from queueing.pools import Pool
from tests.controller.test_sources_prometheus import PROMETHEUS, wait_until
from tests.workers.test_reliability import cli
from workers.checkpoint import write_tiny_checkpoint
from workers.engine_metrics import SGLANG_TOKENS_BUCKETS, build_1_2_5_buckets
from workers.redis_util import RedisServer, free_port

PROFILE = "llama-2-70b-tp4@a100-80g"  # slow steps: the emulation's overheads are small
RATE_RPS = 3.0
LOAD_S = 21.0
WINDOW_S = 16.0
OBSERVE_AT_S = 20.0  # into the load: the window is full and the traffic still steady
SCV_STEP_S = 1.0  # the scrape interval: the most sub-windows for the ca² estimate
PROMPT_TOKENS = (50, 800)  # uniform, inclusive
OUTPUT_TOKENS = (8, 40)
Z = 3.0  # the intervals' half-width in standard deviations (two-sided 99.73 %)
# A P99 TTFT SLO near the one prefill worker's P99 at this rate: the policy asks for
# more prefill workers than run, so the comparison is not between two floors.
SLO_TTFT_P99_S = 1.0
TINY_CONTEXT = 4096  # the tiny checkpoint's max_position_embeddings: vLLM's length buckets' top
# The length buckets each flavour reads a window's mix from.
LENGTH_BUCKETS = {
    MetricsFlavor.SARA: TOKEN_BUCKETS,
    MetricsFlavor.VLLM: tuple(float(b) for b in build_1_2_5_buckets(TINY_CONTEXT)),
    MetricsFlavor.SGLANG: tuple(float(b) for b in SGLANG_TOKENS_BUCKETS),
}
REPLICAS = {pool: PoolObservation(current_replicas=1, ready_replicas=1) for pool in Pool}
FLAVORS = (MetricsFlavor.SARA, MetricsFlavor.VLLM, MetricsFlavor.SGLANG)


@dataclass
class Observed:
    observations: dict[MetricsFlavor, Observation]
    results: list[RequestResult]


def plan(rng: np.random.Generator) -> list[PlannedRequest]:
    """Poisson arrivals at RATE_RPS for LOAD_S, lengths uniform on their ranges."""
    gaps = rng.exponential(1.0 / RATE_RPS, size=int(RATE_RPS * LOAD_S * 2))
    arrivals = np.cumsum(gaps)
    arrivals = arrivals[arrivals < LOAD_S]
    return [
        PlannedRequest(
            index=i,
            send_at_s=float(at),
            prompt_token_ids=tuple(
                rng.integers(
                    3, 500, int(rng.integers(PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1))
                ).tolist()
            ),
            max_tokens=int(rng.integers(OUTPUT_TOKENS[0], OUTPUT_TOKENS[1] + 1)),
        )
        for i, at in enumerate(arrivals)
    ]


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def observe(url: str, flavor: MetricsFlavor) -> Observation:
    with PrometheusSource(
        url,
        window_s=WINDOW_S,
        burst_window_s=3.0,
        scv_step_s=SCV_STEP_S,
        selector='job="flavors"',
        metrics=MetricsConfig(flavor=flavor),
    ) as source:
        observation = source.observe(now_s=100.0, replicas=REPLICAS)
        assert source.failing == {}, (flavor, source.failing)
    return observation


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    if not Path(PROMETHEUS).exists():
        pytest.skip("the prometheus binary is not installed (CI installs the Debian package)")
    work = tmp_path_factory.mktemp("flavors-e2e")
    model_dir = write_tiny_checkpoint(work / "tiny", seed=0)  # config.json and tokenizer
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    assert config["max_position_embeddings"] == TINY_CONTEXT, "vLLM's length buckets end there"
    server = RedisServer.start()
    router_port = free_port()
    ports = {pool: free_port() for pool in Pool}
    processes: list[subprocess.Popen[bytes]] = []

    def start(name: str, argv: list[str]) -> None:
        log = (work / f"{name}.log").open("wb")
        processes.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))

    start("router", cli(
        "router", "--redis", server.url, "--model", str(model_dir),
        "--listen", f"127.0.0.1:{router_port}", "--request-timeout-s", "60",
    ))  # fmt: skip
    for pool in Pool:
        start(pool.value, cli(
            "worker", pool.value, "--engine", "emulated", "--profile", PROFILE,
            "--startup-s", "0", "--redis", server.url, "--model", str(model_dir),
            "--metrics-listen", f"127.0.0.1:{ports[pool]}", "--metrics-flavor", "vllm,sglang",
            "--served-model-name", "llama-2-70b",
        ))  # fmt: skip
    targets = "".join(
        f"      - targets: ['127.0.0.1:{ports[pool]}']\n        labels: {{pool: {pool.value}}}\n"
        for pool in Pool
    )
    (work / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
        "  - job_name: flavors\n    honor_labels: true\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{router_port}']\n" + targets
    )
    prom_port = free_port()
    start("prometheus", [
        PROMETHEUS, f"--config.file={work / 'prometheus.yml'}",
        f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}",
    ])  # fmt: skip
    prom = f"http://127.0.0.1:{prom_port}"
    router = f"http://127.0.0.1:{router_port}"
    results: list[RequestResult] = []
    load: threading.Thread | None = None
    try:
        for name, url in [("router", router)] + [
            (pool.value, f"http://127.0.0.1:{ports[pool]}") for pool in Pool
        ]:
            wait_until(
                lambda url=url: httpx.get(f"{url}/readyz", timeout=1).status_code == 200,
                timeout_s=60,
                what=f"{name} ready ({work / name}.log)",
            )

        def all_up() -> bool:
            reply = httpx.get(f"{prom}/api/v1/query", params={"query": "sum(up)"}, timeout=2)
            result = reply.json()["data"]["result"]
            return bool(result) and float(result[0]["value"][1]) == 3

        wait_until(all_up, timeout_s=30, what="Prometheus scraping the router and both workers")
        requests = plan(np.random.default_rng(2024))
        load = threading.Thread(
            target=lambda: results.extend(asyncio.run(run_load(router, requests))), daemon=True
        )
        started = time.monotonic()
        load.start()
        time.sleep(max(0.0, OBSERVE_AT_S - (time.monotonic() - started)))
        observations = {flavor: observe(prom, flavor) for flavor in FLAVORS}
        load.join(timeout=LOAD_S + 60)
        yield Observed(observations=observations, results=results)
    finally:
        for process in reversed(processes):
            _stop(process)
        server.stop()


def test_the_load_was_served(observed: Observed) -> None:
    # The pools keep up: the engines count completions, equal to arrivals only then.
    assert observed.results, "the load generator sent nothing"
    failed = [r for r in observed.results if r.status is not ResultStatus.OK]
    assert not failed, failed[:3]


@pytest.mark.parametrize("flavor", FLAVORS, ids=lambda f: f.value)
def test_every_observation_field_is_populated(observed: Observed, flavor: MetricsFlavor) -> None:
    o = observed.observations[flavor]
    for name in (
        "arrival_rate_rps",
        "burst_arrival_rate_rps",
        "interarrival_scv",
        "ttft_p99_s",
        "tpot_p99_s",
        "prefill_queue_depth",
        "kv_usage_fraction",
        "lengths",
    ):
        value = getattr(o, name)
        assert value is not None, f"{flavor.value}: {name} is missing"
        if isinstance(value, float):
            assert math.isfinite(value) and value >= 0, (name, value)
    assert o.arrival_rate_rps is not None and o.arrival_rate_rps > 0
    assert o.ttft_p99_s is not None and o.ttft_p99_s > 0
    assert o.tpot_p99_s is not None and o.tpot_p99_s > 0
    # A gauge read at one instant: 0 when the decode worker happens to hold nothing.
    assert o.kv_usage_fraction is not None and 0 <= o.kv_usage_fraction <= 1


def targets(observation: Observation, config: ControllerConfig) -> tuple[int, int]:
    """The pool sizes the policy recommends on the observation, read at a second tick.

    One window of this load holds about 48 requests, around the 50 a length mix needs
    (``leadtime.MIN_POOLED_REQUESTS``): a first tick below it holds and keeps the
    window, and the second, a window later, decides on both (the same traffic,
    measured twice). A first tick at or above it already acts, and the second then
    sits in the up-cooldown, its target the replicas still running: so the solver's
    recommendation is compared, which neither the count of 49 or 50 nor a cooldown
    moves."""
    models = CapacityModels()
    first = decide(observation, ControllerState(), config, now_s=100.0, models=models)
    later = dataclasses.replace(observation, time_s=observation.time_s + WINDOW_S)
    decision = decide(later, first.state, config, now_s=100.0 + WINDOW_S, models=models)
    prefill = decision.pools[Pool.PREFILL].recommended
    decode = decision.pools[Pool.DECODE].recommended
    assert prefill is not None and decode is not None, decision.reasons
    return prefill, decode


def bucket_edge(values: np.ndarray, bounds: tuple[float, ...], *, upper: bool) -> np.ndarray:
    """Each value's bucket's lower (first token above the bound below) or upper bound;
    a value above the top bound sits at it, as a reconstruction from the buckets puts it."""
    grid = np.asarray(bounds)
    index = np.searchsorted(grid, values, side="left")  # the first bound >= the value
    if upper:
        return np.where(index < len(grid), grid[np.minimum(index, len(grid) - 1)], grid[-1])
    below = np.where(index > 0, grid[np.maximum(index - 1, 0)], 0.0)
    return np.where(index < len(grid), below + 1, grid[-1])


def length_edge(lengths: LengthSamples, flavor: MetricsFlavor, *, upper: bool) -> LengthSamples:
    """The `sara` flavour's mix with every length at the end, low or high, of what the
    flavour's buckets could report for it: the true length lies anywhere in its router
    bucket, and the engine reads any length in its own bucket as spread over that bucket."""

    def edge(values: np.ndarray) -> np.ndarray:
        router = bucket_edge(values, LENGTH_BUCKETS[MetricsFlavor.SARA], upper=upper)
        engine = bucket_edge(router, LENGTH_BUCKETS[flavor], upper=upper)
        # SGLang's first bucket holds every length up to 100: its low end would be one
        # token, and a request of one output token has no TPOT for the decode pool to
        # size on, so the low end keeps two.
        return np.maximum(engine, 2).astype(np.int64)

    return LengthSamples(
        prompt_tokens=edge(lengths.prompt_tokens),
        output_tokens=edge(lengths.output_tokens),
        source=f"{lengths.source}, {flavor.value} buckets' {'upper' if upper else 'lower'} ends",
    )


def moved(
    observation: Observation,
    *,
    rate_factor: float,
    scv_factor: float,
    lengths: LengthSamples | None = None,
) -> Observation:
    assert observation.arrival_rate_rps is not None and observation.interarrival_scv is not None
    burst = observation.burst_arrival_rate_rps
    return dataclasses.replace(
        observation,
        arrival_rate_rps=observation.arrival_rate_rps * rate_factor,
        burst_arrival_rate_rps=None if burst is None else burst * rate_factor,
        interarrival_scv=observation.interarrival_scv * scv_factor,
        lengths=observation.lengths if lengths is None else lengths,
    )


def test_the_engine_flavours_decide_what_the_sara_flavour_decides_within_the_noise(
    observed: Observed,
) -> None:
    # The controller's window is the sources' (consecutive windows a window apart do
    # not overlap, so the second tick's mix holds both windows' requests).
    config = ControllerConfig(
        profile=PROFILE, slo=SloConfig(ttft_p99_s=SLO_TTFT_P99_S), window_s=WINDOW_S
    )
    sara = observed.observations[MetricsFlavor.SARA]
    assert sara.arrival_rate_rps is not None
    # The rate counts N arrivals in the window: Poisson, relative s.d. 1/sqrt(N). The
    # ca² is the dispersion index of k per-second counts: for Poisson arrivals
    # chi²(k-1)/(k-1) times the true value, whose interval the estimate gives.
    arrivals = sara.arrival_rate_rps * WINDOW_S
    rate_half = Z * math.sqrt(arrivals) / arrivals
    dof = int(WINDOW_S / SCV_STEP_S) - 2  # k intervals between the window's samples, less 1
    tail = stats.norm.sf(Z)
    scv_low = dof / stats.chi2.ppf(1 - tail, dof)
    scv_high = dof / stats.chi2.ppf(tail, dof)
    assert sara.lengths is not None
    band = {
        flavor: (
            targets(moved(sara, rate_factor=1 - rate_half, scv_factor=scv_low,
                          lengths=length_edge(sara.lengths, flavor, upper=False)), config),
            targets(moved(sara, rate_factor=1 + rate_half, scv_factor=scv_high,
                          lengths=length_edge(sara.lengths, flavor, upper=True)), config),
        )
        for flavor in FLAVORS
    }  # fmt: skip
    # The count noise alone, with the sara flavour's own mix.
    low = targets(moved(sara, rate_factor=1 - rate_half, scv_factor=scv_low), config)
    high = targets(moved(sara, rate_factor=1 + rate_half, scv_factor=scv_high), config)
    decided = {flavor: targets(observed.observations[flavor], config) for flavor in FLAVORS}
    for flavor, o in observed.observations.items():  # pytest -s shows them
        assert o.lengths is not None
        print(
            f"{flavor.value:7s} rate {o.arrival_rate_rps:.2f} ca2 {o.interarrival_scv:.2f} "
            f"TTFT p99 {o.ttft_p99_s:.3f} TPOT p99 {o.tpot_p99_s:.4f} "
            f"queue {o.prefill_queue_depth:.0f} KV {o.kv_usage_fraction:.4f} "
            f"prompt mean {o.lengths.prompt_tokens.mean():.0f} "
            f"output mean {o.lengths.output_tokens.mean():.1f} -> {decided[flavor]}; "
            f"sara over the noise and these buckets {band[flavor][0]}..{band[flavor][1]}"
        )
    print(f"sara over the window's count noise: {low}..{high}")
    for flavor in (MetricsFlavor.VLLM, MetricsFlavor.SGLANG):
        flavor_low, flavor_high = band[flavor]
        for i, pool in enumerate(Pool):
            assert flavor_low[i] <= decided[flavor][i] <= flavor_high[i], (
                f"{flavor.value} decides {decided[flavor][i]} {pool.value} workers; the sara "
                f"flavour {decided[MetricsFlavor.SARA][i]} ({flavor_low[i]}..{flavor_high[i]} "
                f"over its rate ±{rate_half:.0%}, its ca² x{scv_low:.2f}..x{scv_high:.2f} and "
                f"its lengths at the ends of {flavor.value}'s buckets); "
                f"observations {observed.observations}"
            )
    # The policy asks for more prefill workers than run: not two floors compared.
    assert decided[MetricsFlavor.SARA][0] > REPLICAS[Pool.PREFILL].current_replicas or (
        high[0] > low[0]
    ), (decided, low, high)
