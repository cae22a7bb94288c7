"""Request-length distributions and their reduction to weighted classes.

The models need the *joint* distribution of (prompt, output) lengths: a prompt's
prefill time, its KV handoff and its decode context all come from the same request.
``LengthSamples`` holds the empirical pairs; ``stratify`` reduces them to a
few hundred weighted groups, ordered by a score, with finer groups in the upper tail
of that score where the P99 is decided. Reductions happen once per workload,
so the solver's inner loop works on small arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, kw_only=True, eq=False)
class LengthSamples:
    """Empirical (prompt, output) length pairs, in tokens, one row per request.

    Row i of both arrays is the same request: prompt and output lengths are
    correlated in real workloads (summarisation: long in, short out), so they are
    never resampled separately.
    """

    prompt_tokens: IntArray
    output_tokens: IntArray
    source: str

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "output_tokens"):
            values = getattr(self, name)
            if not isinstance(values, np.ndarray) or values.ndim != 1:
                raise ValueError(f"{name}: expected a 1-D numpy array")
            if not np.issubdtype(values.dtype, np.integer):
                raise ValueError(f"{name}: expected integers, got dtype {values.dtype}")
            if len(values) == 0:
                raise ValueError(f"{name}: needs at least one sample")
            if int(values.min()) < 1:
                raise ValueError(f"{name}: every length must be >= 1, found {values.min()}")
        if len(self.prompt_tokens) != len(self.output_tokens):
            raise ValueError(
                f"output_tokens: length {len(self.output_tokens)} != "
                f"prompt_tokens length {len(self.prompt_tokens)}"
            )

    def __len__(self) -> int:
        return len(self.prompt_tokens)

    @property
    def decoding(self) -> BoolArray:
        """The requests that reach the decode pool: a request's first token comes
        from its prefill, so only those with more than one output token decode."""
        return self.output_tokens >= 2


def observed_within_context(
    samples: LengthSamples, max_context_tokens: int | None
) -> LengthSamples:
    """Observed pairs as requests that fit the context: an output longer than what its
    prompt leaves is cut to it (``samples`` itself when none is, or no context is
    stated; a prompt as long as the context is left for the model to reject).

    A router rejects a request longer than the context before it counts it, so every
    observed request fit. Pairs reconstructed from two histograms do not know that:
    paired in quantile order, the longest prompts (piled just under the context when
    clients clip them there) meet the longest outputs, and a capacity model that
    drops over-context requests (``queueing.solver.CapacityModel.build``, right for a
    trace's) then drops the very prompts the P99 TTFT is made of: on the demo's mix,
    exactly paired, 1.42 s at 3 prefill workers and 4 req/s; its two marginals paired
    in quantile order, 0.77 s. Cutting the output keeps the prompt marginal exact.
    """
    if max_context_tokens is None:
        return samples
    room = max_context_tokens - samples.prompt_tokens
    # Only a prompt that leaves room is re-paired: one that does not is no pairing's
    # artefact (the model rejects it, as the router would have).
    cut = (room >= 1) & (samples.output_tokens > room)
    if not bool(cut.any()):
        return samples
    return LengthSamples(
        prompt_tokens=samples.prompt_tokens,
        output_tokens=np.where(cut, room, samples.output_tokens),
        source=samples.source,
    )


@dataclass(frozen=True, kw_only=True, eq=False)
class Strata:
    """Groups of consecutive samples in score order, with their probability weights.

    ``order`` sorts the samples by score; group g holds ``order[edges[g]:edges[g+1]]``.
    """

    order: IntArray
    edges: IntArray
    weights: FloatArray

    def means(self, values: FloatArray) -> FloatArray:
        """The mean of ``values`` (one per sample) within each group."""
        counts = np.diff(self.edges).astype(np.float64)
        return np.add.reduceat(values[self.order], self.edges[:-1]) / counts

    def variances(self, values: FloatArray) -> FloatArray:
        """The variance of ``values`` within each group (0 for single-sample groups)."""
        mean_sq = self.means(values * values)
        mean = self.means(values)
        return np.maximum(mean_sq - mean * mean, 0.0)


def stratify(
    score: FloatArray,
    *,
    body_classes: int = 160,
    tail_classes: int = 160,
    tail_mass: float = 0.05,
) -> Strata:
    """Groups of requests with consecutive ``score``, finer in the upper tail.

    The ``tail_mass`` of requests with the highest score get ``tail_classes`` groups of
    their own, so quantiles near the top are resolved to about
    ``tail_mass / tail_classes`` of probability; the rest share ``body_classes``.
    Representing a group by the mean of a per-request quantity (``Strata.means``)
    keeps every group's expectation exact.
    """
    n = len(score)
    if n == 0:
        raise ValueError("score: needs at least one sample")
    if not (0.0 < tail_mass < 1.0):
        raise ValueError(f"tail_mass: must be in (0, 1), got {tail_mass!r}")
    order = np.argsort(score, kind="stable").astype(np.int64)
    if n <= body_classes + tail_classes:
        edges = np.arange(n + 1, dtype=np.int64)
    else:
        tail_start = min(n - 1, max(1, round(n * (1.0 - tail_mass))))
        body = np.linspace(0, tail_start, min(body_classes, tail_start) + 1)
        tail = np.linspace(tail_start, n, min(tail_classes, n - tail_start) + 1)
        edges = np.unique(np.concatenate([body, tail]).round().astype(np.int64))
    weights = np.diff(edges).astype(np.float64) / n
    return Strata(order=order, edges=edges, weights=weights)
