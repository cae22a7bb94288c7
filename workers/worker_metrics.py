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

With an engine flavour (``sara worker --metrics-flavor vllm|sglang``) the same events
are also exposed under that engine's names (``workers.engine_metrics``): every event
is recorded here once, and the flavour's exposition only names, labels and buckets it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from controller.config import MetricsFlavor
from queueing.pools import Pool
from workers.engine_metrics import (
    EndedRequest,
    EngineExposition,
    EngineIdentity,
    RequestEnd,
    engine_exposition,
)

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


# The engines' finish reason of each outcome (a prefill worker's hand-off ends its
# part as a vLLM prefill instance's max_tokens=1 request ends: by length).
_ENDS = {
    WorkerOutcome.HANDED_OFF: RequestEnd.LENGTH,
    WorkerOutcome.FINISHED: RequestEnd.LENGTH,
    WorkerOutcome.CANCELLED: RequestEnd.ABORT,
    WorkerOutcome.FAILED: RequestEnd.ERROR,
}


class TransferDirection(enum.Enum):
    SEND = "send"
    RECEIVE = "receive"


class WorkerMetrics:
    """The metrics of one worker of ``pool``; ``exposition()`` is the ``/metrics`` body.

    ``flavors`` adds those engines' families (``identity`` names the model and its
    context for them; required unless only ``sara`` is asked for). Several engines at
    once serve one purpose: comparing the controller's flavours on the same traffic;
    each flavour's queries read only its own engine's names.
    """

    def __init__(
        self,
        pool: Pool,
        registry: CollectorRegistry | None = None,
        *,
        flavors: Sequence[MetricsFlavor] = (MetricsFlavor.SARA,),
        identity: EngineIdentity | None = None,
    ) -> None:
        self.pool = pool
        self.registry = registry or CollectorRegistry()
        r = self.registry
        engines = [f for f in dict.fromkeys(flavors) if f is not MetricsFlavor.SARA]
        if engines and identity is None:
            raise ValueError(f"identity: the {engines[0].value} flavour names the model it serves")
        if identity is not None and identity.pool is not pool:
            raise ValueError(f"identity: pool {identity.pool.value} is not this worker's")
        self.engines: list[EngineExposition] = []
        if identity is not None:
            for flavor in engines:
                exposition = engine_exposition(flavor, identity, r)
                if exposition is not None:
                    self.engines.append(exposition)
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

    def ended(
        self,
        outcome: WorkerOutcome,
        *,
        prompt_tokens: int = 0,
        output_tokens: int = 0,
        stopped: bool = False,
        e2e_s: float | None = None,
        tpot_s: float | None = None,
    ) -> None:
        """A request left this worker: ``output_tokens`` it has so far (all of them on
        a decode worker), ``stopped`` on EOS, ``e2e_s`` since its arrival at the router,
        ``tpot_s`` its mean gap between tokens where this worker timed them."""
        self._requests.labels(self.pool.value, outcome.value).inc()
        if not self.engines:
            return
        end = _ENDS[outcome]
        if stopped and outcome is WorkerOutcome.FINISHED:
            end = RequestEnd.STOP
        # Wall-clock differences across machines can come out a little negative.
        request = EndedRequest(
            end=end,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            e2e_s=None if e2e_s is None else max(0.0, e2e_s),
            tpot_s=None if tpot_s is None else max(0.0, tpot_s),
        )
        for engine in self.engines:
            engine.ended(request)

    def first_token(self, ttft_s: float) -> None:
        """This worker's first token of a request, ``ttft_s`` after it arrived here."""
        for engine in self.engines:
            engine.first_token(max(0.0, ttft_s))

    def token_gaps(self, gaps_s: Sequence[float]) -> None:
        """The gap before each token this worker generated."""
        gaps = [max(0.0, g) for g in gaps_s]
        for engine in self.engines:
            engine.token_gaps(gaps)

    def stepped(self, *, elapsed_s: float, batch_tokens: int) -> None:
        """One engine step that ran a plan."""
        self.iteration_s.observe(elapsed_s)
        self.batch_tokens.observe(batch_tokens)
        for engine in self.engines:
            engine.stepped(batch_tokens)

    def gauges(
        self, *, queue_depth: int, kv_utilization: float, waiting: int, running: int
    ) -> None:
        """The worker's state now: held requests, of which ``waiting`` not yet started
        by its engine and ``running`` in its batch; the KV fraction in use."""
        self.queue_depth.set(queue_depth)
        self.kv_utilization.set(kv_utilization)
        for engine in self.engines:
            engine.gauges(waiting=waiting, running=running, kv_usage=kv_utilization)

    def transferred(
        self, *, transport: str, direction: TransferDirection, nbytes: int, duration_s: float
    ) -> None:
        self._transfer_s.labels(transport, direction.value).observe(duration_s)
        self._transfer_bytes.labels(transport, direction.value).inc(nbytes)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
