"""The prefill and decode workers against a real Redis, with the tiny model, in threads.

The reference for every continuation is one engine generating the same prompts with
the same sampling parameters in one process: a request prefilled by one worker,
moved over Redis and decoded by another must produce exactly those tokens, also when
a worker dies holding it and another takes over (the KV is then recomputed).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest

pytest.importorskip("torch")

from queueing.pools import Pool
from workers.checkpoint import random_weights, tiny_config
from workers.decode_worker import DecodeWorker
from workers.engine import Engine
from workers.model import LlamaForCausalLM
from workers.prefill_worker import PrefillWorker
from workers.protocol import (
    FinishReason,
    KeySpace,
    PrefillRequest,
    Streams,
    TokenEvent,
    connect,
)
from workers.redis_util import RedisServer
from workers.registry import Registry
from workers.sampling import SamplingParams
from workers.transfer import RedisKvTransport
from workers.worker import Worker, WorkerSettings
from workers.worker_metrics import WorkerMetrics

PREFIX = "wl"
KEYS = KeySpace(PREFIX)
DEADLINE_S = 60.0


def tiny_engine(**kwargs: Any) -> Engine:
    config = tiny_config()
    model = LlamaForCausalLM(config, device="cpu")
    model.load_state_dict(random_weights(config, seed=0))
    return Engine(model, **{"token_budget": 32, "num_blocks": 128, **kwargs})


def settings(pool: Pool, worker_id: str, **overrides: Any) -> WorkerSettings:
    base = WorkerSettings(
        worker_id=worker_id,
        pool=pool,
        token_budget=32,
        num_blocks=128,
        key_prefix=PREFIX,
        idle_block_ms=20,
        keepalive_interval_s=0.1,
        reclaim_interval_s=0.1,
        reclaim_min_idle_ms=400,
    )
    return replace(base, **overrides)


def make_worker(pool: Pool, worker_id: str, url: str, **overrides: Any) -> Worker:
    s = settings(pool, worker_id, **overrides)
    client = connect(url)
    cls: Any = PrefillWorker if pool is Pool.PREFILL else DecodeWorker
    return cls(
        s,
        engine=tiny_engine(
            token_budget=s.token_budget, num_blocks=s.num_blocks, keep_finished_kv=True
        ),
        transport=RedisKvTransport(client, key_prefix=f"{PREFIX}:kv"),
        client=client,
        metrics=WorkerMetrics(pool),
    )


@dataclass(frozen=True)
class Ask:
    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None

    def params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, seed=self.seed
        )


ASKS = [
    Ask(tuple(range(3, 40)), 12),  # greedy, a prompt over one budget
    Ask(tuple(range(100, 105)), 9, temperature=0.8, seed=7),  # sampled, short prompt
    Ask(tuple(range(200, 290)), 6, temperature=1.0, seed=123),  # several chunks
    Ask(tuple(range(50, 60)), 1),  # done at the prefill worker
]


def reference(asks: list[Ask]) -> list[list[int]]:
    return tiny_engine().generate([list(a.prompt) for a in asks], [a.params() for a in asks])


@pytest.fixture
def redis_url() -> Iterator[str]:
    server = RedisServer.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def streams(redis_url: str) -> Iterator[Streams]:
    client = connect(redis_url)
    s = Streams(client, KEYS)
    s.ensure_groups()
    yield s
    client.close()


def enqueue(streams: Streams, asks: list[Ask]) -> list[str]:
    now = time.time()
    ids = []
    for i, a in enumerate(asks):
        rid = f"req-{i}"
        streams.enqueue_prefill(
            PrefillRequest(
                request_id=rid,
                prompt_token_ids=a.prompt,
                max_tokens=a.max_tokens,
                temperature=a.temperature,
                seed=a.seed,
                arrival_s=now,
                deadline_s=now + DEADLINE_S,
            )
        )
        ids.append(rid)
    return ids


def collect(streams: Streams, request_id: str, timeout_s: float = 30.0) -> list[TokenEvent]:
    """The request's events as a router reads them: first of each index, until the end."""
    deadline = time.monotonic() + timeout_s
    last, kept = "0-0", []
    while time.monotonic() < deadline:
        last, events = streams.read_tokens(request_id, last, block_ms=100)
        for event in events:
            if event.error is not None:
                return [*kept, event]
            if event.index == len(kept):
                kept.append(event)
                if event.finished:
                    return kept
    raise AssertionError(f"{request_id}: no final event within {timeout_s} s; got {kept}")


class Running:
    """Workers looping in threads until stopped."""

    def __init__(self, *workers: Worker) -> None:
        self.stop = threading.Event()
        self.codes: dict[str, int] = {}
        self.threads = [
            threading.Thread(target=self._run, args=(w,), daemon=True) for w in workers
        ]
        for t in self.threads:
            t.start()

    def _run(self, worker: Worker) -> None:
        self.codes[worker.settings.worker_id] = worker.run(self.stop)

    def join(self, timeout_s: float = 30.0) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout_s)
            assert not t.is_alive(), "a worker did not finish draining"


