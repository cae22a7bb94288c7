from __future__ import annotations

import numpy as np
import pytest

from queueing.lengths import LengthSamples


@pytest.fixture
def samples() -> LengthSamples:
    """Lognormal prompts (median ~1k tokens) and outputs (median ~130 tokens)."""
    rng = np.random.default_rng(7)
    prompt = np.clip(rng.lognormal(np.log(1000), 0.7, 5000), 8, 12000).astype(np.int64)
    output = np.clip(rng.lognormal(np.log(130), 0.9, 5000), 2, 2000).astype(np.int64)
    return LengthSamples(prompt_tokens=prompt, output_tokens=output, source="lognormal")
