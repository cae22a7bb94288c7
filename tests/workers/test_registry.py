"""The worker registry: heartbeats with a TTL in a real redis-server, listed per pool."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis

from queueing.pools import Pool
from tests.workers.conftest import KEYS
from workers.protocol import connect, connect_async
from workers.redis_util import RedisServer
from workers.registry import AsyncRegistry, Heartbeat, Registry, WorkerInfo


def info(worker_id: str = "p-0", pool: Pool = Pool.PREFILL, **overrides: Any) -> WorkerInfo:
    fields: dict[str, Any] = {"ready": True, "capacity": 8, **overrides}
    return WorkerInfo(pool=pool, worker_id=worker_id, **fields)


@pytest.fixture
def registry(redis_server: RedisServer) -> Registry:
    return Registry(connect(redis_server.url), KEYS, ttl_s=0.3)


def wait_until(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_a_heartbeat_lists_the_worker_with_what_it_said(registry: Registry) -> None:
    sent = info(queue_depth=3, kv_utilization=0.25, address="10.0.0.7:9000")
    registry.heartbeat(sent)
    [got] = registry.live(Pool.PREFILL)
    assert got.heartbeat_s is not None
    assert abs(got.heartbeat_s - time.time()) < 5  # the server's clock, near ours here
    assert got == WorkerInfo(**{**sent.__dict__, "heartbeat_s": got.heartbeat_s})


def test_pools_are_listed_separately_and_sorted_by_id(registry: Registry) -> None:
    for wid in ("p-2", "p-0", "p-1"):
        registry.heartbeat(info(wid))
    registry.heartbeat(info("d-0", Pool.DECODE, ready=False))
    assert [w.worker_id for w in registry.live(Pool.PREFILL)] == ["p-0", "p-1", "p-2"]
    [decode] = registry.live(Pool.DECODE)
    assert (decode.worker_id, decode.ready) == ("d-0", False)


def test_a_worker_that_stops_beating_drops_out_after_its_ttl(registry: Registry) -> None:
    registry.heartbeat(info())
    assert len(registry.live(Pool.PREFILL)) == 1
    time.sleep(0.4)
    assert registry.live(Pool.PREFILL) == []
    assert registry.client.zcard(KEYS.workers(Pool.PREFILL)) == 0  # the index is cleaned


def test_deregister_removes_a_worker_at_once(registry: Registry) -> None:
    registry.heartbeat(info("p-0"))
    registry.heartbeat(info("p-1"))
    registry.deregister(Pool.PREFILL, "p-0")
    assert [w.worker_id for w in registry.live(Pool.PREFILL)] == ["p-1"]


def test_a_malformed_record_is_skipped(registry: Registry) -> None:
    registry.heartbeat(info("p-0"))
    registry.heartbeat(info("p-1"))
    registry.client.hset(KEYS.worker(Pool.PREFILL, "p-1"), "capacity", "lots")
    assert [w.worker_id for w in registry.live(Pool.PREFILL)] == ["p-0"]


def test_the_heartbeat_thread_keeps_a_worker_live_and_deregisters_on_stop(
    registry: Registry,
) -> None:
    depth = {"n": 0}
    beat = Heartbeat(registry, lambda: info(queue_depth=depth["n"]), interval_s=0.05).start()
    try:
        assert len(registry.live(Pool.PREFILL)) == 1  # registered before start() returned
        depth["n"] = 4
        time.sleep(0.5)  # longer than the TTL
        [w] = registry.live(Pool.PREFILL)
        assert w.queue_depth == 4
    finally:
        beat.stop()
    assert registry.live(Pool.PREFILL) == []


def test_the_heartbeat_survives_a_redis_restart(redis_server: RedisServer) -> None:
    registry = Registry(connect(redis_server.url, timeout_s=0.5), KEYS, ttl_s=0.5)
    beat = Heartbeat(registry, lambda: info(), interval_s=0.05).start()
    try:
        redis_server.kill()
        time.sleep(0.2)  # beats fail meanwhile, the thread carries on
        redis_server.restart()
        wait_until(lambda: len(registry.live(Pool.PREFILL)) == 1)
    finally:
        beat.stop()


def test_listing_an_unreachable_redis_raises_a_connection_error(
    redis_server: RedisServer,
) -> None:
    registry = Registry(connect(redis_server.url, timeout_s=0.5), KEYS)
    redis_server.kill()
    with pytest.raises(redis.ConnectionError):
        registry.live(Pool.PREFILL)


def test_the_async_registry_lists_the_same_workers(
    redis_server: RedisServer, registry: Registry
) -> None:
    registry.heartbeat(info("p-0"))

    async def listing() -> list[str]:
        client = connect_async(redis_server.url)
        try:
            return [w.worker_id for w in await AsyncRegistry(client, KEYS).live(Pool.PREFILL)]
        finally:
            await client.aclose()

    assert asyncio.run(listing()) == ["p-0"]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"worker_id": ""}, "worker_id"),
        ({"worker_id": "a/b"}, "worker_id"),
        ({"capacity": -1}, "capacity"),
        ({"queue_depth": 1.5}, "queue_depth"),
        ({"kv_utilization": 1.5}, "kv_utilization"),
        ({"pool": "prefill"}, "pool"),
    ],
)
def test_invalid_worker_info_is_refused_naming_the_field(
    overrides: dict[str, Any], field: str
) -> None:
    fields: dict[str, Any] = {
        "pool": Pool.PREFILL,
        "worker_id": "w",
        "ready": True,
        "capacity": 1,
        **overrides,
    }
    with pytest.raises(ValueError, match=field):
        WorkerInfo(**fields)


def test_a_heartbeat_interval_must_fit_twice_in_the_ttl(registry: Registry) -> None:
    with pytest.raises(ValueError, match="interval_s"):
        Heartbeat(registry, lambda: info(), interval_s=0.2)  # TTL 0.3 s
