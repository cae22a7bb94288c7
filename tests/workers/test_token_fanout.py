"""TokenFanout: one blocking read for all the router's requests, against a real Redis."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.workers.conftest import KEYS
from workers.protocol import FinishReason, Streams, TokenEvent, connect_async
from workers.redis_util import RedisServer
from workers.token_fanout import TokenFanout

BLOCK_MS = 400


async def _collect(fanout: TokenFanout, request_id: str, n: int) -> list[int]:
    tokens: list[int] = []
    while len(tokens) < n:
        for event in await fanout.read(request_id, block_ms=BLOCK_MS):
            assert event.token is not None
            tokens.append(event.token)
    return tokens


def test_many_requests_share_one_read_per_step_not_one_per_token(
    redis_server: RedisServer, streams: Streams
) -> None:
    requests, steps = 20, 30

    async def scenario() -> tuple[list[list[int]], int]:
        client = connect_async(redis_server.url)
        fanout = TokenFanout(client, KEYS, block_ms=BLOCK_MS)
        ids = [f"r{i}" for i in range(requests)]
        for request_id in ids:
            fanout.subscribe(request_id)
        readers = [asyncio.create_task(_collect(fanout, r, steps)) for r in ids]

        def publish() -> None:  # a decode worker: one step's token for every request
            for step in range(steps):
                streams.publish_tokens((r, TokenEvent(index=step, token=step)) for r in ids)
                time.sleep(0.01)

        await asyncio.to_thread(publish)
        out = await asyncio.gather(*readers)
        reads = fanout.reads
        await fanout.close()
        await client.aclose()
        return out, reads

    out, reads = asyncio.run(scenario())
    assert out == [list(range(steps))] * requests
    # Read alone, each request would cost a round trip per token: 600 here.
    assert reads <= 2 * steps + 5


def test_a_request_that_subscribes_while_the_read_blocks_gets_its_token_at_once(
    redis_server: RedisServer, streams: Streams
) -> None:
    async def scenario() -> float:
        client = connect_async(redis_server.url)
        fanout = TokenFanout(client, KEYS, block_ms=BLOCK_MS)
        fanout.subscribe("idle")  # nothing will come for it: the shared read blocks
        await asyncio.sleep(0.05)
        fanout.subscribe("late")
        streams.publish_token("late", TokenEvent(index=0, token=7, finish_reason=FinishReason.STOP))
        start = time.perf_counter()
        events = await fanout.read("late", block_ms=BLOCK_MS)
        waited = time.perf_counter() - start
        assert [e.token for e in events] == [7]
        await fanout.close()
        await client.aclose()
        return waited

    assert asyncio.run(scenario()) < BLOCK_MS / 1000 / 2


def test_a_malformed_entry_fails_only_the_request_it_belongs_to(
    redis_server: RedisServer, streams: Streams
) -> None:
    async def scenario() -> None:
        client = connect_async(redis_server.url)
        fanout = TokenFanout(client, KEYS, block_ms=BLOCK_MS)
        fanout.subscribe("bad")
        fanout.subscribe("good")
        await client.xadd(KEYS.tokens("bad"), {"v": "1", "i": "not-an-index"})
        streams.publish_token("good", TokenEvent(index=0, token=3))
        await asyncio.sleep(0.1)
        with pytest.raises(Exception, match="i"):
            await fanout.read("bad", block_ms=BLOCK_MS)
        assert [e.token for e in await fanout.read("good", block_ms=BLOCK_MS)] == [3]
        await fanout.close()
        await client.aclose()

    asyncio.run(scenario())


def test_block_ms_must_be_a_positive_integer(redis_server: RedisServer) -> None:
    client = connect_async(redis_server.url)
    with pytest.raises(ValueError, match="block_ms"):
        TokenFanout(client, KEYS, block_ms=0)
