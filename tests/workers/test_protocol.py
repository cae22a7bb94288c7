"""The Redis data-plane protocol: messages, their validation, and the stream operations
against a real redis-server (one per test, on a free loopback port)."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queueing.pools import Pool
from tests.workers.conftest import KEYS
from workers.protocol import (
    AsyncStreams,
    DecodeRequest,
    FinishReason,
    KeySpace,
    KvTransportName,
    PrefillRequest,
    ProtocolError,
    Streams,
    TokenEvent,
    connect,
    connect_async,
    decode_decode,
    decode_prefill,
    decode_token,
    encode_decode,
    encode_prefill,
    encode_token,
)
from workers.redis_util import RedisServer


def request(rid: str = "r1", **overrides: Any) -> PrefillRequest:
    fields: dict[str, Any] = {
        "request_id": rid,
        "prompt_token_ids": (5, 6, 7),
        "max_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 42,
        "arrival_s": 1000.0,
        "deadline_s": 1300.0,
        **overrides,
    }
    return PrefillRequest(**fields)


def handoff(req: PrefillRequest) -> DecodeRequest:
    return DecodeRequest(
        request=req,
        first_token=9,
        kv_transport=KvTransportName.REDIS,
        kv_handle="kv:r1",
        prefill_worker="p-0",
        prefill_done_s=1000.5,
    )


def as_stored(fields: dict[str, bytes | str]) -> dict[bytes, bytes]:
    """What Redis hands back: bytes keys and values."""
    return {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}


# --------------------------------------------------------------------------- messages

requests = st.builds(
    PrefillRequest,
    request_id=st.from_regex(r"[A-Za-z0-9._:-]{1,40}", fullmatch=True),
    prompt_token_ids=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300).map(tuple),
    max_tokens=st.integers(1, 100_000),
    temperature=st.floats(0, 2),
    top_p=st.floats(0, 1, exclude_min=True),
    seed=st.none() | st.integers(0, 2**63 - 1),
    ignore_eos=st.booleans(),
    arrival_s=st.floats(0, 2e9),
    deadline_s=st.just(3e9),
)


@given(requests)
@settings(max_examples=200, deadline=None)
def test_a_prefill_request_survives_encoding_exactly(req: PrefillRequest) -> None:
    assert decode_prefill(as_stored(encode_prefill(req))) == req


@given(requests, st.integers(0, 2**32 - 1), st.sampled_from(KvTransportName))
@settings(max_examples=50, deadline=None)
def test_a_decode_hand_off_survives_encoding_exactly(
    req: PrefillRequest, token: int, transport: KvTransportName
) -> None:
    msg = DecodeRequest(
        request=req,
        first_token=token,
        kv_transport=transport,
        kv_handle="h",
        prefill_worker="w",
        prefill_done_s=1.5,
    )
    assert decode_decode(as_stored(encode_decode(msg))) == msg


@pytest.mark.parametrize(
    "event",
    [
        TokenEvent(index=0, token=17),
        TokenEvent(index=5, token=0, finish_reason=FinishReason.LENGTH),
        TokenEvent(index=2, token=3, finish_reason=FinishReason.STOP),
        TokenEvent.failure(1, "CUDA out of memory ✗"),
    ],
)
def test_a_token_event_survives_encoding_exactly(event: TokenEvent) -> None:
    assert decode_token(as_stored(encode_token(event))) == event


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"request_id": ""}, "request_id"),
        ({"request_id": "has space"}, "request_id"),
        ({"prompt_token_ids": ()}, "prompt_token_ids"),
        ({"prompt_token_ids": (1, -1)}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, 2]}, "prompt_token_ids"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"arrival_s": math.inf}, "arrival_s"),
        ({"deadline_s": 999.0}, "deadline_s"),
    ],
)
def test_an_invalid_request_is_refused_naming_the_field(
    overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(ProtocolError, match=field):
        request(**overrides)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"index": -1, "token": 1}, "index"),
        ({"index": 0, "token": 2**32}, "token"),
        ({"index": 0, "token": None}, "token"),
        ({"index": 0, "token": 1, "error": "x"}, "error"),
        ({"index": 0, "token": None, "finish_reason": FinishReason.ERROR}, "error"),
    ],
)
def test_an_invalid_token_event_is_refused_naming_the_field(
    kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(ProtocolError, match=field):
        TokenEvent(**kwargs)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"v": b"2"}, "schema version 2"),
        ({"max_tokens": b"many"}, "max_tokens"),
        ({"prompt": b"\x01\x02\x03"}, "prompt"),
        ({"temperature": b"hot"}, "temperature"),
        ({"seed": b"x"}, "seed"),
    ],
)
def test_a_malformed_stored_message_is_a_protocol_error_naming_the_field(
    change: dict[str, bytes], field: str
) -> None:
    fields = as_stored(encode_prefill(request()))
    fields.update({k.encode(): v for k, v in change.items()})
    with pytest.raises(ProtocolError, match=field):
        decode_prefill(fields)


def test_a_missing_field_is_named() -> None:
    fields = as_stored(encode_prefill(request()))
    del fields[b"deadline_s"]
    with pytest.raises(ProtocolError, match="deadline_s"):
        decode_prefill(fields)


def test_keys_are_namespaced_by_prefix() -> None:
    keys = KeySpace("prod")
    assert keys.stream(Pool.PREFILL) == "prod:prefill"
    assert keys.stream(Pool.DECODE) == "prod:decode"
    assert keys.tokens("r1") == "prod:tokens:r1"
    with pytest.raises(ValueError, match="prefix"):
        KeySpace("a b")


# --------------------------------------------------------------------------- streams


def test_the_prefill_pool_is_one_shared_queue_each_request_delivered_once(
    streams: Streams,
) -> None:
    for i in range(10):
        assert streams.enqueue_prefill(request(f"r{i}")) is not None
    seen: list[str] = []
    consumers = ["p-0", "p-1", "p-2"]
    while len(seen) < 10:
        for consumer in consumers:
            seen += [d.message.request_id for d in streams.read_prefill(consumer, count=2)]
    assert seen == [f"r{i}" for i in range(10)]  # FIFO, no duplicates
    assert streams.read_prefill("p-0", count=10) == []


def test_admission_is_limited_by_the_requests_waiting_plus_in_service(
    streams: Streams,
) -> None:
    assert streams.enqueue_prefill(request("a"), max_queued=2) is not None
    assert streams.enqueue_prefill(request("b"), max_queued=2) is not None
    assert streams.enqueue_prefill(request("c"), max_queued=2) is None
    taken = streams.read_prefill("p-0", count=1)
    depth = streams.queue_depth(Pool.PREFILL)
    assert (depth.waiting, depth.in_service, depth.total) == (1, 1, 2)
    assert streams.enqueue_prefill(request("c"), max_queued=2) is None  # in service counts
    streams.ack(Pool.PREFILL, [taken[0].entry_id])
    assert streams.queue_depth(Pool.PREFILL).total == 1
    assert streams.enqueue_prefill(request("c"), max_queued=2) is not None


def test_a_hand_off_moves_the_request_to_decode_and_acks_it_atomically(
    streams: Streams,
) -> None:
    req = request()
    streams.enqueue_prefill(req)
    [d] = streams.read_prefill("p-0")
    streams.hand_off_to_decode(d.entry_id, handoff(req))
    assert streams.queue_depth(Pool.PREFILL).total == 0
    assert streams.client.xlen(KEYS.stream(Pool.PREFILL)) == 0  # acked and deleted
    [got] = streams.read_decode("d-0", count=5, block_ms=100)
    assert got.message == handoff(req)
    assert streams.queue_depth(Pool.DECODE).in_service == 1
    streams.ack(Pool.DECODE, [got.entry_id])
    assert streams.queue_depth(Pool.DECODE).total == 0


def test_a_dead_consumers_request_is_reclaimed_after_the_grace(
    streams: Streams,
) -> None:
    streams.enqueue_prefill(request())
    [d] = streams.read_prefill("dead")
    live = {"alive"}  # "dead" is missing from the registry's live set
    assert streams.reclaim_stale(Pool.PREFILL, "alive", live=live, min_idle_ms=200) == []
    time.sleep(0.25)
    [again] = streams.reclaim_stale(Pool.PREFILL, "alive", live=live, min_idle_ms=200)
    assert (again.entry_id, again.message, again.deliveries) == (d.entry_id, d.message, 2)
    # The dead consumer, were it only slow, learns that it lost the request.
    assert streams.keep_alive(Pool.PREFILL, "dead", [d.entry_id]) == {d.entry_id}
    assert streams.keep_alive(Pool.PREFILL, "alive", [d.entry_id]) == set()


def test_a_slow_but_live_consumer_keeps_its_entries_however_long_they_wait(
    streams: Streams,
) -> None:
    streams.enqueue_prefill(request())
    [d] = streams.read_prefill("slow")
    time.sleep(0.2)  # far past the grace, no keep-alive: only the heartbeat says it lives
    live = {"slow", "thief"}
    assert streams.reclaim_stale(Pool.PREFILL, "thief", live=live, min_idle_ms=50) == []
    assert streams.pending_consumers(Pool.PREFILL) == {"slow": 1}
    # ... until its lease expires: a loop that never touches its work is wedged.
    [taken] = streams.reclaim_stale(Pool.PREFILL, "thief", live=live, min_idle_ms=50, lease_ms=150)
    assert (taken.entry_id, taken.deliveries) == (d.entry_id, 2)


def test_entries_left_under_the_callers_own_id_are_taken_back_but_not_those_it_holds(
    streams: Streams,
) -> None:
    streams.enqueue_prefill(request("a"))
    streams.enqueue_prefill(request("b"))
    [a, b] = streams.read_prefill("w-0", count=2)
    time.sleep(0.06)
    # A restart under the same id: it holds "b" again already, "a" was left behind.
    [back] = streams.reclaim_stale(
        Pool.PREFILL, "w-0", live={"w-0"}, held={b.entry_id}, min_idle_ms=50
    )
    assert back.entry_id == a.entry_id


def test_keep_alive_protects_a_long_running_request_from_reclaim(streams: Streams) -> None:
    streams.enqueue_prefill(request())
    [d] = streams.read_prefill("slow")
    for _ in range(3):
        time.sleep(0.1)
        assert streams.keep_alive(Pool.PREFILL, "slow", [d.entry_id]) == set()
        assert (
            streams.reclaim_stale(
                Pool.PREFILL, "thief", live={"slow", "thief"}, min_idle_ms=50, lease_ms=150
            )
            == []
        )


def test_a_poison_request_ends_with_an_error_event_after_max_deliveries(
    streams: Streams,
) -> None:
    streams.enqueue_prefill(request("poison"))
    streams.read_prefill("w-0")
    for i in range(1, 3):  # delivered 2 and 3 times: still served (w-{i-1} died each time)
        time.sleep(0.06)
        taken = streams.reclaim_stale(
            Pool.PREFILL, f"w-{i}", live={f"w-{i}"}, min_idle_ms=50, max_deliveries=3
        )
        assert len(taken) == 1
    time.sleep(0.06)
    assert (
        streams.reclaim_stale(Pool.PREFILL, "w-3", live={"w-3"}, min_idle_ms=50, max_deliveries=3)
        == []
    )
    _, [event] = streams.read_tokens("poison")
    assert event.finish_reason is FinishReason.ERROR
    assert "failed on 3 prefill workers" in (event.error or "")
    assert streams.queue_depth(Pool.PREFILL).total == 0


def test_a_malformed_entry_is_answered_with_an_error_and_dropped(streams: Streams) -> None:
    fields = encode_prefill(request("bad"))
    fields["max_tokens"] = "zero"
    streams.client.xadd(KEYS.stream(Pool.PREFILL), fields)  # type: ignore[arg-type]
    streams.enqueue_prefill(request("good"))
    got = streams.read_prefill("p-0", count=10)
    assert [d.message.request_id for d in got] == ["good"]
    _, [event] = streams.read_tokens("bad")
    assert event.error is not None and "max_tokens" in event.error
    assert streams.queue_depth(Pool.PREFILL).total == 1  # only "good", in service


def test_tokens_are_read_in_order_from_where_the_reader_left_off(streams: Streams) -> None:
    streams.publish_tokens([("r1", TokenEvent(index=i, token=10 + i)) for i in range(3)])
    last, events = streams.read_tokens("r1")
    assert [e.token for e in events] == [10, 11, 12]
    streams.publish_token("r1", TokenEvent(index=3, token=13, finish_reason=FinishReason.STOP))
    last, events = streams.read_tokens("r1", last)
    assert [(e.index, e.finished) for e in events] == [(3, True)]
    # With nothing new, a blocking read answers nothing -- and only once its block time
    # has passed (a lower bound against the configured 100 ms, less 5 ms for Redis
    # timing blocked reads in whole milliseconds).
    started = time.monotonic()
    assert streams.read_tokens("r1", last, block_ms=100) == (last, [])
    assert time.monotonic() - started >= 0.1 - 0.005


def test_a_blocking_token_read_is_woken_by_the_next_publish(streams: Streams) -> None:
    # Blocking for far longer than the publish takes to come: the read answers with the
    # event, so it was woken by it rather than running out its block time empty.
    last, _ = streams.read_tokens("r1")
    timer = threading.Timer(0.05, streams.publish_token, ("r1", TokenEvent(index=0, token=7)))
    timer.start()
    try:
        _, events = streams.read_tokens("r1", last, block_ms=4000)  # under the 5 s socket timeout
    finally:
        timer.join()
    assert [e.token for e in events] == [7]


def test_a_token_stream_expires_by_itself(streams: Streams) -> None:
    streams.publish_token("r1", TokenEvent(index=0, token=1))
    ttl = streams.client.ttl(KEYS.tokens("r1"))
    assert 0 < ttl <= streams.token_ttl_s


def test_published_tokens_keep_the_first_of_each_index_up_to_a_gap(streams: Streams) -> None:
    streams.publish_tokens(
        [
            ("r1", TokenEvent(index=i, token=t))
            for i, t in [(0, 5), (1, 6), (0, 5), (1, 9), (2, 7), (4, 8)]
        ]
    )
    assert streams.published_tokens("r1") == [5, 6, 7]


def test_cancel_marks_the_request_and_removes_its_queue_entry(streams: Streams) -> None:
    entry = streams.enqueue_prefill(request("gone"))
    streams.publish_token("gone", TokenEvent(index=0, token=1))
    streams.cancel("gone", entry)
    assert streams.cancelled(["gone", "other"]) == {"gone"}
    assert streams.client.exists(KEYS.tokens("gone")) == 0
    assert streams.read_prefill("p-0", count=10) == []


def test_the_stream_length_is_capped_approximately(redis_server: RedisServer) -> None:
    s = Streams(connect(redis_server.url), KEYS, max_stream_len=10)
    for i in range(500):
        s.enqueue_prefill(request(f"r{i}"))
    # Approximate trimming removes whole nodes (100 entries each by default).
    assert s.client.xlen(KEYS.stream(Pool.PREFILL)) <= 10 + 100


def test_reading_recreates_the_groups_after_redis_restarts_empty(
    redis_server: RedisServer,
) -> None:
    s = Streams(connect(redis_server.url), KEYS)
    s.ensure_groups()
    redis_server.kill()
    redis_server.restart()
    s.enqueue_prefill(request())  # the stream exists again, without groups
    [d] = s.read_prefill("p-0")
    assert d.message.request_id == "r1"


@pytest.mark.parametrize("block_ms", [0, 5000])
def test_a_block_that_is_forever_or_outlasts_the_socket_timeout_is_refused(
    redis_server: RedisServer, block_ms: int
) -> None:
    s = Streams(connect(redis_server.url, timeout_s=2.0), KEYS)
    with pytest.raises(ValueError, match="block_ms"):
        s.read_prefill("p-0", block_ms=block_ms)


def test_the_async_router_side_speaks_the_same_protocol(
    redis_server: RedisServer, streams: Streams
) -> None:
    async def scenario() -> list[TokenEvent]:
        client = connect_async(redis_server.url)
        a = AsyncStreams(client, KEYS)
        try:
            assert await a.enqueue_prefill(request("x"), max_queued=5) is not None
            [d] = streams.read_prefill("p-0")
            streams.publish_token(
                d.message.request_id,
                TokenEvent(index=0, token=3, finish_reason=FinishReason.LENGTH),
            )
            _, events = await a.read_tokens("x", block_ms=100)
            assert (await a.queue_depth(Pool.PREFILL)).in_service == 1
            await a.finish("x")
            assert await client.exists(KEYS.tokens("x")) == 0
            return events
        finally:
            await client.aclose()

    events = asyncio.run(scenario())
    assert events == [TokenEvent(index=0, token=3, finish_reason=FinishReason.LENGTH)]


def test_keep_alive_after_redis_lost_its_streams_reports_every_entry_lost(
    streams: Streams,
) -> None:
    # A Redis restarted without its data has no stream and no group: what a worker
    # held is gone, and keep_alive says so instead of raising (which killed workers).
    streams.client.flushall()
    assert streams.keep_alive(Pool.DECODE, "w", ["1-0", "2-0"]) == {"1-0", "2-0"}
