"""The cluster simulator matches hand-computed closed forms and loses no request."""

from __future__ import annotations

import csv
import math
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queueing.pools import Pool
from sim.cluster import Cluster, ClusterConfig
from sim.results import SimResults
from sim.trace import Trace
from tests.profiles import TEST_8B
from workers.scheduler import SchedulingPolicy

CHUNKED = SchedulingPolicy.CHUNKED_PREFILL
PREFILL_FIRST = SchedulingPolicy.PREFILL_FIRST

# The cluster tests need four things the shared profile does not have: two GPUs per
# worker (so GPU-seconds = worker-seconds x tensor_parallel is not a no-op), 0.1 ms per
# prompt token (40 prompts of 2000 tokens stay a backlog past a 5 s startup), a small
# KV cache (a few requests exhaust it, for the block-size and can-never-fit
# rejections) and a 5 s startup (the start/serve times asserted below).
PROFILE = replace(
    TEST_8B, tensor_parallel=2, t_tok_s=1e-4, kv_capacity_tokens=50_000, startup_s=5.0
)
LINK_BYTES_PER_S = PROFILE.kv_bytes_per_token / 2e-6  # 2 us per token of KV
LINK_LATENCY_S = 0.003


def config(**overrides: object) -> ClusterConfig:
    fields: dict[str, object] = {
        "prefill_workers": 2,
        "decode_workers": 2,
        "profile": PROFILE,
        "token_budget": 256,
        "kv_link_bytes_per_s": LINK_BYTES_PER_S,
        "kv_link_latency_s": LINK_LATENCY_S,
    }
    fields.update(overrides)
    return ClusterConfig(**fields)  # type: ignore[arg-type]


def trace_of(arrival_s: list[float], prompt: list[int], output: list[int]) -> Trace:
    return Trace(
        arrival_s=np.asarray(arrival_s, dtype=np.float64),
        prompt_tokens=np.asarray(prompt, dtype=np.int64),
        output_tokens=np.asarray(output, dtype=np.int64),
        source="test",
    )


def random_trace(rng: np.random.Generator, n: int, *, rate_rps: float, mean_prompt: float) -> Trace:
    arrival = np.cumsum(rng.exponential(1 / rate_rps, n))
    prompt = rng.geometric(1 / mean_prompt, n)
    output = np.minimum(rng.geometric(1 / 20, n), 100)
    return trace_of(arrival.tolist(), prompt.tolist(), output.tolist())


def union_length_s(starts: np.ndarray, ends: np.ndarray) -> float:
    """Length of the union of the intervals [starts[i], ends[i]]."""
    pairs: list[tuple[float, float]] = sorted(zip(starts.tolist(), ends.tolist(), strict=True))
    total = 0.0
    cur_start, cur_end = pairs[0]
    for s, e in pairs[1:]:
        if s > cur_end:
            total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    return total + (cur_end - cur_start)


# -- closed forms ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "budget", "output", "policy"),
    [
        (1000, 256, 50, CHUNKED),
        (100, 512, 2, CHUNKED),
        (513, 512, 1, CHUNKED),
        (777, 100, 9, PREFILL_FIRST),
    ],
)
def test_a_lone_request_has_the_ttft_and_tpot_of_its_hand_computed_iterations(
    prompt: int, budget: int, output: int, policy: SchedulingPolicy
) -> None:
    res = Cluster(
        config(token_budget=budget, policy=policy), trace_of([3.0], [prompt], [output])
    ).run()
    p = PROFILE
    # Chunks of the budget (or one whole prompt): the causal pairs of the chunks
    # always add up to L (L + 1) / 2, one t0 per iteration.
    iterations = math.ceil(prompt / budget) if policy is CHUNKED else 1
    ttft_s = iterations * p.t0_s + p.t_tok_s * prompt + p.t_attn_s * prompt * (prompt + 1) / 2
    assert res.ttft_s[0] == pytest.approx(ttft_s, rel=1e-12)
    if output == 1:
        assert res.finish_s[0] == res.first_token_s[0] and math.isnan(res.tpot_s[0])
        return
    handoff_s = LINK_LATENCY_S + prompt * p.kv_bytes_per_token / LINK_BYTES_PER_S
    # Batch 1; the j-th decode reads the prompt plus j tokens (its own input included).
    decode_s = (output - 1) * (p.t0_s + p.t_tok_s) + p.t_kv_s * sum(
        prompt + j for j in range(1, output)
    )
    assert res.kv_ready_s[0] == pytest.approx(3.0 + ttft_s + handoff_s, rel=1e-12)
    assert res.finish_s[0] == pytest.approx(3.0 + ttft_s + handoff_s + decode_s, rel=1e-12)
    assert res.tpot_s[0] == pytest.approx((handoff_s + decode_s) / (output - 1), rel=1e-12)


