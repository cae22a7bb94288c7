"""What prefill and decode workers share: settings, the held entries, the run loop.

A worker is one process with one engine and one thread of control. ``run()`` loops
over ``iterate()`` (read work from its pool's stream, run one engine step, publish,
hand off) until it has drained:

- On ``stop`` (SIGTERM) it drains: it stops reading new entries, marks itself not
  ready in the registry at once (so the router and the controller stop counting it),
  finishes everything it holds, deregisters and returns 0.
- Redis going away is retryable: the loop backs off (capped) and carries on when
  Redis answers again; the engine keeps its state meanwhile. Entries it held are
  reclaimed by other workers if its heartbeat expires meanwhile; the
  keep-alive then reports them lost and the worker drops that work.
- Every entry it holds is kept alive (``Streams.keep_alive``) so a long prefill or
  decode is never stolen, and every ``reclaim_interval_s`` it takes over entries a
  dead worker of its pool left pending (``Streams.reclaim_stale``): a worker is dead
  when its heartbeat (a thread of its own, beating however slow the engine is) has
  expired from the registry, never because one of its entries has waited long. It
  also takes back entries pending under its own id that it does not hold: a previous
  process's under the same id, or work it let go of when Redis failed mid-hand-off.

What must stay true: an entry is acknowledged only when its request has ended
(a final or error event published) or was handed off, so a worker killed at any
moment loses no request.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis

from queueing.pools import Pool
from workers.protocol import (
    KEEPALIVE_INTERVAL_MS,
    LEASE_MS,
    RECLAIM_MIN_IDLE_MS,
    KeySpace,
    Streams,
    TokenEvent,
    check_request_id,
)
from workers.registry import Heartbeat, Registry, WorkerInfo
from workers.transfer import KvTransportUnavailableError
from workers.worker_metrics import WorkerMetrics, WorkerOutcome

if TYPE_CHECKING:  # the engine needs torch; this module's users import it anyway
    from workers.engine import Engine, GeneratedToken
    from workers.transfer import KvTransport

logger = logging.getLogger(__name__)

RETRYABLE_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    KvTransportUnavailableError,
)


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """How one worker runs.

    ``token_budget``: tokens per engine step (Sarathi's budget). ``num_blocks`` x
    ``block_size`` tokens of KV cache. ``max_running``: sequences in one batch
    (a prefill worker's prompts in flight; a decode worker's batch). ``idle_block_ms``:
    how long an idle worker blocks on its stream (it wakes at once when work lands).
    ``kv_receive_timeout_s``: how long a decode worker waits for a hand-off's KV.
    ``reclaim_min_idle_ms``: the grace before the entries of a worker gone from the
    registry are taken; ``lease_ms``: how long an entry of a worker that still beats
    may go untouched before it is taken anyway (a wedged loop).
    """

    worker_id: str
    pool: Pool
    token_budget: int = 512
    num_blocks: int = 1024
    block_size: int = 16
    max_running: int = 64
    key_prefix: str = "sara"
    idle_block_ms: int = 200
    reclaim_interval_s: float = 2.0
    reclaim_min_idle_ms: int = RECLAIM_MIN_IDLE_MS
    lease_ms: int = LEASE_MS
    keepalive_interval_s: float = KEEPALIVE_INTERVAL_MS / 3000.0
    kv_ttl_s: float = 120.0
    kv_receive_timeout_s: float = 10.0
    max_backoff_s: float = 1.0

    def __post_init__(self) -> None:
        check_request_id(self.worker_id)
        if not isinstance(self.pool, Pool):
            raise ValueError(f"pool: expected a Pool, got {self.pool!r}")
        for name in (
            "token_budget",
            "num_blocks",
            "block_size",
            "max_running",
            "idle_block_ms",
            "reclaim_min_idle_ms",
            "lease_ms",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        for name in (
            "reclaim_interval_s",
            "keepalive_interval_s",
            "kv_ttl_s",
            "kv_receive_timeout_s",
            "max_backoff_s",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: expected seconds > 0, got {value!r}")
        if self.keepalive_interval_s * 1000 >= self.lease_ms:
            raise ValueError(
                f"keepalive_interval_s: {self.keepalive_interval_s} s must be well below "
                f"lease_ms ({self.lease_ms} ms), or live work is stolen"
            )
        KeySpace(self.key_prefix)  # validates


class Worker(ABC):
    """The loop and bookkeeping common to both pools; subclasses do the work."""

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        engine: Engine,
        transport: KvTransport,
        client: redis.Redis,
        metrics: WorkerMetrics,
        address: str = "",
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        # Both pools export or restore KV after a sequence finished: it must stay held.
        if not engine.scheduler.keep_finished_kv:
            raise ValueError("engine: a worker's engine must keep finished KV (keep_finished_kv)")
        self.engine = engine
        self.transport = transport
        self.settings = settings
        self.client = client
        self.keys = KeySpace(settings.key_prefix)
        self.streams = Streams(client, self.keys)
        self.metrics = metrics
        self.address = address
        self.clock = clock
        self.wall_clock = wall_clock
        self.draining = False
        self.redis_ok = False
        self._registry = Registry(client, self.keys)
        self._heartbeat: Heartbeat | None = None
        self._last_keepalive = -math.inf
        self._last_reclaim = -math.inf

    # -- what subclasses provide ------------------------------------------------------------

    @abstractmethod
    def iterate(self) -> None:
        """Read, step, publish: one turn of the loop (Redis errors propagate)."""

    @abstractmethod
    def held_entry_ids(self) -> list[str]:
        """Stream entries this worker holds (not yet acknowledged)."""

    @abstractmethod
    def drop_lost(self, entry_ids: set[str]) -> None:
        """Forget work whose entries another worker took over (or that was cancelled)."""

    @abstractmethod
    def capacity(self) -> int:
        """Requests this worker can hold at once (for the registry)."""

    @abstractmethod
    def queue_depth(self) -> int:
        """Requests it holds now."""

    @abstractmethod
    def kv_utilization(self) -> float:
        """Fraction of its KV cache in use."""

    @property
    @abstractmethod
    def idle(self) -> bool:
        """Nothing held: a draining worker may exit."""

    # -- the loop -------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.redis_ok and not self.draining

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            pool=self.settings.pool,
            worker_id=self.settings.worker_id,
            ready=self.ready,
            capacity=self.capacity(),
            queue_depth=self.queue_depth(),
            kv_utilization=min(1.0, max(0.0, self.kv_utilization())),
            address=self.address,
            draining=self.draining,
        )

    def readiness(self) -> tuple[bool, dict[str, object]]:
        """For ``/readyz``."""
        return self.ready, {
            "ready": self.ready,
            "pool": self.settings.pool.value,
            "worker_id": self.settings.worker_id,
            "draining": self.draining,
            "redis": "ok" if self.redis_ok else "unreachable",
            "queue_depth": self.queue_depth(),
        }

    def run(self, stop: threading.Event) -> int:
        """Serve until ``stop`` is set and everything held is finished; returns 0."""
        self._heartbeat = Heartbeat(self._registry, self.info, interval_s=1.0)
        backoff_s = 0.05
        self._connect_once()
        self._heartbeat.start()
        logger.info("%s worker %s started", self.settings.pool.value, self.settings.worker_id)
        while True:
            if stop.is_set() and not self.draining:
                self.start_drain()
            if self.draining and self.idle:
                break
            try:
                self.maintain()
                self.iterate()
            except RETRYABLE_ERRORS as exc:
                if self.redis_ok:
                    logger.warning("redis unreachable (retrying): %s", exc)
                self.redis_ok = False
                time.sleep(backoff_s)
                backoff_s = min(2 * backoff_s, self.settings.max_backoff_s)
                continue
            if not self.redis_ok:
                logger.info("redis reachable again")
                self.redis_ok = True
                self._heartbeat.beat_now()
            backoff_s = 0.05
            self.publish_gauges()
        self._heartbeat.stop(deregister=True)
        logger.info("%s worker %s drained", self.settings.pool.value, self.settings.worker_id)
        return 0

    def _connect_once(self) -> None:
        try:
            self.streams.ensure_groups()
            self.redis_ok = True
        except RETRYABLE_ERRORS as exc:
            logger.warning("redis unreachable at start (retrying): %s", exc)

    def start_drain(self) -> None:
        logger.info("draining: no new work; finishing %d held", self.queue_depth())
        self.draining = True
        if self._heartbeat is not None:
            self._heartbeat.beat_now()  # the live set learns it at once, not at the next beat

    def maintain(self) -> None:
        """Keep held entries alive; take over entries dead workers left (not when draining)."""
        now = self.clock()
        if now - self._last_keepalive >= self.settings.keepalive_interval_s:
            self._last_keepalive = now
            held = self.held_entry_ids()
            if held:
                lost = self.streams.keep_alive(self.settings.pool, self.settings.worker_id, held)
                if lost:
                    logger.warning("lost %d entries to other workers: dropping them", len(lost))
                    self.drop_lost(lost)
        if not self.draining and now - self._last_reclaim >= self.settings.reclaim_interval_s:
            self._last_reclaim = now
            deliveries = self.streams.reclaim_stale(
                self.settings.pool,
                self.settings.worker_id,
                live={w.worker_id for w in self._registry.live(self.settings.pool)},
                held=set(self.held_entry_ids()),
                min_idle_ms=self.settings.reclaim_min_idle_ms,
                lease_ms=self.settings.lease_ms,
                count=self.reclaim_room(),
            )
            for delivery in deliveries:
                logger.info(
                    "took over entry %s (delivery %d)", delivery.entry_id, delivery.deliveries
                )
                self.admit_reclaimed(delivery)

    @abstractmethod
    def admit_reclaimed(self, delivery: object) -> None:
        """Serve an entry taken over from a dead worker."""

    def reclaim_room(self) -> int:
        """Entries it may take over now: one it cannot serve would wait under its
        name, unseen by the others, with a delivery spent."""
        return 16

    def waiting_requests(self) -> int:
        """Requests it holds that its engine has not started (an engine's waiting queue)."""
        return self.engine.num_waiting

    def publish_gauges(self) -> None:
        self.metrics.gauges(
            queue_depth=self.queue_depth(),
            kv_utilization=self.kv_utilization(),
            waiting=self.waiting_requests(),
            running=self.engine.num_running,
        )

    def fail(
        self, entry_id: str, request_id: str, index: int, message: str, *, prompt_tokens: int = 0
    ) -> None:
        """End a request with an error event and acknowledge its entry."""
        logger.warning("request %s failed: %s", request_id, message)
        self.streams.publish_token(request_id, TokenEvent.failure(index, message))
        self.streams.ack(self.settings.pool, [entry_id])
        self.metrics.ended(WorkerOutcome.FAILED, prompt_tokens=prompt_tokens, output_tokens=index)

    def timed_step(self, engine: Engine) -> list[GeneratedToken]:
        """One engine step, timed for ``sara_worker_iteration_seconds``."""
        before = engine.last_plan
        started = self.clock()
        tokens = engine.step()
        elapsed_s = self.clock() - started
        plan = engine.last_plan
        if plan is not None and plan is not before:  # an empty step keeps the old plan
            self.metrics.stepped(elapsed_s=elapsed_s, batch_tokens=plan.num_batched_tokens)
        return tokens
