"""The emulated engine: the real scheduler and KV bookkeeping, the profile's time, no model.

Serving stacks test their autoscalers without accelerators by emulating the engine
(llm-d's inference simulator mimics vLLM's timing; NVIDIA Dynamo has a mocker
engine). ``EmulatedEngine`` is SARA's: it is an ``Engine`` whose forward pass is
replaced by time. Everything else is the real thing —

- ``workers.scheduler.Scheduler`` plans every step (Sarathi-Serve chunked prefill
  under the token budget, decodes first) over a real ``PagedKVCache``, so admission,
  KV room and batch composition are the simulator's and the torch engine's;
- a step lasts ``profile.iteration_s`` of its plan's token counts (batched tokens,
  decode KV reads, prefill attention pairs: DESIGN §3.1). The duration is fixed when
  the step starts and the step then *sleeps until it is due* on the injected clock,
  so the Python work of the step (planning, bookkeeping) and of the worker between
  back-to-back steps (see ``EmulatedEngine.step``) is absorbed into it rather than
  added, and a process descheduled by CPU contention catches up at the next step
  instead of drifting;
- tokens are a deterministic function of (request key, token index): the key is the
  request's seed when it samples, a CRC-32 of its prompt when it is greedy. Any
  worker that continues a request therefore produces exactly the tokens another
  would have, as with the torch engine. An emulated model never emits EOS: every
  request generates its ``max_tokens``, the lengths a trace asks for;
- the KV hand-off moves real bytes over the real transport: an exported sequence is
  ``kv_scale`` x ``profile.kv_bytes_per_token`` bytes per token (``DEFAULT_KV_SCALE``
  = 1/256: a Llama-3-8B token's 128 KiB becomes 512 B, so a loaded 2-core machine's
  Redis carries it; 1.0 moves the full size).

The worker process emulates the profile's startup time before it serves
(``cli.worker_cmd``).
"""

from __future__ import annotations

import math
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from queueing.profile import IterationProfile
from workers.engine import Engine, FinishReason, GeneratedToken, _Request
from workers.kv_cache import PagedKVCache
from workers.paged_attention import KvShapeError
from workers.sampling import SamplingParams, token_seed
from workers.scheduler import Scheduler, SchedulingPolicy
from workers.scheduler import Sequence as SchedSequence

if TYPE_CHECKING:
    from workers.paged_attention import KvSnapshot

DEFAULT_KV_SCALE = 1.0 / 256
_MASK64 = (1 << 64) - 1
# Bytes per emulated KV element (float16) and elements per token per width unit (K and V).
_ELEMENT_BYTES = 2


@dataclass(frozen=True, kw_only=True)
class EmulatedModel:
    """What an emulated model says about itself (the fields ``Engine`` checks requests
    against): its vocabulary, its context and its EOS ids (never generated)."""

    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise ValueError(f"{name}: expected an integer >= 2, got {value!r}")
        if len(set(self.eos_token_ids)) >= self.vocab_size:
            raise ValueError("eos_token_ids: would leave no token to generate")

    @classmethod
    def from_config(cls, config: dict[str, object]) -> EmulatedModel:
        """From a checkpoint's ``config.json`` (a real model's, or ``model_card``'s)."""
        eos = config.get("eos_token_id", ())
        eos_ids = (eos,) if isinstance(eos, int) else tuple(eos or ())  # type: ignore[arg-type]
        for name in ("vocab_size", "max_position_embeddings"):
            if name not in config:
                raise ValueError(f"{name}: missing from the model's config.json")
        return cls(
            vocab_size=config["vocab_size"],  # type: ignore[arg-type]
            max_position_embeddings=config["max_position_embeddings"],  # type: ignore[arg-type]
            eos_token_ids=tuple(int(t) for t in eos_ids),
        )


def kv_width(profile: IterationProfile, kv_scale: float) -> int:
    """float16 elements per token of K (and of V) that carry ``kv_scale`` of the
    profile's ``kv_bytes_per_token``: at least 1."""
    if not (math.isfinite(kv_scale) and 0 < kv_scale <= 1):
        raise ValueError(f"kv_scale: expected a number in (0, 1], got {kv_scale!r}")
    return max(1, round(profile.kv_bytes_per_token * kv_scale / (2 * _ELEMENT_BYTES)))