def test_a_lone_prefill_worker_is_busy_exactly_while_some_request_awaits_its_first_token() -> None:
    # Work conservation: with short exponential-ish prompts a single server never idles
    # while a request waits, and never works without one.
    rng = np.random.default_rng(11)
    trace = random_trace(rng, 600, rate_rps=60.0, mean_prompt=40.0)
    res = Cluster(config(prefill_workers=1, token_budget=128), trace).run()
    waiting_s = union_length_s(res.arrival_s, res.first_token_s)
    assert res.prefill_busy_s == pytest.approx(waiting_s, rel=1e-9)
    assert 0.3 < res.prefill_busy_s / res.end_s < 0.95  # a meaningfully loaded server


def test_a_prefill_pool_works_no_more_than_its_requests_wait_and_no_less_than_their_union() -> None:
    rng = np.random.default_rng(12)
    trace = random_trace(rng, 600, rate_rps=150.0, mean_prompt=40.0)
    res = Cluster(config(prefill_workers=3, token_budget=128), trace).run()
    in_prefill_s = res.first_token_s - res.arrival_s
    union_s = union_length_s(res.arrival_s, res.first_token_s)
    # Some worker is busy whenever a request waits; no more workers are busy than requests wait.
    assert union_s * (1 - 1e-9) <= res.prefill_busy_s <= float(in_prefill_s.sum()) * (1 + 1e-9)
    assert res.prefill_busy_s <= 3 * union_s * (1 + 1e-9)


