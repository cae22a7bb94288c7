"""Fixtures for the data-plane tests: a private redis-server, the worker side of the
protocol, and the router served by uvicorn on loopback.

``ProtocolWorker`` simulates the prefill and decode pools through the same protocol
helpers the real workers use (read through the consumer groups, publish tokens,
hand off, acknowledge), with a fixed token rule instead of a model. It stands in
for the real workers in the router and load-generator tests.
"""

from __future__ import annotations

import logging
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest
import redis
import uvicorn

from queueing.pools import Pool
from workers.protocol import (
    DecodeRequest,
    Delivery,
    FinishReason,
    KeySpace,
    KvTransportName,
    Streams,
    TokenEvent,
    connect,
)
from workers.redis_util import RedisServer
from workers.registry import Heartbeat, Registry, WorkerInfo
from workers.router import RouterConfig, create_router_app

logger = logging.getLogger(__name__)
KEYS = KeySpace("test")


def byte_tokenize(text: str) -> list[int]:
    """A byte-level tokenizer: one token per UTF-8 byte (vocabulary 256)."""
    return list(text.encode("utf-8"))


def byte_detokenize(ids: Sequence[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def letter(prompt: Sequence[int], index: int) -> int:
    """The simulated model: output token ``index`` is a lowercase letter."""
    return ord("a") + (prompt[-1] + index) % 26


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def streams(redis_server: RedisServer) -> Iterator[Streams]:
    client = connect(redis_server.url)
    s = Streams(client, KEYS)
    s.ensure_groups()
    yield s
    client.close()


@dataclass
class _Active:
    delivery: Delivery[DecodeRequest]
    next_index: int = 1


@dataclass
class ProtocolWorker:
    """One simulated prefill worker and one decode worker, each a thread.

    Prefill: ``prefill_s`` per request, publishes token 0 and hands off (or
    finishes when ``max_tokens`` is 1). Decode: a batch of every admitted request,
    one token each per step of ``tpot_s``. A prompt whose first token is
    ``fail_token`` gets an error event instead. Both register heartbeats.
    """

    url: str
    keys: KeySpace = KEYS
    prefill_s: float = 0.0
    tpot_s: float = 0.001
    fail_token: int | None = None
    next_token: Callable[[Sequence[int], int], int] = letter
    name: str = "sim"
    prefilled: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _beats: list[Heartbeat] = field(default_factory=list)

    def start(self) -> ProtocolWorker:
        for pool, loop in ((Pool.PREFILL, self._prefill_loop), (Pool.DECODE, self._decode_loop)):
            client = connect(self.url, timeout_s=2.0)
            info = WorkerInfo(
                pool=pool, worker_id=f"{self.name}-{pool.value}", ready=True, capacity=64
            )
            beat = Heartbeat(
                Registry(client, self.keys, ttl_s=2.0), partial(_same, info), interval_s=0.2
            )
            self._beats.append(beat.start())
            thread = threading.Thread(
                target=self._guard, args=(loop, Streams(client, self.keys)), daemon=True
            )
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        for beat in self._beats:
            beat.stop()

    def _guard(self, loop: Callable[[Streams], None], s: Streams) -> None:
        while not self._stop.is_set():
            try:
                loop(s)
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.05)  # Redis is down: wait for it, as a worker does

    def _prefill_loop(self, s: Streams) -> None:
        consumer = f"{self.name}-prefill"
        while not self._stop.is_set():
            for d in s.read_prefill(consumer, count=4, block_ms=50):
                req = d.message
                if s.cancelled([req.request_id]):
                    s.ack(Pool.PREFILL, [d.entry_id])
                    continue
                time.sleep(self.prefill_s)
                self.prefilled += 1
                if req.prompt_token_ids[0] == self.fail_token:
                    s.publish_token(req.request_id, TokenEvent.failure(0, "simulated failure"))
                    s.ack(Pool.PREFILL, [d.entry_id])
                    continue
                token = self.next_token(req.prompt_token_ids, 0)
                done = req.max_tokens == 1
                s.publish_token(
                    req.request_id,
                    TokenEvent(
                        index=0, token=token, finish_reason=FinishReason.LENGTH if done else None
                    ),
                )
                if done:
                    s.ack(Pool.PREFILL, [d.entry_id])
                    continue
                s.hand_off_to_decode(
                    d.entry_id,
                    DecodeRequest(
                        request=req,
                        first_token=token,
                        kv_transport=KvTransportName.REDIS,
                        kv_handle="simulated",
                        prefill_worker=consumer,
                        prefill_done_s=time.time(),
                    ),
                )

    def _decode_loop(self, s: Streams) -> None:
        consumer = f"{self.name}-decode"
        active: list[_Active] = []
        while not self._stop.is_set():
            new = s.read_decode(consumer, count=64, block_ms=None if active else 50)
            active += [_Active(d) for d in new]
            if not active:
                continue
            gone = s.cancelled([a.delivery.message.request.request_id for a in active])
            events: list[tuple[str, TokenEvent]] = []
            finished: list[_Active] = []
            for a in active:
                req = a.delivery.message.request
                if req.request_id in gone:
                    finished.append(a)
                    continue
                last = a.next_index == req.max_tokens - 1
                events.append(
                    (
                        req.request_id,
                        TokenEvent(
                            index=a.next_index,
                            token=self.next_token(req.prompt_token_ids, a.next_index),
                            finish_reason=FinishReason.LENGTH if last else None,
                        ),
                    )
                )
                a.next_index += 1
                if last:
                    finished.append(a)
            if events:
                s.publish_tokens(events)
            if finished:
                s.ack(Pool.DECODE, [a.delivery.entry_id for a in finished])
                active = [a for a in active if a not in finished]
            time.sleep(self.tpot_s)


def _same(info: WorkerInfo) -> WorkerInfo:
    return info


@pytest.fixture
def worker(redis_server: RedisServer) -> Iterator[ProtocolWorker]:
    w = ProtocolWorker(redis_server.url).start()
    yield w
    w.stop()


class ServerThread:
    """An ASGI app served by uvicorn on a free loopback port, in a thread."""

    def __init__(self, app: Any) -> None:
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto
        # says TCP, and accepted sockets inherit it. Without it, Nagle's algorithm and
        # delayed ACKs hold each streamed chunk back by ~40 ms.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the router did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


RouterFactory = Callable[..., ServerThread]


@pytest.fixture
def start_router(redis_server: RedisServer) -> Iterator[RouterFactory]:
    """Start routers on this test's Redis: ``start_router(**RouterConfig overrides)``."""
    started: list[ServerThread] = []

    def start(**overrides: Any) -> ServerThread:
        settings: dict[str, Any] = {
            "redis_url": redis_server.url,
            "max_context_tokens": 512,
            "vocab_size": 256,
            "model_name": "tiny",
            "key_prefix": KEYS.prefix,
            "request_timeout_s": 10.0,
            "poll_block_ms": 100,
            **overrides,
        }
        app = create_router_app(
            RouterConfig(**settings), tokenize=byte_tokenize, detokenize=byte_detokenize
        )
        server = ServerThread(app).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
