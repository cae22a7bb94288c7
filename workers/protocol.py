"""The Redis data plane (DESIGN §1): stream names, messages, and the operations on them.

Keys (``prefix`` defaults to ``sara``; one Redis can hold several deployments):

- ``{prefix}:prefill`` — stream of ``PrefillRequest``; consumer group ``prefill``.
  The router adds, prefill workers read through the one group: the pool is one
  shared queue. A worker acknowledges an entry only when it has handed the request
  off (``hand_off_to_decode``, atomic with the ack) or finished it.
- ``{prefix}:decode`` — stream of ``DecodeRequest``; consumer group ``decode``.
  Decode workers read it when they have KV room, and acknowledge when the request
  has finished.
- ``{prefix}:tokens:{request_id}`` — stream of ``TokenEvent``, one per generated
  token (index 0 from the prefill worker, then the decode worker), the last one
  with a ``finish_reason``. Every publish refreshes its TTL; the router deletes it.
- ``{prefix}:cancel:{request_id}`` — set (with a TTL) when the router gave up on
  the request (timeout, client gone): workers skip or abort it.

Invariants that keep requests from being lost or leaking:

- An acknowledged entry is also deleted (``XACK`` + ``XDEL``), so a stream's length
  is exactly the requests waiting plus those being served: the router's admission
  limit compares against it, atomically in a script (``enqueue_prefill``).
- Stream lengths are capped (``MAXLEN ~``) far above any admission limit, as a
  guard only: trimming drops entries regardless of their state.
- Pending entries are reclaimed (``XCLAIM``) only from a consumer that is gone: not
  in the registry's live set (its heartbeat expired), after a short grace of
  ``RECLAIM_MIN_IDLE_MS``; or when their lease expired (idle ``LEASE_MS`` although
  the holder still beats). Live workers call ``keep_alive`` on what they hold (at
  most every ``KEEPALIVE_INTERVAL_MS``) so a long prefill or decode is never stolen.
  A slow worker is not a dead one: its entries stay, so a delivery count counts
  real failures only. An entry delivered more than ``MAX_DELIVERIES`` times is a
  poison message: it ends with an error event and is acknowledged.
- Re-running a reclaimed request republishes indexes already sent; readers keep
  the first event of each index (``TokenEvent.index``). The router always sets a
  ``seed``, so a re-run samples the same tokens; ``published_tokens`` lets a
  decode worker resume from what was already sent instead.

The operations exist twice, ``Streams`` (sync client: workers) and ``AsyncStreams``
(asyncio client: the router), over the same encoders. Both expect clients from
``connect`` / ``connect_async`` (RESP2 replies, bytes).
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.retry import Retry

from queueing.pools import Pool

SCHEMA_VERSION = 1
PREFILL_GROUP = "prefill"
DECODE_GROUP = "decode"
GROUPS: Mapping[Pool, str] = {Pool.PREFILL: PREFILL_GROUP, Pool.DECODE: DECODE_GROUP}

MAX_STREAM_LEN = 100_000  # approximate cap of the prefill and decode streams (a guard)
TOKEN_STREAM_TTL_S = 600  # a per-request token stream outlives its last publish by this
CANCEL_TTL_S = 3_600  # how long a cancellation mark stays
# A consumer missing from the live set (registry) loses its entries once they have been
# idle this long: a grace for a worker that read an entry before its first beat landed.
RECLAIM_MIN_IDLE_MS = 3_000
# An entry of a consumer that still beats is taken only when idle this long: its holder's
# loop is wedged (a slow engine step touches its entries between steps, far sooner).
LEASE_MS = 120_000
KEEPALIVE_INTERVAL_MS = 3_000  # live consumers touch what they hold at least this often
MAX_DELIVERIES = 3  # deliveries before an entry is declared poison

M = TypeVar("M")
T = TypeVar("T")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_MAX_TOKEN_ID = 2**32 - 1
_MAX_SEED = 2**63 - 1


class ProtocolError(ValueError):
    """Permanent: a message that does not follow the schema (the text names the field)."""


class FinishReason(enum.Enum):
    STOP = "stop"  # an EOS token
    LENGTH = "length"  # max_tokens generated
    ERROR = "error"  # a worker-side failure; the event's ``error`` says which


class KvTransportName(enum.Enum):
    """Which transport holds a hand-off's KV: the values of ``workers.transfer.TransportKind``
    (not imported here: that module needs torch, and the router must not)."""

    REDIS = "redis"
    GLOO = "gloo"
    NCCL = "nccl"


@dataclass(frozen=True)
class KeySpace:
    """The Redis key names of one deployment."""

    prefix: str = "sara"

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", self.prefix):
            raise ValueError(f"prefix: expected 1-64 of [A-Za-z0-9._-], got {self.prefix!r}")

    def stream(self, pool: Pool) -> str:
        return f"{self.prefix}:{pool.value}"

    def tokens(self, request_id: str) -> str:
        return f"{self.prefix}:tokens:{request_id}"

    def cancel(self, request_id: str) -> str:
        return f"{self.prefix}:cancel:{request_id}"

    def workers(self, pool: Pool) -> str:
        return f"{self.prefix}:workers:{pool.value}"

    def worker(self, pool: Pool, worker_id: str) -> str:
        return f"{self.prefix}:worker:{pool.value}:{worker_id}"


DEFAULT_KEYS = KeySpace()


def check_request_id(request_id: str) -> str:
    if not isinstance(request_id, str) or not _REQUEST_ID.fullmatch(request_id):
        raise ProtocolError(f"request_id: expected 1-128 of [A-Za-z0-9._:-], got {request_id!r}")
    return request_id


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True, kw_only=True)
class PrefillRequest:
    """One completion request as the router queues it.

    ``arrival_s`` and ``deadline_s`` are wall-clock (Unix) seconds: they cross
    machines. After ``deadline_s`` the router has answered with a timeout, so the
    work is wasted. ``seed`` is ``None`` only when the sender does not care about
    a re-run sampling the same tokens (the router always sets one).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    arrival_s: float
    deadline_s: float

    def __post_init__(self) -> None:
        check_request_id(self.request_id)
        if not isinstance(self.prompt_token_ids, tuple) or not self.prompt_token_ids:
            raise ProtocolError("prompt_token_ids: expected a non-empty tuple of token ids")
        if min(self.prompt_token_ids) < 0 or max(self.prompt_token_ids) > _MAX_TOKEN_ID:
            raise ProtocolError(f"prompt_token_ids: ids must be in [0, {_MAX_TOKEN_ID}]")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ProtocolError(f"max_tokens: expected an integer >= 1, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ProtocolError(f"max_tokens: expected an integer >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ProtocolError(
                f"temperature: expected a finite number >= 0, got {self.temperature}"
            )
        if not (0 < self.top_p <= 1):
            raise ProtocolError(f"top_p: expected a number in (0, 1], got {self.top_p}")
        if self.seed is not None and not (
            isinstance(self.seed, int)
            and not isinstance(self.seed, bool)
            and 0 <= self.seed <= _MAX_SEED
        ):
            raise ProtocolError(
                f"seed: expected an integer in [0, 2**63) or None, got {self.seed!r}"
            )
        for name in ("arrival_s", "deadline_s"):
            if not math.isfinite(getattr(self, name)):
                raise ProtocolError(f"{name}: expected finite wall-clock seconds")
        if self.deadline_s < self.arrival_s:
            raise ProtocolError(
                f"deadline_s: {self.deadline_s} is before arrival_s {self.arrival_s}"
            )

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def expired(self, now_s: float) -> bool:
        """True once the router has given up on it (``now_s``: wall-clock seconds)."""
        return now_s > self.deadline_s

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``workers.sampling.SamplingParams``."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
        }


