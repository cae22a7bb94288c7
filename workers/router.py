"""The router: an OpenAI-compatible API in front of the Redis data plane.

``POST /v1/completions`` and ``POST /v1/chat/completions`` validate the request,
tokenise a text prompt (chat: the messages rendered by the chat template,
``workers.router_chat``), queue a ``PrefillRequest`` on the prefill stream per
choice (``n`` of them, admission-limited), then read the token streams back (one
blocking read for all requests in flight, ``workers.token_fanout``) and answer — as
server-sent events ending in ``data: [DONE]`` with ``stream: true``, else as one
JSON body — with ``usage``. Stop strings (``workers.router_stop``) end a choice and
withdraw it from the workers.
``GET /v1/models``, ``/healthz`` (the process is up), ``/readyz`` (Redis answers
and at least one prefill and one decode worker is live), ``/metrics``. ``FrontDoor``
answers refusals (429 at the in-flight limit, 413 by ``Content-Length``) and
``/healthz`` before any other layer; ``workers.router_health`` answers the probes
from a process of their own, off this event loop.

Errors have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``:

| status | code | when |
|---|---|---|
| 400 | ``invalid_value``, ``invalid_json``, ``context_length_exceeded``, ``unsupported`` | |
|     |  | a bad request (``param`` names the field) |
| 404 | ``model_not_found``, ``not_found`` | ``model`` names another model; no such path |
| 413 | ``request_too_large`` | the body exceeds ``max_body_bytes`` (checked before it is read) |
| 429 | ``queue_full`` (+ ``Retry-After``) | the prefill stream holds ``max_queued_requests``, or |
|     |                                   | this router serves ``max_inflight_requests`` already |
| 503 | ``no_workers`` (+ ``Retry-After``) | a pool has no ready worker in the registry |
| 503 | ``redis_unavailable`` (+ ``Retry-After``) | Redis unreachable: at once, no retry loop |
| 504 | ``request_timeout`` | no complete answer within ``request_timeout_s`` |
| 500 | ``worker_error``, ``protocol_error`` | a worker failed, or broke the protocol |

A streaming request that fails after its headers went out ends with an error
event (the same body) and then ``data: [DONE]``; one whose next token is owed by a
pool that has had no live worker for ``no_worker_grace_s`` ends that way at once
(503 ``no_workers``) rather than at its timeout.

Admission comes before exhaustion: a router serves at most ``max_inflight_requests``
at once, below its Redis connection pool (a request in flight may hold one
while it is admitted or cleaned up; its tokens come through the shared read), so
overload is a 429, and a 503
``redis_unavailable`` means Redis itself failed. Text prompts are tokenised in a
worker thread, never on the event loop. A client that goes away cancels
its request (``AsyncStreams.cancel``: workers skip it).

Every request gets a seed (the client's, or a fresh random one), so a request that
a worker re-runs after another died samples the same tokens; duplicate indexes are
dropped here.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.to_thread
import redis
import redis.asyncio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from queueing.pools import Pool
from queueing.profile import exceeds_context
from workers.protocol import (
    MAX_STREAM_LEN,
    AsyncStreams,
    FinishReason,
    KeySpace,
    PrefillRequest,
    ProtocolError,
    TokenEvent,
    connect_async,
)
from workers.registry import AsyncRegistry
from workers.router_chat import DEFAULT_CHAT_TEMPLATE, ChatError, ChatTemplate, parse_messages
from workers.router_health import LoopWatch, beat_loop, readiness_body
from workers.router_metrics import CONTENT_TYPE, Outcome, RouterMetrics
from workers.router_stop import StopMatcher
from workers.token_fanout import TokenFanout

logger = logging.getLogger(__name__)

Tokenize = Callable[[str], Sequence[int]]
Detokenize = Callable[[Sequence[int]], str]
_MAX_SEED = 2**63 - 1
_REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)
# Connections of the pool kept for what is not a request in flight: admission's own
# XADD while it is decided, readiness, /metrics, cleanup.
_RESERVED_CONNECTIONS = 16
# What a request body carries besides its prompt (the other fields, JSON syntax).
_BODY_OVERHEAD_BYTES = 16_384
# A refused body on a connection that closes after the answer is read and dropped up
# to this size, so the client reads its 413; beyond, it is answered at once (a reset).
_MAX_DRAIN_BYTES = 64 * 1024 * 1024
COMPLETION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# How often the serving loop stamps its LoopWatch (a stall shows within this).
_LOOP_BEAT_S = 0.5


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """How the router talks to Redis and what it admits.

    ``max_context_tokens``: the model's context; prompt + ``max_tokens`` beyond it
    is a 400. ``vocab_size``: token-id prompts must be below it (``None``: unchecked).
    ``max_queued_requests``: admission limit on the prefill stream (waiting plus
    being prefilled). ``request_timeout_s``: from arrival to the last token.
    ``poll_block_ms``: one blocking read of a token stream (the timeout is checked
    between reads). ``redis_timeout_s``: any other Redis call.
    ``max_inflight_requests``: requests this router serves at once (429 beyond); it
    must leave room in ``max_redis_connections``, which each of them holds while it
    waits for tokens. ``body_bytes_per_token``: the request-size limit is this many
    bytes per context token plus 16 KiB (a token id as JSON takes at most 11 bytes,
    a token's text rarely over 8 characters even \\u-escaped 6 bytes each).
    ``liveness_refresh_s``: how old the router's view of the live workers may be.
    ``no_worker_grace_s``: how long a started request waits for a pool with no live
    worker (one being replaced) before it fails.
    """

    redis_url: str
    max_context_tokens: int
    model_name: str = "sara"
    vocab_size: int | None = None
    max_queued_requests: int = 1024
    request_timeout_s: float = 300.0
    retry_after_s: int = 1
    redis_timeout_s: float = 2.0
    poll_block_ms: int = 500
    max_redis_connections: int = 512
    max_inflight_requests: int = 480
    body_bytes_per_token: int = 32
    liveness_refresh_s: float = 1.0
    no_worker_grace_s: float = 2.0
    key_prefix: str = "sara"
    default_max_tokens: int = 16

    def __post_init__(self) -> None:
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url: expected redis://HOST:PORT[/DB], got {self.redis_url!r}")
        if not self.model_name:
            raise ValueError("model_name: must not be empty")
        for name, low in (
            ("max_context_tokens", 2),
            ("max_queued_requests", 1),
            ("retry_after_s", 1),
            ("poll_block_ms", 1),
            ("max_redis_connections", 1),
            ("max_inflight_requests", 1),
            ("body_bytes_per_token", 1),
            ("default_max_tokens", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
        if self.vocab_size is not None and not (
            isinstance(self.vocab_size, int) and self.vocab_size >= 1
        ):
            raise ValueError(
                f"vocab_size: expected an integer >= 1 or None, got {self.vocab_size!r}"
            )
        if self.max_queued_requests >= MAX_STREAM_LEN // 2:
            raise ValueError(
                f"max_queued_requests: must stay below {MAX_STREAM_LEN // 2} (the streams are "
                f"capped at about {MAX_STREAM_LEN}), got {self.max_queued_requests}"
            )
        if self.max_inflight_requests > self.max_redis_connections - _RESERVED_CONNECTIONS:
            raise ValueError(
                f"max_inflight_requests: {self.max_inflight_requests} must leave "
                f"{_RESERVED_CONNECTIONS} of max_redis_connections ({self.max_redis_connections}) "
                "free, or overload runs the Redis pool dry before it is refused"
            )
        for name in ("request_timeout_s", "redis_timeout_s", "liveness_refresh_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: expected a number of seconds > 0, got {value!r}")
        grace = self.no_worker_grace_s
        if not (isinstance(grace, int | float) and math.isfinite(grace) and grace >= 0):
            raise ValueError(f"no_worker_grace_s: expected seconds >= 0, got {grace!r}")
        KeySpace(self.key_prefix)  # validates

    @property
    def max_body_bytes(self) -> int:
        """The request-size limit: the context's worth of tokens, and the other fields."""
        return _BODY_OVERHEAD_BYTES + self.body_bytes_per_token * self.max_context_tokens


# --------------------------------------------------------------------------- the API edge


# OpenAI's limits: n up to 128 choices, up to 4 stop sequences.
MAX_CHOICES = 128
MAX_STOP_SEQUENCES = 4


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class _SamplingBody(BaseModel):
    """The fields both endpoints share. Unknown fields are ignored; unsupported ones
    rejected."""

    model_config = ConfigDict(extra="ignore")

    # Strict types: "0.5" is not a temperature, "yes" not a boolean.
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat = Field(default=1.0, ge=0, le=2)
    top_p: StrictFloat = Field(default=1.0, gt=0, le=1)
    seed: StrictInt | None = Field(default=None, ge=0, le=_MAX_SEED)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # vLLM's extension: generate max_tokens regardless of EOS
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: StrictStr | list[StrictStr] | None = None


class CompletionBody(_SamplingBody):
    """``POST /v1/completions``."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    best_of: StrictInt | None = None
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None


class ChatBody(_SamplingBody):
    """``POST /v1/chat/completions``; ``messages`` is checked by ``parse_messages``
    (its errors name the message and the field)."""

    messages: Any
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class Endpoint(enum.Enum):
    """Which API a request came through: its ``object`` names and chunk shape."""

    COMPLETIONS = "text_completion"
    CHAT = "chat.completion"


@dataclass(frozen=True, kw_only=True)
class _Ask:
    """A validated request, whichever endpoint it came through."""

    endpoint: Endpoint
    ids: tuple[int, ...]
    max_tokens: int
    n: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    temperature: float
    top_p: float
    seed: int | None
    ignore_eos: bool


class ApiError(Exception):
    """An answer with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        code: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _invalid(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, type="invalid_request_error", code=code, param=param)


class IncrementalDetokenizer:
    """Text deltas for a growing token list, without splitting a multi-byte character.

    Decodes a short window (from ``prefix``) instead of the whole output each time;
    text that ends in U+FFFD (an incomplete byte sequence) is held back until the
    next token completes it, or until ``flush``.
    """

    def __init__(self, detokenize: Detokenize) -> None:
        self._detokenize = detokenize
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text was emitted

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self._detokenize(self.ids[self._prefix : self._read])
        after = self._detokenize(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        before = self._detokenize(self.ids[self._prefix : self._read])
        after = self._detokenize(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]


# --------------------------------------------------------------------------- one request


@dataclass
class _Token:
    token: int
    text: str


@dataclass
class _End:
    finish_reason: Literal["stop", "length"] | None = None
    error: ApiError | None = None
    text: str = ""


@dataclass
class _Generation:
    """The token-reading side of one admitted request."""

    router: Router
    req: PrefillRequest
    entry_id: str
    arrival: float  # router clock
    detok: IncrementalDetokenizer
    stop: StopMatcher
    tokens: list[int] = field(default_factory=list)
    first_at: float | None = None
    last_at: float | None = None
    outcome: Outcome | None = None  # set once the request ended
    # Ended by a stop string while the workers still generate: they are told to stop.
    cut_short: bool = False
    released: bool = False

    def release(self) -> None:
        """Give back its admission slot (once, however the request ended)."""
        if not self.released:
            self.released = True
            self.router.inflight_requests -= 1

    async def pieces(self) -> AsyncGenerator[_Token | _End, None]:
        """Tokens in order, then one ``_End``. Cleans up however it stops."""
        router = self.router
        router.metrics.inflight.inc()
        router.fanout.subscribe(self.req.request_id)
        try:
            async for piece in self._read():
                yield piece
        finally:
            router.fanout.unsubscribe(self.req.request_id)
            router.metrics.inflight.dec()
            if self.outcome is None:  # the consumer stopped early: the client left
                self.outcome = Outcome.CANCELLED
                router.metrics.ended(Outcome.CANCELLED)
            with anyio.move_on_after(router.config.redis_timeout_s, shield=True):
                try:
                    if self.outcome is Outcome.OK and not self.cut_short:
                        await router.streams.finish(self.req.request_id)
                    else:
                        await router.streams.cancel(self.req.request_id, self.entry_id)
                except redis.RedisError as exc:
                    logger.info("cleanup of %s skipped: %s", self.req.request_id, exc)
            self.release()

    async def _read(self) -> AsyncIterator[_Token | _End]:
        router, config = self.router, self.router.config
        deadline = self.arrival + config.request_timeout_s
        while True:
            remaining = deadline - router.clock()
            if remaining <= 0:
                yield self._fail(Outcome.TIMEOUT, router.timeout_error(len(self.tokens)))
                return
            block_ms = max(1, min(config.poll_block_ms, math.ceil(remaining * 1000)))
            try:
                events = await router.fanout.read(self.req.request_id, block_ms=block_ms)
            except (*_REDIS_ERRORS, OSError) as exc:
                yield self._fail(Outcome.UNAVAILABLE, router.unavailable(exc))
                return
            except (ProtocolError, redis.ResponseError) as exc:
                yield self._fail(Outcome.ERROR, _protocol_error(str(exc)))
                return
            for event in events:
                piece = self._accept(event)
                if piece is not None:
                    yield piece
                if isinstance(piece, _End):
                    return
            if not events:
                # The next token is owed by the prefill pool until the first one came.
                owed = Pool.PREFILL if not self.tokens else Pool.DECODE
                missing_s = await router.liveness.without_workers_s(owed)
                if missing_s is not None and missing_s >= config.no_worker_grace_s:
                    yield self._fail(Outcome.NO_WORKERS, router.no_workers([owed]))
                    return

    def _accept(self, event: TokenEvent) -> _Token | _End | None:
        if event.error is not None:  # final whatever its index
            return self._fail(
                Outcome.ERROR,
                ApiError(
                    500,
                    f"a worker failed on this request: {event.error}",
                    type="server_error",
                    code="worker_error",
                ),
            )
        n = len(self.tokens)
        if event.index < n:  # a re-run after a worker died republishes
            return None
        if event.index > n:
            return self._fail(
                Outcome.ERROR,
                _protocol_error(f"token stream skipped from index {n} to {event.index}"),
            )
        assert event.token is not None  # only error events have none
        now = self.router.clock()
        if self.first_at is None:
            self.first_at = now
            self.router.metrics.first_token(ttft_s=now - self.arrival)
        self.last_at = now
        self.tokens.append(event.token)
        text = self.detok.add(event.token)
        # A worker that overruns max_tokens is cut here.
        last = event.finish_reason is not None or len(self.tokens) >= self.req.max_tokens
        if last:
            text += self.detok.flush()
        released, stopped = self.stop.feed(text)
        reason: Literal["stop", "length"]
        if stopped:
            reason, self.cut_short = "stop", not last
        elif not last:
            return _Token(event.token, released)
        else:
            released += self.stop.flush()
            reason = "stop" if event.finish_reason is FinishReason.STOP else "length"
        self.outcome = Outcome.OK
        n_out = len(self.tokens)
        tpot = None if n_out < 2 else (self.last_at - self.first_at) / (n_out - 1)
        self.router.metrics.finished(output_tokens=n_out, tpot_s=tpot)
        return _End(finish_reason=reason, text=released)

    def _fail(self, outcome: Outcome, error: ApiError) -> _End:
        self.outcome = outcome
        self.router.metrics.ended(outcome)
        if outcome is Outcome.TIMEOUT and self.first_at is None:
            # A lower bound of its TTFT, so that overload shows in the P99.
            self.router.metrics.first_token(ttft_s=self.router.clock() - self.arrival)
        return _End(error=error, text=self.detok.flush())


@dataclass
class _Admitted:
    """One API request: its ``n`` generations (one per choice), queued."""

    ask: _Ask
    response_id: str
    created_s: int  # Unix seconds of its arrival
    gens: list[_Generation] = field(default_factory=list)
    started: set[int] = field(default_factory=set)  # chat choices whose role was sent

    def release(self) -> None:
        for gen in self.gens:
            gen.release()

    async def withdraw(self) -> None:
        """Admission failed part-way (a later choice refused): cancel those queued."""
        for gen in self.gens:
            gen.outcome = Outcome.CANCELLED
            gen.router.metrics.ended(Outcome.CANCELLED)
            with anyio.move_on_after(gen.router.config.redis_timeout_s, shield=True):
                try:
                    await gen.router.streams.cancel(gen.req.request_id, gen.entry_id)
                except redis.RedisError as exc:
                    logger.info("cleanup of %s skipped: %s", gen.req.request_id, exc)
            gen.release()

    async def pieces(self) -> AsyncGenerator[tuple[int, _Token | _End], None]:
        """Every choice's pieces, tagged with its index, as they come; each choice
        ends with one ``_End``. Stopping early withdraws the choices still running."""
        if len(self.gens) == 1:
            async with aclosing(self.gens[0].pieces()) as only:
                async for piece in only:
                    yield 0, piece
            return
        queue: asyncio.Queue[tuple[int, _Token | _End]] = asyncio.Queue()

        async def pump(index: int, gen: _Generation) -> None:
            try:
                async with aclosing(gen.pieces()) as pieces:
                    async for piece in pieces:
                        queue.put_nowait((index, piece))
            except Exception as exc:  # a bug: this choice fails instead of hanging the rest
                logger.exception("choice %d of %s failed", index, self.response_id)
                queue.put_nowait((index, _End(error=_protocol_error(repr(exc)))))

        # Tasks, not a task group: a generator must not yield inside one.
        tasks = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(self.gens)]
        try:
            ended = 0
            while ended < len(tasks):
                index, piece = await queue.get()
                ended += isinstance(piece, _End)
                yield index, piece
        finally:
            for task in tasks:
                task.cancel()
            # Each generation cleans up in its own task (bounded by redis_timeout_s).
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)


