"""Fast-forwarding decode workers in closed form is exactly stepping the real scheduler.

The reference here runs the decode pool the slow way: one
``workers.scheduler.Scheduler`` per worker, one ``schedule``/``complete_step`` per
iteration, fed the same requests at the same KV-ready times. Every decode token of
every request must come out at the same time (to 1e-9 s) in both.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace

import numpy as np
import pytest

from sim.cluster import Cluster, ClusterConfig
from sim.decode_worker import DecodeWorker
from sim.results import SimResults
from sim.trace import Trace
from tests.profiles import TEST_8B
from workers.kv_cache import PagedKVCache
from workers.scheduler import Scheduler, Sequence, StepPlan

PROFILE = TEST_8B


def random_trace(
    rng: np.random.Generator, n: int, *, rate_rps: float, long_prompt_share: float
) -> Trace:
    """Poisson arrivals; prompts uniform on [5, 200), or a mix of short [5, 60) and long
    [300, 700) ones (long ones block the head of a KV-limited decode queue)."""
    arrival = np.cumsum(rng.exponential(1 / rate_rps, n))
    if long_prompt_share == 0:
        prompt = rng.integers(5, 200, n)
    else:
        is_long = rng.random(n) < long_prompt_share
        prompt = np.where(is_long, rng.integers(300, 700, n), rng.integers(5, 60, n))
    output = np.minimum(rng.geometric(1 / 25, n), 90)
    return Trace(
        arrival_s=arrival.astype(np.float64),
        prompt_tokens=prompt.astype(np.int64),
        output_tokens=output.astype(np.int64),
        source="random test workload",
    )


def step_decode_pool(
    res: SimResults, *, workers: int, max_batch: int, kv_blocks: int, block_size: int
) -> tuple[dict[int, list[float]], dict[int, float]]:
    """Token times and admission times from stepping one Scheduler per decode worker."""
    ready = sorted(
        (r for r in range(len(res)) if res.output_tokens[r] > 1),
        key=lambda r: (res.kv_ready_s[r], r),
    )
    schedulers = [
        Scheduler(
            token_budget=max_batch,
            kv_cache=PagedKVCache(num_blocks=kv_blocks, block_size_tokens=block_size),
        )
        for _ in range(workers)
    ]
    plans: list[StepPlan | None] = [None] * workers
    ends_s = [math.inf] * workers
    queue: deque[Sequence] = deque()
    token_times: dict[int, list[float]] = {r: [] for r in ready}
    starts_s: dict[int, float] = {}

    def start(w: int, now_s: float) -> None:
        before = {s.seq_id for s in schedulers[w].running}
        plan = schedulers[w].schedule(queue)
        for seq in schedulers[w].running:
            if seq.seq_id not in before:
                starts_s[seq.seq_id] = now_s
        if plan.is_empty:
            plans[w], ends_s[w] = None, math.inf
            return
        assert not plan.prefill_chunks
        plans[w] = plan
        ends_s[w] = now_s + PROFILE.iteration_s(
            n_tokens=plan.num_batched_tokens, n_kv_read=plan.num_kv_read_tokens
        )

    i = 0
    while i < len(ready) or any(p is not None for p in plans):
        ready_s = float(res.kv_ready_s[ready[i]]) if i < len(ready) else math.inf
        w = min(range(workers), key=lambda k: (ends_s[k], k))
        if ready_s <= ends_s[w]:
            r = ready[i]
            i += 1
            prompt, out = int(res.prompt_tokens[r]), int(res.output_tokens[r])
            queue.append(
                Sequence(
                    seq_id=r,
                    num_prompt_tokens=prompt,
                    max_new_tokens=out,
                    num_computed_tokens=prompt,
                    num_generated_tokens=1,
                )
            )
            for k in range(workers):  # idle workers take it at once, lowest index first
                if plans[k] is None and queue:
                    start(k, ready_s)
            continue
        plan = plans[w]
        assert plan is not None
        now_s = ends_s[w]
        schedulers[w].complete_step(plan)
        for r in plan.decode_seq_ids:
            token_times[r].append(now_s)
        start(w, now_s)
    return token_times, starts_s


@pytest.mark.parametrize(
    ("seed", "decode_workers", "max_batch", "kv_capacity_tokens", "long_prompt_share"),
    [
        (1, 1, 8, 1_000_000, 0.0),  # batch-limited
        (2, 1, 64, 1024, 0.0),  # KV-limited: a few requests fill the cache
        (3, 3, 6, 2048, 0.0),  # a pool: boundaries of three workers interleave
        (4, 2, 16, 1600, 0.0),
        # A long request at the head that one worker cannot hold while another can:
        # freeing the head must wake the workers that have room for the next one.
        (2, 3, 16, 1200, 0.3),
        (5, 2, 16, 1600, 0.3),
        (5, 2, 32, 1500, 0.3),
    ],
)
def test_fast_forward_gives_every_token_at_the_time_stepping_the_scheduler_gives(
    seed: int,
    decode_workers: int,
    max_batch: int,
    kv_capacity_tokens: int,
    long_prompt_share: float,
) -> None:
    rng = np.random.default_rng(seed)
    trace = random_trace(rng, 250, rate_rps=25.0, long_prompt_share=long_prompt_share)
    profile = replace(PROFILE, kv_capacity_tokens=kv_capacity_tokens)
    config = ClusterConfig(
        prefill_workers=4,
        decode_workers=decode_workers,
        profile=profile,
        token_budget=max_batch,
        kv_link_bytes_per_s=PROFILE.kv_bytes_per_token / 1e-5,  # 10 us per token
        kv_link_latency_s=0.002,
        block_size_tokens=16,
    )
    res = Cluster(config, trace, record_token_times=True).run()
    assert res.completed == len(trace)
    assert res.decode_queue_max >= 2  # requests did wait for room, the interesting case

    expected, starts_s = step_decode_pool(
        res,
        workers=decode_workers,
        max_batch=max_batch,
        kv_blocks=config.kv_blocks_per_worker,
        block_size=16,
    )
    assert res.token_times_s is not None
    for r, times in expected.items():
        got = res.token_times_s[r]
        assert len(got) == len(times) == res.output_tokens[r] - 1
        np.testing.assert_allclose(got, times, rtol=0, atol=1e-9)
        assert res.decode_start_s[r] == pytest.approx(starts_s[r], abs=1e-9)
        assert res.finish_s[r] == pytest.approx(times[-1], abs=1e-9)


def test_the_boundary_search_finds_the_first_boundary_at_or_after_a_time() -> None:
    worker = DecodeWorker(
        profile=PROFILE,
        max_batch=8,
        kv_cache=PagedKVCache(num_blocks=1000, block_size_tokens=16),
    )
    worker.admit(1, prompt_tokens=300, output_tokens=500, now_s=2.0)
    worker.admit(2, prompt_tokens=40, output_tokens=400, now_s=2.0)
    # Boundaries by summing iteration times one by one, batch 2, reads 342, 344, ...
    boundaries_s = [2.0]
    for j in range(300):
        boundaries_s.append(
            boundaries_s[-1] + PROFILE.iteration_s(n_tokens=2, n_kv_read=342 + 2 * j)
        )
    for k in (0, 1, 7, 150, 299):
        assert worker.boundary_time_s(k) == pytest.approx(boundaries_s[k], abs=1e-12)
    rng = np.random.default_rng(0)
    for t in rng.uniform(1.0, boundaries_s[-1], 200):
        expected = next(k for k, b in enumerate(boundaries_s) if b >= t)
        assert worker.first_boundary_at_or_after(float(t)) == expected


def test_a_member_leaves_after_output_minus_1_iterations_and_frees_its_kv() -> None:
    kv = PagedKVCache(num_blocks=100, block_size_tokens=16)
    worker = DecodeWorker(profile=PROFILE, max_batch=4, kv_cache=kv)
    worker.admit(7, prompt_tokens=100, output_tokens=11, now_s=0.0)
    assert kv.num_used_blocks == math.ceil(111 / 16)
    assert worker.next_finish_k() == 10
    assert worker.advance(10) == [7]
    assert worker.batch == 0 and kv.num_used_blocks == 0
    # Ten iterations of batch 1 reading 101 .. 110 entries.
    busy_s = 10 * (PROFILE.t0_s + PROFILE.t_tok_s) + PROFILE.t_kv_s * sum(range(101, 111))
    assert worker.epoch_start_s == pytest.approx(busy_s, abs=1e-12)
    with pytest.raises(RuntimeError, match="request 8"):
        DecodeWorker(
            profile=PROFILE, max_batch=1, kv_cache=PagedKVCache(num_blocks=1, block_size_tokens=16)
        ).admit(8, prompt_tokens=100, output_tokens=2, now_s=0.0)