@dataclass(frozen=True, kw_only=True)
class DecodeRequest:
    """A prefilled request handed to the decode pool.

    ``first_token`` was published as index 0 already. ``kv_handle`` is opaque here:
    the ``kv_transport`` that wrote the KV cache knows how to find it from it.
    ``prefill_done_s`` is wall-clock seconds.
    """

    request: PrefillRequest
    first_token: int
    kv_transport: KvTransportName
    kv_handle: str
    prefill_worker: str
    prefill_done_s: float

    def __post_init__(self) -> None:
        if not (0 <= self.first_token <= _MAX_TOKEN_ID):
            raise ProtocolError(f"first_token: expected a token id, got {self.first_token}")
        if not isinstance(self.kv_transport, KvTransportName):
            raise ProtocolError(
                f"kv_transport: expected a KvTransportName, got {self.kv_transport!r}"
            )
        if not self.kv_handle:
            raise ProtocolError("kv_handle: must not be empty")
        if not math.isfinite(self.prefill_done_s):
            raise ProtocolError("prefill_done_s: expected finite wall-clock seconds")


@dataclass(frozen=True, kw_only=True)
class TokenEvent:
    """One generated token (0-based ``index``), or the error that ended the request.

    The last event of a request has a ``finish_reason``; an error event has
    ``finish_reason=ERROR``, an ``error`` message and usually no token. Readers keep
    the first event of each index (a re-run republishes), except that an error event
    ends the request whatever its index.
    """

    index: int
    token: int | None
    finish_reason: FinishReason | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ProtocolError(f"index: expected an integer >= 0, got {self.index!r}")
        if self.token is not None and not (0 <= self.token <= _MAX_TOKEN_ID):
            raise ProtocolError(f"token: expected a token id or None, got {self.token}")
        if (self.error is not None) != (self.finish_reason is FinishReason.ERROR):
            raise ProtocolError("error: an error message goes with finish_reason=ERROR only")
        if self.token is None and self.error is None:
            raise ProtocolError("token: only an error event may have no token")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def failure(cls, index: int, message: str) -> TokenEvent:
        return cls(index=index, token=None, finish_reason=FinishReason.ERROR, error=message)