def test_requests_prefilled_by_one_worker_and_decoded_by_another_continue_exactly(
    redis_url: str, streams: Streams
) -> None:
    expected = reference(ASKS)
    running = Running(
        make_worker(Pool.PREFILL, "p0", redis_url), make_worker(Pool.DECODE, "d0", redis_url)
    )
    try:
        ids = enqueue(streams, ASKS)
        for rid, want in zip(ids, expected, strict=True):
            events = collect(streams, rid)
            assert [e.token for e in events] == want, rid
            assert events[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
            assert all(e.finish_reason is None for e in events[:-1])
    finally:
        running.join()
    assert running.codes == {"p0": 0, "d0": 0}
    assert streams.queue_depth(Pool.PREFILL).total == 0
    assert streams.queue_depth(Pool.DECODE).total == 0


def test_a_drain_finishes_everything_held_then_deregisters_while_the_pool_serves_on(
    redis_url: str, streams: Streams
) -> None:
    asks = [Ask(tuple(range(10, 10 + n)), 40) for n in (20, 33, 47, 61, 75, 89)]
    expected = reference(asks)
    leaving = {pool: make_worker(pool, f"{pool.value}-leaving", redis_url) for pool in Pool}
    staying = Running(*(make_worker(pool, f"{pool.value}-staying", redis_url) for pool in Pool))
    drained = {pool: Running(w) for pool, w in leaving.items()}
    ids = enqueue(streams, asks)
    for pool, worker in leaving.items():  # SIGTERM each as soon as it holds work
        deadline = time.monotonic() + 30
        while worker.queue_depth() == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert worker.queue_depth() > 0, f"the {pool.value} worker never took work"
        drained[pool].stop.set()
    registry = Registry(streams.client, KEYS)
    try:
        for rid, want in zip(ids, expected, strict=True):
            assert [e.token for e in collect(streams, rid)] == want, rid
        for pool, running in drained.items():
            running.join()
            assert running.codes == {f"{pool.value}-leaving": 0}
            assert [w.worker_id for w in registry.live(pool)] == [f"{pool.value}-staying"]
    finally:
        staying.join()


def test_a_decode_worker_that_dies_mid_request_is_replaced_and_the_tokens_continue_exactly(
    redis_url: str, streams: Streams
) -> None:
    asks = [Ask(tuple(range(30, 75)), 30), Ask(tuple(range(5, 25)), 25, temperature=0.9, seed=3)]
    expected = reference(asks)
    prefill = Running(make_worker(Pool.PREFILL, "p0", redis_url))
    doomed = make_worker(Pool.DECODE, "d-doomed", redis_url)
    ids = enqueue(streams, asks)
    deadline = time.monotonic() + 30
    # Drive the doomed worker by hand until both requests have a few decoded tokens out.
    while time.monotonic() < deadline:
        doomed.maintain()
        doomed.iterate()
        if all(len(streams.published_tokens(r)) >= 4 for r in ids):
            break
    assert doomed.queue_depth() == 2
    # kill -9: it stops here, acknowledging nothing; its KV was taken from Redis.
    replacement = Running(make_worker(Pool.DECODE, "d-new", redis_url))
    try:
        for rid, want in zip(ids, expected, strict=True):
            assert [e.token for e in collect(streams, rid)] == want, rid
    finally:
        replacement.join()
        prefill.join()
    assert streams.queue_depth(Pool.DECODE).total == 0


def test_a_prefill_worker_that_dies_holding_a_prompt_loses_no_request(
    redis_url: str, streams: Streams
) -> None:
    asks = [Ask(tuple(range(1, 300)), 5)]  # ten chunks of the 32-token budget
    expected = reference(asks)
    doomed = make_worker(Pool.PREFILL, "p-doomed", redis_url)
    (rid,) = enqueue(streams, asks)
    doomed.iterate()  # takes the prompt and runs its first chunk, then dies
    assert doomed.queue_depth() == 1
    running = Running(
        make_worker(Pool.PREFILL, "p-new", redis_url), make_worker(Pool.DECODE, "d0", redis_url)
    )
    try:
        assert [e.token for e in collect(streams, rid)] == expected[0]
    finally:
        running.join()


def test_a_request_too_long_for_the_decode_cache_ends_with_an_error_not_a_hang(
    redis_url: str, streams: Streams
) -> None:
    running = Running(
        make_worker(Pool.PREFILL, "p0", redis_url, num_blocks=16),
        make_worker(Pool.DECODE, "d0", redis_url, num_blocks=16),
    )
    try:
        (rid,) = enqueue(streams, [Ask(tuple(range(1, 200)), 100)])  # 299 > 16 x 16 tokens
        events = collect(streams, rid)
        assert events[-1].finish_reason is FinishReason.ERROR
        assert "KV cache" in (events[-1].error or "")
    finally:
        running.join()
    assert streams.queue_depth(Pool.PREFILL).total == 0


def test_a_request_the_router_gave_up_on_is_dropped_unserved(
    redis_url: str, streams: Streams
) -> None:
    (rid,) = enqueue(streams, [Ask(tuple(range(1, 50)), 20)])
    streams.cancel(rid)  # the client left while it was queued (entry kept: already taken)
    worker = make_worker(Pool.PREFILL, "p0", redis_url)
    worker.iterate()
    assert worker.queue_depth() == 0
    assert streams.queue_depth(Pool.PREFILL).total == 0
    assert streams.published_tokens(rid) == []


def test_a_worker_waits_out_a_redis_outage_not_ready_and_serves_after_it() -> None:
    server = RedisServer.start()
    try:
        worker = make_worker(Pool.PREFILL, "p0", server.url)
        stop = threading.Event()
        thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
        thread.start()
        wait_until(lambda: worker.ready, "the worker to be ready")
        server.kill()  # kill -9 of Redis
        wait_until(lambda: not worker.ready, "the worker to notice the outage")
        assert thread.is_alive()
        server.restart()  # empty, on the same port: the groups are gone too
        s = Streams(connect(server.url), KEYS)
        ask = Ask(tuple(range(1, 20)), 1)
        (rid,) = enqueue(s, [ask])
        assert [e.token for e in collect(s, rid)] == reference([ask])[0]
        assert worker.ready
        stop.set()
        thread.join(10)
        assert not thread.is_alive()
    finally:
        server.stop()


def wait_until(condition: Any, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# -- KV over a torch.distributed link (gloo here, NCCL on GPUs): the decode side pulls -----


def torch_link_workers(url: str, prefill_id: str, decode_id: str) -> tuple[Worker, Worker]:
    from workers.kv_pull import KvPullClient, KvPullServer

    prefill_settings = settings(Pool.PREFILL, prefill_id)
    server = KvPullServer(connect(url), worker_id=prefill_id, keys=KEYS).start()
    client = connect(url)
    prefill = PrefillWorker(
        prefill_settings,
        engine=tiny_engine(keep_finished_kv=True),
        transport=server,
        client=client,
        metrics=WorkerMetrics(Pool.PREFILL),
    )
    decode_settings = settings(Pool.DECODE, decode_id, kv_receive_timeout_s=5.0)
    dclient = connect(url)
    decode = DecodeWorker(
        decode_settings,
        engine=tiny_engine(keep_finished_kv=True),
        transport=RedisKvTransport(dclient, key_prefix=f"{PREFIX}:kv"),
        client=dclient,
        metrics=WorkerMetrics(Pool.DECODE),
        pull=KvPullClient(connect(url), worker_id=decode_id, keys=KEYS),
    )
    return prefill, decode


def test_kv_pulled_over_a_gloo_link_continues_exactly_and_the_link_is_reused(
    redis_url: str, streams: Streams
) -> None:
    expected = reference(ASKS)
    prefill, decode = torch_link_workers(redis_url, "p-link", "d-link")
    running = Running(prefill, decode)
    try:
        ids = enqueue(streams, ASKS)
        for rid, want in zip(ids, expected, strict=True):
            assert [e.token for e in collect(streams, rid)] == want, rid
        # Three hand-offs (the fourth request ends at the prefill), all on one link.
        assert list(decode.pull._links) == ["p-link--d-link"]  # type: ignore[attr-defined]
    finally:
        running.join()
        prefill.transport.close()  # type: ignore[attr-defined]
        decode.pull.close()  # type: ignore[attr-defined]
    received = decode.metrics.exposition().decode()
    count = 'sara_kv_transfer_seconds_count{direction="receive",transport="gloo"} 3.0'
    assert count in received


def test_kv_parked_on_a_prefill_worker_that_died_is_recomputed_exactly(
    redis_url: str, streams: Streams
) -> None:
    ask = Ask(tuple(range(40, 90)), 10, temperature=0.7, seed=11)
    expected = reference([ask])
    prefill, decode = torch_link_workers(redis_url, "p-dies", "d-live")
    (rid,) = enqueue(streams, [ask])
    while prefill.queue_depth() or streams.queue_depth(Pool.DECODE).total == 0:
        prefill.maintain()
        prefill.iterate()  # prefill, park the KV, hand off; then it dies (no pull served)
    prefill.transport.close()  # type: ignore[attr-defined]
    Registry(streams.client, KEYS).deregister(Pool.PREFILL, "p-dies")  # its beats stop
    running = Running(decode)
    try:
        assert [e.token for e in collect(streams, rid)] == expected[0]
    finally:
        running.join()
        decode.pull.close()  # type: ignore[attr-defined]