def _protocol_error(message: str) -> ApiError:
    return ApiError(
        500,
        f"the data plane broke the protocol: {message}",
        type="server_error",
        code="protocol_error",
    )


# --------------------------------------------------------------------------- the router


class Liveness:
    """The router's view of the registry, at most ``liveness_refresh_s`` old.

    One refresh at a time for all requests (a lock), so a thousand waiting streams
    cost one registry read per interval, not one each. While Redis does not answer
    nothing is known, and nothing is concluded: the Redis errors speak for themselves.
    """

    def __init__(self, router: Router) -> None:
        self.router = router
        self._lock = anyio.Lock()
        self._at: float | None = None  # router clock of the last refresh
        self._ready: dict[Pool, int] = {}
        self._live: dict[Pool, int] = {}
        self._empty_since: dict[Pool, float] = {}  # router clock: no live worker since

    async def _refresh(self) -> bool:
        router = self.router
        async with self._lock:
            now = router.clock()
            if self._at is not None and now - self._at < router.config.liveness_refresh_s:
                return True
            try:
                with anyio.fail_after(router.config.redis_timeout_s):
                    listed = {pool: await router.registry.live(pool) for pool in Pool}
            except (redis.RedisError, TimeoutError):
                self._at = None
                self._empty_since.clear()
                return False
            self._at = now
            for pool, workers in listed.items():
                self._ready[pool] = sum(w.ready for w in workers)
                self._live[pool] = len(workers)
                if workers:
                    self._empty_since.pop(pool, None)
                else:
                    self._empty_since.setdefault(pool, now)
            return True

    async def pools_without_ready_workers(self) -> list[Pool]:
        """Pools no new request can be served by now (empty when unknown)."""
        if not await self._refresh():
            return []
        return [pool for pool in Pool if self._ready.get(pool, 0) == 0]

    async def without_workers_s(self, pool: Pool) -> float | None:
        """How long ``pool`` has had no live worker at all; ``None`` if it has one."""
        if not await self._refresh():
            return None
        since = self._empty_since.get(pool)
        return None if since is None else self.router.clock() - since