# --------------------------------------------------------------------------- encoding

Fields = dict[str, bytes | str]


def _pack_ids(ids: Sequence[int]) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


class _Reader:
    """Typed access to a stream entry's fields; errors name the field."""

    def __init__(self, fields: Mapping[bytes, bytes], what: str) -> None:
        self._fields = fields
        self._what = what

    def raw(self, name: str) -> bytes:
        try:
            return self._fields[name.encode()]
        except KeyError:
            raise ProtocolError(f"{self._what}: field {name!r} is missing") from None

    def opt(self, name: str) -> bytes | None:
        return self._fields.get(name.encode())

    def text(self, name: str) -> str:
        try:
            return self.raw(name).decode()
        except UnicodeDecodeError:
            raise ProtocolError(f"{self._what}: field {name!r} is not UTF-8") from None

    def integer(self, name: str) -> int:
        try:
            return int(self.raw(name))
        except ValueError:
            raise ProtocolError(f"{self._what}: field {name!r} is not an integer") from None

    def ids(self, name: str) -> tuple[int, ...]:
        raw = self.raw(name)
        if len(raw) == 0 or len(raw) % 4:
            raise ProtocolError(
                f"{self._what}: field {name!r} is not little-endian uint32 ids ({len(raw)} bytes)"
            )
        return tuple(np.frombuffer(raw, dtype="<u4").tolist())

    def opt_integer(self, name: str) -> int | None:
        return None if self.opt(name) is None else self.integer(name)

    def number(self, name: str) -> float:
        try:
            return float(self.raw(name))
        except ValueError:
            raise ProtocolError(f"{self._what}: field {name!r} is not a number") from None

    def enum(self, name: str, kind: type[enum.Enum]) -> Any:
        value = self.text(name)
        try:
            return kind(value)
        except ValueError:
            raise ProtocolError(f"{self._what}: field {name!r} = {value!r} is unknown") from None

    def version(self) -> None:
        version = self.integer("v")
        if version != SCHEMA_VERSION:
            raise ProtocolError(
                f"{self._what}: schema version {version}, this code speaks {SCHEMA_VERSION}"
            )


def encode_prefill(req: PrefillRequest) -> Fields:
    fields: Fields = {
        "v": str(SCHEMA_VERSION),
        "id": req.request_id,
        "prompt": _pack_ids(req.prompt_token_ids),
        "max_tokens": str(req.max_tokens),
        "temperature": repr(float(req.temperature)),
        "top_p": repr(float(req.top_p)),
        "ignore_eos": "1" if req.ignore_eos else "0",
        "arrival_s": repr(float(req.arrival_s)),
        "deadline_s": repr(float(req.deadline_s)),
    }
    if req.seed is not None:
        fields["seed"] = str(req.seed)
    return fields


def decode_prefill(fields: Mapping[bytes, bytes]) -> PrefillRequest:
    """The request in a prefill (or decode) stream entry; ``ProtocolError`` if malformed."""
    r = _Reader(fields, "prefill request")
    r.version()
    return _build(
        PrefillRequest,
        "prefill request",
        request_id=r.text("id"),
        prompt_token_ids=r.ids("prompt"),
        max_tokens=r.integer("max_tokens"),
        temperature=r.number("temperature"),
        top_p=r.number("top_p"),
        seed=r.opt_integer("seed"),
        ignore_eos=r.raw("ignore_eos") == b"1",
        arrival_s=r.number("arrival_s"),
        deadline_s=r.number("deadline_s"),
    )


