"""The engine: the Sarathi scheduler's plan run as one forward pass per step.

``Engine.step()`` asks ``workers.scheduler.Scheduler`` for a ``StepPlan`` (decodes
first, then prefill chunks under the token budget), lays the plan out as one flat
hybrid batch (``workers.paged_attention.build_batch``), runs the model once over the
paged KV cache, samples a token for every decode and for every chunk that completes
its prompt, and hands the plan back to the scheduler (``complete_step``). The block
tables are the scheduler's ``PagedKVCache`` — the bookkeeping the simulator runs —
and their physical block ids index the engine's KV tensors.

``ModelRunner`` is the tensor half (KV tensors, batch layout, forward, logits); the
profiler drives it directly with synthetic batches. ``Engine`` adds requests,
sampling, stopping (EOS or ``max_tokens``) and KV export/import for the hand-off
from a prefill worker to a decode worker.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import numpy as np
import torch

from workers.kv_cache import PagedKVCache
from workers.model import LlamaForCausalLM
from workers.paged_attention import (
    KvCacheTensors,
    KvShapeError,
    KvSnapshot,
    PagedAttention,
    SeqSlice,
    build_batch,
)
from workers.sampling import SamplingParams, sample_batch, token_seed
from workers.scheduler import Scheduler, SchedulingPolicy, Sequence, SequenceStatus, StepPlan


def tune_cpu_allocator() -> bool:
    """Keep freed memory in the process instead of returning it to the OS (glibc only).

    A forward pass allocates tens of MB of temporaries (gathered KV blocks, attention
    scores) and frees them again. With glibc's defaults each such buffer is handed
    back to the kernel and faulted in again, page by page, on the next pass: that
    makes large batches cost far more than their size (measured: R^2 of the
    iteration-time fit 0.79 -> 0.98 on the tiny CPU model). Raising the trim and mmap
    thresholds reuses the memory. A process-wide setting, so only entry points
    (``sara profile``, benches, worker processes) call it. Returns False where
    ``mallopt`` is unavailable (not glibc), changing nothing.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    # 32 MiB is glibc's ceiling for the mmap threshold on 64-bit systems.
    return bool(mallopt(m_trim_threshold, 1 << 30)) and bool(mallopt(m_mmap_threshold, 1 << 25))


class KvCacheFullError(RuntimeError):
    """Retryable: the KV cache (or the running set) has no room for the sequence now."""


class FinishReason(Enum):
    STOP = "stop"  # generated an EOS token
    LENGTH = "length"  # generated max_tokens
    ABORT = "abort"  # ended by the caller


class GeneratedToken(NamedTuple):
    seq_id: int
    token_id: int


@dataclass(frozen=True, kw_only=True)
class FinishedRequest:
    seq_id: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    finish_reason: FinishReason


@dataclass(eq=False)
class _Request:
    seq: Sequence
    token_ids: list[int]  # prompt then generated
    params: SamplingParams
    seed: int
    generator: torch.Generator | None = None
    finish_reason: FinishReason | None = None
    eos_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens


