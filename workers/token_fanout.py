"""One blocking read of the token streams for all the router's requests in flight.

A request read alone costs a Redis round trip, a reply to parse and a task wake-up
per token it streams: at a few hundred tokens per second that is most of the
router's CPU. ``TokenFanout`` keeps one ``XREAD BLOCK`` over every subscribed
request's ``tokens`` stream (and a private wake-up stream) and hands each
request what arrived for it, so one round trip serves every token that came in
the meantime, whichever requests they belong to.

A request that subscribes while the read blocks would wait for the next token of
another request; the subscription adds an entry to the wake-up stream (kept at
one entry, with a TTL so that a router that died leaves nothing behind), which
ends the blocking read at once, and the next read includes the new stream.

Errors: a Redis error of the shared read goes to every request waiting then (each
fails as it did when it read alone); a malformed entry fails only the request
whose stream it is in.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass, field

import anyio
import redis
import redis.asyncio

from workers.protocol import KeySpace, ProtocolError, TokenEvent, decode_token

# A wake-up stream outlives its router by at most this long.
_WAKE_TTL_S = 60
# After a failed shared read, the next one waits this long: a dead Redis is not
# retried in a tight loop (the waiting requests have their error already).
_ERROR_PAUSE_S = 0.05
_COUNT_PER_STREAM = 1024


@dataclass
class _Subscription:
    key: str
    last_id: str = "0-0"
    events: list[TokenEvent] = field(default_factory=list)
    error: BaseException | None = None
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class TokenFanout:
    """The token streams of the requests in flight, read together (see the module)."""

    def __init__(self, client: redis.asyncio.Redis, keys: KeySpace, *, block_ms: int) -> None:
        if isinstance(block_ms, bool) or not isinstance(block_ms, int) or block_ms < 1:
            raise ValueError(f"block_ms: expected an integer >= 1, got {block_ms!r}")
        self.client = client
        self.keys = keys
        self.block_ms = block_ms
        self.wake_key = f"{keys.prefix}:router-wake:{uuid.uuid4().hex}"
        self._wake_last = "0-0"
        self._subs: dict[str, _Subscription] = {}  # tokens key -> subscription
        self._task: asyncio.Task[None] | None = None
        self._blocked = False  # the shared read is waiting in Redis
        self.reads = 0  # shared reads issued (for tests and benches)

    def subscribe(self, request_id: str) -> None:
        """Start reading ``request_id``'s tokens (from its first)."""
        key = self.keys.tokens(request_id)
        self._subs[key] = _Subscription(key)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        elif self._blocked:
            self._blocked = False  # one wake-up per blocking read is enough
            asyncio.get_running_loop().create_task(self._wake())

    def unsubscribe(self, request_id: str) -> None:
        self._subs.pop(self.keys.tokens(request_id), None)

    async def read(self, request_id: str, *, block_ms: int) -> list[TokenEvent]:
        """What arrived for ``request_id`` since the last call, waiting up to
        ``block_ms`` for something; raises the Redis or protocol error that ended
        its read."""
        sub = self._subs[self.keys.tokens(request_id)]
        if not sub.events and sub.error is None:
            sub.arrived.clear()
            with anyio.move_on_after(block_ms / 1000):
                await sub.arrived.wait()
        if sub.error is not None:
            error, sub.error = sub.error, None
            raise error
        events, sub.events = sub.events, []
        return events

    async def close(self) -> None:
        # Nothing left to read: the loop ends even if the cancellation reaches it as
        # the connection error the client turns it into.
        self._subs.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        with contextlib.suppress(redis.RedisError, OSError):
            await self.client.delete(self.wake_key)

    async def _wake(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.xadd(self.wake_key, {"w": "1"}, maxlen=1, approximate=False)
        pipe.expire(self.wake_key, _WAKE_TTL_S)
        with contextlib.suppress(redis.RedisError, OSError):
            await pipe.execute()

    async def _run(self) -> None:
        while self._subs:
            streams = {key: sub.last_id for key, sub in self._subs.items()}
            streams[self.wake_key] = self._wake_last
            self.reads += 1
            self._blocked = True
            try:
                reply = await self.client.xread(
                    streams,  # type: ignore[arg-type]
                    count=_COUNT_PER_STREAM,
                    block=self.block_ms,
                )
            except (redis.RedisError, OSError) as exc:
                self._blocked = False
                for sub in self._subs.values():
                    sub.error = exc
                    sub.arrived.set()
                await asyncio.sleep(_ERROR_PAUSE_S)
                continue
            self._blocked = False
            for raw_key, entries in reply.items() if isinstance(reply, dict) else reply or []:
                key = _text(raw_key)
                if entries and isinstance(entries[0], list):  # RESP3 nests once more
                    entries = entries[0]
                if key == self.wake_key:
                    self._wake_last = _text(entries[-1][0])
                    continue
                sub = self._subs.get(key)
                if sub is None:  # unsubscribed while the read was out
                    continue
                for entry_id, fields in entries:
                    sub.last_id = _text(entry_id)
                    try:
                        sub.events.append(decode_token(dict(fields or {})))
                    except ProtocolError as exc:
                        sub.error = exc
                        break
                sub.arrived.set()