def _build(cls: type[T], what: str, **kwargs: Any) -> T:
    """``cls(**kwargs)``, its validation errors prefixed with what was being read."""
    try:
        return cls(**kwargs)
    except ProtocolError as exc:
        raise ProtocolError(f"{what}: {exc}") from None


def encode_decode(msg: DecodeRequest) -> Fields:
    return {
        **encode_prefill(msg.request),
        "first_token": str(msg.first_token),
        "kv_transport": msg.kv_transport.value,
        "kv_handle": msg.kv_handle,
        "prefill_worker": msg.prefill_worker,
        "prefill_done_s": repr(float(msg.prefill_done_s)),
    }


def decode_decode(fields: Mapping[bytes, bytes]) -> DecodeRequest:
    """The hand-off in a decode stream entry; ``ProtocolError`` if malformed."""
    request = decode_prefill(fields)
    r = _Reader(fields, "decode request")
    return _build(
        DecodeRequest,
        "decode request",
        request=request,
        first_token=r.integer("first_token"),
        kv_transport=r.enum("kv_transport", KvTransportName),
        kv_handle=r.text("kv_handle"),
        prefill_worker=r.text("prefill_worker"),
        prefill_done_s=r.number("prefill_done_s"),
    )


def encode_token(event: TokenEvent) -> Fields:
    fields: Fields = {"v": str(SCHEMA_VERSION), "i": str(event.index)}
    if event.token is not None:
        fields["t"] = str(event.token)
    if event.finish_reason is not None:
        fields["f"] = event.finish_reason.value
    if event.error is not None:
        fields["e"] = event.error
    return fields


def decode_token(fields: Mapping[bytes, bytes]) -> TokenEvent:
    r = _Reader(fields, "token event")
    r.version()
    error = r.opt("e")
    return _build(
        TokenEvent,
        "token event",
        index=r.integer("i"),
        token=r.opt_integer("t"),
        finish_reason=None if r.opt("f") is None else r.enum("f", FinishReason),
        error=None if error is None else error.decode(errors="replace"),
    )


# --------------------------------------------------------------------------- replies

Entry = tuple[str, dict[bytes, bytes]]


@dataclass(frozen=True)
class Delivery(Generic[M]):
    """A message read from a stream: its entry id (for ``ack``) and how often delivered."""

    entry_id: str
    message: M
    deliveries: int = 1


@dataclass(frozen=True, kw_only=True)
class QueueDepth:
    """A pool's stream now: ``waiting`` not yet taken, ``in_service`` taken, not acked."""

    waiting: int
    in_service: int

    @property
    def total(self) -> int:
        return self.waiting + self.in_service


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _entries(reply: Any) -> list[Entry]:
    """The entries of an XREAD/XREADGROUP reply for one stream (RESP2 or RESP3 shape)."""
    if not reply:
        return []
    streams = reply.items() if isinstance(reply, dict) else reply
    out: list[Entry] = []
    for _, entries in streams:
        # RESP3 nests the entry list once more.
        if entries and isinstance(entries[0], list):
            entries = entries[0]
        out.extend((_text(eid), dict(f or {})) for eid, f in entries)
    return out


# An admission check and the XADD in one step, so that several routers never
# overshoot the limit. ARGV: limit (0 = none), maxlen, then field/value pairs.
_ENQUEUE = """
local limit = tonumber(ARGV[1])
if limit > 0 and redis.call('XLEN', KEYS[1]) >= limit then return false end
return redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, 3))
"""

# XLEN and the group's pending count; a missing stream or group counts as empty.
_DEPTH = """
local n = redis.call('XLEN', KEYS[1])
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1])
if ok then return {n, pending[1]} end
return {n, 0}
"""


# Touch (XCLAIM JUSTID, which leaves the delivery count alone) only the entries this
# consumer still owns: a plain XCLAIM would steal back an entry another consumer
# reclaimed meanwhile. ARGV: group, consumer, entry ids. Returns the ids still held.
_KEEP_ALIVE = """
local held = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #p > 0 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    held[#held + 1] = ARGV[i]
  end
end
return held
"""


