"""Prometheus histograms: quantiles and reconstructed samples from bucket counts.

A bucket is ``(upper_bound, cumulative_count)`` as in the exposition format's ``le``
label: the count of observations ``<= upper_bound``. Counts may be absolute or per
second (rates): only their proportions matter. Both observation sources use these
functions, so the scrape source's P99 is computed exactly as PromQL's
``histogram_quantile`` (Prometheus 2.42, ``promql/quantile.go``) computes it, and the
simulator reads its windows' P99s through the router's buckets with it, so a
back-tested controller calibrates on what a deployed one would see:

- the buckets must include ``+Inf``; duplicate bounds are merged; counts are made
  non-decreasing (they can dip when the buckets are not scraped atomically);
- the value is interpolated linearly inside the bucket that holds the rank; the
  first bucket starts at 0 (unless its bound is <= 0);
- a rank in the ``+Inf`` bucket answers the highest finite bound: a lower bound of
  the truth, which is why length and latency buckets should end above any real value.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from queueing.lengths import LengthSamples

FloatArray = npt.NDArray[np.float64]
Bucket = tuple[float, float]  # (upper bound, cumulative count)

DEFAULT_SAMPLES = 500

# -- the buckets SARA's router exports (``workers.router_metrics``) ----------------------

# Within a bucket ``histogram_quantile`` interpolates linearly, so a P99 read from a
# window's histogram can sit anywhere in its bucket: with neighbours 1.33x apart it
# can be off by a third, which the controller takes for the model's error (its
# calibration) and sizes on, and the simulator reads its P99s through the same
# buckets (``sim.control``), as a deployment's controller would. Steps of at most
# 1.17x bound that error to a sixth of the value. Every bound of the coarser
# grid (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8) is kept, so SLOs set on one stay bounds.
_DENSE = (
    1.0, 1.1, 1.2, 1.25, 1.3, 1.4, 1.5, 1.6, 1.8, 2.0, 2.2, 2.5, 2.8, 3.0, 3.3, 3.6, 4.0,
    4.5, 5.0, 5.5, 6.0, 7.0, 8.0, 9.0,
)  # fmt: skip


def _decades(first_exponent: int, last_exponent: int) -> tuple[float, ...]:
    return tuple(
        round(m * 10.0**e, 10) for e in range(first_exponent, last_exponent + 1) for m in _DENSE
    )


TTFT_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.0075, *_decades(-2, 0), 10.0, 12.5, 15.0, 20.0, 25.0, 30.0, 45.0, 60.0, 90.0,
    120.0, 180.0, 300.0,
)  # fmt: skip
TPOT_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.00075, *_decades(-3, -1), 1.0, 1.25, 1.5, 2.0, 3.0, 5.0,
)  # fmt: skip
TOKEN_BUCKETS: tuple[float, ...] = tuple(
    float(b) for e in range(0, 18) for b in sorted({2**e, 3 * 2**e // 2}) if b <= 2**17
)


def bucketed(values: npt.ArrayLike, bounds: Iterable[float]) -> list[Bucket]:
    """The cumulative buckets a histogram with these (finite) bounds would hold for
    ``values``, ``+Inf`` included: what a scrape of the router would show."""
    data = np.sort(np.asarray(values, dtype=np.float64))
    finite = sorted(float(b) for b in bounds)
    counts = np.searchsorted(data, finite, side="right")
    return [
        *zip(finite, counts.astype(np.float64).tolist(), strict=True),
        (math.inf, float(len(data))),
    ]


def _normalised(buckets: Iterable[Bucket]) -> tuple[FloatArray, FloatArray] | None:
    """Sorted bounds and monotone cumulative counts, or None where PromQL gives NaN."""
    merged: dict[float, float] = {}
    for bound, count in buckets:
        if math.isnan(bound) or not math.isfinite(count):
            return None
        merged[bound] = merged.get(bound, 0.0) + count
    if len(merged) < 2 or math.inf not in merged:
        return None
    bounds = np.array(sorted(merged), dtype=np.float64)
    counts = np.maximum.accumulate(np.array([merged[b] for b in bounds], dtype=np.float64))
    if counts[-1] <= 0:
        return None
    return bounds, counts


def _quantiles(bounds: FloatArray, counts: FloatArray, qs: FloatArray) -> FloatArray:
    """Vectorised ``bucketQuantile`` for normalised buckets."""
    ranks = qs * counts[-1]
    # The first bucket (among all but +Inf) whose cumulative count reaches the rank.
    b = np.searchsorted(counts[:-1], ranks, side="left")
    last = len(bounds) - 1
    in_top = b == last
    b = np.minimum(b, last - 1)
    end = bounds[b]
    start = np.where(b > 0, bounds[np.maximum(b - 1, 0)], 0.0)
    below = np.where(b > 0, counts[np.maximum(b - 1, 0)], 0.0)
    width = counts[b] - below
    with np.errstate(divide="ignore", invalid="ignore"):
        inside = np.where(width > 0, (ranks - below) / width, 0.0)
    # The clamp keeps a value at the top of its bucket from rounding one ulp above it.
    values = np.minimum(start + (end - start) * inside, end)
    values = np.where((b == 0) & (bounds[0] <= 0), bounds[0], values)
    result: FloatArray = np.where(in_top, bounds[last - 1], values)
    return result


def histogram_quantile(q: float, buckets: Iterable[Bucket]) -> float | None:
    """The ``q`` quantile, as PromQL's ``histogram_quantile(q, ...)`` computes it.

    ``None`` where PromQL answers NaN: no ``+Inf`` bucket, fewer than two buckets,
    no observations, or a NaN count. ``q`` outside [0, 1] is a programming error.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q: must be in [0, 1], got {q!r}")
    normal = _normalised(buckets)
    if normal is None:
        return None
    return float(_quantiles(*normal, np.array([q]))[0])


