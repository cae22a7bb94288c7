"""Built-in GPUs, models and their roofline profiles, with the sources of every number.

Profiles are named ``"<model>@<gpu>"`` (tensor parallel 1) or ``"<model>-tp<N>@<gpu>"``.
The catalogue: every 7B/8B dense model on every GPU at TP 1, the 70B models at TP 4
on every NVIDIA GPU (and at TP 1 on an MI300X), and Mixtral-8x7B where it fits
(``_BUILDS`` says which and why).
``docs/profiles.md`` shows the table that ``profiles_table_markdown()`` prints.
"""

from __future__ import annotations

import functools
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
        allreduce_latency_s=59e-6,
        source=(
            "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column: BF16 tensor "
            "312 TFLOPS dense (624 with sparsity), 80 GB HBM2e at 2,039 GB/s, NVLink "
            "600 GB/s total = 300 GB/s per direction; all-reduce 59 µs: Vidur's "
            "a100_pairwise_nvlink profile, 4 GPUs, messages <= 64 KiB, median (its "
            "a100_dgx profile: 20 µs; the slower topology is kept)"
        ),
    ),
    GpuSpec(
        name="h100-sxm",
        peak_dense_flops=989e12,
        hbm_bytes_per_s=3350e9,
        memory_bytes=80_000_000_000,
        interconnect_bytes_per_s=450e9,
        allreduce_latency_s=38e-6,
        source=(
            "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: BF16 tensor "
            "1,979 TFLOPS with sparsity = 989 dense, 80 GB HBM3 at 3.35 TB/s, NVLink "
            "900 GB/s total = 450 GB/s per direction; all-reduce 38 µs: Vidur's "
            "h100_dgx profile, 4 GPUs, messages <= 64 KiB, median (its "
            "h100_pairwise_nvlink profile: 28 µs; the slower topology is kept)"
        ),
    ),
    GpuSpec(
        name="h200",
        peak_dense_flops=989e12,
        hbm_bytes_per_s=4800e9,
        memory_bytes=141_000_000_000,
        interconnect_bytes_per_s=450e9,
        allreduce_latency_s=38e-6,
        source=(
            "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: BF16 tensor "
            "1,979 TFLOPS with sparsity = 989 dense, 141 GB HBM3e at 4.8 TB/s, NVLink "
            "900 GB/s total = 450 GB/s per direction; all-reduce: none published, "
            "assumed the H100's (same NVLink 4 and NVSwitch)"
        ),
    ),
    GpuSpec(
        name="l40s",
        peak_dense_flops=362.05e12,
        hbm_bytes_per_s=864e9,
        memory_bytes=48_000_000_000,
        interconnect_bytes_per_s=32e9,
        allreduce_latency_s=59e-6,
        source=(
            "NVIDIA L40S datasheet: BF16 tensor 362.05 TFLOPS dense (733 with "
            "sparsity), 48 GB GDDR6 at 864 GB/s, no NVLink: PCIe Gen4 x16 64 GB/s "
            "bidirectional = 32 GB/s per direction; all-reduce: none published over "
            "PCIe, assumed the slowest NVLink measurement (A100 pairwise, 59 µs), "
            "a lower bound"
        ),
    ),
    GpuSpec(
        name="b200",
        peak_dense_flops=2250e12,
        hbm_bytes_per_s=8000e9,
        memory_bytes=180_000_000_000,
        interconnect_bytes_per_s=900e9,
        allreduce_latency_s=38e-6,
        source=(
            "NVIDIA HGX B200 datasheet (8 x B200 SXM, 1,000 W): FP16/BF16 tensor "
            "36 PFLOPS with sparsity = 4.5 per GPU = 2,250 TFLOPS dense, 1,440 GB "
            "HBM3e = 180 GB per GPU at 8 TB/s, NVLink 5 1.8 TB/s total = 900 GB/s per "
            "direction; all-reduce: none published, assumed the H100's"
        ),
    ),
    GpuSpec(
        name="mi300x",
        peak_dense_flops=1307.4e12,
        hbm_bytes_per_s=5300e9,
        memory_bytes=192_000_000_000,
        interconnect_bytes_per_s=448e9,
        allreduce_latency_s=38e-6,
        source=(
            "AMD Instinct MI300X datasheet: peak BF16 matrix 1,307.4 TFLOPS dense "
            "(2,614.9 with sparsity), 192 GB HBM3 at 5.3 TB/s, 7 Infinity Fabric links "
            "of 128 GB/s (bidirectional) = 448 GB/s per direction over all seven; "
            "all-reduce: none published, assumed the H100's"
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
    ModelShape(
        name="qwen2.5-7b-instruct",
        num_layers=28,
        hidden_size=3584,
        num_attention_heads=28,
        num_kv_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        max_context_tokens=32768,
        dtype_bytes=2,
        attention_bias=True,
        source=(
            "Hugging Face Qwen/Qwen2.5-7B-Instruct config.json (q/k/v biases, untied head), BF16"
        ),
    ),
    ModelShape(
        name="mixtral-8x7b",
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        vocab_size=32000,
        max_context_tokens=32768,
        dtype_bytes=2,
        num_experts=8,
        experts_per_token=2,
        source=(
            "Hugging Face mistralai/Mixtral-8x7B-v0.1 config.json (num_local_experts 8, "
            "num_experts_per_tok 2), BF16"
        ),
    ),
)

GPUS: Mapping[str, GpuSpec] = MappingProxyType({gpu.name: gpu for gpu in _GPUS})
MODELS: Mapping[str, ModelShape] = MappingProxyType({model.name: model for model in _MODELS})

_NVIDIA = ("a100-80g", "h100-sxm", "h200", "l40s", "b200")
_EVERY_GPU = (*_NVIDIA, "mi300x")

# (model, tensor parallel degree, GPUs). The 70B models run at TP 4, the degree they
# are usually served at: at TP 2 their 138-141 GB of weights leave two 80 GB GPUs
# about 6k tokens of KV cache and do not fit on two L40S. On an MI300X they fit at
# TP 1 (192 GB), which is how it is sold; its links are a mesh of which a 4-GPU
# all-reduce uses only three of seven, which the per-GPU link figure does not say,
# so no TP > 1 profile is built for it. Mixtral-8x7B (93 GB) runs at TP 2 on the
# 80 GB GPUs and at TP 1 where one GPU holds it; TP 4 on L40S.
_BUILDS: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    ("llama-2-7b", 1, _EVERY_GPU),
    ("llama-3-8b", 1, _EVERY_GPU),
    ("mistral-7b", 1, _EVERY_GPU),
    ("llama-2-70b", 4, _NVIDIA),
    ("llama-3.1-8b", 1, _EVERY_GPU),
    ("llama-3.1-70b", 4, _NVIDIA),
    ("llama-3.1-70b", 1, ("mi300x",)),
    ("qwen2.5-7b-instruct", 1, _EVERY_GPU),
    ("mixtral-8x7b", 2, ("a100-80g", "h100-sxm")),
    ("mixtral-8x7b", 1, ("h200", "b200", "mi300x")),
    ("mixtral-8x7b", 4, ("l40s",)),
)


@functools.cache
def _catalogue() -> Mapping[str, IterationProfile]:
    """The built-in profiles, built once: their inputs (``MODELS``, ``GPUS``,
    ``_BUILDS``) are read-only and the profiles frozen, and the controller resolves its
    profile every tick (building the 60-odd rooflines took about 2 ms of it)."""
    profiles: dict[str, IterationProfile] = {}
    for model_name, tensor_parallel, gpus in _BUILDS:
        for gpu_name in gpus:
            profile = roofline_profile(
                MODELS[model_name], GPUS[gpu_name], tensor_parallel=tensor_parallel
            )
            profiles[profile.name] = profile
    return MappingProxyType(profiles)


def builtin_profiles() -> dict[str, IterationProfile]:
    """Every built-in roofline profile by name, in catalogue order (a fresh dict)."""
    return dict(_catalogue())


def resolve_profile(name: str) -> IterationProfile:
    """The built-in profile called ``name``; ``ProfileError`` listing the known names."""
    profiles = _catalogue()
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