def _enqueue_args(keys: KeySpace, req: PrefillRequest, limit: int | None, maxlen: int) -> list[Any]:
    flat: list[Any] = [_ENQUEUE, 1, keys.stream(Pool.PREFILL), limit or 0, maxlen]
    for name, value in encode_prefill(req).items():
        flat += [name, value]
    return flat


def _depth(reply: Sequence[int]) -> QueueDepth:
    length, pending = int(reply[0]), int(reply[1])
    return QueueDepth(waiting=max(0, length - pending), in_service=min(pending, length))


def _entry_order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _tokens_reply(reply: Any, last_id: str) -> tuple[str, list[TokenEvent]]:
    events = []
    for entry_id, fields in _entries(reply):
        last_id = entry_id
        events.append(decode_token(fields))
    return last_id, events


def _check_block(client: Any, block_ms: int | None) -> None:
    """A blocking read must end before the client's socket timeout, or it fails as one."""
    if block_ms is None:
        return
    if block_ms < 1:  # Redis reads BLOCK 0 as "forever"
        raise ValueError(f"block_ms: expected >= 1 or None (no blocking), got {block_ms}")
    timeout = client.connection_pool.connection_kwargs.get("socket_timeout")
    if timeout is not None and block_ms >= timeout * 1000:
        raise ValueError(
            f"block_ms: {block_ms} ms must stay below the client's socket timeout ({timeout} s)"
        )


def _is_nogroup(exc: redis.ResponseError) -> bool:
    return str(exc).startswith("NOGROUP")


def _is_busygroup(exc: redis.ResponseError) -> bool:
    return str(exc).startswith("BUSYGROUP")


# --------------------------------------------------------------------------- clients


def connect(url: str, *, timeout_s: float = 5.0) -> redis.Redis:
    """A sync client for ``Streams``/``Registry``: RESP2, bytes, one quick retry.

    The single retry (no backoff) replaces a connection that died with a Redis
    restart; a Redis that is down fails in one connect attempt, not after backoff.
    ``timeout_s`` bounds every reply, so blocking reads must block for less.
    """
    return redis.Redis.from_url(
        url,
        protocol=2,
        socket_timeout=timeout_s,
        socket_connect_timeout=min(timeout_s, 2.0),
        retry=Retry(NoBackoff(), 1),
    )


def connect_async(
    url: str, *, timeout_s: float = 5.0, max_connections: int = 512
) -> redis.asyncio.Redis:
    """The asyncio counterpart of ``connect``, for the router.

    A blocking pool of ``max_connections``: every streaming request holds one
    connection while it waits for tokens; past the pool, requests wait up to
    ``timeout_s`` for one, then fail as Redis being unavailable.
    """
    from redis.asyncio.retry import Retry as AsyncRetry

    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url,
        protocol=2,
        socket_timeout=timeout_s,
        socket_connect_timeout=min(timeout_s, 2.0),
        max_connections=max_connections,
        timeout=timeout_s,
        retry=AsyncRetry(NoBackoff(), 1),
    )
    return redis.asyncio.Redis.from_pool(pool)


