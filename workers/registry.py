"""The live set of workers: heartbeats in Redis with a TTL.

Each worker writes ``{prefix}:worker:{pool}:{worker_id}`` (a hash: readiness,
capacity, queue depth, ...) every ``interval_s`` with a TTL of ``ttl_s``, and its
id into the pool's index ``{prefix}:workers:{pool}`` (a sorted set scored by the
expiry time). A worker that stops beating drops out after ``ttl_s``; one that
drains marks itself not ready, then deregisters. Listing removes expired index
entries first.

Times come from the Redis server's clock (``TIME`` inside the scripts), so workers
on machines with skewed clocks still expire correctly. The scripts touch the
worker hashes by name, which a single Redis (not Redis Cluster) allows.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

from queueing.pools import Pool
from workers.protocol import DEFAULT_KEYS, KeySpace, ProtocolError, check_request_id

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 5.0
DEFAULT_INTERVAL_S = 1.0

_NOW_MS = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: pool index, worker hash. ARGV: ttl ms, worker id, field/value pairs.
_BEAT = (
    _NOW_MS
    + """
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'heartbeat_ms', now_ms, unpack(ARGV, 3))
redis.call('PEXPIRE', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[1]), ARGV[2])
return now_ms
"""
)

# KEYS: pool index. ARGV: the worker hashes' key prefix. Returns {now_ms, {hash...}}.
_LIST = (
    _NOW_MS
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
local out = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local h = redis.call('HGETALL', ARGV[1] .. id)
  if #h > 0 then out[#out + 1] = h end
end
return {now_ms, out}
"""
)


@dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """What one worker says about itself.

    ``capacity``: requests it can hold at once (prefill: prompts it batches;
    decode: sequences its KV cache admits). ``queue_depth``: requests it holds now,
    waiting or running. ``kv_utilization``: fraction of its KV cache in use.
    ``address``: ``host:port`` of its HTTP endpoint (``/metrics``), or empty.
    ``heartbeat_s``: the server time of the last beat (set when listed).
    """

    pool: Pool
    worker_id: str
    ready: bool
    capacity: int
    queue_depth: int = 0
    kv_utilization: float | None = None
    address: str = ""
    draining: bool = False
    heartbeat_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pool, Pool):
            raise ValueError(f"pool: expected a Pool, got {self.pool!r}")
        try:
            check_request_id(self.worker_id)  # the same safe charset as request ids
        except ProtocolError:
            raise ValueError(
                f"worker_id: expected 1-128 of [A-Za-z0-9._:-], got {self.worker_id!r}"
            ) from None
        for name in ("capacity", "queue_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected an integer >= 0, got {value!r}")
        u = self.kv_utilization
        if u is not None and not (math.isfinite(u) and 0 <= u <= 1):
            raise ValueError(f"kv_utilization: expected a fraction in [0, 1] or None, got {u!r}")

    def to_fields(self) -> dict[str, str]:
        fields = {
            "pool": self.pool.value,
            "worker_id": self.worker_id,
            "ready": "1" if self.ready else "0",
            "capacity": str(self.capacity),
            "queue_depth": str(self.queue_depth),
            "address": self.address,
            "draining": "1" if self.draining else "0",
        }
        if self.kv_utilization is not None:
            fields["kv_utilization"] = repr(float(self.kv_utilization))
        return fields

    @classmethod
    def from_fields(cls, fields: Mapping[str, str]) -> WorkerInfo:
        """Parse a registry hash; ``ValueError`` naming the field when malformed."""
        try:
            kv = fields.get("kv_utilization")
            beat = fields.get("heartbeat_ms")
            return cls(
                pool=Pool(fields["pool"]),
                worker_id=fields["worker_id"],
                ready=fields["ready"] == "1",
                capacity=int(fields["capacity"]),
                queue_depth=int(fields["queue_depth"]),
                kv_utilization=None if kv is None else float(kv),
                address=fields.get("address", ""),
                draining=fields.get("draining") == "1",
                heartbeat_s=None if beat is None else int(beat) / 1000.0,
            )
        except KeyError as exc:
            raise ValueError(f"worker record: field {exc.args[0]!r} is missing") from None


