"""A direct simulation of FCFS Gamma renewal arrivals at c servers of equal service
times: the independent reference for the GI/D/c results of ``queueing.ggc.gid_wait``
and the prefill model's burst factor."""

from __future__ import annotations

import heapq
import math

import numpy as np


def simulate_equal_service(
    *, servers: int, rho: float, ca2: float, arrivals: int, seed: int
) -> tuple[float, float, float]:
    """Unit service at load ``rho`` per server: (P(wait), mean wait, the mean wait's
    95 % half-width from 20 batch means), the first tenth of the arrivals left out."""
    rng = np.random.default_rng(seed)
    shape = 1.0 / ca2
    starts = np.cumsum(rng.gamma(shape, 1.0 / (rho * servers * shape), arrivals))
    free_at = [0.0] * servers
    waits = np.empty(arrivals)
    for i, t in enumerate(starts):
        start = max(heapq.heappop(free_at), t)
        waits[i] = start - t
        heapq.heappush(free_at, start + 1.0)
    kept = waits[arrivals // 10 :]
    batches = np.array([b.mean() for b in np.array_split(kept, 20)])
    half_width = 2.09 * float(batches.std(ddof=1)) / math.sqrt(20)
    return float((kept > 0).mean()), float(kept.mean()), half_width
