"""The decode worker: prefilled requests from the decode stream, decoded stall-free.

It reads one hand-off at a time, and only when its batch has a free place; the
entry stays with it (pending, kept alive) until its KV cache has room for the
whole request (prompt + ``max_tokens``), so a worker never takes more than it can
serve while another has room. Then it takes the KV from the transport, loads it
into its paged cache and decodes the request with the others, one token per step,
publishing each step's tokens in one round trip. The entry is acknowledged when the
last token (with its ``finish_reason``) is out.

Restoring lost KV: a transfer can be gone — taken by a decode worker that then died
(taking is final), expired in a long queue, or corrupt. Then the worker recomputes
it: it prefills prompt + the tokens already published (``Streams.published_tokens``)
as a restore sequence in its own engine (chunked, so the running decodes do not
stall), exports that KV and imports it as the request, which resumes with the next
token index and the next per-token seed: the continuation is the one the lost
worker would have produced.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

from workers.engine import FinishReason, KvCacheFullError
from workers.kv_pull import KvPullClient
from workers.paged_attention import KvSnapshot
from workers.protocol import DecodeRequest, Delivery, KvTransportName, TokenEvent
from workers.protocol import FinishReason as EventFinish
from workers.sampling import SamplingParams
from workers.transfer import KvTransferError, KvTransport, KvTransportUnavailableError
from workers.worker import Worker, WorkerSettings
from workers.worker_metrics import TransferDirection, WorkerOutcome

logger = logging.getLogger(__name__)

_FINISH = {FinishReason.STOP: EventFinish.STOP, FinishReason.LENGTH: EventFinish.LENGTH}


@dataclass
class _Held:
    """A request this worker holds: decoding, or restoring its KV (``restore`` set)."""

    entry_id: str
    msg: DecodeRequest
    seq_id: int
    outputs: list[int]  # tokens published so far, index 0 first
    restoring: bool = False
    snapshot: KvSnapshot | None = field(default=None, repr=False)  # restored, awaiting room
    # Wall-clock time of its last token (the hand-off's for the first gap) and whether
    # this worker times its tokens from the hand-off (not when taken over mid-way).
    last_token_s: float = 0.0
    from_hand_off: bool = True
    generated_here: int = 0

    @property
    def request_id(self) -> str:
        return self.msg.request.request_id

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(**self.msg.request.sampling_kwargs())


class DecodeWorker(Worker):
    """See the module docstring. ``engine`` must keep finished KV (``keep_finished_kv``):
    restore sequences are exported after they finish."""

    def __init__(
        self, settings: WorkerSettings, *, pull: KvPullClient | None = None, **kwargs: Any
    ) -> None:
        super().__init__(settings, **kwargs)
        self.pull = pull  # hand-offs whose KV waits on their prefill worker (a torch link)
        self._pending: Delivery[DecodeRequest] | None = None  # read, not admitted yet
        self._pending_reclaimed = False
        self._held: dict[int, _Held] = {}  # by seq_id
        self._seq_ids = itertools.count()

    # -- bookkeeping --------------------------------------------------------------------------

    def waiting_requests(self) -> int:
        # The hand-off it read but has no room for yet waits as in an engine's queue.
        return self.engine.num_waiting + (self._pending is not None)

    def held_entry_ids(self) -> list[str]:
        ids = [h.entry_id for h in self._held.values()]
        if self._pending is not None:
            ids.append(self._pending.entry_id)
        return ids

    def drop_lost(self, entry_ids: set[str]) -> None:
        if self._pending is not None and self._pending.entry_id in entry_ids:
            self._pending = None
        for seq_id, held in list(self._held.items()):
            if held.entry_id in entry_ids:
                self._abort(seq_id)

    def capacity(self) -> int:
        return self.settings.max_running

    def queue_depth(self) -> int:
        return len(self._held) + (self._pending is not None)

    def kv_utilization(self) -> float:
        cache = self.engine.kv_cache
        return cache.num_used_blocks / cache.num_blocks

    @property
    def idle(self) -> bool:
        return not self._held and self._pending is None

    def _abort(self, seq_id: int) -> None:
        held = self._held.pop(seq_id, None)
        if held is not None and held.snapshot is not None:
            return  # restored KV waiting for room: nothing in the engine
        try:
            self.engine.abort(seq_id)
        except KeyError:  # finished meanwhile: it only holds its KV
            self.engine.release(seq_id)

    # -- the loop -----------------------------------------------------------------------------

    def iterate(self) -> None:
        self._import_restored()
        if self._pending is None and not self.draining and self._has_place():
            block_ms = None if self._held else self.settings.idle_block_ms
            got = self.streams.read_decode(self.settings.worker_id, count=1, block_ms=block_ms)
            if got:
                self._pending, self._pending_reclaimed = got[0], False
        if self._pending is not None:
            self._try_admit()
        if not self._held:
            return
        self._drop_cancelled()
        if self.engine.has_unfinished:
            self._publish(self.timed_step(self.engine))

    def admit_reclaimed(self, delivery: object) -> None:
        assert isinstance(delivery, Delivery) and isinstance(delivery.message, DecodeRequest)
        # reclaim_room() asked for one only when nothing is pending: it becomes the
        # pending entry (kept alive) until it is admitted.
        assert self._pending is None, "reclaim_room() allows one only when none is pending"
        self._pending, self._pending_reclaimed = delivery, True
        self._try_admit()

    def reclaim_room(self) -> int:
        return 1 if self._pending is None and self._has_place() else 0

    def _has_place(self) -> bool:
        return len(self._held) < self.settings.max_running

    def _try_admit(self) -> None:
        delivery = self._pending
        assert delivery is not None
        msg, req = delivery.message, delivery.message.request
        rid = req.request_id
        if req.expired(self.wall_clock()) or self.streams.cancelled([rid]):
            self._pending = None
            self.transport.discard(rid)
            self.streams.ack(self.settings.pool, [delivery.entry_id])
            self.metrics.ended(
                WorkerOutcome.CANCELLED, prompt_tokens=req.prompt_tokens, output_tokens=1
            )
            return
        params = SamplingParams(**req.sampling_kwargs())
        try:
            self.engine.check_request(req.prompt_token_ids, params)
        except ValueError as exc:
            self._pending = None
            self.transport.discard(rid)
            self.fail(
                delivery.entry_id, rid, 1, f"cannot decode here: {exc}",
                prompt_tokens=req.prompt_tokens,
            )  # fmt: skip
            return
        if not self._has_place() or not self.engine.can_admit(req.prompt_tokens + req.max_tokens):
            return  # stays pending (kept alive) until a running request finishes
        outputs = [msg.first_token]
        if self._pending_reclaimed:
            outputs = self.streams.published_tokens(rid) or outputs
        self._pending = None
        from_hand_off = len(outputs) == 1
        held = _Held(
            entry_id=delivery.entry_id,
            msg=msg,
            seq_id=next(self._seq_ids),
            outputs=outputs,
            last_token_s=msg.prefill_done_s if from_hand_off else self.wall_clock(),
            from_hand_off=from_hand_off,
        )
        if self._finished_already(held):
            return
        kv = None if len(outputs) > 1 else self._receive(msg)
        if kv is None:
            self._start_restore(held)
            return
        self._import(held, kv)

    def _finished_already(self, held: _Held) -> bool:
        """A reclaimed request whose dead worker published every token but the end mark."""
        req = held.msg.request
        last = held.outputs[-1]
        eos = not req.ignore_eos and last in self.engine.config.eos_token_ids
        if len(held.outputs) < req.max_tokens and not eos:
            return False
        reason = EventFinish.STOP if eos else EventFinish.LENGTH
        event = TokenEvent(index=len(held.outputs) - 1, token=last, finish_reason=reason)
        self.streams.publish_token(held.request_id, event)
        self.streams.ack(self.settings.pool, [held.entry_id])
        self.metrics.ended(
            WorkerOutcome.FINISHED, prompt_tokens=req.prompt_tokens,
            output_tokens=len(held.outputs), stopped=eos,
            e2e_s=self.wall_clock() - req.arrival_s,
        )  # fmt: skip
        return True

    def _receive(self, msg: DecodeRequest) -> KvSnapshot | None:
        """The hand-off's KV, or ``None`` when it is lost (the caller recomputes it)."""
        request_id = msg.request.request_id
        started = self.clock()
        try:
            if msg.kv_transport is KvTransportName.REDIS:
                transport = _transport_name(self.transport)
                payload = self.transport.receive(
                    request_id, timeout_s=self.settings.kv_receive_timeout_s
                )
            elif self.pull is not None:
                transport = self.pull.transport.value
                payload = self.pull.receive_from(
                    msg.prefill_worker, request_id, timeout_s=self.settings.kv_receive_timeout_s
                )
            else:
                logger.warning(
                    "KV of %s is on a %s link and this worker has none: recomputing it",
                    request_id,
                    msg.kv_transport.value,
                )
                return None
        except KvTransportUnavailableError:
            raise  # Redis is down: retried by the loop, the entry stays pending
        except KvTransferError as exc:
            logger.warning("KV of %s lost (%s): recomputing it", request_id, exc)
            return None
        self.metrics.transferred(
            transport=transport,
            direction=TransferDirection.RECEIVE,
            nbytes=payload.nbytes,
            duration_s=self.clock() - started,
        )
        return KvSnapshot(key=payload.key, value=payload.value)

    def _import(self, held: _Held, kv: KvSnapshot) -> bool:
        req = held.msg.request
        try:
            self.engine.import_kv(
                held.seq_id,
                kv,
                kv.num_tokens,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=held.outputs,
                params=held.params,
            )
        except KvCacheFullError:
            held.snapshot = kv  # room went to a restore meanwhile: retry next step
            self._held[held.seq_id] = held
            return False
        held.snapshot = None
        self._held[held.seq_id] = held
        return True

    def _import_restored(self) -> None:
        for held in [h for h in self._held.values() if h.snapshot is not None]:
            del self._held[held.seq_id]
            assert held.snapshot is not None
            self._import(held, held.snapshot)

    def _start_restore(self, held: _Held) -> None:
        """Prefill prompt + outputs[:-1] here to rebuild the lost KV (see the docstring)."""
        req = held.msg.request
        tokens = list(req.prompt_token_ids) + held.outputs[:-1]
        held.restoring = True
        self.engine.add_request(
            tokens, SamplingParams(max_tokens=1, ignore_eos=True), seq_id=held.seq_id
        )
        self._held[held.seq_id] = held

    def _drop_cancelled(self) -> None:
        by_request = {h.request_id: seq_id for seq_id, h in self._held.items()}
        now_s = self.wall_clock()
        gone = self.streams.cancelled(list(by_request))
        gone |= {r for r, s in by_request.items() if self._held[s].msg.request.expired(now_s)}
        for rid in gone:
            held = self._held[by_request[rid]]
            self._abort(held.seq_id)
            self.streams.ack(self.settings.pool, [held.entry_id])
            self.metrics.ended(
                WorkerOutcome.CANCELLED, prompt_tokens=held.msg.request.prompt_tokens,
                output_tokens=len(held.outputs),
            )  # fmt: skip

    def _publish(self, tokens: list[Any]) -> None:
        finished = {f.seq_id: f for f in self.engine.take_finished()}
        events: list[tuple[str, TokenEvent]] = []
        done: list[_Held] = []
        sent: list[_Held] = []
        for seq_id, token in tokens:
            held = self._held.get(seq_id)
            if held is None or held.restoring:
                continue
            end = finished.get(seq_id)
            reason = None if end is None else _FINISH.get(end.finish_reason)
            events.append(
                (
                    held.request_id,
                    TokenEvent(index=len(held.outputs), token=token, finish_reason=reason),
                )
            )
            held.outputs.append(token)
            sent.append(held)
            if end is not None:
                done.append(held)
        if events:
            self.streams.publish_tokens(events)
            self._time_tokens(sent)
        for held in done:
            del self._held[held.seq_id]
            self.engine.release(held.seq_id)
            self.streams.ack(self.settings.pool, [held.entry_id])
            self._ended(held, finished[held.seq_id].finish_reason is FinishReason.STOP)
        for seq_id in finished:
            held = self._held.get(seq_id)
            if held is not None and held.restoring:
                self._finish_restore(held)

    def _time_tokens(self, published: list[_Held]) -> None:
        """The gaps before the tokens just published, and the first token's latency
        after the hand-off (this instance's own TTFT)."""
        now_s = self.wall_clock()
        gaps: list[float] = []
        for held in published:
            gaps.append(now_s - held.last_token_s)
            held.last_token_s = now_s
            held.generated_here += 1
            if held.generated_here == 1 and held.from_hand_off:
                self.metrics.first_token(now_s - held.msg.prefill_done_s)
        self.metrics.token_gaps(gaps)

    def _ended(self, held: _Held, stopped: bool) -> None:
        """A request's last token is out: its mean gap from the hand-off, which follows
        the first token's publication by the KV export and send (what the router
        measures from the first token it reads)."""
        req = held.msg.request
        n = len(held.outputs)
        timed = held.from_hand_off and n > 1
        tpot_s = (held.last_token_s - held.msg.prefill_done_s) / (n - 1) if timed else None
        self.metrics.ended(
            WorkerOutcome.FINISHED, prompt_tokens=req.prompt_tokens, output_tokens=n,
            stopped=stopped, e2e_s=held.last_token_s - req.arrival_s, tpot_s=tpot_s,
        )  # fmt: skip

    def _finish_restore(self, held: _Held) -> None:
        snapshot = self.engine.export_kv(held.seq_id)
        self.engine.release(held.seq_id)
        del self._held[held.seq_id]
        held.restoring = False
        held.seq_id = next(self._seq_ids)
        self._import(held, snapshot)


def _transport_name(transport: KvTransport) -> str:
    """The ``transport`` label: every implementation names its kind in ``transport``."""
    kind = getattr(transport, "transport", None)
    return str(kind.value) if kind is not None else type(transport).__name__
