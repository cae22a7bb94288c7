"""Built-in GPUs, models and their roofline profiles, with the sources of every number.

Profiles are named ``"<model>@<gpu>"`` (tensor parallel 1) or ``"<model>-tp<N>@<gpu>"``.
The catalogue: every 7B/8B model on every GPU at TP 1, and Llama-2-70B at TP 4 on
every GPU (its 138 GB of FP16 weights fit in four of any of them, L40S included).
``docs/profiles.md`` shows the table that ``profiles_table_markdown()`` prints.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from queueing.hardware import GpuSpec, ModelShape
from queueing.profile import IterationProfile, ProfileError
from queueing.roofline import roofline_profile

DEFAULT_PROFILE_NAME = "llama-3-8b@h100-sxm"

_GPUS = (
    GpuSpec(
        name="a100-80g",
        peak_dense_flops=312e12,
        hbm_bytes_per_s=2039e9,
        memory_bytes=80_000_000_000,
        interconnect_bytes_per_s=300e9,
        source=(
            "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column: BF16 tensor "
            "312 TFLOPS dense (624 with sparsity), 80 GB HBM2e at 2,039 GB/s, NVLink "
            "600 GB/s total = 300 GB/s per direction"
        ),
    ),
    GpuSpec(
        name="h100-sxm",
        peak_dense_flops=989e12,
        hbm_bytes_per_s=3350e9,
        memory_bytes=80_000_000_000,
        interconnect_bytes_per_s=450e9,
        source=(
            "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: BF16 tensor "
            "1,979 TFLOPS with sparsity = 989 dense, 80 GB HBM3 at 3.35 TB/s, NVLink "
            "900 GB/s total = 450 GB/s per direction"
        ),
    ),
    GpuSpec(
        name="h200",
        peak_dense_flops=989e12,
        hbm_bytes_per_s=4800e9,
        memory_bytes=141_000_000_000,
        interconnect_bytes_per_s=450e9,
        source=(
            "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: BF16 tensor "
            "1,979 TFLOPS with sparsity = 989 dense, 141 GB HBM3e at 4.8 TB/s, NVLink "
            "900 GB/s total = 450 GB/s per direction"
        ),
    ),
    GpuSpec(
        name="l40s",
        peak_dense_flops=362.05e12,
        hbm_bytes_per_s=864e9,
        memory_bytes=48_000_000_000,
        interconnect_bytes_per_s=32e9,
        source=(
            "NVIDIA L40S datasheet: BF16 tensor 362.05 TFLOPS dense (733 with "
            "sparsity), 48 GB GDDR6 at 864 GB/s, no NVLink: PCIe Gen4 x16 64 GB/s "
            "bidirectional = 32 GB/s per direction"
        ),
    ),
)

_MODELS = (
    ModelShape(
        name="llama-2-7b",
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_kv_heads=32,
        intermediate_size=11008,
        vocab_size=32000,
        max_context_tokens=4096,
        dtype_bytes=2,
        source="Hugging Face meta-llama/Llama-2-7b-hf config.json, FP16",
    ),
    ModelShape(
        name="llama-3-8b",
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_context_tokens=8192,
        dtype_bytes=2,
        source="Hugging Face meta-llama/Meta-Llama-3-8B config.json, BF16",
    ),
    ModelShape(
        name="mistral-7b",
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        vocab_size=32000,
        max_context_tokens=32768,
        dtype_bytes=2,
        source="Hugging Face mistralai/Mistral-7B-v0.1 config.json (sliding_window 4096), BF16",
    ),
    ModelShape(
        name="llama-2-70b",
        num_layers=80,
        hidden_size=8192,
        num_attention_heads=64,
        num_kv_heads=8,
        intermediate_size=28672,
        vocab_size=32000,
        max_context_tokens=4096,
        dtype_bytes=2,
        source="Hugging Face meta-llama/Llama-2-70b-hf config.json, FP16",
    ),
    ModelShape(
        name="llama-3.1-8b",
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_context_tokens=131072,
        dtype_bytes=2,
        source="Hugging Face meta-llama/Llama-3.1-8B config.json (rope_scaling llama3), BF16",
    ),
    ModelShape(
        name="llama-3.1-70b",
        num_layers=80,
        hidden_size=8192,
        num_attention_heads=64,
        num_kv_heads=8,
        intermediate_size=28672,
        vocab_size=128256,
        max_context_tokens=131072,
        dtype_bytes=2,
        source="Hugging Face meta-llama/Llama-3.1-70B config.json (rope_scaling llama3), BF16",
    ),
)

GPUS: Mapping[str, GpuSpec] = MappingProxyType({gpu.name: gpu for gpu in _GPUS})
MODELS: Mapping[str, ModelShape] = MappingProxyType({model.name: model for model in _MODELS})

# (model, tensor parallel degree) pairs built on every GPU. Llama-2-70B runs at TP 4,
# the degree it is usually served at: at TP 2 its 138 GB of weights leave two 80 GB
# GPUs about 6k tokens of KV cache (not two full 4k-token requests) and do not fit
# on two L40S at all.
_BUILDS = (
    ("llama-2-7b", 1),
    ("llama-3-8b", 1),
    ("mistral-7b", 1),
    ("llama-2-70b", 4),
    ("llama-3.1-8b", 1),
    ("llama-3.1-70b", 4),
)


def builtin_profiles() -> dict[str, IterationProfile]:
    """Every built-in roofline profile by name, in catalogue order (a fresh dict)."""
    profiles: dict[str, IterationProfile] = {}
    for model_name, tensor_parallel in _BUILDS:
        for gpu in GPUS.values():
            profile = roofline_profile(MODELS[model_name], gpu, tensor_parallel=tensor_parallel)
            profiles[profile.name] = profile
    return profiles


def resolve_profile(name: str) -> IterationProfile:
    """The built-in profile called ``name``; ``ProfileError`` listing the known names."""
    profiles = builtin_profiles()
    try:
        return profiles[name]
    except KeyError:
        known = ", ".join(profiles)
        raise ProfileError(f"profile: unknown profile {name!r}; known: {known}") from None


def profiles_table_markdown() -> str:
    """A Markdown table of every built-in profile (the one in ``docs/profiles.md``)."""
    header = (
        "| profile | TP | t0 (ms) | t_tok (µs) | t_kv (ns) | t_attn (ns) "
        "| KV capacity (tokens) | KV bytes/token | context (tokens) | startup (s) |"
    )
    rule = "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
    rows = [header, rule]
    for profile in builtin_profiles().values():
        rows.append(
            f"| `{profile.name}` | {profile.tensor_parallel} "
            f"| {profile.t0_s * 1e3:.2f} | {profile.t_tok_s * 1e6:.2f} "
            f"| {profile.t_kv_s * 1e9:.3f} | {profile.t_attn_s * 1e9:.3f} "
            f"| {profile.kv_capacity_tokens:,} | {profile.kv_bytes_per_token:,} "
            f"| {profile.max_context_tokens or 0:,} | {profile.startup_s:.1f} |"
        )
    return "\n".join(rows) + "\n"
