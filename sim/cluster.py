"""Discrete-event model of a disaggregated cluster: a prefill pool and a decode pool.

The semantics, which the analytical models are validated against:

- A request whose prompt plus output tokens exceed the profile's
  ``max_context_tokens`` is rejected at arrival, as the router rejects it
  (``queueing.profile.exceeds_context``): it gets no first token and does not
  complete (``rejected``), and uses no worker.
- Requests arrive at ``trace.arrival_s`` into one shared FIFO prefill queue. Each
  prefill worker runs its own ``workers.scheduler.Scheduler`` over that queue (one
  ``Sequence`` per request with ``max_new_tokens=1``, KV reserved for the prompt
  plus that token). An idle worker starts an iteration as soon as there is work
  (lowest index first); a busy one plans its next step when an iteration ends.
  An iteration takes ``profile.iteration_s`` of its plan's token counts.
- The first token comes out at the end of the iteration that completes the prompt
  (TTFT = that time - arrival) and the prefill worker frees the prompt's KV. With
  one output token the request is done. Otherwise its KV travels over the network
  (no contention is modelled; it costs no prefill compute) and the request joins
  one shared FIFO decode queue at ``first token + kv_link_latency_s +
  prompt_tokens * kv_bytes_per_token / kv_link_bytes_per_s``.
- A decode worker takes requests from the head of the decode queue at its iteration
  boundaries, or at once when idle (lowest index first), while it has a batch slot
  (``token_budget`` of them) and KV for prompt + output tokens (reserved: no
  preemption). A request then needs ``output_tokens - 1`` iterations; an iteration
  with batch ``B`` takes ``profile.iteration_s(n_tokens=B, n_kv_read=sum of
  (num_computed_tokens + 1))`` and gives every member a token. Decode workers are
  advanced in closed form between membership changes (``sim.decode_worker``).
- Scaling (``set_pool_size``): a new worker costs GPU time at once but serves only
  after ``startup_s``; a removed one (the newest not yet draining) takes no new
  work, finishes what it holds and retires. GPU time runs from a worker's start to
  its retirement (or the end of the run), times the profile's tensor parallelism.

Simultaneous events are handled in the order they were scheduled.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from enum import Enum

import numpy as np

from queueing.pools import Pool
from queueing.profile import IterationProfile, exceeds_context
from sim.decode_worker import DecodeWorker
from sim.events import EventQueue
from sim.results import SimResults
from sim.trace import FloatArray, IntArray, Trace
from workers.kv_cache import PagedKVCache
from workers.scheduler import Scheduler, SchedulingPolicy, Sequence, StepPlan


class WorkerState(Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    RETIRED = "retired"


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """The cluster's shape. ``token_budget`` is the prefill workers' Sarathi budget
    and the decode workers' maximum batch. ``startup_s`` (seconds from a scale-up to
    serving) defaults to the profile's; see ``worker_startup_s``. ``policy`` applies
    to the prefill workers."""

    prefill_workers: int
    decode_workers: int
    profile: IterationProfile
    token_budget: int
    kv_link_bytes_per_s: float
    kv_link_latency_s: float = 0.0
    block_size_tokens: int = 16
    policy: SchedulingPolicy = SchedulingPolicy.CHUNKED_PREFILL
    startup_s: float | None = None
    # At most this many prompts in progress on one prefill worker (vLLM's
    # max_num_seqs); None: as many as the token budget admits.
    prefill_max_running: int | None = None

    def __post_init__(self) -> None:
        for name in ("prefill_workers", "decode_workers", "token_budget", "block_size_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if not isinstance(self.profile, IterationProfile):
            raise ValueError(f"profile: must be an IterationProfile, got {self.profile!r}")
        if not _finite(self.kv_link_bytes_per_s) or self.kv_link_bytes_per_s <= 0:
            raise ValueError(
                "kv_link_bytes_per_s: must be a finite number > 0, "
                f"got {self.kv_link_bytes_per_s!r}"
            )
        if not _finite(self.kv_link_latency_s) or self.kv_link_latency_s < 0:
            raise ValueError(
                f"kv_link_latency_s: must be a finite number >= 0, got {self.kv_link_latency_s!r}"
            )
        if self.startup_s is not None and (not _finite(self.startup_s) or self.startup_s < 0):
            raise ValueError(f"startup_s: must be a finite number >= 0, got {self.startup_s!r}")
        if self.prefill_max_running is not None and (
            isinstance(self.prefill_max_running, bool)
            or not isinstance(self.prefill_max_running, int)
            or not 1 <= self.prefill_max_running <= self.token_budget
        ):
            raise ValueError(
                "prefill_max_running: must be an integer in [1, token_budget], "
                f"got {self.prefill_max_running!r}"
            )
        if not isinstance(self.policy, SchedulingPolicy):
            raise ValueError(f"policy: must be a SchedulingPolicy, got {self.policy!r}")
        if self.kv_blocks_per_worker < 1:
            raise ValueError(
                f"block_size_tokens: {self.block_size_tokens} exceeds the profile's "
                f"kv_capacity_tokens {self.profile.kv_capacity_tokens}"
            )

    @property
    def worker_startup_s(self) -> float:
        return self.profile.startup_s if self.startup_s is None else self.startup_s

    @property
    def kv_blocks_per_worker(self) -> int:
        return self.profile.kv_capacity_tokens // self.block_size_tokens


@dataclass(frozen=True, kw_only=True)
class PoolSnapshot:
    """One pool at an instant. ``serving`` excludes draining workers; ``busy`` counts
    workers in an iteration (prefill) or with a non-empty batch (decode);
    ``running`` the requests the workers hold."""

    starting: int
    serving: int
    draining: int
    busy: int
    queue_length: int
    running: int


@dataclass(frozen=True, kw_only=True, eq=False)
class ClusterSnapshot:
    """What a controller can observe at ``time_s``, over the window
    ``(time_s - window_s, time_s]``: arrivals (and their prompt lengths), first
    tokens (their TTFTs) and completions (output lengths, TPOTs of those with a
    decode stage)."""

    time_s: float
    window_s: float
    prefill: PoolSnapshot
    decode: PoolSnapshot
    arrived: int
    completed: int
    window_arrivals: int
    window_arrival_rate_rps: float
    window_prompt_tokens: IntArray
    window_output_tokens: IntArray
    window_completed_prompt_tokens: IntArray  # paired with window_output_tokens
    window_arrival_s: FloatArray
    window_ttft_s: FloatArray
    window_tpot_s: FloatArray


class _EventKind(Enum):
    ARRIVAL = 0
    PREFILL_SERVING = 1
    PREFILL_ITERATION_END = 2
    KV_READY = 3
    DECODE_SERVING = 4
    DECODE_BOUNDARY = 5


@dataclass(eq=False, kw_only=True)
class _Lifecycle:
    index: int
    state: WorkerState
    started_s: float
    serving_from_s: float
    retired_s: float | None = None


@dataclass(eq=False, kw_only=True)
class _PrefillWorker(_Lifecycle):
    scheduler: Scheduler
    plan: StepPlan | None = None  # the iteration in flight, if any
    busy_s: float = 0.0


@dataclass(eq=False, kw_only=True)
class _DecodeSlot(_Lifecycle):
    engine: DecodeWorker


class Cluster:
    """Simulate ``trace`` on a cluster shaped by ``config``.

    Drive it with ``run_until(t_s)`` / ``snapshot()`` / ``set_pool_size()`` from a
    controller, then ``finish()`` for the results (or just ``run()``). Raises
    ``ValueError`` at construction for a request that can never fit a worker's KV
    cache (naming it). ``rejected`` marks the requests beyond the profile's context
    (never served). ``record_token_times`` keeps every decode token's time (for
    tests; memory grows with the total output tokens).
    """

    def __init__(
        self, config: ClusterConfig, trace: Trace, *, record_token_times: bool = False
    ) -> None:
        self.config = config
        self.trace = trace
        self._record = record_token_times
        profile = config.profile
        self._profile = profile
        self._prompt = trace.prompt_tokens.tolist()
        self._output = trace.output_tokens.tolist()
        self._arrival = trace.arrival_s.tolist()
        self.rejected = exceeds_context(
            trace.prompt_tokens, trace.output_tokens, profile.max_context_tokens
        )
        self._rejected = self.rejected.tolist()
        self._check_fits()
        n = len(trace)
        self._first_token_s = [math.nan] * n
        self._kv_ready_s = [math.nan] * n
        self._decode_start_s = [math.nan] * n
        self._finish_s = [math.nan] * n
        self._token_times: dict[int, list[float]] = {}
        self._handoff_s_per_token = profile.kv_bytes_per_token / config.kv_link_bytes_per_s

        self.now_s = min(0.0, self._arrival[0]) if n else 0.0
        self._events: EventQueue[_EventKind, tuple[int, int]] = EventQueue()
        if n:
            self._events.push(self._arrival[0], _EventKind.ARRIVAL, (0, 0))
        self._prefill_queue: deque[Sequence] = deque()
        self._decode_queue: deque[int] = deque()
        self._no_work: deque[Sequence] = deque()  # what a draining worker schedules from
        self._prefill: list[_PrefillWorker] = []
        self._decode: list[_DecodeSlot] = []
        for _ in range(config.prefill_workers):
            self._add_prefill_worker(serving_from_s=self.now_s)
        for _ in range(config.decode_workers):
            self._add_decode_worker(serving_from_s=self.now_s)

        self._completed = 0
        self._prefill_queue_max = 0
        self._decode_queue_max = 0
        # Time-ordered logs for the windowed snapshot.
        self._first_token_log_s: list[float] = []
        self._first_token_log_req: list[int] = []
        self._finish_log_s: list[float] = []
        self._finish_log_req: list[int] = []

    def _check_fits(self) -> None:
        blocks = self.config.kv_blocks_per_worker
        bs = self.config.block_size_tokens
        # Rejected requests never reach a worker.
        prompt = np.where(self.rejected, 1, self.trace.prompt_tokens)
        output = np.where(self.rejected, 1, self.trace.output_tokens)
        prefill_blocks = -(-(prompt + 1) // bs)
        decode_blocks = np.where(output > 1, -(-(prompt + output) // bs), 0)
        for pool, need in (("prefill", prefill_blocks), ("decode", decode_blocks)):
            too_big = np.flatnonzero(need > blocks)
            if len(too_big):
                r = int(too_big[0])
                raise ValueError(
                    f"trace: request {r} (prompt {int(prompt[r])}, output {int(output[r])} "
                    f"tokens) can never fit a {pool} worker's KV cache of "
                    f"{blocks * bs} tokens"
                )

    # -- workers -------------------------------------------------------------------

    def _add_prefill_worker(self, *, serving_from_s: float) -> None:
        cfg = self.config
        kv = PagedKVCache(
            num_blocks=cfg.kv_blocks_per_worker, block_size_tokens=cfg.block_size_tokens
        )
        starting = serving_from_s > self.now_s
        worker = _PrefillWorker(
            index=len(self._prefill),
            state=WorkerState.STARTING if starting else WorkerState.SERVING,
            started_s=self.now_s,
            serving_from_s=serving_from_s,
            scheduler=Scheduler(
                token_budget=cfg.token_budget,
                kv_cache=kv,
                policy=cfg.policy,
                max_running=cfg.prefill_max_running,
            ),
        )
        self._prefill.append(worker)
        if starting:
            self._events.push(serving_from_s, _EventKind.PREFILL_SERVING, (worker.index, 0))

    def _add_decode_worker(self, *, serving_from_s: float) -> None:
        cfg = self.config
        kv = PagedKVCache(
            num_blocks=cfg.kv_blocks_per_worker, block_size_tokens=cfg.block_size_tokens
        )
        starting = serving_from_s > self.now_s
        slot = _DecodeSlot(
            index=len(self._decode),
            state=WorkerState.STARTING if starting else WorkerState.SERVING,
            started_s=self.now_s,
            serving_from_s=serving_from_s,
            engine=DecodeWorker(
                profile=cfg.profile,
                max_batch=cfg.token_budget,
                kv_cache=kv,
                record_token_times=self._record,
            ),
        )
        self._decode.append(slot)
        if starting:
            self._events.push(serving_from_s, _EventKind.DECODE_SERVING, (slot.index, 0))

    def _retire(self, worker: _Lifecycle) -> None:
        worker.state = WorkerState.RETIRED
        worker.retired_s = self.now_s

    # -- driving ---------------------------------------------------------------------

    def run_until(self, t_s: float) -> None:
        """Process every event at or before ``t_s``; the clock then reads ``t_s``."""
        if not t_s >= self.now_s:
            raise ValueError(f"t_s: {t_s} is before the cluster's clock {self.now_s}")
        self._process(t_s)
        self.now_s = t_s

    def run(self) -> SimResults:
        """Simulate the whole trace and return the results."""
        return self.finish()

    def finish(self) -> SimResults:
        """Run until every request has completed, then collect the results."""
        self._process(math.inf)
        return self._results()

    def _process(self, until_s: float) -> None:
        events = self._events
        kinds = _EventKind
        while events:
            time_s = events.peek_time_s()
            assert time_s is not None
            if time_s > until_s:
                return
            _, kind, (a, b) = events.pop()
            self.now_s = time_s
            if kind is kinds.DECODE_BOUNDARY:
                self._on_decode_boundary(a, b)
            elif kind is kinds.PREFILL_ITERATION_END:
                self._on_prefill_iteration_end(a)
            elif kind is kinds.KV_READY:
                self._on_kv_ready(a)
            elif kind is kinds.ARRIVAL:
                self._on_arrival(a)
            elif kind is kinds.PREFILL_SERVING:
                self._on_serving(self._prefill[a])
                self._dispatch_prefill()
            else:
                self._on_serving(self._decode[a])
                self._offer_decode_queue()

    def _on_serving(self, worker: _Lifecycle) -> None:
        # A worker removed while still starting has retired already.
        if worker.state is WorkerState.STARTING:
            worker.state = WorkerState.SERVING

    # -- prefill pool ------------------------------------------------------------------

    def _on_arrival(self, r: int) -> None:
        nxt = r + 1
        if nxt < len(self._arrival):
            self._events.push(self._arrival[nxt], _EventKind.ARRIVAL, (nxt, 0))
        if self._rejected[r]:
            return
        self._prefill_queue.append(
            Sequence(seq_id=r, num_prompt_tokens=self._prompt[r], max_new_tokens=1)
        )
        self._prefill_queue_max = max(self._prefill_queue_max, len(self._prefill_queue))
        self._dispatch_prefill()

    def _dispatch_prefill(self) -> None:
        """Idle serving prefill workers take queued work at once, lowest index first."""
        queue = self._prefill_queue
        for worker in self._prefill:
            if not queue:
                return
            if worker.plan is None and worker.state is WorkerState.SERVING:
                self._start_prefill_iteration(worker, worker.scheduler.schedule(queue))

    def _start_prefill_iteration(self, worker: _PrefillWorker, plan: StepPlan) -> None:
        if plan.is_empty:
            worker.plan = None
            if worker.state is WorkerState.DRAINING:
                self._retire(worker)
            return
        duration_s = self._profile.iteration_s(
            n_tokens=plan.num_batched_tokens,
            n_kv_read=plan.num_kv_read_tokens,
            n_attn_pairs=plan.num_attention_pairs,
        )
        worker.plan = plan
        worker.busy_s += duration_s
        self._events.push(
            self.now_s + duration_s, _EventKind.PREFILL_ITERATION_END, (worker.index, 0)
        )

    def _on_prefill_iteration_end(self, w: int) -> None:
        worker = self._prefill[w]
        scheduler = worker.scheduler
        assert worker.plan is not None
        now_s = self.now_s
        for seq in scheduler.complete_step(worker.plan):
            r = seq.seq_id
            self._first_token_s[r] = now_s
            self._first_token_log_s.append(now_s)
            self._first_token_log_req.append(r)
            if self._output[r] == 1:
                self._complete(r)
            else:
                ready_s = (
                    now_s
                    + self.config.kv_link_latency_s
                    + self._prompt[r] * self._handoff_s_per_token
                )
                self._events.push(ready_s, _EventKind.KV_READY, (r, 0))
        queue = self._prefill_queue if worker.state is WorkerState.SERVING else self._no_work
        self._start_prefill_iteration(worker, scheduler.schedule(queue))

    def _complete(self, r: int) -> None:
        self._finish_s[r] = self.now_s
        self._finish_log_s.append(self.now_s)
        self._finish_log_req.append(r)
        self._completed += 1

    # -- decode pool -------------------------------------------------------------------

    def _on_kv_ready(self, r: int) -> None:
        self._kv_ready_s[r] = self.now_s
        queue = self._decode_queue
        was_empty = not queue
        queue.append(r)
        self._decode_queue_max = max(self._decode_queue_max, len(queue))
        # A non-empty queue already has every worker with room for its head woken.
        if was_empty:
            self._offer_decode_queue()

    def _offer_decode_queue(self) -> None:
        """Keep the invariant: with a non-empty decode queue, no idle serving worker
        exists and every busy serving worker with room for the head has a wake-up at
        its first boundary from now."""
        queue = self._decode_queue
        if not queue:
            return
        for slot in self._decode:
            engine = slot.engine
            if slot.state is WorkerState.SERVING and engine.batch == 0:
                self._take_from_decode_queue(slot)
                if not queue:
                    return
        head = queue[0]
        prompt, output = self._prompt[head], self._output[head]
        for slot in self._decode:
            engine = slot.engine
            if (
                slot.state is WorkerState.SERVING
                and engine.batch > 0
                and engine.has_room(prompt_tokens=prompt, output_tokens=output)
            ):
                k = engine.first_boundary_at_or_after(self.now_s)
                wake = engine.wake_iteration
                if wake is None or engine.iteration + k < wake:
                    self._plan_decode_wake(slot, k)

    def _take_from_decode_queue(self, slot: _DecodeSlot) -> bool:
        """Admit from the head of the decode queue while there is room (FCFS)."""
        engine = slot.engine
        queue = self._decode_queue
        took = False
        while queue:
            r = queue[0]
            prompt, output = self._prompt[r], self._output[r]
            if not engine.has_room(prompt_tokens=prompt, output_tokens=output):
                break
            queue.popleft()
            engine.admit(r, prompt_tokens=prompt, output_tokens=output, now_s=self.now_s)
            self._decode_start_s[r] = self.now_s
            took = True
        if took:
            self._plan_decode_wake(slot, engine.next_finish_k())
        return took

    def _plan_decode_wake(self, slot: _DecodeSlot, k: int) -> None:
        time_s, version = slot.engine.plan_wake(k)
        self._events.push(time_s, _EventKind.DECODE_BOUNDARY, (slot.index, version))

    def _on_decode_boundary(self, w: int, version: int) -> None:
        slot = self._decode[w]
        engine = slot.engine
        if version != engine.version:
            return  # superseded by a later plan
        wake = engine.wake_iteration
        assert wake is not None
        for r in engine.advance(wake - engine.iteration):
            self._complete(r)
        # The clock is at this boundary; admissions happen here.
        if slot.state is WorkerState.SERVING and self._take_from_decode_queue(slot):
            self._offer_decode_queue()
        elif engine.batch > 0:
            self._plan_decode_wake(slot, engine.next_finish_k())
        else:
            engine.clear_wake()
            if slot.state is WorkerState.DRAINING:
                self._retire(slot)

    # -- scaling -------------------------------------------------------------------------

    def pool_size(self, pool: Pool) -> int:
        """Workers counted towards the pool's size: starting or serving (not draining)."""
        workers: list[_PrefillWorker] | list[_DecodeSlot] = (
            self._prefill if pool is Pool.PREFILL else self._decode
        )
        return sum(1 for w in workers if w.state in (WorkerState.STARTING, WorkerState.SERVING))

    def set_pool_size(self, pool: Pool, target: int, now_s: float) -> None:
        """Grow or shrink a pool to ``target`` (>= 1) workers at ``now_s``.

        The cluster first runs up to ``now_s`` (which may not be in its past). New
        workers serve after ``config.worker_startup_s``; removed ones are the newest
        that are starting or serving: a starting one retires at once, a serving one
        drains (takes no new work, finishes what it holds, then retires).
        """
        if isinstance(target, bool) or not isinstance(target, int) or target < 1:
            raise ValueError(f"target: must be an integer >= 1, got {target!r}")
        if not now_s >= self.now_s:
            raise ValueError(f"now_s: {now_s} is before the cluster's clock {self.now_s}")
        self.run_until(now_s)
        current = self.pool_size(pool)
        serving_from_s = self.now_s + self.config.worker_startup_s
        if target > current:
            for _ in range(target - current):
                if pool is Pool.PREFILL:
                    self._add_prefill_worker(serving_from_s=serving_from_s)
                else:
                    self._add_decode_worker(serving_from_s=serving_from_s)
            # With no startup delay the new workers serve now.
            if pool is Pool.PREFILL:
                self._dispatch_prefill()
            else:
                self._offer_decode_queue()
            return
        if target == current:
            return
        if pool is Pool.PREFILL:
            self._shrink_prefill(current - target)
        else:
            self._shrink_decode(current - target)

    def _shrink_prefill(self, count: int) -> None:
        live = [w for w in self._prefill if w.state in (WorkerState.STARTING, WorkerState.SERVING)]
        for worker in sorted(live, key=lambda w: (w.started_s, w.index), reverse=True)[:count]:
            if worker.state is WorkerState.STARTING or worker.plan is None:
                self._retire(worker)
            else:
                worker.state = WorkerState.DRAINING

    def _shrink_decode(self, count: int) -> None:
        live = [s for s in self._decode if s.state in (WorkerState.STARTING, WorkerState.SERVING)]
        for slot in sorted(live, key=lambda s: (s.started_s, s.index), reverse=True)[:count]:
            engine = slot.engine
            if slot.state is WorkerState.STARTING or engine.batch == 0:
                self._retire(slot)
            else:
                slot.state = WorkerState.DRAINING

    # -- observation -------------------------------------------------------------------

    def snapshot(self, *, window_s: float = 30.0) -> ClusterSnapshot:
        """The pools now and the requests of the last ``window_s`` seconds (> 0)."""
        if not _finite(window_s) or window_s <= 0:
            raise ValueError(f"window_s: must be a finite number > 0, got {window_s!r}")
        now_s = self.now_s
        since_s = now_s - window_s
        arrived = bisect.bisect_right(self._arrival, now_s)
        first_arrival = bisect.bisect_right(self._arrival, since_s)
        window_arrivals = arrived - first_arrival

        lo = bisect.bisect_right(self._first_token_log_s, since_s)
        ttft_req = np.asarray(self._first_token_log_req[lo:], dtype=np.int64)
        lo = bisect.bisect_right(self._finish_log_s, since_s)
        done_req = np.asarray(self._finish_log_req[lo:], dtype=np.int64)
        first = np.asarray(self._first_token_s)
        finish = np.asarray(self._finish_s)
        arrival = self.trace.arrival_s
        output = self.trace.output_tokens
        with_decode = done_req[output[done_req] > 1]
        tpot = (finish[with_decode] - first[with_decode]) / (output[with_decode] - 1)

        return ClusterSnapshot(
            time_s=now_s,
            window_s=window_s,
            prefill=self._prefill_snapshot(),
            decode=self._decode_snapshot(),
            arrived=arrived,
            completed=self._completed,
            window_arrivals=window_arrivals,
            window_arrival_rate_rps=window_arrivals / window_s,
            window_prompt_tokens=self.trace.prompt_tokens[first_arrival:arrived].copy(),
            window_output_tokens=output[done_req],
            window_completed_prompt_tokens=self.trace.prompt_tokens[done_req],
            window_arrival_s=arrival[first_arrival:arrived].copy(),
            window_ttft_s=first[ttft_req] - arrival[ttft_req],
            window_tpot_s=tpot.astype(np.float64),
        )

    def _prefill_snapshot(self) -> PoolSnapshot:
        states = [w.state for w in self._prefill]
        return PoolSnapshot(
            starting=states.count(WorkerState.STARTING),
            serving=states.count(WorkerState.SERVING),
            draining=states.count(WorkerState.DRAINING),
            busy=sum(1 for w in self._prefill if w.plan is not None),
            queue_length=len(self._prefill_queue),
            running=sum(w.scheduler.num_running for w in self._prefill),
        )

    def _decode_snapshot(self) -> PoolSnapshot:
        states = [s.state for s in self._decode]
        batches = [s.engine.batch for s in self._decode]
        return PoolSnapshot(
            starting=states.count(WorkerState.STARTING),
            serving=states.count(WorkerState.SERVING),
            draining=states.count(WorkerState.DRAINING),
            busy=sum(1 for b in batches if b > 0),
            queue_length=len(self._decode_queue),
            running=sum(batches),
        )

    # -- results ---------------------------------------------------------------------------

    def _results(self) -> SimResults:
        end_s = self.now_s
        tp = self._profile.tensor_parallel
        gpu_s = 0.0
        prefill_serving_s = 0.0
        decode_serving_s = 0.0
        workers: list[_Lifecycle] = [*self._prefill, *self._decode]
        for w in workers:
            stop_s = end_s if w.retired_s is None else w.retired_s
            gpu_s += (stop_s - w.started_s) * tp
            serving_s = max(stop_s - w.serving_from_s, 0.0)
            if isinstance(w, _PrefillWorker):
                prefill_serving_s += serving_s
            else:
                decode_serving_s += serving_s
        engines = [s.engine for s in self._decode]
        token_times: tuple[FloatArray, ...] | None = None
        if self._record:
            merged: dict[int, list[float]] = {}
            for engine in engines:
                assert engine.token_times_s is not None
                merged.update(engine.token_times_s)
            token_times = tuple(
                np.asarray(merged.get(r, []), dtype=np.float64) for r in range(len(self.trace))
            )
        return SimResults(
            arrival_s=self.trace.arrival_s.copy(),
            prompt_tokens=self.trace.prompt_tokens.copy(),
            output_tokens=self.trace.output_tokens.copy(),
            first_token_s=np.asarray(self._first_token_s, dtype=np.float64),
            kv_ready_s=np.asarray(self._kv_ready_s, dtype=np.float64),
            decode_start_s=np.asarray(self._decode_start_s, dtype=np.float64),
            finish_s=np.asarray(self._finish_s, dtype=np.float64),
            rejected=np.asarray(self.rejected, dtype=np.bool_).copy(),
            end_s=end_s,
            prefill_busy_s=sum(w.busy_s for w in self._prefill),
            prefill_serving_s=prefill_serving_s,
            decode_busy_s=sum(e.busy_s for e in engines),
            decode_serving_s=decode_serving_s,
            decode_iterations=sum(e.iteration for e in engines),
            decode_batch_token_total=sum(e.batch_token_total for e in engines),
            prefill_queue_max=self._prefill_queue_max,
            decode_queue_max=self._decode_queue_max,
            gpu_seconds=gpu_s,
            token_times_s=token_times,
        )


def _finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