def bucket_samples(buckets: Iterable[Bucket], *, n: int = DEFAULT_SAMPLES) -> FloatArray | None:
    """``n`` values, sorted, whose histogram matches the buckets' proportions.

    Sample i is the histogram's quantile at ``(i + 0.5) / n``: each bucket gets its
    share of the ``n`` samples to within one, spread evenly (uniformly) over the
    bucket, and the result is deterministic. Samples in the ``+Inf`` bucket sit at the
    highest finite bound (as ``histogram_quantile`` answers). ``None`` when the
    buckets hold no observations or are malformed (as for ``histogram_quantile``).
    """
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n!r}")
    normal = _normalised(buckets)
    if normal is None:
        return None
    return _quantiles(*normal, (np.arange(n, dtype=np.float64) + 0.5) / n)


def histogram_count(buckets: Iterable[Bucket]) -> float | None:
    """The observations the buckets hold (the ``+Inf`` bucket's count); ``None`` where
    the buckets are malformed or empty."""
    normal = _normalised(buckets)
    return None if normal is None else float(normal[1][-1])


def length_samples(
    prompt_buckets: Iterable[Bucket],
    output_buckets: Iterable[Bucket],
    *,
    source: str,
    requests: float,
    n: int = DEFAULT_SAMPLES,
) -> LengthSamples | None:
    """(prompt, output) token-length pairs reconstructed from two histograms, one pair
    per request the window finished (``requests``, rounded, at least one), at most ``n``.

    Histograms keep the two marginals but lose which prompt came with which output.
    The pairs are formed in quantile order (the i-th shortest prompt with the i-th
    shortest output): of all pairings of the same marginals this one maximises
    E[prompt x output] (rearrangement inequality), so the output-weighted decode
    context, the one quantity the pairing changes, is over- rather than
    under-estimated; it is also deterministic. Lengths are rounded up to whole tokens
    (an integer bound stays in its ``le`` bucket) and are at least 1.

    Why one pair per request: the controller pools the windows' pairs, and a window
    of exact samples (the simulator's) weighs in that pool by its requests. A fixed
    number of pairs per histogram would weigh a quiet window of five requests — often
    the shortest, the first to finish after a start — as much as a busy one of two
    hundred (the demo's pooled mean output read 217 tokens where its requests held
    258). The pairs are an evenly strided subset of the ``n``-quantile reconstruction,
    its first and last included, so a window of few requests still reaches the
    histogram's extremes instead of stopping at its ``(k - 0.5) / k`` quantile.
    ``None`` when either histogram has no observations, or ``requests`` is not > 0.
    """
    prompt = bucket_samples(prompt_buckets, n=n)
    output = bucket_samples(output_buckets, n=n)
    if prompt is None or output is None or not (math.isfinite(requests) and requests > 0):
        return None
    pairs = min(n, max(1, round(requests)))
    keep = np.linspace(0, n - 1, pairs).round().astype(np.int64)
    return LengthSamples(
        prompt_tokens=_tokens(prompt[keep]), output_tokens=_tokens(output[keep]), source=source
    )


def _tokens(values: FloatArray) -> npt.NDArray[np.int64]:
    return np.maximum(np.ceil(values), 1.0).astype(np.int64)
