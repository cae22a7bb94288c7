"""Choosing the next token: greedy, or temperature with nucleus (top-p) sampling.

Randomness is per request and reproducible: the ``n``-th generated token of a request
with seed ``s`` is drawn from a ``torch.Generator`` seeded by ``token_seed(s, n)``.
So the draw depends only on (seed, position, logits), never on which other requests
shared the batch or on which engine ran the earlier tokens: a request prefilled on
one worker and decoded on another samples exactly what one engine would have.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_SEED_MASK = (1 << 63) - 1


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request generates.

    ``max_tokens``: tokens generated at most (>= 1). ``temperature`` 0 is greedy
    (argmax); above 0, logits are divided by it and ``top_p`` keeps the smallest set
    of most likely tokens whose probability reaches ``top_p``. ``seed``: ``None``
    lets the engine pick one. ``ignore_eos``: generate ``max_tokens`` regardless.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed: must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def token_seed(seed: int, index: int) -> int:
    """The generator seed of generated token ``index`` (0-based) of a request seeded ``seed``."""
    # A fixed odd multiplier spreads neighbouring (seed, index) pairs apart.
    return (seed * 0x9E3779B97F4A7C15 + index) & _SEED_MASK


def sample_one(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """The next token from float logits ``[vocab]``; ``generator`` is needed unless greedy."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    if generator is None:
        raise ValueError("generator: needed when temperature > 0")
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep a token if the mass before it is still short of top_p (the first always).
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = torch.where(before < params.top_p, sorted_probs, 0.0)
        pick = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[pick].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of ``logits`` ``[rows, vocab]``; greedy rows in one argmax."""
    if logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(
            f"params: {len(params)} params and {len(generators)} generators "
            f"for {logits.shape[0]} rows"
        )
    tokens = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        picks = torch.argmax(logits[greedy], dim=-1).tolist()
        for row, token in zip(greedy, picks, strict=True):
            tokens[row] = int(token)
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = sample_one(logits[i], p, generators[i])
    return tokens
