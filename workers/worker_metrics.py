"""A worker's Prometheus metrics (one registry per worker process).

- ``sara_worker_iteration_seconds{pool}``: wall time of one engine step (the
  forward pass plus sampling), the quantity the iteration-time profile models.
- ``sara_worker_batch_tokens{pool}``: tokens in one step (prefill chunks + decodes).
- ``sara_worker_queue_depth{pool}``: requests this worker holds now, waiting or
  running (a decode worker counts the one it read but could not admit yet).
- ``sara_worker_kv_utilization{pool}``: fraction of the KV cache's blocks in use.
- ``sara_worker_requests_total{pool,outcome}``: requests this worker ended, by
  ``WorkerOutcome`` (a prefill worker's hand-off counts as ``handed_off``).
- ``sara_kv_transfer_seconds{transport}``: one KV send (prefill side) or receive
  (decode side, ``direction="receive"``), by transport.
- ``sara_kv_transfer_bytes_total{transport,direction}``: KV bytes moved.

Bucket bounds: iteration times from 1 ms (a small GPU decode step) to 10 s (a
CPU step of a large batch); transfers from 100 µs to 30 s.
"""

from __future__ import annotations

import enum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from queueing.pools import Pool

ITERATION_BUCKETS_S = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0,
    10.0,
)  # fmt: skip
BATCH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
TRANSFER_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0,
)  # fmt: skip


class WorkerOutcome(enum.Enum):
    HANDED_OFF = "handed_off"  # prefill: KV sent, request queued for decode
    FINISHED = "finished"  # the last token was published here
    CANCELLED = "cancelled"  # the router gave up (timeout, client gone) before the end
    FAILED = "failed"  # ended with an error event (bad prompt for this model, lost KV...)


class TransferDirection(enum.Enum):
    SEND = "send"
    RECEIVE = "receive"


class WorkerMetrics:
    """The metrics of one worker of ``pool``; ``exposition()`` is the ``/metrics`` body."""

    def __init__(self, pool: Pool, registry: CollectorRegistry | None = None) -> None:
        self.pool = pool
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.iteration_s = Histogram(
            "sara_worker_iteration_seconds",
            "Wall time of one engine step (forward pass and sampling).",
            ["pool"],
            buckets=ITERATION_BUCKETS_S,
            registry=r,
        ).labels(pool.value)
        self.batch_tokens = Histogram(
            "sara_worker_batch_tokens",
            "Tokens in one engine step: prefill chunk tokens plus one per decode.",
            ["pool"],
            buckets=BATCH_TOKEN_BUCKETS,
            registry=r,
        ).labels(pool.value)
        self.queue_depth = Gauge(
            "sara_worker_queue_depth",
            "Requests this worker holds now, waiting or running.",
            ["pool"],
            registry=r,
        ).labels(pool.value)
        self.kv_utilization = Gauge(
            "sara_worker_kv_utilization",
            "Fraction of this worker's KV-cache blocks in use.",
            ["pool"],
            registry=r,
        ).labels(pool.value)
        self._requests = Counter(
            "sara_worker_requests",
            "Requests this worker ended, by outcome.",
            ["pool", "outcome"],
            registry=r,
        )
        self._transfer_s = Histogram(
            "sara_kv_transfer_seconds",
            "Time of one KV-cache transfer (send on prefill workers, receive on decode).",
            ["transport", "direction"],
            buckets=TRANSFER_BUCKETS_S,
            registry=r,
        )
        self._transfer_bytes = Counter(
            "sara_kv_transfer_bytes",
            "KV-cache bytes moved between workers.",
            ["transport", "direction"],
            registry=r,
        )
        for outcome in WorkerOutcome:  # every series exists from the start (rate() of 0)
            self._requests.labels(pool.value, outcome.value)

    def ended(self, outcome: WorkerOutcome) -> None:
        self._requests.labels(self.pool.value, outcome.value).inc()

    def transferred(
        self, *, transport: str, direction: TransferDirection, nbytes: int, duration_s: float
    ) -> None:
        self._transfer_s.labels(transport, direction.value).observe(duration_s)
        self._transfer_bytes.labels(transport, direction.value).inc(nbytes)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
