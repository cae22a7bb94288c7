"""Checkpoints round-trip in the Hugging Face layout, and a broken one says what is wrong."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("torch")

import torch
from safetensors.torch import load_file, save_file

from workers.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    load_model,
    load_tokenizer,
    random_weights,
    save_model,
    tiny_config,
    write_tiny_checkpoint,
)

# A tiny model gains nothing from a second thread, and on a shared machine a descheduled
# OpenMP thread stalls every op (single forwards then take 10-100x their time).
torch.set_num_threads(1)

PROMPT = [1, 17, 300, 42, 99, 5, 260, 7, 11, 480]
HF_NAMES = {
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.norm.weight",
    "lm_head.weight",
}


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("one"), seed=3)


def stored_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def test_the_tiny_checkpoint_uses_hugging_face_names_and_the_seed_decides_the_weights(
    unsharded: Path,
) -> None:
    stored = stored_tensors(unsharded)
    assert set(stored) >= HF_NAMES
    assert len(stored) == 2 + 9 * 4 + 1
    expected = random_weights(tiny_config(), seed=3)
    assert all(torch.equal(stored[name], expected[name]) for name in expected)
    assert not torch.equal(
        random_weights(tiny_config(), seed=4)["model.norm.weight"], expected["model.norm.weight"]
    )
    config = json.loads((unsharded / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] == 2


@pytest.mark.parametrize("shards", [2, 5])
def test_a_sharded_checkpoint_loads_to_the_same_model(
    unsharded: Path, tmp_path: Path, shards: int
) -> None:
    folder = write_tiny_checkpoint(tmp_path, seed=3, shards=shards, tokenizer=False)
    index = json.loads((folder / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    assert not (folder / SINGLE_FILE).exists()
    one = load_model(unsharded).full_logits(PROMPT)
    many = load_model(folder).full_logits(PROMPT)
    assert torch.equal(one, many)


def test_save_model_then_load_is_the_identity(unsharded: Path, tmp_path: Path) -> None:
    model = load_model(unsharded)
    save_model(model, tmp_path / "copy", shards=3)
    again = load_model(tmp_path / "copy")
    assert torch.equal(model.full_logits(PROMPT), again.full_logits(PROMPT))


def test_a_tied_checkpoint_stores_no_lm_head(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(
        tmp_path, seed=3, config=tiny_config(tie_word_embeddings=True), tokenizer=False
    )
    assert "lm_head.weight" not in stored_tensors(folder)
    model = load_model(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_checkpoint_loads_in_bfloat16(unsharded: Path) -> None:
    model = load_model(unsharded, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    full = load_model(unsharded).full_logits(PROMPT)
    half = model.full_logits(PROMPT)
    assert half.dtype == torch.float32
    assert (half.argmax(-1) == full.argmax(-1)).float().mean() > 0.5


# -- errors that name the tensor or file ------------------------------------------------


def rewrite(folder: Path, change: Callable[[dict[str, torch.Tensor]], object]) -> None:
    file = folder / SINGLE_FILE
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda t: t.pop("model.layers.2.mlp.up_proj.weight"),
            r"model\.layers\.2\.mlp\.up_proj\.weight: missing from the checkpoint",
        ),
        (
            lambda t: t.__setitem__("model.layers.9.mlp.up_proj.weight", torch.zeros(2)),
            r"model\.layers\.9\.mlp\.up_proj\.weight: unexpected tensor in model\.safetensors",
        ),
        (
            lambda t: t.__setitem__("model.norm.weight", torch.ones(64)),
            r"model\.norm\.weight: shape \(64,\) in model\.safetensors, expected \(128,\)",
        ),
    ],
)
def test_a_wrong_tensor_is_named(
    tmp_path: Path, change: Callable[[dict[str, torch.Tensor]], object], message: str
) -> None:
    folder = write_tiny_checkpoint(tmp_path, seed=0, tokenizer=False)
    rewrite(folder, change)
    with pytest.raises(CheckpointError, match=message):
        load_model(folder)


def test_rotary_tables_stored_by_old_checkpoints_are_ignored(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(tmp_path, seed=0, tokenizer=False)
    rewrite(
        folder,
        lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(16)),
    )
    load_model(folder)


def test_a_missing_shard_is_named(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(tmp_path, seed=0, shards=2, tokenizer=False)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: listed in"):
        load_model(folder)


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_dict()))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not found"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_act": "relu"}))
    with pytest.raises(CheckpointError, match="hidden_act"):
        load_model(tmp_path)


# -- tokenizer ---------------------------------------------------------------------------


def test_the_tiny_tokenizer_encodes_any_text_within_the_vocabulary(unsharded: Path) -> None:
    tokenizer = load_tokenizer(unsharded)
    assert tokenizer is not None
    text = "The prefill reads the whole prompt. Ünïcödé and emoji 🚀 too."
    ids = tokenizer.encode(text).ids
    assert ids[0] == 1  # <s>
    assert all(0 <= i < 512 for i in ids)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges were learned


def test_a_folder_without_a_tokenizer_has_none(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(tmp_path, seed=0, tokenizer=False)
    assert load_tokenizer(folder) is None