def test_the_same_trace_gives_the_same_results() -> None:
    rng = np.random.default_rng(13)
    trace = random_trace(rng, 300, rate_rps=40.0, mean_prompt=300.0)

    def run() -> SimResults:
        cluster = Cluster(config(), trace)
        cluster.set_pool_size(Pool.DECODE, 3, 1.0)
        cluster.set_pool_size(Pool.PREFILL, 1, 2.0)
        return cluster.finish()

    a, b = run(), run()
    for name in ("first_token_s", "kv_ready_s", "decode_start_s", "finish_s"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert (a.gpu_seconds, a.prefill_busy_s, a.decode_busy_s) == (
        b.gpu_seconds,
        b.prefill_busy_s,
        b.decode_busy_s,
    )


# -- scaling ---------------------------------------------------------------------------------------


def test_gpu_time_runs_from_each_workers_start_to_its_retirement() -> None:
    trace = trace_of([0.0, 1.0, 2.0, 3.0, 4.0, 100.0], [100] * 6, [5] * 6)
    cluster = Cluster(config(prefill_workers=1, decode_workers=1), trace)
    cluster.set_pool_size(Pool.PREFILL, 3, 10.0)
    snap = cluster.snapshot()
    assert (snap.prefill.starting, snap.prefill.serving) == (2, 1)
    cluster.set_pool_size(Pool.DECODE, 2, 20.0)
    snap = cluster.snapshot()
    assert (snap.prefill.starting, snap.prefill.serving) == (0, 3)  # started at 10 + 5
    cluster.set_pool_size(Pool.PREFILL, 1, 50.0)  # the two new ones are idle: retire now
    snap = cluster.snapshot()
    assert (snap.prefill.serving, snap.prefill.draining) == (1, 0)
    assert cluster.pool_size(Pool.PREFILL) == 1 and cluster.pool_size(Pool.DECODE) == 2
    res = cluster.finish()
    end_s = res.end_s
    assert end_s > 100.0
    worker_s = 2 * end_s + 2 * (50.0 - 10.0) + (end_s - 20.0)
    assert res.gpu_seconds == pytest.approx(worker_s * PROFILE.tensor_parallel, rel=1e-12)
    # Serving time excludes startup: the new prefill workers served from 15 to 50.
    assert res.prefill_serving_s == pytest.approx(end_s + 2 * (50.0 - 15.0), rel=1e-12)
    assert res.summary(ttft_slo_s=1.0, tpot_slo_s=1.0).gpu_hours == pytest.approx(
        res.gpu_seconds / 3600
    )


def test_a_new_worker_serves_only_after_its_startup() -> None:
    trace = trace_of([0.0] * 40, [2000] * 40, [1] * 40)  # a backlog for a long while
    cluster = Cluster(config(prefill_workers=1, startup_s=5.0), trace)
    cluster.set_pool_size(Pool.PREFILL, 2, 0.0)
    cluster.run_until(4.99)
    snap = cluster.snapshot()
    assert (snap.prefill.starting, snap.prefill.busy) == (1, 1)
    cluster.run_until(5.01)
    snap = cluster.snapshot()
    assert (snap.prefill.starting, snap.prefill.serving, snap.prefill.busy) == (0, 2, 2)
    res = cluster.finish()
    assert res.completed == 40


def test_a_removed_busy_decode_worker_drains_what_it_holds_and_takes_nothing_new() -> None:
    trace = trace_of([0.0, 0.05, 0.6], [50, 50, 50], [400, 400, 20])
    cluster = Cluster(config(), trace, record_token_times=True)
    cluster.run_until(0.5)
    assert cluster.snapshot().decode.busy == 2  # one request on each worker
    cluster.set_pool_size(Pool.DECODE, 1, 0.5)  # the newest (index 1) drains
    snap = cluster.snapshot()
    assert (snap.decode.serving, snap.decode.draining, snap.decode.running) == (1, 1, 2)
    res = cluster.finish()
    assert res.completed == 3
    assert cluster.snapshot().decode.draining == 0
    assert res.token_times_s is not None
    # The late request shares worker 0's iterations with the first request.
    first_request_tokens = res.token_times_s[0]
    assert np.all(np.isin(res.token_times_s[2], first_request_tokens))
    assert not np.any(np.isin(res.token_times_s[2], res.token_times_s[1]))


def test_a_removed_busy_prefill_worker_finishes_its_prompt_undisturbed() -> None:
    trace = trace_of([0.0, 0.001, 0.2], [3000, 3000, 100], [1, 1, 1])
    cluster = Cluster(config(token_budget=256), trace)
    cluster.set_pool_size(Pool.PREFILL, 1, 0.1)  # worker 1 holds the second prompt
    assert cluster.snapshot().prefill.draining == 1
    res = cluster.finish()
    p = PROFILE
    alone_s = math.ceil(3000 / 256) * p.t0_s + p.t_tok_s * 3000 + p.t_attn_s * 3000 * 3001 / 2
    assert res.ttft_s[1] == pytest.approx(alone_s, rel=1e-12)
    # The third request waited for worker 0 instead of being given to the draining one.
    assert res.first_token_s[2] > res.first_token_s[0]


@pytest.mark.parametrize(("target", "now_s", "field"), [(0, 1.0, "target"), (2, -1.0, "now_s")])
def test_a_scaling_request_for_no_workers_or_for_the_past_is_rejected(
    target: int, now_s: float, field: str
) -> None:
    cluster = Cluster(config(), trace_of([0.0], [10], [2]))
    with pytest.raises(ValueError, match=field):
        cluster.set_pool_size(Pool.PREFILL, target, now_s)


@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.floats(0.0, 0.3), st.integers(1, 3000), st.integers(1, 60)),
        min_size=1,
        max_size=50,
    ),
    actions=st.lists(
        st.tuples(st.floats(0.0, 15.0), st.sampled_from(list(Pool)), st.integers(1, 4)),
        max_size=8,
    ),
    startup_s=st.sampled_from([0.0, 0.7, 4.0]),
    policy=st.sampled_from(list(SchedulingPolicy)),
    budget=st.sampled_from([8, 64, 512]),
)
def test_every_request_completes_exactly_once_whatever_the_scaling(
    requests: list[tuple[float, int, int]],
    actions: list[tuple[float, Pool, int]],
    startup_s: float,
    policy: SchedulingPolicy,
    budget: int,
) -> None:
    arrival = np.cumsum([gap for gap, _, _ in requests])
    trace = trace_of(arrival.tolist(), [p for _, p, _ in requests], [o for _, _, o in requests])
    cluster = Cluster(
        config(startup_s=startup_s, policy=policy, token_budget=budget, decode_workers=1),
        trace,
    )
    for time_s, pool, target in sorted(actions, key=lambda a: a[0]):
        cluster.set_pool_size(pool, target, time_s)
        assert cluster.pool_size(pool) == target
        snap = cluster.snapshot()
        pool_snap = snap.prefill if pool is Pool.PREFILL else snap.decode
        assert pool_snap.starting + pool_snap.serving == target
    res = cluster.finish()
    n = len(trace)
    summary = res.summary(ttft_slo_s=1.0, tpot_slo_s=0.1)
    assert res.completed == summary.completed == n and summary.lost_requests == 0
    final = cluster.snapshot(window_s=1e9)
    assert final.completed == n and len(final.window_output_tokens) == n  # logged once each
    assert final.prefill.running == final.decode.running == 0
    assert final.prefill.queue_length == final.decode.queue_length == 0
    assert np.all(res.arrival_s <= res.first_token_s) and np.all(res.first_token_s <= res.finish_s)
    decoded = res.output_tokens > 1
    handoff_s = LINK_LATENCY_S + res.prompt_tokens * PROFILE.kv_bytes_per_token / LINK_BYTES_PER_S
    np.testing.assert_allclose(
        res.kv_ready_s[decoded], (res.first_token_s + handoff_s)[decoded], rtol=1e-12
    )
    assert np.all(res.kv_ready_s[decoded] <= res.decode_start_s[decoded])
    assert np.all(res.decode_start_s[decoded] < res.finish_s[decoded])
    assert np.all(np.isnan(res.kv_ready_s[~decoded]))


