"""The production tick driving a simulated cluster through the source/actuator pair."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from controller.config import ControllerConfig, SloConfig
from queueing.catalog import resolve_profile
from queueing.pools import Pool
from queueing.solver import CapacityModel, KvLink
from sim.cluster import Cluster, ClusterConfig
from sim.control import run_controlled
from sim.lengths import lengths_of
from sim.trace_io import load_trace
from sim.workload import scale_rate, time_slice

ROOT = Path(__file__).resolve().parents[2]
PROFILE = resolve_profile("llama-2-70b-tp4@h100-sxm")
CONFIG = ControllerConfig(profile=PROFILE.name, slo=SloConfig(ttft_p99_s=1.5, tpot_p99_s=0.1))


def cluster_for(trace_slice_s: float, rate_scale: float, start: tuple[int, int]) -> Cluster:
    trace = time_slice(
        load_trace(ROOT / "data/traces/AzureLLMInferenceTrace_conv.csv"),
        start_s=0.0,
        end_s=trace_slice_s,
    )
    trace = scale_rate(trace, rate_scale, np.random.default_rng(1))
    model = CapacityModel.build(lengths_of(trace), PROFILE, tpot_slo_s=CONFIG.slo.tpot_p99_s)
    config = ClusterConfig(
        prefill_workers=start[0],
        decode_workers=start[1],
        profile=PROFILE,
        token_budget=model.token_budget,
        kv_link_bytes_per_s=KvLink().bytes_per_s,
        startup_s=60.0,
    )
    return Cluster(config, trace)


def test_the_controller_grows_undersized_pools_and_loses_no_request() -> None:
    cluster = cluster_for(1200.0, 4.0, start=(1, 1))
    run = run_controlled(cluster, CONFIG, profile=PROFILE, until_s=1200.0)
    results = cluster.finish()
    summary = results.summary(ttft_slo_s=1.5, tpot_slo_s=0.1)
    assert summary.lost_requests == 0
    assert summary.completed + summary.rejected_requests == summary.requests
    last = run.decisions[-1]
    assert last.target(Pool.PREFILL) > 1
    assert any(d.actuate for d in run.decisions)


def test_with_the_right_size_from_the_start_the_controller_holds_steady() -> None:
    cluster = cluster_for(1800.0, 1.0, start=(1, 1))
    run = run_controlled(cluster, CONFIG, profile=PROFILE, until_s=1800.0)
    settled = [d for d in run.decisions if (d.state.last_tick_s or 0) >= 600]
    changes = sum(p.changed for d in settled for _, p in d.pools.items())
    assert changes <= 2
    summary = cluster.finish().summary(ttft_slo_s=1.5, tpot_slo_s=0.1)
    assert summary.slo_attainment is not None and summary.slo_attainment > 0.97