def _check_ttl(ttl_s: float) -> int:
    if not (math.isfinite(ttl_s) and ttl_s >= 0.05):
        raise ValueError(f"ttl_s: expected a number of seconds >= 0.05, got {ttl_s!r}")
    return int(ttl_s * 1000)


def _parse_list(reply: Any, pool: Pool) -> list[WorkerInfo]:
    workers = []
    for flat in reply[1]:
        text = [v.decode() if isinstance(v, bytes) else str(v) for v in flat]
        fields = dict(zip(text[::2], text[1::2], strict=True))
        try:
            info = WorkerInfo.from_fields(fields)
        except ValueError as exc:
            logger.warning("ignoring a malformed %s worker record: %s", pool.value, exc)
            continue
        workers.append(info)
    return sorted(workers, key=lambda w: w.worker_id)


class Registry:
    """Heartbeats and listings over a sync client (workers, the local actuator, tools)."""

    def __init__(
        self, client: redis.Redis, keys: KeySpace = DEFAULT_KEYS, *, ttl_s: float = DEFAULT_TTL_S
    ) -> None:
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s
        self._ttl_ms = _check_ttl(ttl_s)

    def heartbeat(self, info: WorkerInfo) -> None:
        """Record ``info``, alive for ``ttl_s`` from now."""
        self.client.eval(*_beat_args(self.keys, info, self._ttl_ms))

    def deregister(self, pool: Pool, worker_id: str) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.zrem(self.keys.workers(pool), worker_id)
        pipe.delete(self.keys.worker(pool, worker_id))
        pipe.execute()

    def live(self, pool: Pool) -> list[WorkerInfo]:
        """The workers of ``pool`` whose last heartbeat is younger than its TTL, by id."""
        return _parse_list(self.client.eval(*_list_args(self.keys, pool)), pool)


class AsyncRegistry:
    """Listings over an asyncio client (the router's readiness check)."""

    def __init__(self, client: redis.asyncio.Redis, keys: KeySpace = DEFAULT_KEYS) -> None:
        self.client = client
        self.keys = keys

    async def live(self, pool: Pool) -> list[WorkerInfo]:
        return _parse_list(await self.client.eval(*_list_args(self.keys, pool)), pool)


def _beat_args(keys: KeySpace, info: WorkerInfo, ttl_ms: int) -> Sequence[Any]:
    flat: list[Any] = [
        _BEAT,
        2,
        keys.workers(info.pool),
        keys.worker(info.pool, info.worker_id),
        ttl_ms,
        info.worker_id,
    ]
    for name, value in info.to_fields().items():
        flat += [name, value]
    return flat


def _list_args(keys: KeySpace, pool: Pool) -> Sequence[Any]:
    return [_LIST, 1, keys.workers(pool), keys.worker(pool, "")]


class Heartbeat:
    """A daemon thread that beats ``snapshot()`` every ``interval_s`` until ``stop()``.

    A failed beat (Redis down) is logged once per episode and retried on the next
    tick: the worker keeps working, and reappears when Redis does.
    """

    def __init__(
        self,
        registry: Registry,
        snapshot: Callable[[], WorkerInfo],
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        if not (math.isfinite(interval_s) and 0 < interval_s <= registry.ttl_s / 2):
            raise ValueError(
                f"interval_s: expected a number in (0, ttl_s / 2 = {registry.ttl_s / 2}], "
                f"got {interval_s!r}"
            )
        self.registry = registry
        self.snapshot = snapshot
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sara-heartbeat", daemon=True)
        self._failing = False

    def start(self) -> Heartbeat:
        self._beat()  # registered before start() returns
        self._thread.start()
        return self

    def _beat(self) -> None:
        try:
            self.registry.heartbeat(self.snapshot())
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if not self._failing:
                logger.warning("heartbeat failed (will retry): %s", exc)
            self._failing = True
            return
        if self._failing:
            logger.info("heartbeat recovered")
        self._failing = False

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._beat()

    def stop(self, *, deregister: bool = True) -> None:
        """Stop beating; with ``deregister`` also leave the live set now (not after the TTL)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 5)
        if deregister:
            info = self.snapshot()
            try:
                self.registry.deregister(info.pool, info.worker_id)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                logger.warning("deregister failed (the entry expires by itself): %s", exc)

    def beat_now(self) -> None:
        """Publish ``snapshot()`` now, e.g. as soon as a drain starts (not ready)."""
        self._beat()