class ModelRunner:
    """The model plus its paged KV tensors: runs one flat batch, returns logits."""

    def __init__(self, model: LlamaForCausalLM, *, num_blocks: int, block_size: int) -> None:
        config = model.config
        self.model = model
        self.device = model.device
        self.kv = KvCacheTensors(
            num_layers=config.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_size,
            dtype=model.dtype,
            device=self.device,
        )

    @torch.inference_mode()
    def execute(self, slices: Seq[SeqSlice]) -> torch.Tensor:
        """One forward over ``slices``; float32 logits ``[S, vocab]`` of the sampled ones.

        Rows follow the order of the slices with ``sample=True``. Writes every slice's
        K/V into the cache at its block table.
        """
        batch = build_batch(slices, self.kv, self.device)
        hidden = self.model(batch.input_ids, batch.positions, PagedAttention(self.kv, batch))
        return self.model.compute_logits(hidden[batch.sample_rows])

    def synchronize(self) -> None:
        """Wait for the device (CUDA kernels run asynchronously); a no-op on CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class Engine:
    """One worker's inference engine (see the module docstring).

    ``num_blocks`` x ``block_size`` token slots of KV cache. ``device`` moves the
    model there (default: where it is). ``seed`` seeds the choice of seeds for
    requests that bring none. ``keep_finished_kv``: finished sequences keep their
    KV blocks until ``release`` (a prefill worker exports them first).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        token_budget: int,
        num_blocks: int,
        block_size: int = 16,
        policy: SchedulingPolicy = SchedulingPolicy.CHUNKED_PREFILL,
        device: torch.device | str | None = None,
        max_running: int | None = None,
        reserve_output_tokens: bool = True,
        keep_finished_kv: bool = False,
        seed: int | None = None,
    ) -> None:
        if device is not None and torch.device(device) != model.device:
            model = model.to(device)
        self.model = model
        self.config = model.config
        self.kv_cache = PagedKVCache(num_blocks=num_blocks, block_size_tokens=block_size)
        self.scheduler = Scheduler(
            token_budget=token_budget,
            kv_cache=self.kv_cache,
            policy=policy,
            max_running=max_running,
            reserve_output_tokens=reserve_output_tokens,
            keep_finished_kv=keep_finished_kv,
        )
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size)
        self.waiting: deque[Sequence] = deque()
        self._requests: dict[int, _Request] = {}
        self._finished: dict[int, _Request] = {}
        self._held: dict[int, Sequence] = {}
        self._rng = np.random.default_rng(seed)
        self._next_seq_id = 0
        self._eos_ids = frozenset(self.config.eos_token_ids)
        # The plan of the latest non-empty step (for metrics: batch tokens, KV reads).
        self.last_plan: StepPlan | None = None

    # -- state ------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def token_budget(self) -> int:
        return self.scheduler.token_budget

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_cache.capacity_tokens

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting) or self.scheduler.has_unfinished

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    def output_token_ids(self, seq_id: int) -> list[int]:
        """Tokens generated so far by a request not yet taken (KeyError otherwise)."""
        req = self._requests.get(seq_id) or self._finished.get(seq_id)
        if req is None:
            raise KeyError(f"seq_id {seq_id}: unknown to this engine")
        return req.token_ids[req.num_prompt_tokens :]

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a sequence needing ``num_tokens`` of KV would be admitted now."""
        return (
            self.scheduler.num_running < self.scheduler.max_running
            and self.kv_cache.blocks_needed(num_tokens) <= self.kv_cache.num_free_blocks
        )

    # -- requests ---------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: Seq[int],
        params: SamplingParams | None = None,
        *,
        seq_id: int | None = None,
    ) -> int:
        """Queue a prompt (token ids); returns its ``seq_id``.

        ``ValueError`` naming the field for an empty prompt, a token id outside the
        vocabulary, a ``seq_id`` in use, or prompt + ``max_tokens`` over the model's
        context or the whole KV cache.
        """
        params = params or SamplingParams()
        prompt = self._check_prompt(prompt_token_ids, params)
        seq_id = self._claim_seq_id(seq_id)
        seq = Sequence(
            seq_id=seq_id, num_prompt_tokens=len(prompt), max_new_tokens=params.max_tokens
        )
        self._requests[seq_id] = self._request(seq, prompt, params)
        self.waiting.append(seq)
        return seq_id

    def check_request(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """``ValueError`` naming the field if this request could never run here (as
        ``add_request`` checks it), e.g. before a prefill for a decode engine alike."""
        self._check_prompt(prompt_token_ids, params)

    def _check_prompt(self, prompt_token_ids: Seq[int], params: SamplingParams) -> list[int]:
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("prompt_token_ids: must not be empty")
        vocab = self.config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(
                f"prompt_token_ids: token {bad} is outside the vocabulary [0, {vocab})"
            )
        total = len(prompt) + params.max_tokens
        if total > self.config.max_position_embeddings:
            raise ValueError(
                f"max_tokens: prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds "
                f"the model's context of {self.config.max_position_embeddings} tokens"
            )
        if self.kv_cache.blocks_needed(total) > self.kv_cache.num_blocks:
            raise ValueError(
                f"max_tokens: prompt + max_tokens = {total} tokens exceeds the KV cache "
                f"({self.kv_cache.capacity_tokens} tokens)"
            )
        return prompt

    def _claim_seq_id(self, seq_id: int | None) -> int:
        if seq_id is None:
            while any(self._next_seq_id in d for d in (self._requests, self._finished, self._held)):
                self._next_seq_id += 1
            seq_id = self._next_seq_id
            self._next_seq_id += 1
        elif seq_id in self._requests or seq_id in self._finished or seq_id in self._held:
            raise ValueError(f"seq_id: {seq_id} is already in use on this engine")
        return seq_id

    def _request(self, seq: Sequence, token_ids: list[int], params: SamplingParams) -> _Request:
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**62))
        eos = frozenset() if params.ignore_eos else self._eos_ids
        return _Request(seq=seq, token_ids=token_ids, params=params, seed=seed, eos_ids=eos)

    def abort(self, seq_id: int) -> None:
        """End a waiting or running request now and free its KV. KeyError if unknown."""
        req = self._requests.get(seq_id)
        if req is None:
            raise KeyError(f"seq_id {seq_id}: not waiting or running on this engine")
        if req.seq.status is SequenceStatus.RUNNING:
            self.scheduler.finish(seq_id)
            if self.scheduler.keep_finished_kv:
                self.scheduler.release(seq_id)
        else:
            self.waiting.remove(req.seq)
        self._retire(req, FinishReason.ABORT, hold_kv=False)

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[GeneratedToken]:
        """Run one iteration; returns the token each sampled sequence generated.

        An empty list when there is nothing to run. Finished requests are collected
        by ``take_finished``.
        """
        plan = self.scheduler.schedule(self.waiting)
        if plan.is_empty:
            return []
        self.last_plan = plan
        slices: list[SeqSlice] = []
        sampled: list[_Request] = []
        for seq_id in plan.decode_seq_ids:
            req = self._requests[seq_id]
            pos = req.seq.num_computed_tokens
            # The newest token is the input; all before it are in the cache.
            assert pos == len(req.token_ids) - 1, "decode input must be the newest token"
            slices.append(
                SeqSlice(
                    token_ids=req.token_ids[pos : pos + 1],
                    start_pos=pos,
                    block_table=self.kv_cache.block_table(seq_id),
                    sample=True,
                )
            )
            sampled.append(req)
        for chunk in plan.prefill_chunks:
            req = self._requests[chunk.seq_id]
            # After a recompute preemption the chunk that restores the KV samples nothing:
            # the sequence's newest token is already known.
            sample = chunk.completes_prompt and req.seq.num_generated_tokens == 0
            stop = chunk.start_token + chunk.num_tokens
            slices.append(
                SeqSlice(
                    token_ids=req.token_ids[chunk.start_token : stop],
                    start_pos=chunk.start_token,
                    block_table=self.kv_cache.block_table(chunk.seq_id),
                    sample=sample,
                )
            )
            if sample:
                sampled.append(req)

        logits = self.runner.execute(slices)
        generators = [self._generator(req) for req in sampled]
        tokens = sample_batch(logits, [req.params for req in sampled], generators)

        by_length = {seq.seq_id for seq in self.scheduler.complete_step(plan)}
        out: list[GeneratedToken] = []
        for req, token in zip(sampled, tokens, strict=True):
            seq_id = req.seq.seq_id
            req.token_ids.append(token)
            out.append(GeneratedToken(seq_id, token))
            if token in req.eos_ids:
                if seq_id not in by_length:
                    self.scheduler.finish(seq_id)
                self._retire(req, FinishReason.STOP, hold_kv=self.scheduler.keep_finished_kv)
            elif seq_id in by_length:
                self._retire(req, FinishReason.LENGTH, hold_kv=self.scheduler.keep_finished_kv)
        return out

    def _generator(self, req: _Request) -> torch.Generator | None:
        if req.params.greedy:
            return None
        if req.generator is None:
            req.generator = torch.Generator(device=self.device)
        req.generator.manual_seed(token_seed(req.seed, req.seq.num_generated_tokens))
        return req.generator

    def _retire(self, req: _Request, reason: FinishReason, *, hold_kv: bool) -> None:
        req.finish_reason = reason
        seq_id = req.seq.seq_id
        del self._requests[seq_id]
        self._finished[seq_id] = req
        if hold_kv:
            self._held[seq_id] = req.seq

    def take_finished(self) -> list[FinishedRequest]:
        """The requests finished since the last call (their records are dropped)."""
        done = [
            FinishedRequest(
                seq_id=seq_id,
                prompt_token_ids=tuple(req.token_ids[: req.num_prompt_tokens]),
                output_token_ids=tuple(req.token_ids[req.num_prompt_tokens :]),
                finish_reason=req.finish_reason or FinishReason.ABORT,
            )
            for seq_id, req in self._finished.items()
        ]
        self._finished.clear()
        return done

    def generate(
        self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Run ``prompts`` to completion; their generated tokens, in order (for tests, benches)."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        outputs: dict[int, list[int]] = {i: [] for i in ids}
        while any(i in self._requests for i in ids):
            for seq_id, token in self.step():
                if seq_id in outputs:
                    outputs[seq_id].append(token)
        for seq_id in ids:
            self._finished.pop(seq_id, None)
            if seq_id in self._held:
                self.release(seq_id)
        return [outputs[i] for i in ids]

    # -- KV hand-off -----------------------------------------------------------------------

    def export_kv(self, seq_id: int) -> KvSnapshot:
        """A copy of the KV computed so far for a running or held sequence.

        ``num_tokens`` of the snapshot is the sequence's ``num_computed_tokens``:
        its prompt and every generated token but the newest. KeyError if the
        sequence has no KV here.
        """
        seq = self._held.get(seq_id)
        if seq is None:
            req = self._requests.get(seq_id)
            if req is None or req.seq.status is not SequenceStatus.RUNNING:
                raise KeyError(f"seq_id {seq_id}: has no KV on this engine")
            seq = req.seq
        return self.runner.kv.export(self.kv_cache.block_table(seq_id), seq.num_computed_tokens)

    def release(self, seq_id: int) -> None:
        """Free the KV a finished sequence kept (``keep_finished_kv``). KeyError if none."""
        if seq_id not in self._held:
            raise KeyError(f"seq_id {seq_id}: holds no finished KV on this engine")
        self.scheduler.release(seq_id)
        del self._held[seq_id]

    def import_kv(
        self,
        seq_id: int,
        kv: KvSnapshot,
        num_tokens: int,
        *,
        prompt_token_ids: Seq[int],
        output_token_ids: Seq[int],
        params: SamplingParams,
    ) -> None:
        """Admit a sequence whose KV was computed elsewhere; it decodes from the next step.

        ``kv`` holds ``num_tokens`` = prompt + generated - 1 tokens (all but the
        newest generated token, the next decode's input). Raises
        ``KvCacheFullError`` (retryable, nothing changed) when it does not fit now,
        ``KvShapeError`` for KV of another model shape, ``ValueError`` for
        inconsistent lengths or a sequence with nothing left to generate.
        """
        prompt = self._check_prompt(prompt_token_ids, params)
        outputs = [int(t) for t in output_token_ids]
        if not outputs:
            raise ValueError("output_token_ids: a sequence arrives with at least its first token")
        if len(outputs) >= params.max_tokens:
            raise ValueError(
                f"output_token_ids: already {len(outputs)} of max_tokens {params.max_tokens}"
            )
        if not params.ignore_eos and outputs[-1] in self._eos_ids:
            raise ValueError("output_token_ids: the sequence already ended with EOS")
        expected = len(prompt) + len(outputs) - 1
        if num_tokens != expected or kv.num_tokens != num_tokens:
            raise KvShapeError(
                f"num_tokens: {num_tokens} (snapshot has {kv.num_tokens}); prompt + outputs - 1 "
                f"= {expected}"
            )
        seq_id = self._claim_seq_id(seq_id)
        seq = Sequence(
            seq_id=seq_id,
            num_prompt_tokens=len(prompt),
            max_new_tokens=params.max_tokens,
            num_computed_tokens=num_tokens,
            num_generated_tokens=len(outputs),
        )
        if not self.scheduler.admit(seq):
            raise KvCacheFullError(
                f"seq_id {seq_id}: no KV room for {len(prompt) + params.max_tokens} tokens now "
                f"({self.kv_cache.num_free_blocks} free blocks, "
                f"{self.scheduler.num_running} running)"
            )
        try:
            self.runner.kv.load(self.kv_cache.block_table(seq_id), kv)
        except KvShapeError:
            self.scheduler.finish(seq_id)
            if self.scheduler.keep_finished_kv:
                self.scheduler.release(seq_id)
            raise
        self._requests[seq_id] = self._request(seq, prompt + outputs, params)