class Router:
    """The request path, independent of the web framework's routing."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        tokenize: Tokenize,
        detokenize: Detokenize,
        metrics: RouterMetrics,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        new_seed: Callable[[], int],
        chat_template: ChatTemplate = DEFAULT_CHAT_TEMPLATE,
        tokenize_chat: Tokenize | None = None,
    ) -> None:
        self.config = config
        self.tokenize = tokenize
        self.detokenize = detokenize
        self.chat_template = chat_template
        self.tokenize_chat = tokenize if tokenize_chat is None else tokenize_chat
        self.metrics = metrics
        self.clock = clock
        self.wall_clock = wall_clock
        self.new_seed = new_seed
        self.keys = KeySpace(config.key_prefix)
        self._client: redis.asyncio.Redis | None = None
        self._fanout: TokenFanout | None = None
        self.created = int(wall_clock())
        self.inflight_requests = 0  # admitted and not yet released (max_inflight_requests)
        self.liveness = Liveness(self)

    # The client is made inside the serving event loop (lifespan, or first use).
    @property
    def client(self) -> redis.asyncio.Redis:
        if self._client is None:
            self._client = connect_async(
                self.config.redis_url,
                timeout_s=self.config.redis_timeout_s + self.config.poll_block_ms / 1000,
                max_connections=self.config.max_redis_connections,
            )
        return self._client

    @property
    def fanout(self) -> TokenFanout:
        if self._fanout is None:
            self._fanout = TokenFanout(self.client, self.keys, block_ms=self.config.poll_block_ms)
        return self._fanout

    @property
    def streams(self) -> AsyncStreams:
        return AsyncStreams(self.client, self.keys)

    @property
    def registry(self) -> AsyncRegistry:
        return AsyncRegistry(self.client, self.keys)

    async def close(self) -> None:
        if self._fanout is not None:
            await self._fanout.close()
            self._fanout = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def unavailable(self, exc: BaseException) -> ApiError:
        return ApiError(
            503,
            f"the data plane is unavailable (Redis at {self.config.redis_url}: "
            f"{exc or type(exc).__name__}); retry later",
            type="service_unavailable",
            code="redis_unavailable",
            headers={"Retry-After": str(self.config.retry_after_s)},
        )

    def no_workers(self, pools: Sequence[Pool]) -> ApiError:
        names = " or ".join(p.value for p in pools)
        return ApiError(
            503,
            f"no live {names} worker is registered; retry after {self.config.retry_after_s} s",
            type="service_unavailable",
            code="no_workers",
            headers={"Retry-After": str(self.config.retry_after_s)},
        )

    def queue_full(self, why: str) -> ApiError:
        return ApiError(
            429,
            f"{why}; retry after {self.config.retry_after_s} s",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(self.config.retry_after_s)},
        )

    def timeout_error(self, tokens: int) -> ApiError:
        return ApiError(
            504,
            f"no complete answer within the request timeout of {self.config.request_timeout_s:g} "
            f"s ({tokens} tokens received)",
            type="timeout",
            code="request_timeout",
        )

    async def _tokenized(
        self, text: Any, tokenize: Callable[[Any], Sequence[int]], param: str
    ) -> list[int]:
        try:
            # A worker thread: a long prompt must not stall every other stream.
            tokens = await anyio.to_thread.run_sync(tokenize, text)
            return [int(t) for t in tokens]
        except ChatError:
            raise  # the template refused the messages: said as such by the caller
        except (ValueError, TypeError) as exc:
            raise _invalid(f"the {param} cannot be tokenised: {exc}", param) from exc

    async def prompt_ids(self, body: CompletionBody) -> list[int]:
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise _invalid(
                    "batched prompts are not supported: send one prompt per request",
                    "prompt",
                    "unsupported",
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise _invalid("prompt: must not be empty", "prompt")
            ids = await self._tokenized(prompt, self.tokenize, "prompt")
        else:
            ids = list(prompt)
        if not ids:
            raise _invalid("prompt: must not be empty", "prompt")
        vocab = self.config.vocab_size
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise _invalid(
                f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt"
            )
        return ids

    async def chat_ids(self, body: ChatBody) -> list[int]:
        template, tokenize = self.chat_template, self.tokenize_chat

        def rendered(messages: Any) -> Sequence[int]:
            return tokenize(template.render(messages))

        try:
            # Rendered with the tokenising, in a worker thread: a long conversation
            # through a Jinja template must not stall the streams either.
            ids = await self._tokenized(parse_messages(body.messages), rendered, "messages")
        except ChatError as exc:
            raise _invalid(
                str(exc), exc.param, "unsupported" if exc.unsupported else "invalid_value"
            ) from exc
        if not ids:
            raise _invalid("messages: the chat template rendered them to no tokens", "messages")
        return ids

    def _check_model(self, body: _SamplingBody) -> None:
        if body.model is not None and body.model != self.config.model_name:
            raise ApiError(
                404,
                f"model {body.model!r} does not exist; this router serves "
                f"{self.config.model_name!r}",
                type="invalid_request_error",
                code="model_not_found",
                param="model",
            )

    def _ask(self, body: _SamplingBody, endpoint: Endpoint, ids: list[int]) -> _Ask:
        """The fields both endpoints share, checked; ``ids`` the prompt's tokens."""
        if (
            body.max_tokens is not None
            and body.max_completion_tokens is not None
            and body.max_tokens != body.max_completion_tokens
        ):
            raise _invalid(
                f"max_completion_tokens: {body.max_completion_tokens} disagrees with max_tokens "
                f"({body.max_tokens}); send one of them",
                "max_completion_tokens",
            )
        max_tokens = body.max_completion_tokens or body.max_tokens or self.config.default_max_tokens
        if body.stream_options is not None and not body.stream:
            raise _invalid("stream_options: only allowed with stream: true", "stream_options")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
        if len(stops) > MAX_STOP_SEQUENCES:
            raise _invalid(
                f"stop: at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", "stop"
            )
        if any(not s for s in stops):
            raise _invalid("stop: a stop sequence must not be empty", "stop")
        if body.n > self.config.max_inflight_requests:
            raise _invalid(
                f"n: this router serves at most {self.config.max_inflight_requests} requests "
                f"at once, so n={body.n} can never be admitted",
                "n",
            )
        ctx = self.config.max_context_tokens
        # The one context rule, shared with the simulator and the capacity model.
        if exceeds_context(len(ids), max_tokens, ctx):
            param = "messages" if endpoint is Endpoint.CHAT else "prompt"
            raise _invalid(
                f"this model's context is {ctx} tokens, but the {param} ({len(ids)} tokens) "
                f"plus max_tokens ({max_tokens}) asks for {len(ids) + max_tokens}",
                param,
                "context_length_exceeded",
            )
        return _Ask(
            endpoint=endpoint,
            ids=tuple(ids),
            max_tokens=max_tokens,
            n=body.n,
            stop=tuple(stops),
            stream=body.stream,
            include_usage=body.stream_options is not None and body.stream_options.include_usage,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
        )

    async def check(self, body: CompletionBody) -> _Ask:
        """The request of ``/v1/completions``, or the 400/404 that says what is wrong."""
        self._check_model(body)
        for name, bad in (
            ("best_of", body.best_of not in (None, 1)),
            ("echo", body.echo),
            ("logprobs", body.logprobs is not None),
            ("suffix", bool(body.suffix)),
        ):
            if bad:
                raise _invalid(f"{name}: not supported by this server", name, "unsupported")
        return self._ask(body, Endpoint.COMPLETIONS, await self.prompt_ids(body))

    async def check_chat(self, body: ChatBody) -> _Ask:
        """The request of ``/v1/chat/completions``, or the 400/404 that says what is wrong."""
        self._check_model(body)
        response_format = (body.response_format or {}).get("type", "text")
        for name, bad in (
            ("logprobs", body.logprobs),
            ("top_logprobs", body.top_logprobs is not None),
            ("tools", bool(body.tools)),
            ("functions", bool(body.functions)),
            ("tool_choice", body.tool_choice not in (None, "none", "auto")),  # auto: no tools
            ("response_format", response_format != "text"),
        ):
            if bad:
                raise _invalid(f"{name}: not supported by this server", name, "unsupported")
        return self._ask(body, Endpoint.CHAT, await self.chat_ids(body))

    async def admit(self, body: CompletionBody | ChatBody) -> _Admitted:
        """Validate and queue the request (``n`` of them for ``n`` choices); raises
        ``ApiError`` (400/404/429/503).

        ``sara_requests_total`` counts what the data plane was asked to serve and
        either queued or refused for want of capacity (429): the demand the
        controller plans on; ``n`` choices are ``n`` requests to the pools. Refusals
        because the data plane is broken (503: Redis down, no worker) are counted
        apart, in ``sara_requests_refused_total``: a client retrying against a dead
        Redis is not load the pools could absorb.
        """
        arrival, wall = self.clock(), self.wall_clock()
        try:
            ask = await (self.check_chat(body) if isinstance(body, ChatBody) else self.check(body))
        except ApiError:
            self.metrics.ended(Outcome.INVALID)
            raise
        if self.inflight_requests + ask.n > self.config.max_inflight_requests:
            for _ in range(ask.n):
                self.metrics.arrived(prompt_tokens=len(ask.ids))
                self.metrics.ended(Outcome.REJECTED)
            raise self.queue_full(
                f"this router serves {self.config.max_inflight_requests} requests already"
            )
        # Before any await: the check and the count are one step.
        self.inflight_requests += ask.n
        admitted = _Admitted(
            ask=ask,
            response_id=f"{'chatcmpl' if ask.endpoint is Endpoint.CHAT else 'cmpl'}-"
            f"{uuid.uuid4().hex}",
            created_s=int(wall),
        )
        try:
            missing = await self.liveness.pools_without_ready_workers()
            if missing:
                self.metrics.refused(Outcome.NO_WORKERS)
                raise self.no_workers(missing)
            for index in range(ask.n):
                admitted.gens.append(await self._enqueue(admitted, index, arrival, wall))
        except BaseException:
            self.inflight_requests -= ask.n - len(admitted.gens)
            await admitted.withdraw()
            raise
        return admitted

    async def _enqueue(
        self, admitted: _Admitted, index: int, arrival: float, wall: float
    ) -> _Generation:
        ask = admitted.ask
        # Distinct choices from one seed, the same ones on every run.
        seed = self.new_seed() if ask.seed is None else (ask.seed + index) % (_MAX_SEED + 1)
        req = PrefillRequest(
            request_id=admitted.response_id if ask.n == 1 else f"{admitted.response_id}.{index}",
            prompt_token_ids=ask.ids,
            max_tokens=ask.max_tokens,
            temperature=ask.temperature,
            top_p=ask.top_p,
            seed=seed,
            ignore_eos=ask.ignore_eos,
            arrival_s=wall,
            deadline_s=wall + self.config.request_timeout_s,
        )
        try:
            with anyio.fail_after(self.config.redis_timeout_s):
                entry_id = await self.streams.enqueue_prefill(
                    req, max_queued=self.config.max_queued_requests
                )
        except (redis.RedisError, TimeoutError) as exc:  # down, or refusing (OOM, READONLY)
            self.metrics.refused(Outcome.UNAVAILABLE)
            raise self.unavailable(exc) from exc
        self.metrics.arrived(prompt_tokens=len(ask.ids))
        if entry_id is None:
            self.metrics.ended(Outcome.REJECTED)
            raise self.queue_full(
                f"the prefill queue is full ({self.config.max_queued_requests} requests)"
            )
        return _Generation(
            self,
            req,
            entry_id,
            arrival,
            IncrementalDetokenizer(self.detokenize),
            StopMatcher(ask.stop),
        )

    # ----------------------------------------------------------------- the answers

    def _chunk(
        self, admitted: _Admitted, choices: list[dict[str, Any]], *, stream: bool
    ) -> dict[str, Any]:
        endpoint = admitted.ask.endpoint
        kind = endpoint.value
        if stream and endpoint is Endpoint.CHAT:
            kind = "chat.completion.chunk"
        return {
            "id": admitted.response_id,
            "object": kind,
            "created": admitted.created_s,
            "model": self.config.model_name,
            "choices": choices,
        }

    def _usage(self, admitted: _Admitted) -> dict[str, int]:
        # The prompt once, as OpenAI counts it for n choices of one prompt.
        p = len(admitted.ask.ids)
        c = sum(len(g.tokens) for g in admitted.gens)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _delta(
        self, admitted: _Admitted, index: int, text: str, reason: str | None, ids: list[int]
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if admitted.ask.endpoint is Endpoint.CHAT:
            delta = {"content": text}
            if index not in admitted.started:
                admitted.started.add(index)
                delta = {"role": "assistant", **delta}
            choice["delta"] = delta
        else:
            choice["text"] = text
        return {**choice, "logprobs": None, "finish_reason": reason, "token_ids": ids}

    async def sse(self, admitted: _Admitted) -> AsyncIterator[bytes]:
        """Server-sent events: one chunk per token; the last of each choice carries its
        finish_reason. Usage: with ``stream_options.include_usage`` a last chunk with
        no choices (OpenAI's); without, on the chunk that finishes the last choice."""
        async with aclosing(admitted.pieces()) as pieces:
            async for event in self._events(admitted, pieces):
                yield event
        yield b"data: [DONE]\n\n"

    async def _events(
        self, admitted: _Admitted, pieces: AsyncIterator[tuple[int, _Token | _End]]
    ) -> AsyncIterator[bytes]:
        include_usage = admitted.ask.include_usage
        extra: dict[str, Any] = {"usage": None} if include_usage else {}
        ended = 0
        async for index, piece in pieces:
            if isinstance(piece, _Token):
                delta = self._delta(admitted, index, piece.text, None, [piece.token])
                yield _event({**self._chunk(admitted, [delta], stream=True), **extra})
                continue
            if piece.error is not None:
                yield _event(piece.error.body())
                return  # the other choices are withdrawn as the pieces stop
            ended += 1
            last = admitted.gens[index].tokens[-1:]
            delta = self._delta(admitted, index, piece.text, piece.finish_reason, last)
            chunk = {**self._chunk(admitted, [delta], stream=True), **extra}
            if ended == admitted.ask.n and not include_usage:
                chunk["usage"] = self._usage(admitted)
            yield _event(chunk)
        if include_usage:
            usage = self._usage(admitted)
            yield _event({**self._chunk(admitted, [], stream=True), "usage": usage})

    async def complete(self, admitted: _Admitted) -> Response:
        texts: dict[int, list[str]] = {i: [] for i in range(admitted.ask.n)}
        reasons: dict[int, str | None] = {}
        async with aclosing(admitted.pieces()) as pieces:
            async for index, piece in pieces:
                texts[index].append(piece.text)
                if isinstance(piece, _End):
                    if piece.error is not None:
                        return piece.error.response()
                    reasons[index] = piece.finish_reason
        choices = []
        for index, gen in enumerate(admitted.gens):
            text = "".join(texts[index])
            choice: dict[str, Any] = {"index": index}
            if admitted.ask.endpoint is Endpoint.CHAT:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice.update(logprobs=None, finish_reason=reasons[index], token_ids=list(gen.tokens))
            choices.append(choice)
        body = self._chunk(admitted, choices, stream=False)
        return JSONResponse({**body, "usage": self._usage(admitted)})

    async def readiness(self) -> tuple[bool, dict[str, Any]]:
        try:
            with anyio.fail_after(self.config.redis_timeout_s):
                await self.client.ping()
                live = {pool: await self.registry.live(pool) for pool in Pool}
        except (redis.RedisError, TimeoutError) as exc:
            return False, {"status": "not ready", "reason": str(self.unavailable(exc))}
        return readiness_body({pool: sum(w.ready for w in ws) for pool, ws in live.items()})

    async def refresh_pool_gauges(self) -> None:
        """Live workers and stream depths for /metrics; NaN when Redis does not answer."""
        try:
            with anyio.fail_after(self.config.redis_timeout_s):
                for pool in Pool:
                    live = await self.registry.live(pool)
                    depth = await self.streams.queue_depth(pool)
                    self.metrics.set_pool(
                        pool,
                        live_workers=sum(w.ready for w in live),
                        waiting=depth.waiting,
                        in_service=depth.in_service,
                    )
        except (redis.RedisError, TimeoutError):
            for pool in Pool:
                self.metrics.set_pool(pool, live_workers=None, waiting=None, in_service=None)


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
        ctx = first.get("ctx") or {}
        detail = ctx.get("error", first.get("msg", "invalid JSON"))
        return _invalid(f"the body is not valid JSON: {detail}", None, "invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    message = first.get("msg", "invalid request")
    if param == "prompt" and first.get("type") != "missing":
        # A union: pydantic reports the first member it tried, which misleads.
        message = "expected a string or a list of integer token ids"
    return _invalid(f"{param}: {message}" if param else message, param)


def _http_error(exc: StarletteHTTPException) -> ApiError:
    """Starlette's own errors (a body it cannot parse, no such path) in OpenAI's shape."""
    status = exc.status_code
    if status == 400:
        return _invalid(
            f"the body cannot be parsed: {exc.detail} (expected UTF-8 JSON, nested at "
            "most a few levels)",
            None,
            "invalid_json",
        )
    codes = {404: "not_found", 405: "method_not_allowed"}
    return ApiError(
        status,
        str(exc.detail),
        type="invalid_request_error",
        code=codes.get(status, "invalid_request"),
        headers=dict(exc.headers or {}),
    )


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(
        413,
        f"the request body exceeds {max_bytes} bytes (the model's context with room "
        "to spare); send a shorter prompt",
        type="invalid_request_error",
        code="request_too_large",
    )


@dataclass(frozen=True, kw_only=True)
class _Canned:
    """A whole response, encoded once: sending it costs two ASGI messages."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    @classmethod
    def of(cls, status: int, payload: dict[str, Any], headers: dict[str, str]) -> _Canned:
        body = json.dumps(payload, separators=(",", ":")).encode()
        raw = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        return cls(status=status, headers=raw, body=body)

    async def send(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


class FrontDoor:
    """What is answered before the framework, any parsing or any Redis call.

    Under an overload most requests are refused, and each refusal must cost the event
    loop next to nothing, or the refusals themselves stall the streams being served
    and the probes: so, with responses encoded once, at the outermost layer,

    - ``GET /healthz``: the process and its event loop are up;
    - ``POST`` to a completion path while the router serves ``max_inflight_requests``
      already: 429 before the body is read or parsed (``admit`` checks again, for the
      requests that pass here);
    - a declared ``Content-Length`` over ``max_bytes``: 413 before any of the body is
      parsed. On a kept-alive connection the response goes out at once and the server
      (uvicorn) drops the rest of the body as it arrives without handing it to the
      app, so the client still reads the 413 and no app code runs per chunk; on one
      the server closes after the answer (``Connection: close``, as ``urllib``
      sends) the body is first read and dropped, or the close would reset it.

    A chunked body over the limit is counted as it arrives (``BodyLimit``).
    """

    def __init__(self, app: ASGIApp, *, router: Router, max_bytes: int) -> None:
        self.app = app
        self.router = router
        self.max_bytes = max_bytes
        limit = router.config.max_inflight_requests
        full = router.queue_full(f"this router serves {limit} requests already")
        self._full = _Canned.of(full.status, full.body(), full.headers)
        large = _too_large(max_bytes)
        self._large = _Canned.of(large.status, large.body(), large.headers)
        self._health = _Canned.of(200, {"status": "ok"}, {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, router = scope["method"], self.router
        if method == "GET" and scope["path"] == "/healthz":
            await self._health.send(send)
            return
        if (
            method == "POST"
            and scope["path"] in COMPLETION_PATHS
            and router.inflight_requests >= router.config.max_inflight_requests
        ):
            router.metrics.requests.inc()  # demand refused for want of capacity
            router.metrics.ended(Outcome.REJECTED)
            await self._full.send(send)
            return
        if method in ("POST", "PUT", "PATCH"):
            declared = _declared_length(scope)
            if declared is not None and declared > self.max_bytes:
                if _closes_after_answer(scope) and declared <= _MAX_DRAIN_BYTES:
                    # The server closes this connection once answered, and a close with
                    # the body unread resets it under the client, which is still
                    # sending: so the body is dropped here first (never kept or parsed).
                    while True:
                        message = await receive()
                        if message["type"] != "http.request" or not message.get("more_body"):
                            break
                await self._large.send(send)
                return
        await self.app(scope, receive, send)


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def _closes_after_answer(scope: Scope) -> bool:
    """Whether the server will close the connection after its answer while the client
    still sends the body: HTTP/1.0 or ``Connection: close``, unless the client waits
    for ``100 Continue`` (it has sent no body then). A kept-alive connection stays
    open and the server itself drops the rest of a refused body as it arrives."""
    closes = scope.get("http_version") == "1.0"
    for name, value in scope["headers"]:
        if name == b"expect" and value.lower() == b"100-continue":
            return False
        if name == b"connection" and b"close" in value.lower():
            closes = True
    return closes


class BodyLimit:
    """Refuses a chunked request body (no ``Content-Length``; ``FrontDoor`` refuses a
    declared one) with 413 once more than ``max_bytes`` of it arrived."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        seen = 0
        refused = False

        async def limited() -> Message:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes and not refused:
                    # Answer here and tell the app the client left: an exception raised
                    # into its body parser would come out as a 400.
                    refused = True
                    await _too_large(self.max_bytes).response()(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message: Message) -> None:
            if not refused:  # the 413 went out: the app's own answer has nowhere to go
                await send(message)

        try:
            await self.app(scope, limited, guarded)
        except Exception:
            if not refused:
                raise


def create_router_app(
    config: RouterConfig,
    *,
    tokenize: Tokenize,
    detokenize: Detokenize,
    metrics: RouterMetrics | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    new_seed: Callable[[], int] = lambda: secrets.randbits(63),
    chat_template: ChatTemplate = DEFAULT_CHAT_TEMPLATE,
    tokenize_chat: Tokenize | None = None,
    loop_watch: LoopWatch | None = None,
) -> FastAPI:
    """The router's ASGI app. ``clock`` (monotonic seconds) times TTFT/TPOT and the
    timeout; ``wall_clock`` stamps messages and ``created`` (Unix seconds);
    ``new_seed`` seeds requests that carry none; ``chat_template`` renders chat
    messages into a prompt, which ``tokenize_chat`` (default ``tokenize``) tokenises;
    ``loop_watch`` is stamped from the serving loop every 0.5 s, for a
    ``workers.router_health.HealthServer`` that answers the probes off that loop."""
    router = Router(
        config,
        tokenize=tokenize,
        detokenize=detokenize,
        metrics=metrics or RouterMetrics(),
        clock=clock,
        wall_clock=wall_clock,
        new_seed=new_seed,
        chat_template=chat_template,
        tokenize_chat=tokenize_chat,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        beats = None
        if loop_watch is not None:
            beats = asyncio.create_task(
                beat_loop(loop_watch, interval_s=_LOOP_BEAT_S, clock=router.clock)
            )
        yield
        if beats is not None:
            beats.cancel()
        await router.close()

    app = FastAPI(title="SARA router", lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        router.metrics.ended(Outcome.INVALID)
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if request.url.path in COMPLETION_PATHS:
            router.metrics.ended(Outcome.INVALID)
        return _http_error(exc).response()

    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    # Outermost (added last): refusals and the probe before any other layer.
    app.add_middleware(FrontDoor, router=router, max_bytes=config.max_body_bytes)

    async def answer(body: CompletionBody | ChatBody) -> Response:
        admitted = await router.admit(body)
        if body.stream:
            # The background task gives the slots back even when the client left before
            # the stream started (the generator then never runs its cleanup).
            return StreamingResponse(
                router.sse(admitted),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                background=BackgroundTask(admitted.release),
            )
        try:
            return await router.complete(admitted)
        finally:
            admitted.release()

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionBody) -> Response:
        return await answer(body)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatBody) -> Response:
        return await answer(body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model_name,
                    "object": "model",
                    "created": router.created,
                    "owned_by": "sara",
                    "max_model_len": config.max_context_tokens,
                    "vocab_size": config.vocab_size,
                }
            ],
        }

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:  # answered by FrontDoor; here for the schema
        return {"status": "ok"}

    @app.get("/readyz", response_model=None)
    async def readyz() -> Response:
        ready, body = await router.readiness()
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        await router.refresh_pool_gauges()
        return Response(router.metrics.exposition(), media_type=CONTENT_TYPE)

    return app
