"""Sarathi-Serve stall-free batching under a token budget (DESIGN §3.1, §7).

One ``Scheduler`` drives one worker. Each step it turns the running sequences and a
shared FCFS queue of waiting ones into a ``StepPlan``: which sequences decode one
token and which prefill chunks run, never more than ``token_budget`` tokens in all
(for ``CHUNKED_PREFILL``). The caller runs the plan (a real forward pass, or the
simulator's iteration-time model) and hands it back to ``complete_step``.

Every sequence has ``num_computed_tokens`` (tokens whose KV is in the cache)
catching up with the tokens that must be computed before it can decode; a chunk
that completes a prompt generates the first token, a decode computes one token and
generates the next.

The waiting queue is the caller's ``collections.deque``; ``schedule`` pops from its
left as it admits, so several schedulers (workers) can share one deque, which is
one shared queue served by a pool of workers.

KV memory: with ``reserve_output_tokens`` (the default) a sequence is admitted only
when blocks for its prompt plus all its output tokens are free, and they are
allocated at once, so a running sequence never needs more memory and never has to
be preempted. Without it, blocks are allocated chunk by chunk and token by token;
when a running sequence cannot grow, the newest running sequences are preempted:
their blocks are freed, ``num_computed_tokens`` drops to 0 and they go back to the
front of the waiting queue, to be recomputed (vLLM's recompute preemption).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum

from queueing.profile import attention_pairs
from workers.kv_cache import PagedKVCache


class SchedulingPolicy(Enum):
    """How prefills and decodes share a step."""

    # Sarathi-Serve: decodes first, the rest of the budget in prefill chunks.
    CHUNKED_PREFILL = "chunked-prefill"
    # vLLM without chunking: whole prompts, prefill steps before decode steps.
    PREFILL_FIRST = "prefill-first"


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request as the scheduler sees it (mutable; identity semantics).

    ``max_new_tokens`` is how many tokens it generates in total (>= 1). A decode
    worker receives sequences whose prompt is already computed
    (``num_computed_tokens == num_prompt_tokens``, ``num_generated_tokens == 1``);
    a prefill worker uses ``max_new_tokens=1`` so the sequence finishes when its
    prompt does.
    """

    seq_id: int
    num_prompt_tokens: int
    max_new_tokens: int
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1:
            raise ValueError(f"num_prompt_tokens: must be >= 1, got {self.num_prompt_tokens}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.num_generated_tokens <= self.max_new_tokens:
            raise ValueError(
                f"num_generated_tokens: must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.num_generated_tokens}"
            )
        # The newest generated token has no KV yet: it is the input of the next decode.
        most = self.num_prompt_tokens + max(self.num_generated_tokens - 1, 0)
        if not 0 <= self.num_computed_tokens <= most:
            raise ValueError(
                f"num_computed_tokens: must be in [0, {most}] for this sequence, "
                f"got {self.num_computed_tokens}"
            )

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens whose KV must be computed before the sequence can decode.

        The prompt; after a recompute preemption also all generated tokens but the
        newest (which is the next decode's input).
        """
        return self.num_prompt_tokens + max(self.num_generated_tokens - 1, 0)

    @property
    def is_prefilling(self) -> bool:
        """True while its prompt (``num_prefill_tokens``) is not all in the cache."""
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def remaining_prompt_tokens(self) -> int:
        return max(self.num_prefill_tokens - self.num_computed_tokens, 0)

    @property
    def context_tokens(self) -> int:
        """Tokens the sequence has: prompt plus generated."""
        return self.num_prompt_tokens + self.num_generated_tokens

    @property
    def is_done(self) -> bool:
        return self.num_generated_tokens >= self.max_new_tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduledChunk:
    """``num_tokens`` prompt tokens of ``seq_id`` starting at token ``start_token``."""

    seq_id: int
    start_token: int
    num_tokens: int
    completes_prompt: bool

    def __post_init__(self) -> None:
        if self.start_token < 0:
            raise ValueError(f"start_token: must be >= 0, got {self.start_token}")
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens: must be >= 1, got {self.num_tokens}")


@dataclass(frozen=True, kw_only=True, slots=True)
class StepPlan:
    """What one iteration of a worker computes, with the token counts that price it.

    - ``num_batched_tokens``: chunk tokens plus one per decode;
    - ``num_kv_read_tokens``: per decode, its ``num_computed_tokens + 1`` (the context
      it attends, itself included);
    - ``num_attention_pairs``: per chunk, ``attention_pairs(chunk, prefix)``.

    Construction checks the invariants and raises ``ValueError`` when one is broken:
    the counts agree with the contents, no sequence appears twice, and the plan fits
    the budget (``PREFILL_FIRST`` may exceed it only with one whole prompt alone, and
    never mixes prefills with decodes).
    """

    decode_seq_ids: tuple[int, ...]
    prefill_chunks: tuple[ScheduledChunk, ...]
    num_batched_tokens: int
    num_kv_read_tokens: int
    num_attention_pairs: int
    token_budget: int
    policy: SchedulingPolicy = SchedulingPolicy.CHUNKED_PREFILL

    def __post_init__(self) -> None:
        if self.token_budget < 1:
            raise ValueError(f"token_budget: must be >= 1, got {self.token_budget}")
        chunk_tokens = sum(c.num_tokens for c in self.prefill_chunks)
        if self.num_batched_tokens != chunk_tokens + len(self.decode_seq_ids):
            raise ValueError(
                f"num_batched_tokens: {self.num_batched_tokens} != chunk tokens {chunk_tokens} "
                f"+ decodes {len(self.decode_seq_ids)}"
            )
        pairs = sum(attention_pairs(c.num_tokens, c.start_token) for c in self.prefill_chunks)
        if self.num_attention_pairs != pairs:
            raise ValueError(f"num_attention_pairs: {self.num_attention_pairs} != {pairs}")
        # Each decode reads at least its own token and one prompt token.
        if self.num_kv_read_tokens < 2 * len(self.decode_seq_ids):
            raise ValueError(
                f"num_kv_read_tokens: {self.num_kv_read_tokens} is less than two per decode"
            )
        ids = [c.seq_id for c in self.prefill_chunks] + list(self.decode_seq_ids)
        if len(set(ids)) != len(ids):
            raise ValueError("prefill_chunks/decode_seq_ids: a sequence is scheduled twice")
        if self.num_batched_tokens > self.token_budget:
            lone_prompt = (
                self.policy is SchedulingPolicy.PREFILL_FIRST
                and len(self.prefill_chunks) == 1
                and not self.decode_seq_ids
            )
            if not lone_prompt:
                raise ValueError(
                    f"num_batched_tokens: {self.num_batched_tokens} exceeds "
                    f"token_budget {self.token_budget}"
                )
        if (
            self.policy is SchedulingPolicy.PREFILL_FIRST
            and self.prefill_chunks
            and self.decode_seq_ids
        ):
            raise ValueError("prefill_chunks: a PREFILL_FIRST step never mixes prefill and decode")

    @property
    def is_empty(self) -> bool:
        return not self.decode_seq_ids and not self.prefill_chunks


class Scheduler:
    """Stall-free batching for one worker (see the module docstring).

    ``max_running`` caps the running set (default ``token_budget``; it may not exceed
    the budget, so the decodes alone always fit in a step). ``keep_finished_kv``:
    finished sequences keep their KV blocks until ``release`` (for a worker that
    hands the KV off after the step); by default they are freed at once.
    """

    def __init__(
        self,
        *,
        token_budget: int,
        kv_cache: PagedKVCache,
        policy: SchedulingPolicy = SchedulingPolicy.CHUNKED_PREFILL,
        max_running: int | None = None,
        reserve_output_tokens: bool = True,
        keep_finished_kv: bool = False,
    ) -> None:
        if token_budget < 1:
            raise ValueError(f"token_budget: must be >= 1, got {token_budget}")
        if max_running is None:
            max_running = token_budget
        if not 1 <= max_running <= token_budget:
            raise ValueError(
                f"max_running: must be in [1, token_budget={token_budget}], got {max_running}"
            )
        self.token_budget = token_budget
        self.kv_cache = kv_cache
        self.policy = policy
        self.max_running = max_running
        self.reserve_output_tokens = reserve_output_tokens
        self.keep_finished_kv = keep_finished_kv
        # Insertion order is admission order: FCFS for chunks, LIFO for preemption.
        self._running: dict[int, Sequence] = {}
        self._held: set[int] = set()
        self._preempted_in_step = False

    # -- state --------------------------------------------------------------------

    @property
    def running(self) -> tuple[Sequence, ...]:
        """Running sequences in admission order."""
        return tuple(self._running.values())

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._running)

    # -- admission ----------------------------------------------------------------

    def admit(self, seq: Sequence) -> bool:
        """Put ``seq`` in the running set now if it fits; False (nothing changed) if not.

        Raises ``ValueError`` if it can never fit in this worker's KV cache, or is
        already finished or admitted.
        """
        self._check_admissible(seq)
        if len(self._running) >= self.max_running:
            return False
        return self._try_admit(seq, self._admission_tokens(seq))

    def _check_admissible(self, seq: Sequence) -> None:
        if seq.is_done:
            raise ValueError(f"seq_id {seq.seq_id}: already generated all its tokens")
        if seq.seq_id in self._running or seq.seq_id in self._held:
            raise ValueError(f"seq_id {seq.seq_id}: already admitted to this scheduler")
        total = seq.num_prompt_tokens + seq.max_new_tokens
        if self.kv_cache.blocks_needed(total) > self.kv_cache.num_blocks:
            raise ValueError(
                f"seq_id {seq.seq_id}: needs {total} tokens of KV "
                f"but the whole cache holds {self.kv_cache.capacity_tokens}; it can never run"
            )

    def _can_ever_fit(self, seq: Sequence) -> bool:
        total = seq.num_prompt_tokens + seq.max_new_tokens
        return self.kv_cache.blocks_needed(total) <= self.kv_cache.num_blocks

    def _admission_tokens(self, seq: Sequence) -> int:
        """KV tokens allocated at admission (before any chunk of it is scheduled)."""
        if self.reserve_output_tokens:
            return seq.num_prompt_tokens + seq.max_new_tokens
        # Without reservation: whatever is already computed, and at least one slot
        # for the first token it will compute.
        return seq.num_computed_tokens + 1

    def _try_admit(self, seq: Sequence, kv_tokens: int) -> bool:
        if self.kv_cache.allocate(seq.seq_id, kv_tokens) is None:
            return False
        seq.status = SequenceStatus.RUNNING
        self._running[seq.seq_id] = seq
        return True

    # -- scheduling ---------------------------------------------------------------

    def schedule(self, waiting: deque[Sequence]) -> StepPlan:
        """Plan the next step, admitting from the left of ``waiting`` (FCFS).

        Raises ``ValueError`` naming the sequence if the head of ``waiting`` can never
        fit in this worker's KV cache (nothing changes: the caller must remove it).
        """
        if waiting:
            self._check_admissible(waiting[0])
        if self.policy is SchedulingPolicy.PREFILL_FIRST:
            return self._schedule_prefill_first(waiting)
        return self._schedule_chunked(waiting)

    def _schedule_chunked(self, waiting: deque[Sequence]) -> StepPlan:
        budget_left = self.token_budget
        decodes: list[int] = []
        kv_reads = 0
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        self._preempted_in_step = False

        # 1. Every decoding sequence gets its token: decodes never stall for a prefill.
        for seq in list(self._running.values()):
            if seq.is_prefilling or seq.seq_id not in self._running:
                continue
            if not self.reserve_output_tokens and not self._grow(
                seq, seq.num_computed_tokens + 1, waiting, scheduled
            ):
                continue  # it preempted itself
            decodes.append(seq.seq_id)
            scheduled.add(seq.seq_id)
            kv_reads += seq.num_computed_tokens + 1
            budget_left -= 1

        # 2. Then the running prompts, oldest first.
        for seq in list(self._running.values()):
            if budget_left <= 0:
                break
            if not seq.is_prefilling or seq.seq_id not in self._running:
                continue
            n = min(seq.remaining_prompt_tokens, budget_left)
            if not self.reserve_output_tokens:
                n = self._fit_chunk(seq, n, waiting, scheduled)
                if n == 0:
                    continue
            chunks.append(self._chunk(seq, n))
            scheduled.add(seq.seq_id)
            budget_left -= n

        # 3. Then new sequences from the shared queue while budget and KV room remain
        # (not after a preemption: the victim would be readmitted only to thrash).
        while (
            waiting
            and budget_left > 0
            and len(self._running) < self.max_running
            and not self._preempted_in_step
        ):
            seq = waiting[0]
            if not self._can_ever_fit(seq) or seq.is_done:
                break  # the next schedule() raises for it before changing anything
            if seq.is_prefilling:
                n = min(seq.remaining_prompt_tokens, budget_left)
                if self.reserve_output_tokens:
                    kv_tokens = seq.num_prompt_tokens + seq.max_new_tokens
                else:
                    room = self.kv_cache.num_free_blocks * self.kv_cache.block_size_tokens
                    n = min(n, room - seq.num_computed_tokens)
                    if n < 1:
                        break
                    kv_tokens = seq.num_computed_tokens + n
                if not self._try_admit(seq, kv_tokens):
                    break
                waiting.popleft()
                chunks.append(self._chunk(seq, n))
                budget_left -= n
            else:
                # Its prompt is already computed (a decode worker's arrival): it joins
                # this step's decodes.
                if not self._try_admit(seq, self._admission_tokens(seq)):
                    break
                waiting.popleft()
                decodes.append(seq.seq_id)
                kv_reads += seq.num_computed_tokens + 1
                budget_left -= 1
            scheduled.add(seq.seq_id)

        return self._plan(decodes, chunks, kv_reads)

    def _schedule_prefill_first(self, waiting: deque[Sequence]) -> StepPlan:
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        budget_used = 0
        self._preempted_in_step = False

        def fits(n: int) -> bool:
            # The first prompt always runs, even alone over the budget.
            return not chunks or budget_used + n <= self.token_budget

        # Whole prompts: running ones first (only after admit()), then the queue.
        for seq in list(self._running.values()):
            if not seq.is_prefilling or seq.seq_id not in self._running:
                continue
            n = seq.remaining_prompt_tokens
            if not fits(n):
                break
            if not self.reserve_output_tokens and not self._grow(
                seq, seq.num_prefill_tokens, waiting, scheduled
            ):
                continue
            chunks.append(self._chunk(seq, n))
            scheduled.add(seq.seq_id)
            budget_used += n
        while waiting and len(self._running) < self.max_running and not self._preempted_in_step:
            seq = waiting[0]
            if not self._can_ever_fit(seq) or seq.is_done:
                break
            n = seq.remaining_prompt_tokens
            if seq.is_prefilling and not fits(n):
                break
            if self.reserve_output_tokens:
                kv_tokens = seq.num_prompt_tokens + seq.max_new_tokens
            else:
                kv_tokens = max(seq.num_prefill_tokens, seq.num_computed_tokens + 1)
            if not self._try_admit(seq, kv_tokens):
                break
            waiting.popleft()
            scheduled.add(seq.seq_id)
            if seq.is_prefilling:
                chunks.append(self._chunk(seq, n))
                budget_used += n
        if chunks:
            return self._plan([], chunks, 0)

        # No prompt to run: a decode step of every running sequence.
        decodes: list[int] = []
        kv_reads = 0
        for seq in list(self._running.values()):
            if seq.is_prefilling or seq.seq_id not in self._running:
                continue
            if not self.reserve_output_tokens and not self._grow(
                seq, seq.num_computed_tokens + 1, waiting, scheduled
            ):
                continue
            decodes.append(seq.seq_id)
            scheduled.add(seq.seq_id)
            kv_reads += seq.num_computed_tokens + 1
        return self._plan(decodes, [], kv_reads)

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        return ScheduledChunk(
            seq_id=seq.seq_id,
            start_token=seq.num_computed_tokens,
            num_tokens=n,
            completes_prompt=seq.num_computed_tokens + n == seq.num_prefill_tokens,
        )

    def _plan(self, decodes: list[int], chunks: list[ScheduledChunk], kv_reads: int) -> StepPlan:
        return StepPlan(
            decode_seq_ids=tuple(decodes),
            prefill_chunks=tuple(chunks),
            num_batched_tokens=len(decodes) + sum(c.num_tokens for c in chunks),
            num_kv_read_tokens=kv_reads,
            num_attention_pairs=sum(attention_pairs(c.num_tokens, c.start_token) for c in chunks),
            token_budget=self.token_budget,
            policy=self.policy,
        )

    # -- growth without reservation -----------------------------------------------

    def _grow(
        self, seq: Sequence, kv_tokens: int, waiting: deque[Sequence], scheduled: set[int]
    ) -> bool:
        """Make ``seq`` hold ``kv_tokens``, preempting the newest unscheduled sequences.

        Returns False if ``seq`` itself had to be preempted.
        """
        while self.kv_cache.allocate(seq.seq_id, kv_tokens) is None:
            victim = self._newest_unscheduled(scheduled)
            if victim is None:
                # Everything else is already in this step; the seq waits for a later step.
                return False
            self._preempt(victim, waiting)
            if victim is seq:
                return False
        return True

    def _fit_chunk(
        self, seq: Sequence, n: int, waiting: deque[Sequence], scheduled: set[int]
    ) -> int:
        """Shrink a chunk to the KV room (preempting if none at all); 0 if it cannot run."""
        bs = self.kv_cache.block_size_tokens
        owned = len(self.kv_cache.block_table(seq.seq_id)) if seq.seq_id in self.kv_cache else 0
        room = (owned + self.kv_cache.num_free_blocks) * bs - seq.num_computed_tokens
        n = min(n, room)
        if n >= 1:
            self.kv_cache.allocate(seq.seq_id, seq.num_computed_tokens + n)
            return n
        if not self._grow(seq, seq.num_computed_tokens + 1, waiting, scheduled):
            return 0
        return 1

    def _newest_unscheduled(self, scheduled: set[int]) -> Sequence | None:
        for seq in reversed(self._running.values()):
            if seq.seq_id not in scheduled:
                return seq
        return None

    def _preempt(self, seq: Sequence, waiting: deque[Sequence]) -> None:
        self._preempted_in_step = True
        del self._running[seq.seq_id]
        if seq.seq_id in self.kv_cache:
            self.kv_cache.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        waiting.appendleft(seq)

    # -- after the step -------------------------------------------------------------

    def complete_step(self, plan: StepPlan) -> list[Sequence]:
        """Apply a plan's effects; returns the sequences it finished (KV freed/held).

        Chunk tokens become computed, a chunk that completes a prompt generates the
        first token, each decode computes one token and generates one. Raises
        ``ValueError`` (changing nothing) for a plan that does not match the current
        state (stale, or from another scheduler).
        """
        running = self._running
        for chunk in plan.prefill_chunks:
            seq = running.get(chunk.seq_id)
            if (
                seq is None
                or seq.num_computed_tokens != chunk.start_token
                or chunk.num_tokens > seq.remaining_prompt_tokens
            ):
                raise ValueError(f"plan: chunk of seq_id {chunk.seq_id} does not match the state")
        for seq_id in plan.decode_seq_ids:
            seq = running.get(seq_id)
            if seq is None or seq.is_prefilling:
                raise ValueError(f"plan: decode of seq_id {seq_id} does not match the state")

        touched: list[Sequence] = []
        for chunk in plan.prefill_chunks:
            seq = running[chunk.seq_id]
            seq.num_computed_tokens += chunk.num_tokens
            if chunk.completes_prompt and seq.num_generated_tokens == 0:
                seq.num_generated_tokens = 1
            touched.append(seq)
        for seq_id in plan.decode_seq_ids:
            seq = running[seq_id]
            seq.num_computed_tokens += 1
            seq.num_generated_tokens += 1
            touched.append(seq)

        finished = [seq for seq in touched if seq.num_generated_tokens >= seq.max_new_tokens]
        for seq in finished:
            self._retire(seq)
        return finished

    def finish(self, seq_id: int) -> Sequence:
        """End a running sequence early (EOS); its KV is freed (or held).

        KeyError if it is not running here.
        """
        seq = self._running.get(seq_id)
        if seq is None:
            raise KeyError(f"seq_id {seq_id}: not running on this scheduler")
        self._retire(seq)
        return seq

    def release(self, seq_id: int) -> int:
        """Free the KV a finished sequence held for handoff; returns the blocks freed.

        Only with ``keep_finished_kv``; KeyError if ``seq_id`` holds none.
        """
        if seq_id not in self._held:
            raise KeyError(f"seq_id {seq_id}: holds no finished KV on this scheduler")
        self._held.remove(seq_id)
        return self.kv_cache.free(seq_id)

    def _retire(self, seq: Sequence) -> None:
        del self._running[seq.seq_id]
        seq.status = SequenceStatus.FINISHED
        if self.keep_finished_kv:
            self._held.add(seq.seq_id)
        else:
            self.kv_cache.free(seq.seq_id)