# -- observation ---------------------------------------------------------------------------------


def test_a_snapshot_sees_exactly_the_arrivals_first_tokens_and_completions_of_its_window() -> None:
    rng = np.random.default_rng(14)
    trace = random_trace(rng, 800, rate_rps=30.0, mean_prompt=200.0)
    cluster = Cluster(config(), trace)
    snaps = []
    for t in (5.0, 12.5, 20.0):
        cluster.run_until(t)
        snaps.append(cluster.snapshot(window_s=4.0))
    res = cluster.finish()
    for snap in snaps:
        t, since = snap.time_s, snap.time_s - 4.0
        arrived = (res.arrival_s > since) & (res.arrival_s <= t)
        assert snap.arrived == int(np.count_nonzero(res.arrival_s <= t))
        assert snap.window_arrivals == int(np.count_nonzero(arrived))
        assert snap.window_arrival_rate_rps == snap.window_arrivals / 4.0
        np.testing.assert_array_equal(snap.window_prompt_tokens, res.prompt_tokens[arrived])
        first = (res.first_token_s > since) & (res.first_token_s <= t)
        np.testing.assert_allclose(np.sort(snap.window_ttft_s), np.sort(res.ttft_s[first]))
        done = (res.finish_s > since) & (res.finish_s <= t)
        assert snap.completed == int(np.count_nonzero(res.finish_s <= t))
        np.testing.assert_array_equal(
            np.sort(snap.window_output_tokens), np.sort(res.output_tokens[done])
        )
        tpot = res.tpot_s[done & (res.output_tokens > 1)]
        np.testing.assert_allclose(np.sort(snap.window_tpot_s), np.sort(tpot))