class Streams:
    """The data-plane operations over a sync client (the workers' side).

    ``read_prefill``/``read_decode`` block at most ``block_ms`` (never forever)
    and return ``Delivery`` objects; malformed entries are answered with an error
    event where the request id can be read, acknowledged, and left out.
    Connection errors propagate (``redis.ConnectionError``: retryable).
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: KeySpace = DEFAULT_KEYS,
        *,
        max_stream_len: int = MAX_STREAM_LEN,
        token_ttl_s: int = TOKEN_STREAM_TTL_S,
    ) -> None:
        self.client = client
        self.keys = keys
        self.max_stream_len = max_stream_len
        self.token_ttl_s = token_ttl_s

    # -- groups and the router side (also used by tests and tools) -------------------

    def ensure_groups(self) -> None:
        """Create both consumer groups (and streams) if missing; reading from the start."""
        for pool, group in GROUPS.items():
            try:
                self.client.xgroup_create(self.keys.stream(pool), group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if not _is_busygroup(exc):
                    raise

    def enqueue_prefill(self, req: PrefillRequest, *, max_queued: int | None = None) -> str | None:
        """Add ``req`` to the prefill stream; its entry id, or ``None`` if the queue is full."""
        entry_id = self.client.eval(*_enqueue_args(self.keys, req, max_queued, self.max_stream_len))
        return None if entry_id is None else _text(entry_id)

    def queue_depth(self, pool: Pool) -> QueueDepth:
        return _depth(self.client.eval(_DEPTH, 1, self.keys.stream(pool), GROUPS[pool]))

    # -- workers -------------------------------------------------------------------

    def read_prefill(
        self,
        consumer: str,
        *,
        count: int = 1,
        block_ms: int | None = None,
        group: str = PREFILL_GROUP,
    ) -> list[Delivery[PrefillRequest]]:
        return [
            Delivery(eid, msg)
            for eid, msg in self._read(Pool.PREFILL, group, consumer, count, block_ms)
            if isinstance(msg, PrefillRequest)
        ]

    def read_decode(
        self,
        consumer: str,
        *,
        count: int = 1,
        block_ms: int | None = None,
        group: str = DECODE_GROUP,
    ) -> list[Delivery[DecodeRequest]]:
        return [
            Delivery(eid, msg)
            for eid, msg in self._read(Pool.DECODE, group, consumer, count, block_ms)
            if isinstance(msg, DecodeRequest)
        ]

    def _read(
        self, pool: Pool, group: str, consumer: str, count: int, block_ms: int | None
    ) -> list[tuple[str, PrefillRequest | DecodeRequest]]:
        _check_block(self.client, block_ms)
        stream = self.keys.stream(pool)
        try:
            reply = self.client.xreadgroup(
                group, consumer, {stream: ">"}, count=count, block=block_ms
            )
        except redis.ResponseError as exc:
            if not _is_nogroup(exc):
                raise
            # Redis restarted empty, or nobody created the groups yet.
            self.ensure_groups()
            reply = self.client.xreadgroup(
                group, consumer, {stream: ">"}, count=count, block=block_ms
            )
        return self._decode_entries(pool, _entries(reply))

    def _decode_entries(
        self, pool: Pool, entries: list[Entry]
    ) -> list[tuple[str, PrefillRequest | DecodeRequest]]:
        decode = decode_prefill if pool is Pool.PREFILL else decode_decode
        out: list[tuple[str, PrefillRequest | DecodeRequest]] = []
        for entry_id, fields in entries:
            try:
                out.append((entry_id, decode(fields)))
            except ProtocolError as exc:
                self._drop(pool, entry_id, fields, f"malformed {pool.value} message: {exc}")
        return out

    def _drop(self, pool: Pool, entry_id: str, fields: Mapping[bytes, bytes], why: str) -> None:
        """End an entry that cannot be served: an error event if possible, then ack."""
        raw_id = fields.get(b"id", b"").decode(errors="replace")
        if _REQUEST_ID.fullmatch(raw_id):  # readers honour an error event at any index
            self.publish_token(raw_id, TokenEvent.failure(0, why))
        self.ack(pool, [entry_id])

    def ack(self, pool: Pool, entry_ids: Sequence[str], *, group: str | None = None) -> None:
        """Acknowledge and delete entries: they are done (or handed off)."""
        if not entry_ids:
            return
        stream = self.keys.stream(pool)
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(stream, group or GROUPS[pool], *entry_ids)
        pipe.xdel(stream, *entry_ids)
        pipe.execute()

    def hand_off_to_decode(self, prefill_entry_id: str, msg: DecodeRequest) -> str:
        """Queue ``msg`` for decode and acknowledge its prefill entry, atomically."""
        prefill = self.keys.stream(Pool.PREFILL)
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(
            self.keys.stream(Pool.DECODE),
            encode_decode(msg),  # type: ignore[arg-type]
            maxlen=self.max_stream_len,
            approximate=True,
        )
        pipe.xack(prefill, PREFILL_GROUP, prefill_entry_id)
        pipe.xdel(prefill, prefill_entry_id)
        decode_id, _, _ = pipe.execute()
        return _text(decode_id)

    def keep_alive(self, pool: Pool, consumer: str, entry_ids: Sequence[str]) -> set[str]:
        """Reset the idle time of entries this consumer holds, so nobody reclaims them.

        Returns the ids it no longer holds (reclaimed by another consumer after this
        one stalled, or cancelled): the caller must drop that work.
        """
        if not entry_ids:
            return set()
        try:
            held = self.client.eval(
                _KEEP_ALIVE, 1, self.keys.stream(pool), GROUPS[pool], consumer, *entry_ids
            )
        except redis.ResponseError as exc:
            if not _is_nogroup(exc):
                raise
            # The stream is gone (a Redis restarted without its data): so is every
            # entry held on it, and the requests were failed when Redis went away.
            return set(entry_ids)
        return set(entry_ids) - {_text(e) for e in held}

    def reclaim_stale(
        self,
        pool: Pool,
        consumer: str,
        *,
        live: Collection[str],
        held: Collection[str] = (),
        min_idle_ms: int = RECLAIM_MIN_IDLE_MS,
        lease_ms: int = LEASE_MS,
        count: int = 16,
        max_deliveries: int = MAX_DELIVERIES,
    ) -> list[Delivery[Any]]:
        """Take over the entries of consumers that are gone, with ``XCLAIM``.

        A consumer is gone when it is not in ``live`` (the registry's live set: its
        heartbeat expired, or it deregistered); its entries are taken once idle for
        ``min_idle_ms`` (a grace for a worker that read before its first beat landed).
        An entry of a live consumer is taken only when its lease expired: idle for
        ``lease_ms`` although its holder keeps beating (a wedged loop). A live but slow
        worker keeps its work, so a delivery count counts real failures only. The
        caller's own pending entries outside ``held`` (what it serves now) count as
        gone: a previous process under the same id left them.

        Returns at most ``count`` deliveries with their delivery counts. Entries
        delivered more than ``max_deliveries`` times end with an error event and are
        acknowledged; entries deleted meanwhile (cancelled) are dropped by Redis.
        """
        if count < 1:
            return []
        stream, group = self.keys.stream(pool), GROUPS[pool]
        try:
            summary: Any = self.client.xpending(stream, group)
        except redis.ResponseError as exc:
            if _is_nogroup(exc):
                return []
            raise
        if not summary["pending"]:
            return []
        owners = [_text(c["name"]) for c in summary["consumers"]]
        candidates: dict[str, tuple[int, int]] = {}  # entry id -> (min idle, deliveries)
        for owner in owners:
            if owner in live and owner != consumer:
                continue
            for p in self._pending(stream, group, min_idle_ms, count + len(held), owner):
                entry_id = _text(p["message_id"])
                if owner == consumer and entry_id in held:
                    continue
                candidates[entry_id] = (min_idle_ms, int(p["times_delivered"]))
        if len(candidates) < count:
            for p in self._pending(stream, group, lease_ms, count + len(held), None):
                entry_id = _text(p["message_id"])
                if entry_id not in held:
                    candidates.setdefault(entry_id, (lease_ms, int(p["times_delivered"])))
        claimed: list[Entry] = []
        for idle_ms in sorted({idle for idle, _ in candidates.values()}):
            ids = [e for e, (i, _) in candidates.items() if i == idle_ms][: count - len(claimed)]
            if not ids:
                continue
            # min_idle_time again: of two reclaimers, only the first gets each entry.
            reply: Any = self.client.xclaim(stream, group, consumer, idle_ms, ids)
            claimed += [(_text(eid), dict(f or {})) for eid, f in reply if f]
        out: list[Delivery[Any]] = []
        for entry_id, fields in sorted(claimed, key=lambda e: _entry_order(e[0])):
            n = candidates[entry_id][1] + 1  # XCLAIM counted this delivery
            if n > max_deliveries:
                self._drop(
                    pool,
                    entry_id,
                    fields,
                    f"request failed on {n - 1} {pool.value} workers; giving up",
                )
                continue
            for eid, msg in self._decode_entries(pool, [(entry_id, fields)]):
                out.append(Delivery(eid, msg, n))
        return out

    def _pending(
        self, stream: str, group: str, idle_ms: int, count: int, owner: str | None
    ) -> list[Any]:
        pending: Any = self.client.xpending_range(
            stream, group, min="-", max="+", count=count, consumername=owner, idle=idle_ms
        )
        return list(pending)

    def pending_consumers(self, pool: Pool) -> dict[str, int]:
        """Entries pending per consumer of ``pool``'s group (empty without a group)."""
        try:
            summary: Any = self.client.xpending(self.keys.stream(pool), GROUPS[pool])
        except redis.ResponseError as exc:
            if _is_nogroup(exc):
                return {}
            raise
        return {_text(c["name"]): int(c["pending"]) for c in summary["consumers"]}

    def publish_token(self, request_id: str, event: TokenEvent) -> None:
        self.publish_tokens([(request_id, event)])

    def publish_tokens(self, events: Iterable[tuple[str, TokenEvent]]) -> None:
        """Publish a step's events (any requests) in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for request_id, event in events:
            key = self.keys.tokens(check_request_id(request_id))
            pipe.xadd(key, encode_token(event))  # type: ignore[arg-type]
            pipe.expire(key, self.token_ttl_s)
        pipe.execute()

    def read_tokens(
        self,
        request_id: str,
        last_id: str = "0-0",
        *,
        block_ms: int | None = None,
        count: int = 1024,
    ) -> tuple[str, list[TokenEvent]]:
        """Events after ``last_id``: ``(new last_id, events)``. Blocks at most ``block_ms``."""
        _check_block(self.client, block_ms)
        key = self.keys.tokens(check_request_id(request_id))
        reply = self.client.xread({key: last_id}, count=count, block=block_ms)
        return _tokens_reply(reply, last_id)

    def published_tokens(self, request_id: str) -> list[int]:
        """The tokens already sent for a request, by index (to resume a reclaimed one)."""
        key = self.keys.tokens(check_request_id(request_id))
        entries: Any = self.client.xrange(key)
        tokens: dict[int, int] = {}
        for _, fields in entries:
            event = decode_token(fields)
            if event.token is not None:
                tokens.setdefault(event.index, event.token)
        prefix: list[int] = []  # up to the first gap: what a reader has seen in order
        while len(prefix) in tokens:
            prefix.append(tokens[len(prefix)])
        return prefix

    def cancelled(self, request_ids: Sequence[str]) -> set[str]:
        """Which of these requests the router has given up on."""
        if not request_ids:
            return set()
        flags = self.client.mget([self.keys.cancel(r) for r in request_ids])
        return {r for r, flag in zip(request_ids, flags, strict=True) if flag is not None}

    def cancel(self, request_id: str, prefill_entry_id: str | None = None) -> None:
        _cancel_pipeline(
            self.client.pipeline(transaction=False), self.keys, request_id, prefill_entry_id
        ).execute()


def _cancel_pipeline(pipe: Any, keys: KeySpace, request_id: str, entry_id: str | None) -> Any:
    pipe.set(keys.cancel(check_request_id(request_id)), b"1", ex=CANCEL_TTL_S)
    pipe.delete(keys.tokens(request_id))
    if entry_id is not None:  # not taken yet: it never will be
        pipe.xdel(keys.stream(Pool.PREFILL), entry_id)
    return pipe


class AsyncStreams:
    """The router's side of ``Streams`` over an asyncio client: same keys and encoders."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        keys: KeySpace = DEFAULT_KEYS,
        *,
        max_stream_len: int = MAX_STREAM_LEN,
    ) -> None:
        self.client = client
        self.keys = keys
        self.max_stream_len = max_stream_len

    async def ping(self) -> None:
        await self.client.ping()

    async def enqueue_prefill(
        self, req: PrefillRequest, *, max_queued: int | None = None
    ) -> str | None:
        entry_id = await self.client.eval(
            *_enqueue_args(self.keys, req, max_queued, self.max_stream_len)
        )
        return None if entry_id is None else _text(entry_id)

    async def queue_depth(self, pool: Pool) -> QueueDepth:
        return _depth(await self.client.eval(_DEPTH, 1, self.keys.stream(pool), GROUPS[pool]))

    async def read_tokens(
        self,
        request_id: str,
        last_id: str = "0-0",
        *,
        block_ms: int | None = None,
        count: int = 1024,
    ) -> tuple[str, list[TokenEvent]]:
        _check_block(self.client, block_ms)
        key = self.keys.tokens(check_request_id(request_id))
        reply = await self.client.xread({key: last_id}, count=count, block=block_ms)
        return _tokens_reply(reply, last_id)

    async def finish(self, request_id: str) -> None:
        """The request is over: its token stream can go."""
        await self.client.delete(self.keys.tokens(check_request_id(request_id)))

    async def cancel(self, request_id: str, prefill_entry_id: str | None = None) -> None:
        """Give up on a request: mark it, drop its tokens, and its queue entry if untaken."""
        await _cancel_pipeline(
            self.client.pipeline(transaction=False), self.keys, request_id, prefill_entry_id
        ).execute()
