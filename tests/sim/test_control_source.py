"""The simulated source measures a window as a deployed controller would.

A deployed controller reads its P99s from the router's histograms, linearly inside the
bucket that holds the rank; the simulator's source reads its exact latencies through
the same buckets, so a back-test calibrates on what production sees.
"""

from __future__ import annotations

import numpy as np
import pytest

from controller.histograms import TPOT_BUCKETS_S, TTFT_BUCKETS_S, bucketed, histogram_quantile
from controller.observation import PoolObservation
from queueing.pools import Pool
from sim.cluster import ClusterSnapshot, PoolSnapshot
from sim.control import observation_from

POOL = PoolSnapshot(starting=0, serving=1, draining=0, busy=1, queue_length=0, running=1)
REPLICAS = {pool: PoolObservation(current_replicas=1, ready_replicas=1) for pool in Pool}


def window(ttft_s: np.ndarray, tpot_s: np.ndarray) -> ClusterSnapshot:
    n = len(ttft_s)
    return ClusterSnapshot(
        time_s=30.0,
        window_s=30.0,
        prefill=POOL,
        decode=POOL,
        arrived=n,
        completed=n,
        window_arrivals=n,
        window_arrival_rate_rps=n / 30.0,
        window_prompt_tokens=np.full(n, 100, dtype=np.int64),
        window_output_tokens=np.full(n, 50, dtype=np.int64),
        window_completed_prompt_tokens=np.full(n, 100, dtype=np.int64),
        window_arrival_s=np.linspace(0.0, 30.0, n),
        window_ttft_s=ttft_s,
        window_tpot_s=tpot_s,
    )


def test_a_tail_inside_one_bucket_reads_where_linear_interpolation_puts_it() -> None:
    # 990 TTFTs of 1.01 s and 10 of 1.09 s, all in the router's (1.0, 1.1] bucket: the
    # exact P99 is 1.01 s; the histogram's rank 990 of 1000 sits 99 % into the bucket.
    ttft = np.concatenate([np.full(990, 1.01), np.full(10, 1.09)])
    tpot = np.concatenate([np.full(990, 0.0401), np.full(10, 0.0449)])  # in (0.04, 0.045]
    assert 1.0 in TTFT_BUCKETS_S and 1.1 in TTFT_BUCKETS_S
    assert 0.04 in TPOT_BUCKETS_S and 0.045 in TPOT_BUCKETS_S
    seen = observation_from(
        window(ttft, tpot), window(ttft, tpot), now_s=30.0, replicas=REPLICAS, interarrival_scv=1.0
    )
    assert seen.ttft_p99_s == pytest.approx(1.0 + 0.99 * 0.1, rel=1e-9)
    assert seen.tpot_p99_s == pytest.approx(0.04 + 0.99 * 0.005, rel=1e-9)


def test_bucketing_counts_each_value_at_or_below_each_bound() -> None:
    values = [0.5, 1.0, 1.0, 2.5]
    assert bucketed(values, [1.0, 2.0, 3.0]) == [
        (1.0, 3.0),
        (2.0, 3.0),
        (3.0, 4.0),
        (float("inf"), 4.0),
    ]
    # Evenly spread values read back their own quantile, as Prometheus would.
    spread = np.linspace(0.0, 10.0, 100_001)[1:]
    assert histogram_quantile(0.99, bucketed(spread, TTFT_BUCKETS_S)) == pytest.approx(
        9.9, rel=1e-3
    )