# -- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"prefill_workers": 0}, "prefill_workers"),
        ({"decode_workers": 1.5}, "decode_workers"),
        ({"token_budget": 0}, "token_budget"),
        ({"kv_link_bytes_per_s": 0.0}, "kv_link_bytes_per_s"),
        ({"kv_link_latency_s": -1.0}, "kv_link_latency_s"),
        ({"block_size_tokens": 100_000}, "block_size_tokens"),
        ({"startup_s": math.nan}, "startup_s"),
    ],
)
def test_a_bad_cluster_config_is_rejected_naming_the_field(
    overrides: dict[str, object], field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        config(**overrides)


def test_a_request_that_can_never_fit_a_worker_is_rejected_up_front_naming_it() -> None:
    trace = trace_of([0.0, 1.0], [100, 49_990], [5, 20])
    with pytest.raises(ValueError, match=r"request 1 .*decode"):
        Cluster(config(), trace)


def test_the_startup_time_defaults_to_the_profiles() -> None:
    assert config().worker_startup_s == PROFILE.startup_s
    assert config(startup_s=1.5).worker_startup_s == 1.5


# -- a real trace ----------------------------------------------------------------------------------

AZURE_CONV = Path(__file__).parents[2] / "data" / "traces" / "AzureLLMInferenceTrace_conv.csv"


def azure_conv_minutes(minutes: float) -> Trace:
    """The first minutes of the Azure conversation trace (parsed here, not by trace_io)."""
    stamps, prompt, output = [], [], []
    with AZURE_CONV.open(newline="") as f:
        reader = csv.reader(f)
        next(reader)
        for row in reader:
            stamps.append(datetime.fromisoformat(row[0][:26]).timestamp())  # 7 digits -> 6
            prompt.append(int(row[1]))
            output.append(int(row[2]))
    t = np.asarray(stamps)
    order = np.argsort(t, kind="stable")
    arrival = t[order] - t[order[0]]
    keep = order[arrival <= minutes * 60]
    return trace_of(
        (t[keep] - t[order[0]]).tolist(),
        np.asarray(prompt)[keep].tolist(),
        np.asarray(output)[keep].tolist(),
    )


def test_on_the_azure_conversation_trace_no_request_beats_its_time_alone_and_none_is_lost() -> None:
    trace = azure_conv_minutes(10.0)
    cfg = config(prefill_workers=3, decode_workers=3, token_budget=512)
    res = Cluster(cfg, trace).run()
    assert res.completed == len(trace) > 1000
    p = PROFILE
    L = res.prompt_tokens.astype(np.float64)
    alone_ttft_s = np.ceil(L / 512) * p.t0_s + p.t_tok_s * L + p.t_attn_s * L * (L + 1) / 2
    assert np.all(res.ttft_s >= alone_ttft_s - 1e-9)  # times near 600 s: absolute rounding
    out = res.output_tokens.astype(np.float64)
    decodes = out - 1
    # Alone: batch 1, reads L + 1 .. L + out - 1, after the handoff.
    alone_decode_s = (
        LINK_LATENCY_S
        + L * p.kv_bytes_per_token / LINK_BYTES_PER_S
        + decodes * (p.t0_s + p.t_tok_s)
        + p.t_kv_s * (decodes * L + decodes * out / 2)
    )
    decoded = res.output_tokens > 1
    took_s = (res.finish_s - res.first_token_s)[decoded]
    assert np.all(took_s >= alone_decode_s[decoded] - 1e-9)
