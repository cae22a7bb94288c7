"""The workers' Llama gives the logits of Hugging Face transformers' Llama, an
implementation written elsewhere, on the same generated checkpoint.

Both load the folder ``write_tiny_checkpoint`` writes (config.json + safetensors);
transformers reads it with its own loader and its own config class. Covered: grouped-
query attention, the llama3 RoPE scaling (all three of its frequency bands: the
original context is set small so that the head's wavelengths fall below, between and
above its thresholds), linear RoPE scaling, and a tied LM head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch
import transformers

from workers.checkpoint import load_model, tiny_config, write_tiny_checkpoint

torch.set_num_threads(1)

# 32-wide heads at rope_theta 10,000 have wavelengths from 6.3 to ~35,000 positions;
# with an original context of 64 and factors 1 and 4 the llama3 thresholds are 16 and
# 64 positions, so some frequencies are kept, some divided by 8 and some blended.
_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
_CASES: dict[str, dict[str, Any]] = {
    "untied, no scaling": {},
    "llama3 scaling": {"rope_scaling": _LLAMA3},
    "linear scaling": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "tied head, llama3 scaling": {"rope_scaling": _LLAMA3, "tie_word_embeddings": True},
}
_PROMPT = [(37 * i + 11) % 512 for i in range(300)]


def _hf_logits(folder: Path) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([_PROMPT]))
    logits: torch.Tensor = out.logits[0].float()
    return logits


@pytest.mark.parametrize("case", list(_CASES))
def test_the_logits_are_those_of_transformers_llama(case: str, tmp_path: Path) -> None:
    config = tiny_config(**_CASES[case])
    folder = write_tiny_checkpoint(tmp_path / "ckpt", seed=5, config=config, tokenizer=False)
    ours = load_model(folder, device=torch.device("cpu")).full_logits(_PROMPT)
    theirs = _hf_logits(folder)
    assert ours.shape == theirs.shape == (len(_PROMPT), 512)
    assert torch.allclose(ours, theirs, atol=2e-4, rtol=1e-4), (
        f"max |difference| {float((ours - theirs).abs().max()):.2e}"
    )


def test_the_rope_scaling_changes_the_logits_so_the_comparison_covers_it(tmp_path: Path) -> None:
    plain = write_tiny_checkpoint(tmp_path / "plain", seed=5, config=tiny_config(), tokenizer=False)
    scaled = write_tiny_checkpoint(
        tmp_path / "scaled",
        seed=5,
        config=tiny_config(rope_scaling=_LLAMA3),
        tokenizer=False,
    )
    difference = (_hf_logits(plain) - _hf_logits(scaled)).abs().max()
    assert float(difference) > 1e-2
