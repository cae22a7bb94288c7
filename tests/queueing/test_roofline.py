"""Roofline profiles: model shapes, GPU datasheets, the derived coefficients, the catalogue.

Expected values are worked out here from the published configs and datasheets, not
read back from the code.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queueing.catalog import (
    DEFAULT_PROFILE_NAME,
    GPUS,
    MODELS,
    builtin_profiles,
    profiles_table_markdown,
    resolve_profile,
)
from queueing.hardware import GpuSpec, ModelShape
from queueing.profile import IterationProfile, ProfileError, attention_pairs
from queueing.roofline import DEFAULT_EFFICIENCY, Efficiency, roofline_profile

SMALL_MODELS = ("llama-2-7b", "llama-3-8b", "mistral-7b", "llama-3.1-8b", "qwen2.5-7b-instruct")
NVIDIA_GPUS = ("a100-80g", "h100-sxm", "h200", "l40s", "b200")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "profiles.md"


def prefill_tokens_per_s(profile: IterationProfile, prompt_tokens: int, chunk_tokens: int) -> float:
    """Prompt tokens per second of one prompt prefilled alone in chunks."""
    total_s = 0.0
    for start in range(0, prompt_tokens, chunk_tokens):
        chunk = min(chunk_tokens, prompt_tokens - start)
        total_s += profile.iteration_s(n_tokens=chunk, n_attn_pairs=attention_pairs(chunk, start))
    return prompt_tokens / total_s


def decode_step_s(profile: IterationProfile, batch: int, context_tokens: int) -> float:
    return profile.iteration_s(n_tokens=batch, n_kv_read=batch * context_tokens)


# --- model shapes ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "kv_bytes"),
    [
        # 2 (K and V) x layers x KV heads x head_dim x 2 bytes
        ("llama-2-7b", 2 * 32 * 32 * 128 * 2),
        ("llama-3-8b", 2 * 32 * 8 * 128 * 2),
        ("mistral-7b", 2 * 32 * 8 * 128 * 2),
        ("llama-2-70b", 2 * 80 * 8 * 128 * 2),
    ],
)
def test_kv_bytes_per_token_is_k_and_v_of_every_layer_and_kv_head(
    model: str, kv_bytes: int
) -> None:
    assert MODELS[model].kv_bytes_per_token == kv_bytes


def test_llama_2_7b_fp16_kv_entry_is_half_a_mebibyte() -> None:
    assert MODELS["llama-2-7b"].kv_bytes_per_token == 524_288


@pytest.mark.parametrize(
    ("model", "published_params"),
    [
        # Parameter counts published on the Hugging Face model pages / model cards.
        ("llama-2-7b", 6.74e9),
        ("llama-3-8b", 8.03e9),
        ("mistral-7b", 7.24e9),
        ("llama-2-70b", 6.9e10),
        ("qwen2.5-7b-instruct", 7.61e9),
        ("mixtral-8x7b", 46.7e9),
    ],
)
def test_parameter_count_matches_the_published_count(model: str, published_params: float) -> None:
    assert MODELS[model].param_count == pytest.approx(published_params, rel=5e-3)


def test_a_mixture_token_passes_through_its_active_experts_only() -> None:
    mixtral = MODELS["mixtral-8x7b"]
    # Mistral AI's model card: 12.9 B parameters used per token of 46.7 B.
    assert mixtral.active_param_count == pytest.approx(12.9e9, rel=5e-3)
    assert mixtral.flops_per_token == 2 * (mixtral.active_param_count - 32_000 * 4096)
    # Every expert is stored and, from a few tokens on, read by every iteration.
    assert mixtral.weight_read_bytes == 2 * (mixtral.param_count - 32_000 * 4096)


@pytest.mark.parametrize(
    ("batch_tokens", "read"), [(1, 0.25), (2, 1 - 0.75**2), (16, 1 - 0.75**16)]
)
def test_an_iteration_reads_the_experts_some_token_picked(batch_tokens: int, read: float) -> None:
    # 2 of 8 experts per token: an expert is unread by n tokens with probability (6/8)^n.
    assert MODELS["mixtral-8x7b"].expert_read_fraction(batch_tokens) == pytest.approx(read)
    assert MODELS["llama-3-8b"].expert_read_fraction(batch_tokens) == 1.0


def test_a_dense_model_is_its_own_single_expert() -> None:
    llama = MODELS["llama-3-8b"]
    assert llama.active_param_count == llama.param_count
    assert llama.flops_per_token == 2 * (llama.param_count - llama.embedding_params)


def test_qwen_biases_add_one_vector_per_projection_to_the_count() -> None:
    qwen = MODELS["qwen2.5-7b-instruct"]
    without = dataclasses.replace(qwen, attention_bias=False)
    assert qwen.param_count - without.param_count == 28 * (3584 + 2 * 4 * 128)


def test_weights_are_two_bytes_a_parameter_in_fp16() -> None:
    llama = MODELS["llama-2-7b"]
    assert llama.weight_bytes == 2 * llama.param_count
    assert llama.weight_bytes == pytest.approx(13.5e9, rel=0.01)


@pytest.mark.parametrize("model", list(MODELS))
def test_every_catalogue_model_has_128_wide_heads(model: str) -> None:
    assert MODELS[model].head_dim == 128


@pytest.mark.parametrize("model", list(MODELS))
def test_attention_costs_four_flops_per_hidden_unit_per_layer_per_pair(model: str) -> None:
    shape = MODELS[model]
    assert shape.attention_flops_per_pair == 4 * shape.num_layers * shape.hidden_size


@pytest.mark.parametrize("model", list(MODELS))
def test_a_token_costs_about_two_flops_per_parameter(model: str) -> None:
    shape = MODELS[model]
    embedding = shape.vocab_size * shape.hidden_size
    assert shape.flops_per_token == 2 * (shape.active_param_count - embedding)
    assert shape.weight_read_bytes == shape.weight_bytes - embedding * shape.dtype_bytes


_LLAMA_2_7B_FIELDS: dict[str, Any] = dataclasses.asdict(MODELS["llama-2-7b"])


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"name": ""}, "name"),
        ({"source": ""}, "source"),
        ({"num_layers": 0}, "num_layers"),
        ({"hidden_size": -4096}, "hidden_size"),
        ({"vocab_size": 32000.0}, "vocab_size"),
        ({"dtype_bytes": True}, "dtype_bytes"),
        ({"max_context_tokens": 0}, "max_context_tokens"),
        ({"intermediate_size": 0}, "intermediate_size"),
        ({"num_attention_heads": 30}, "num_attention_heads"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"num_experts": 0}, "num_experts"),
        ({"experts_per_token": 2}, "experts_per_token"),
        ({"attention_bias": 1}, "attention_bias"),
    ],
)
def test_an_invalid_model_shape_names_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ProfileError, match=rf"^{field}:"):
        ModelShape(**{**_LLAMA_2_7B_FIELDS, **change})


_A100_FIELDS: dict[str, Any] = dataclasses.asdict(GPUS["a100-80g"])


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"name": ""}, "name"),
        ({"source": ""}, "source"),
        ({"peak_dense_flops": 0.0}, "peak_dense_flops"),
        ({"hbm_bytes_per_s": math.nan}, "hbm_bytes_per_s"),
        ({"memory_bytes": 80.5e9}, "memory_bytes"),
        ({"interconnect_bytes_per_s": -1.0}, "interconnect_bytes_per_s"),
        ({"allreduce_latency_s": 0.0}, "allreduce_latency_s"),
    ],
)
def test_an_invalid_gpu_spec_names_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ProfileError, match=rf"^{field}:"):
        GpuSpec(**{**_A100_FIELDS, **change})


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"compute_fraction": 0.0}, "compute_fraction"),
        ({"hbm_fraction": 1.5}, "hbm_fraction"),
        ({"attention_fraction": math.nan}, "attention_fraction"),
        ({"interconnect_fraction": -0.1}, "interconnect_fraction"),
        ({"gpu_memory_fraction": True}, "gpu_memory_fraction"),
        ({"activation_reserve_bytes_per_gpu": -1}, "activation_reserve_bytes_per_gpu"),
        ({"activation_reserve_bytes_per_gpu": 1.5e9}, "activation_reserve_bytes_per_gpu"),
        ({"layer_overhead_s": -1e-6}, "layer_overhead_s"),
        ({"allreduce_launch_s": math.nan}, "allreduce_launch_s"),
        ({"container_start_s": math.inf}, "container_start_s"),
        ({"weight_load_bytes_per_s": 0.0}, "weight_load_bytes_per_s"),
    ],
)
def test_an_invalid_efficiency_names_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ProfileError, match=rf"^{field}:"):
        Efficiency(**change)


# --- sanity anchors against published figures -----------------------------------


def test_llama_2_7b_decode_on_a100_reads_13_5_gb_of_weights_at_about_2_tb_per_s() -> None:
    profile = resolve_profile("llama-2-7b@a100-80g")
    datasheet_floor_s = 13.2e9 / 2.039e12  # weights without the embedding table, at peak
    assert datasheet_floor_s <= profile.t0_s <= 12e-3
    # One sequence decoding at a 1k context: published vLLM / TensorRT-LLM figures
    # are 7-12 ms per token on an A100.
    assert 7e-3 <= decode_step_s(profile, batch=1, context_tokens=1024) <= 12e-3


def test_llama_2_7b_prefills_a_2k_prompt_at_thousands_of_tokens_per_second_on_a100() -> None:
    profile = resolve_profile("llama-2-7b@a100-80g")
    for chunk_tokens in (512, 2048):
        assert 3_000 <= prefill_tokens_per_s(profile, 2048, chunk_tokens) <= 30_000


@pytest.mark.parametrize("model", SMALL_MODELS)
def test_h100_beats_a100_beats_l40s_at_prefill_and_at_decode(model: str) -> None:
    def profile(gpu: str) -> IterationProfile:
        return resolve_profile(f"{model}@{gpu}")

    prefill = {gpu: prefill_tokens_per_s(profile(gpu), 2048, 512) for gpu in GPUS}
    decode = {gpu: decode_step_s(profile(gpu), batch=32, context_tokens=1024) for gpu in GPUS}
    assert prefill["h100-sxm"] > prefill["a100-80g"] > prefill["l40s"]
    assert decode["h100-sxm"] < decode["a100-80g"] < decode["l40s"]
    # H200: the H100's compute with faster, larger memory.
    assert profile("h200").t_tok_s == profile("h100-sxm").t_tok_s
    assert decode["h200"] < decode["h100-sxm"]
    assert profile("h200").kv_capacity_tokens > profile("h100-sxm").kv_capacity_tokens


@pytest.mark.parametrize("gpu", NVIDIA_GPUS)
def test_grouped_query_70b_on_four_gpus_caches_more_tokens_than_7b_on_one(gpu: str) -> None:
    big = resolve_profile(f"llama-2-70b-tp4@{gpu}")
    small = resolve_profile(f"llama-2-7b@{gpu}")
    assert big.kv_capacity_tokens > small.kv_capacity_tokens


def test_llama_2_7b_on_a100_caches_about_a_hundred_thousand_tokens() -> None:
    # 90 % of 80 GB, less 13.5 GB of weights and 2 GB of activations, at 0.5 MiB a token.
    expected = (0.9 * 80e9 - 13.48e9 - 2e9) / 524_288
    profile = resolve_profile("llama-2-7b@a100-80g")
    assert profile.kv_capacity_tokens == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("name", list(builtin_profiles()))
def test_no_coefficient_beats_the_datasheet(name: str) -> None:
    profile = resolve_profile(name)
    model, gpu, tp = MODELS[profile.model], GPUS[profile.hardware], profile.tensor_parallel
    assert profile.t0_s >= model.weight_read_bytes / tp / gpu.hbm_bytes_per_s
    assert profile.t_tok_s >= model.flops_per_token / tp / gpu.peak_dense_flops
    assert profile.t_kv_s >= model.kv_bytes_per_token / tp / gpu.hbm_bytes_per_s
    assert profile.t_attn_s >= model.attention_flops_per_pair / tp / gpu.peak_dense_flops
    assert profile.kv_capacity_tokens * profile.kv_bytes_per_token <= (
        tp * gpu.memory_bytes - model.weight_bytes
    )


@pytest.mark.parametrize("name", list(builtin_profiles()))
def test_a_new_worker_starts_in_tens_of_seconds_to_minutes(name: str) -> None:
    assert 10.0 <= resolve_profile(name).startup_s <= 300.0


# --- the roofline arithmetic -----------------------------------------------------

_PERFECT = Efficiency(
    compute_fraction=1.0,
    hbm_fraction=1.0,
    attention_fraction=1.0,
    interconnect_fraction=1.0,
    gpu_memory_fraction=1.0,
    activation_reserve_bytes_per_gpu=0,
    layer_overhead_s=0.0,
    allreduce_launch_s=0.0,
    container_start_s=0.0,
    weight_load_bytes_per_s=1e9,
)


def test_a_perfect_engine_runs_at_the_datasheet_roofline() -> None:
    model, gpu = MODELS["llama-2-7b"], GPUS["a100-80g"]
    profile = roofline_profile(model, gpu, efficiency=_PERFECT)
    params_without_embedding = 6_738_415_616 - 32_000 * 4096
    assert profile.t0_s == pytest.approx(2 * params_without_embedding / 2.039e12)
    assert profile.t_tok_s == pytest.approx(2 * params_without_embedding / 312e12)
    assert profile.t_kv_s == pytest.approx(524_288 / 2.039e12)
    assert profile.t_attn_s == pytest.approx(4 * 32 * 4096 / 312e12)
    assert profile.kv_capacity_tokens == (80_000_000_000 - 2 * 6_738_415_616) // 524_288
    assert profile.startup_s == pytest.approx(2 * 6_738_415_616 / 1e9)


@given(
    compute=st.floats(0.05, 1.0),
    hbm=st.floats(0.05, 1.0),
    attention=st.floats(0.05, 1.0),
)
def test_each_coefficient_is_the_perfect_one_divided_by_its_efficiency(
    compute: float, hbm: float, attention: float
) -> None:
    model, gpu = MODELS["llama-3-8b"], GPUS["h100-sxm"]
    perfect = roofline_profile(model, gpu, efficiency=_PERFECT)
    real = roofline_profile(
        model,
        gpu,
        efficiency=dataclasses.replace(
            _PERFECT, compute_fraction=compute, hbm_fraction=hbm, attention_fraction=attention
        ),
    )
    assert real.t0_s == pytest.approx(perfect.t0_s / hbm)
    assert real.t_kv_s == pytest.approx(perfect.t_kv_s / hbm)
    assert real.t_tok_s == pytest.approx(perfect.t_tok_s / compute)
    assert real.t_attn_s == pytest.approx(perfect.t_attn_s / attention)


def test_tensor_parallel_splits_the_work_and_adds_two_all_reduces_a_layer() -> None:
    model, gpu = MODELS["llama-2-7b"], GPUS["h100-sxm"]
    eff = DEFAULT_EFFICIENCY
    one = roofline_profile(model, gpu, tensor_parallel=1)
    two = roofline_profile(model, gpu, tensor_parallel=2)
    all_reduces = 2 * 32
    # The weight read halves; every rank still runs every layer's kernels.
    kernels_s = 32 * eff.layer_overhead_s
    allreduce_s = 38e-6 + eff.allreduce_launch_s  # the H100's measured latency + launch
    assert two.t0_s == pytest.approx(
        (one.t0_s - kernels_s) / 2 + kernels_s + all_reduces * allreduce_s
    )
    # Ring all-reduce of a 4096 x 2-byte activation between 2 ranks: each sends it once.
    link_s = all_reduces * 4096 * 2 / (450e9 * eff.interconnect_fraction)
    assert two.t_tok_s == pytest.approx(one.t_tok_s / 2 + link_s)
    assert two.t_kv_s == pytest.approx(one.t_kv_s / 2)
    assert two.t_attn_s == pytest.approx(one.t_attn_s / 2)
    assert two.kv_capacity_tokens > 2 * one.kv_capacity_tokens  # weights stored once


def test_the_fixed_costs_are_added_to_the_weight_read() -> None:
    model, gpu = MODELS["llama-2-70b"], GPUS["a100-80g"]
    eff = DEFAULT_EFFICIENCY
    streaming = roofline_profile(
        model,
        gpu,
        tensor_parallel=4,
        efficiency=dataclasses.replace(eff, layer_overhead_s=0.0, allreduce_launch_s=0.0),
    )
    real = roofline_profile(model, gpu, tensor_parallel=4)
    read_s = 2 * (68_976_648_192 - 32_000 * 8192) / 4 / (2.039e12 * 0.8)
    # 160 all-reduces of 59 µs measured (+ 20 µs launch), 80 layers of 43 µs kernels.
    assert real.t0_s == pytest.approx(read_s + 160 * 79e-6 + 80 * 43e-6)
    assert streaming.t0_s == pytest.approx(read_s + 160 * 59e-6)


def test_more_tensor_parallel_lowers_the_70b_decode_floor() -> None:
    model, gpu = MODELS["llama-2-70b"], GPUS["h100-sxm"]
    four = roofline_profile(model, gpu, tensor_parallel=4)
    eight = roofline_profile(model, gpu, tensor_parallel=8)
    assert eight.t0_s < four.t0_s
    assert eight.kv_capacity_tokens > four.kv_capacity_tokens


def test_70b_on_one_l40s_does_not_fit_and_the_error_says_what_and_where() -> None:
    with pytest.raises(ProfileError) as error:
        roofline_profile(MODELS["llama-2-70b"], GPUS["l40s"])
    message = str(error.value)
    assert message.startswith("kv_capacity_tokens:")
    for part in ("llama-2-70b", "l40s", "tensor_parallel=1"):
        assert part in message


@pytest.mark.parametrize("tensor_parallel", [0, -2, 3, 64, True])
def test_a_tensor_parallel_degree_that_cannot_split_the_heads_is_rejected(
    tensor_parallel: Any,
) -> None:
    with pytest.raises(ProfileError, match=r"^tensor_parallel:"):
        roofline_profile(MODELS["llama-3-8b"], GPUS["h100-sxm"], tensor_parallel=tensor_parallel)


def test_the_profile_is_named_and_sourced_after_its_model_and_gpu() -> None:
    model, gpu = MODELS["llama-2-70b"], GPUS["h200"]
    profile = roofline_profile(model, gpu, tensor_parallel=4)
    assert profile.name == "llama-2-70b-tp4@h200"
    assert (profile.model, profile.hardware, profile.tensor_parallel) == ("llama-2-70b", "h200", 4)
    assert profile.kv_bytes_per_token == model.kv_bytes_per_token
    for part in ("roofline", model.source, gpu.source, "compute 0.6"):
        assert part in profile.source
    renamed = roofline_profile(model, gpu, tensor_parallel=4, name="big@h200")
    assert renamed.name == "big@h200"


# --- the catalogue -----------------------------------------------------------------


def test_the_catalogue_is_keyed_by_name_and_read_only() -> None:
    assert set(GPUS) == {"a100-80g", "h100-sxm", "h200", "l40s", "b200", "mi300x"}
    assert set(MODELS) == {
        "llama-2-7b",
        "llama-3-8b",
        "mistral-7b",
        "llama-2-70b",
        "llama-3.1-8b",
        "llama-3.1-70b",
        "qwen2.5-7b-instruct",
        "mixtral-8x7b",
    }
    assert all(key == gpu.name for key, gpu in GPUS.items())
    assert all(key == model.name for key, model in MODELS.items())
    with pytest.raises(TypeError):
        GPUS["b300"] = GPUS["h200"]  # type: ignore[index]


def test_builtin_profiles_cover_every_small_model_on_every_gpu_and_70b_on_four() -> None:
    expected = {f"{model}@{gpu}" for model in SMALL_MODELS for gpu in GPUS}
    expected |= {
        f"{model}-tp4@{gpu}" for model in ("llama-2-70b", "llama-3.1-70b") for gpu in NVIDIA_GPUS
    }
    expected |= {"llama-3.1-70b@mi300x", "mixtral-8x7b-tp4@l40s"}
    expected |= {f"mixtral-8x7b-tp2@{gpu}" for gpu in ("a100-80g", "h100-sxm")}
    expected |= {f"mixtral-8x7b@{gpu}" for gpu in ("h200", "b200", "mi300x")}
    profiles = builtin_profiles()
    assert set(profiles) == expected
    assert all(name == profile.name for name, profile in profiles.items())


def test_the_default_profile_is_built_in() -> None:
    assert resolve_profile(DEFAULT_PROFILE_NAME).name == "llama-3-8b@h100-sxm"


def test_an_unknown_profile_name_lists_the_known_ones() -> None:
    with pytest.raises(ProfileError, match=r"^profile: unknown profile 'gpt-5@tpu'") as error:
        resolve_profile("gpt-5@tpu")
    for name in builtin_profiles():
        assert name in str(error.value)


def test_the_table_in_the_docs_is_the_one_the_code_generates() -> None:
    table = profiles_table_markdown()
    assert table.count("\n") == 2 + len(builtin_profiles())
    assert table in DOCS.read_text(encoding="utf-8"), (
        "docs/profiles.md is stale: regenerate its table with "
        '`.venv/bin/python -c "from queueing.catalog import profiles_table_markdown; '
        'print(profiles_table_markdown())"`'
    )
