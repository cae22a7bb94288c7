from __future__ import annotations

import numpy as np
import pytest

from queueing.lengths import LengthSamples
from queueing.profile import IterationProfile


@pytest.fixture
def profile() -> IterationProfile:
    """A Llama-3-8B-on-H100-like profile, written out by hand for the tests."""
    return IterationProfile(
        name="test-8b",
        model="test-8b",
        hardware="test-gpu",
        tensor_parallel=1,
        t0_s=0.006,
        t_tok_s=22e-6,
        t_kv_s=49e-9,
        t_attn_s=1.06e-9,
        kv_capacity_tokens=400_000,
        kv_bytes_per_token=131_072,
        startup_s=40.0,
        source="hand-written test profile",
    )


@pytest.fixture
def samples() -> LengthSamples:
    """Lognormal prompts (median ~1k tokens) and outputs (median ~130 tokens)."""
    rng = np.random.default_rng(7)
    prompt = np.clip(rng.lognormal(np.log(1000), 0.7, 5000), 8, 12000).astype(np.int64)
    output = np.clip(rng.lognormal(np.log(130), 0.9, 5000), 2, 2000).astype(np.int64)
    return LengthSamples(prompt_tokens=prompt, output_tokens=output, source="lognormal")
