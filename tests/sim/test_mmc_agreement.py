"""The simulator against closed-form M/M/c: with Poisson arrivals, exponential
service and one prompt per prefill worker at a time, the prefill pool *is* an M/M/c
queue, so its P99 wait must match ``queueing.mmc_wait_quantile``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from queueing import mmc_wait_quantile
from queueing.profile import IterationProfile
from sim.cluster import Cluster, ClusterConfig
from sim.trace import Trace

T_TOK_S = 1e-4  # seconds per prompt token: service = t_tok * L, nothing else
MEAN_TOKENS = 5_000  # mean service 0.5 s


def mmc_cluster_waits(servers: int, rho: float, requests: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mean_service_s = T_TOK_S * MEAN_TOKENS
    rate = rho * servers / mean_service_s
    arrivals = np.cumsum(rng.exponential(1.0 / rate, requests))
    # Exponential service, rounded up to whole tokens (SCV 1 - 1/5000, negligibly off).
    prompts = np.maximum(1, np.ceil(rng.exponential(MEAN_TOKENS, requests))).astype(np.int64)
    trace = Trace(
        arrival_s=arrivals - arrivals[0],
        prompt_tokens=prompts,
        output_tokens=np.ones(requests, dtype=np.int64),
        source="M/M/c",
    )
    # Not the shared tests.profiles.TEST_8B: for the prefill pool to be M/M/c the
    # service time must be exactly t_tok * L (no t0, KV-read or attention term, and a
    # KV cache that never blocks), so every coefficient differs by construction.
    profile = IterationProfile(
        name="linear",
        model="none",
        hardware="none",
        tensor_parallel=1,
        t0_s=0.0,
        t_tok_s=T_TOK_S,
        t_kv_s=0.0,
        t_attn_s=0.0,
        kv_capacity_tokens=10_000_000,
        kv_bytes_per_token=1,
        startup_s=0.0,
        source="closed-form test",
    )
    config = ClusterConfig(
        prefill_workers=servers,
        decode_workers=1,
        profile=profile,
        token_budget=int(prompts.max()) + 16,
        kv_link_bytes_per_s=1e12,
        prefill_max_running=1,
    )
    results = Cluster(config, trace).run()
    waits = results.ttft_s - T_TOK_S * prompts  # TTFT = wait + the single iteration
    return np.maximum(waits, 0.0)


@pytest.mark.parametrize(("servers", "rho"), [(1, 0.7), (3, 0.8), (8, 0.85)])
def test_simulated_p99_wait_agrees_with_mmc_within_the_batch_means_interval(
    servers: int, rho: float
) -> None:
    waits = mmc_cluster_waits(servers, rho, requests=120_000, seed=servers)
    waits = waits[20_000:]  # drop the warm-up from an empty system
    # Waits are autocorrelated, so the interval comes from 10 batch means, not iid ranks.
    batches = np.array([np.quantile(b, 0.99) for b in np.array_split(waits, 10)])
    half_width = 2.262 * batches.std(ddof=1) / math.sqrt(len(batches))  # t(0.975, 9)
    mean_service_s = T_TOK_S * MEAN_TOKENS
    expected = mmc_wait_quantile(rho * servers / mean_service_s, 1 / mean_service_s, servers, 0.99)
    assert abs(float(np.quantile(waits, 0.99)) - expected) <= half_width
    assert half_width < 0.15 * expected  # the interval is tight enough to mean something
