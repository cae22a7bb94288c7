"""The prefill worker: prompts from the shared prefill stream, in chunks, to decode.

Each request it takes runs through the engine with ``max_tokens=1`` (the chunked
prefill and the first token, sampled with the request's own seed so that a re-run
samples the same token). When the prompt completes:

1. it publishes the first token (index 0) at once: that is the request's TTFT;
2. if the request is over (``max_tokens`` 1, or the first token is EOS) the event
   says so and the entry is acknowledged;
3. otherwise it exports the sequence's KV, sends it over the KV transport, and
   hands the request to the decode stream, atomically with the acknowledgement.

Taking work: the pool is one queue served by N workers (the M/G/N queue of the
capacity model), so a worker takes a new prompt only when it would start on it in
the next step: when it holds nothing, or when its last step left token budget
unused and nothing it holds is still waiting for admission. Taking more would park
prompts in one worker's backlog while another worker idles.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from workers.engine import FinishedRequest, FinishReason
from workers.protocol import (
    DecodeRequest,
    Delivery,
    KvTransportName,
    PrefillRequest,
    TokenEvent,
)
from workers.protocol import FinishReason as EventFinish
from workers.sampling import SamplingParams
from workers.transfer import (
    KvPayload,
    KvTransferError,
    KvTransportUnavailableError,
)
from workers.worker import Worker, WorkerSettings
from workers.worker_metrics import TransferDirection, WorkerOutcome

logger = logging.getLogger(__name__)


@dataclass
class _Held:
    entry_id: str
    request: PrefillRequest
    seq_id: int


class PrefillWorker(Worker):
    """See the module docstring. ``engine`` must keep finished KV (``keep_finished_kv``)."""

    def __init__(self, settings: WorkerSettings, **kwargs: Any) -> None:
        super().__init__(settings, **kwargs)
        self._held: dict[int, _Held] = {}  # by seq_id
        self._spare_budget = True  # the last step left budget unused

    # -- bookkeeping --------------------------------------------------------------------------

    def held_entry_ids(self) -> list[str]:
        return [h.entry_id for h in self._held.values()]

    def drop_lost(self, entry_ids: set[str]) -> None:
        for seq_id, held in list(self._held.items()):
            if held.entry_id in entry_ids:
                self._abort(seq_id)

    def capacity(self) -> int:
        return self.settings.max_running

    def queue_depth(self) -> int:
        return len(self._held)

    def kv_utilization(self) -> float:
        cache = self.engine.kv_cache
        return cache.num_used_blocks / cache.num_blocks

    @property
    def idle(self) -> bool:
        # KV parked for a pull (workers.kv_pull) must be served before the worker goes.
        return not self._held and not getattr(self.transport, "pending", 0)

    def _abort(self, seq_id: int) -> None:
        self._held.pop(seq_id, None)
        try:
            self.engine.abort(seq_id)
        except KeyError:  # finished meanwhile: it only holds its KV
            self.engine.release(seq_id)

    # -- the loop -----------------------------------------------------------------------------

    def _wants_work(self) -> bool:
        if self.draining or len(self._held) >= self.settings.max_running:
            return False
        return not self._held or (self._spare_budget and self.engine.num_waiting == 0)

    def iterate(self) -> None:
        if self._wants_work():
            block_ms = None if self._held else self.settings.idle_block_ms
            for delivery in self.streams.read_prefill(
                self.settings.worker_id, count=1, block_ms=block_ms
            ):
                self._admit(delivery)
        if not self._held:
            return
        self._drop_cancelled()
        if not self.engine.has_unfinished:
            return
        self.timed_step(self.engine)
        plan = self.engine.last_plan
        self._spare_budget = plan is None or plan.num_batched_tokens < self.engine.token_budget
        for finished in self.engine.take_finished():
            held = self._held.pop(finished.seq_id, None)
            if held is not None:
                self._complete(held, finished)

    def admit_reclaimed(self, delivery: object) -> None:
        assert isinstance(delivery, Delivery) and isinstance(delivery.message, PrefillRequest)
        self._admit(delivery)

    def reclaim_room(self) -> int:
        return max(0, self.settings.max_running - len(self._held))

    def _admit(self, delivery: Delivery[PrefillRequest]) -> None:
        req = delivery.message
        if req.expired(self.wall_clock()) or self.streams.cancelled([req.request_id]):
            self.streams.ack(self.settings.pool, [delivery.entry_id])
            self.metrics.ended(WorkerOutcome.CANCELLED, prompt_tokens=req.prompt_tokens)
            return
        params = SamplingParams(**{**req.sampling_kwargs(), "max_tokens": 1})
        # The KV must hold the whole request on the decode side; checking it here
        # turns an impossible request into an error now, not after its prefill.
        try:
            self.engine.check_request(req.prompt_token_ids, SamplingParams(**req.sampling_kwargs()))
            seq_id = self.engine.add_request(req.prompt_token_ids, params)
        except ValueError as exc:
            prompt = req.prompt_tokens
            self.fail(delivery.entry_id, req.request_id, 0, str(exc), prompt_tokens=prompt)
            return
        self._held[seq_id] = _Held(entry_id=delivery.entry_id, request=req, seq_id=seq_id)

    def _drop_cancelled(self) -> None:
        by_request = {h.request.request_id: seq_id for seq_id, h in self._held.items()}
        now_s = self.wall_clock()
        gone = self.streams.cancelled(list(by_request))
        gone |= {rid for rid, s in by_request.items() if self._held[s].request.expired(now_s)}
        for rid in gone:
            held = self._held[by_request[rid]]
            self._abort(held.seq_id)
            self.streams.ack(self.settings.pool, [held.entry_id])
            self.metrics.ended(WorkerOutcome.CANCELLED, prompt_tokens=held.request.prompt_tokens)

    def _complete(self, held: _Held, finished: FinishedRequest) -> None:
        req, seq_id = held.request, held.seq_id
        if not finished.output_token_ids:  # aborted: nothing to send
            self.engine.release(seq_id)
            return
        token = finished.output_token_ids[0]
        over = finished.finish_reason is FinishReason.STOP or req.max_tokens == 1
        if over:
            stop = finished.finish_reason is FinishReason.STOP
            event = TokenEvent(
                index=0, token=token, finish_reason=EventFinish.STOP if stop else EventFinish.LENGTH
            )
            self.engine.release(seq_id)
            self.streams.publish_token(req.request_id, event)
            ttft_s = self.wall_clock() - req.arrival_s
            self.metrics.first_token(ttft_s)
            self.streams.ack(self.settings.pool, [held.entry_id])
            self.metrics.ended(
                WorkerOutcome.FINISHED, prompt_tokens=req.prompt_tokens, output_tokens=1,
                stopped=stop, e2e_s=ttft_s,
            )  # fmt: skip
            return
        # The first token goes out before the KV moves: the client's TTFT does not wait
        # for the transfer. A re-run after a crash republishes index 0; readers keep one.
        self.streams.publish_token(req.request_id, TokenEvent(index=0, token=token))
        # TTFT from the arrival at the router: the wait in the pool's stream is the
        # queueing the prefill pool's size sets (an engine's waiting queue).
        self.metrics.first_token(self.wall_clock() - req.arrival_s)
        snapshot = self.engine.export_kv(seq_id)
        self.engine.release(seq_id)
        payload = KvPayload.from_kv(req.request_id, key=snapshot.key, value=snapshot.value)
        try:
            receipt = self.transport.send(payload)
        except KvTransportUnavailableError:
            raise  # Redis is down: the entry stays pending and is re-run after reclaim
        except KvTransferError as exc:
            self.fail(
                held.entry_id, req.request_id, 1, f"KV transfer failed: {exc}",
                prompt_tokens=req.prompt_tokens,
            )  # fmt: skip
            return
        if not getattr(self.transport, "deferred", False):  # else timed when it is pulled
            self.metrics.transferred(
                transport=receipt.transport.value,
                direction=TransferDirection.SEND,
                nbytes=receipt.nbytes,
                duration_s=receipt.duration_s,
            )
        self.streams.hand_off_to_decode(
            held.entry_id,
            DecodeRequest(
                request=req,
                first_token=token,
                kv_transport=KvTransportName(receipt.transport.value),
                kv_handle=req.request_id,
                prefill_worker=self.settings.worker_id,
                prefill_done_s=self.wall_clock(),
            ),
        )
        self.metrics.ended(
            WorkerOutcome.HANDED_OFF, prompt_tokens=req.prompt_tokens, output_tokens=1,
            e2e_s=self.wall_clock() - req.arrival_s,
        )  # fmt: skip