def emulated_token(key: int, index: int, *, vocab_size: int, eos: frozenset[int]) -> int:
    """Token ``index`` of a request keyed ``key``: a splitmix64 hash, EOS skipped."""
    x = (token_seed(key, index) + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    token = (x ^ (x >> 31)) % vocab_size
    while token in eos:
        token = (token + 1) % vocab_size
    return int(token)


class _EmulatedKv:
    """Stands in for the KV tensors: exports zero-filled snapshots of the emulated
    size and checks the shape of what is loaded (a snapshot from another profile or
    scale is refused, as a real cache refuses another model's KV)."""

    def __init__(self, width: int) -> None:
        self.width = width

    def export(self, block_table: Sequence[int], num_tokens: int) -> KvSnapshot:
        import torch

        from workers.paged_attention import KvSnapshot

        shape = (1, num_tokens, 1, self.width)
        return KvSnapshot(
            key=torch.zeros(shape, dtype=torch.float16),
            value=torch.zeros(shape, dtype=torch.float16),
        )

    def load(self, block_table: Sequence[int], snapshot: KvSnapshot) -> None:
        expected = (1, snapshot.num_tokens, 1, self.width)
        if tuple(snapshot.key.shape) != expected:
            raise KvShapeError(
                f"key: shape {tuple(snapshot.key.shape)} does not fit this emulated cache "
                f"(expected {expected}: another profile or kv_scale?)"
            )


class _EmulatedRunner:
    def __init__(self, width: int) -> None:
        self.kv = _EmulatedKv(width)


class EmulatedEngine(Engine):
    """An ``Engine`` that runs no model (see the module docstring).

    ``profile`` times every step; ``model`` bounds requests (vocabulary, context);
    ``clock`` (monotonic seconds) and ``sleep`` are injected so that tests run it on
    a fake clock. ``on_step`` is told each step's profile time and how much of the
    worker's work before it the step overlapped (``sara_worker_emulated_profile_seconds``
    and ``sara_worker_emulated_overlap_seconds``: the worker's measured iteration time
    plus the overlap, over the profile time, is the emulation's accuracy). The other
    arguments are ``Engine``'s.
    """

    def __init__(
        self,
        profile: IterationProfile,
        *,
        model: EmulatedModel,
        token_budget: int,
        num_blocks: int,
        block_size: int = 16,
        policy: SchedulingPolicy = SchedulingPolicy.CHUNKED_PREFILL,
        max_running: int | None = None,
        reserve_output_tokens: bool = True,
        keep_finished_kv: bool = False,
        kv_scale: float = DEFAULT_KV_SCALE,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        on_step: Callable[[float, float], None] | None = None,
        seed: int | None = None,
    ) -> None:
        # Engine.__init__ builds a torch model runner; this sets the same state without one.
        self.profile = profile
        self.model = None  # type: ignore[assignment]
        self.config = model  # type: ignore[assignment]
        self.kv_cache = PagedKVCache(num_blocks=num_blocks, block_size_tokens=block_size)
        self.scheduler = Scheduler(
            token_budget=token_budget,
            kv_cache=self.kv_cache,
            policy=policy,
            max_running=max_running,
            reserve_output_tokens=reserve_output_tokens,
            keep_finished_kv=keep_finished_kv,
        )
        self.kv_scale = kv_scale
        self._kv_width = kv_width(profile, kv_scale)
        self.runner = _EmulatedRunner(self._kv_width)  # type: ignore[assignment]
        self.waiting: deque[SchedSequence] = deque()
        self._requests: dict[int, _Request] = {}
        self._finished: dict[int, _Request] = {}
        self._held: dict[int, SchedSequence] = {}
        self._rng = np.random.default_rng(seed)
        self._next_seq_id = 0
        self._eos_ids = frozenset(model.eos_token_ids)
        self.last_plan = None
        self._clock = clock
        self._sleep = sleep
        self._on_step = on_step
        self._last_due: float | None = None
        self._keys: dict[int, int] = {}

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token's KV occupies in a hand-off (K and V)."""
        return 2 * self._kv_width * _ELEMENT_BYTES

    def _request(
        self, seq: SchedSequence, token_ids: list[int], params: SamplingParams
    ) -> _Request:
        req = super()._request(seq, token_ids, params)
        prompt = np.asarray(token_ids[: seq.num_prompt_tokens], dtype="<i8").tobytes()
        self._keys[seq.seq_id] = zlib.crc32(prompt) if params.greedy else req.seed
        return req

    def _retire(self, req: _Request, reason: FinishReason, *, hold_kv: bool) -> None:
        self._keys.pop(req.seq.seq_id, None)
        super()._retire(req, reason, hold_kv=hold_kv)

    def step_s(self, *, n_tokens: int, n_kv_read: int, n_attn_pairs: int) -> float:
        """How long a step over these counts lasts: the profile's iteration time."""
        return self.profile.iteration_s(
            n_tokens=n_tokens, n_kv_read=n_kv_read, n_attn_pairs=n_attn_pairs
        )

    def step(self) -> list[GeneratedToken]:
        """One iteration: plan, generate, then sleep until the profile's time is up.

        Back-to-back steps keep the profile's cadence: when this step is asked for
        less than its own duration after the previous one was due, it starts at that
        due time — the worker's work in between (publishing tokens, reading streams)
        ran while the emulated accelerator computed, as an engine that overlaps its
        CPU work with the device's does — so that work is absorbed, not added. Only
        work already under way overlaps: a step that left nothing running ends the
        cadence, and the next one starts when it is asked for (an idle accelerator
        computes nothing ahead).
        """
        entry = self._clock()
        plan = self.scheduler.schedule(self.waiting)
        if plan.is_empty:
            self._last_due = None
            return []
        self.last_plan = plan
        step_s = self.step_s(
            n_tokens=plan.num_batched_tokens,
            n_kv_read=plan.num_kv_read_tokens,
            n_attn_pairs=plan.num_attention_pairs,
        )
        started, overlap_s = entry, 0.0
        if self._last_due is not None and 0.0 <= entry - self._last_due < step_s:
            started, overlap_s = self._last_due, entry - self._last_due
        due = started + step_s
        self._last_due = due
        if self._on_step is not None:
            self._on_step(step_s, overlap_s)
        sampled = [self._requests[seq_id] for seq_id in plan.decode_seq_ids]
        for chunk in plan.prefill_chunks:
            req = self._requests[chunk.seq_id]
            # As in Engine.step: a chunk restoring a preempted sequence samples nothing.
            if chunk.completes_prompt and req.seq.num_generated_tokens == 0:
                sampled.append(req)
        vocab = self.config.vocab_size
        tokens = [
            emulated_token(
                self._keys[req.seq.seq_id],
                req.seq.num_generated_tokens,
                vocab_size=vocab,
                eos=self._eos_ids,
            )
            for req in sampled
        ]
        by_length = {seq.seq_id for seq in self.scheduler.complete_step(plan)}
        out: list[GeneratedToken] = []
        for req, token in zip(sampled, tokens, strict=True):
            seq_id = req.seq.seq_id
            req.token_ids.append(token)
            out.append(GeneratedToken(seq_id, token))
            if seq_id in by_length:
                self._retire(req, FinishReason.LENGTH, hold_kv=self.scheduler.keep_finished_kv)
        if not self.waiting and not self.scheduler.has_unfinished:
            self._last_due = None  # idle from here: the next request starts fresh
        while (left := due - self._clock()) > 0:
            self._sleep(left)
        return out


EMULATED_VOCAB_SIZE = 32_000
EMULATED_CONTEXT_TOKENS = 8_192


def context_tokens(profile: IterationProfile) -> int:
    """An emulated model's context: the profile's model's, else ``EMULATED_CONTEXT_TOKENS``."""
    return profile.max_context_tokens or EMULATED_CONTEXT_TOKENS


def model_card(profile: IterationProfile) -> dict[str, object]:
    """The ``config.json`` of an emulated model folder: what the router reads (context,
    vocabulary) and what ``EmulatedModel.from_config`` reads back. No weights."""
    return {
        "model_type": "sara-emulated",
        "sara_profile": profile.name,
        "vocab_size": EMULATED_VOCAB_SIZE,
        "max_position_embeddings": context_tokens(profile),
        "eos_token_id": [],
    }
