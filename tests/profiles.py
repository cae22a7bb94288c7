"""The iteration profile the unit tests share.

``TEST_8B`` is a Llama-3-8B-on-H100-like profile written out by hand. Tests use it as
it is; a test that needs other numbers derives them from it with
``dataclasses.replace`` and says why next to the call, so every difference from the
shared profile is deliberate and visible.
"""

from __future__ import annotations

from queueing.profile import IterationProfile

TEST_8B = IterationProfile(
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
