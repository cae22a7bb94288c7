"""A decode pool run on its own: one-token prompts on 64 prefill workers, so prefill
only delays the arrivals a little, and a link that costs nothing. The tests of the
decode batch's law and of the queue head's wait share it."""

from __future__ import annotations

import numpy as np

from queueing.profile import IterationProfile
from sim.cluster import Cluster, ClusterConfig
from sim.results import SimResults
from sim.trace import Trace


def run_decode_only(
    arrival_s: np.ndarray, output_tokens: np.ndarray, *, workers: int, profile: IterationProfile
) -> SimResults:
    """Simulate ``workers`` decode workers serving requests that arrive at
    ``arrival_s`` (shifted to start at 0) with ``output_tokens`` each."""
    count = len(arrival_s)
    trace = Trace(
        arrival_s=arrival_s - arrival_s[0],
        prompt_tokens=np.ones(count, dtype=np.int64),
        output_tokens=output_tokens[:count],
        source=profile.name,
    )
    config = ClusterConfig(
        prefill_workers=64,
        decode_workers=workers,
        profile=profile,
        token_budget=4096,
        kv_link_bytes_per_s=1e12,
    )
    return Cluster(config, trace).run()
