"""The Sarathi-Serve token budget from the TPOT SLO.

Sarathi-Serve (Agrawal et al., OSDI 2024) picks the per-iteration token budget as the
largest one whose iteration, with the decodes that share it, still fits the
time-between-tokens target: every decode in the batch then gets its next token within
the SLO even while prompts are being chunked in. The budget here is that largest
``n`` (a multiple of ``granularity_tokens``, as kernels prefer tile-sized batches)
for which one iteration of ``decode_batch`` decodes at ``mean_context_tokens`` plus a
prefill chunk of ``n - decode_batch`` fresh tokens takes at most ``tpot_slo_s``.
"""

from __future__ import annotations

import math

from queueing.profile import IterationProfile, attention_pairs

DEFAULT_MAX_BUDGET_TOKENS = 8192
DEFAULT_GRANULARITY_TOKENS = 16


class BudgetInfeasibleError(ValueError):
    """Not even the smallest budget fits the TPOT SLO."""

    def __init__(self, *, tpot_slo_s: float, floor_s: float) -> None:
        super().__init__(
            f"tpot_p99_s: {tpot_slo_s:.4g} s is below one iteration's floor of "
            f"{floor_s:.4g} s on this profile"
        )
        self.tpot_slo_s = tpot_slo_s
        self.floor_s = floor_s


def _iteration_s(
    profile: IterationProfile, budget: int, decode_batch: int, mean_context_tokens: float
) -> float:
    chunk = budget - decode_batch
    return profile.iteration_s(
        n_tokens=budget,
        n_kv_read=decode_batch * mean_context_tokens,
        n_attn_pairs=attention_pairs(chunk, 0),
    )


def token_budget(
    profile: IterationProfile,
    *,
    tpot_slo_s: float,
    decode_batch: int = 0,
    mean_context_tokens: float = 0.0,
    max_budget_tokens: int = DEFAULT_MAX_BUDGET_TOKENS,
    granularity_tokens: int = DEFAULT_GRANULARITY_TOKENS,
) -> int:
    """Largest budget (tokens per iteration) whose iteration fits ``tpot_slo_s``.

    The iteration time rises with the budget, so the answer is found by bisection over
    multiples of ``granularity_tokens`` up to ``max_budget_tokens``. Raises
    ``BudgetInfeasibleError`` when even ``granularity_tokens`` (or the decode batch
    alone) exceeds the SLO.
    """
    if not (math.isfinite(tpot_slo_s) and tpot_slo_s > 0):
        raise ValueError(f"tpot_slo_s: must be a finite number > 0, got {tpot_slo_s!r}")
    if decode_batch < 0:
        raise ValueError(f"decode_batch: must be >= 0, got {decode_batch!r}")
    if granularity_tokens < 1 or max_budget_tokens < granularity_tokens:
        raise ValueError("granularity_tokens: must be >= 1 and <= max_budget_tokens")
    lo = max(1, math.ceil((decode_batch + 1) / granularity_tokens))
    hi = max_budget_tokens // granularity_tokens
    floor_s = _iteration_s(profile, lo * granularity_tokens, decode_batch, mean_context_tokens)
    if floor_s > tpot_slo_s:
        raise BudgetInfeasibleError(tpot_slo_s=tpot_slo_s, floor_s=floor_s)
    # Invariant: budget lo * g fits; find the largest multiple that fits.
    if (
        _iteration_s(profile, hi * granularity_tokens, decode_batch, mean_context_tokens)
        <= tpot_slo_s
    ):
        return hi * granularity_tokens
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if (
            _iteration_s(profile, mid * granularity_tokens, decode_batch, mean_context_tokens)
            <= tpot_slo_s
        ):
            lo = mid
        else:
            hi = mid
    return lo * granularity_tokens
