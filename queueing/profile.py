"""Iteration-time profile of one worker (DESIGN §3.1).

One forward pass ("iteration") over a batch costs

    T = t0_s + t_tok_s * n_tokens + t_kv_s * n_kv_read + t_attn_s * n_attn_pairs

- ``n_tokens``: every token in the batch (prefill-chunk tokens plus one per decode);
- ``n_kv_read``: KV entries read by decode attention (the sum of the decoding
  sequences' context lengths, each including the token being decoded);
- ``n_attn_pairs``: causal (query, key) pairs of the prefill chunks. A chunk of ``c``
  tokens after ``p`` cached tokens has ``c * p + c * (c + 1) / 2`` pairs, so a prompt
  of ``L`` tokens has ``L * (L + 1) / 2`` pairs however it is chunked.

``t0_s`` is the weight-read floor (memory bound), ``t_tok_s`` the per-token compute.
``max_context_tokens`` is the model's context: a request whose prompt plus output
tokens exceed it is rejected, by the router (HTTP 400 ``context_length_exceeded``,
as vLLM and the OpenAI API do), by the simulator (not served, so not completed) and by
the capacity model (left out of the length mix it plans for), all through
``exceeds_context``. Rejecting rather than truncating is what the engines users run
do, and it is the only choice that keeps the three consistent: a truncated prompt
would be a different request. A profile without it (older documents) limits requests
by KV capacity only.
A profile is stored as a small JSON document; parsing validates every field and an
error names the field that is wrong. (Reading and writing files is the callers' job:
this package does no I/O.)
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import numpy.typing as npt


class ProfileError(ValueError):
    """A profile document or value is invalid; the message names the field."""


def attention_pairs(chunk_tokens: int, prefix_tokens: int) -> int:
    """Causal (query, key) pairs of a chunk of ``chunk_tokens`` after ``prefix_tokens``."""
    return chunk_tokens * prefix_tokens + chunk_tokens * (chunk_tokens + 1) // 2


def exceeds_context(
    prompt_tokens: npt.ArrayLike, output_tokens: npt.ArrayLike, max_context_tokens: int | None
) -> npt.NDArray[np.bool_]:
    """Which requests ask for more than the context: prompt + output > max_context_tokens
    (none when the context is not stated)."""
    total = np.asarray(prompt_tokens, dtype=np.int64) + np.asarray(output_tokens, dtype=np.int64)
    if max_context_tokens is None:
        return np.zeros(total.shape, dtype=np.bool_)
    result: npt.NDArray[np.bool_] = total > max_context_tokens
    return result


@dataclass(frozen=True, kw_only=True)
class IterationProfile:
    """Coefficients of the iteration-time model, plus the worker's memory facts.

    All times are seconds; ``kv_capacity_tokens`` is what the worker's KV cache holds
    in total (all tensor-parallel ranks together); ``startup_s`` is the time from the
    start of a new worker to its first served request.
    """

    name: str
    model: str
    hardware: str
    tensor_parallel: int
    t0_s: float
    t_tok_s: float
    t_kv_s: float
    t_attn_s: float
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    startup_s: float
    source: str
    max_context_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("name", "model", "hardware", "source"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ProfileError(f"{name}: must be a non-empty string, got {value!r}")
        for name in ("tensor_parallel", "kv_capacity_tokens", "kv_bytes_per_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ProfileError(f"{name}: must be an integer >= 1, got {value!r}")
        for name in ("t0_s", "t_tok_s", "t_kv_s", "t_attn_s", "startup_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise ProfileError(f"{name}: must be a finite number >= 0, got {value!r}")
        context = self.max_context_tokens
        if context is not None and (
            isinstance(context, bool) or not isinstance(context, int) or context < 2
        ):
            raise ProfileError(f"max_context_tokens: must be an integer >= 2, got {context!r}")
        if self.t0_s + self.t_tok_s <= 0:
            raise ProfileError("t0_s: t0_s and t_tok_s cannot both be 0 (iterations would be free)")

    def iteration_s(
        self, *, n_tokens: float, n_kv_read: float = 0.0, n_attn_pairs: float = 0.0
    ) -> float:
        """Seconds one iteration takes over the given batch."""
        return (
            self.t0_s
            + self.t_tok_s * n_tokens
            + self.t_kv_s * n_kv_read
            + self.t_attn_s * n_attn_pairs
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: Any) -> IterationProfile:
        if not isinstance(data, dict):
            raise ProfileError(f"profile: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ProfileError(f"{unknown[0]}: unknown profile field")
        missing = sorted(known - set(data) - {"max_context_tokens"})
        if missing:
            raise ProfileError(f"{missing[0]}: missing from the profile")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> IterationProfile:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"profile: not valid JSON ({exc})") from exc
        return cls.from_dict(data)
