"""The Llama model is exact under chunking and paging, and its config reads HF documents."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import torch

from workers.checkpoint import load_model, tiny_config, write_tiny_checkpoint
from workers.engine import ModelRunner
from workers.kv_cache import PagedKVCache
from workers.model import (
    ConfigError,
    LlamaConfig,
    LlamaForCausalLM,
    RMSNorm,
    rope_inv_freq,
)
from workers.paged_attention import (
    KvCacheTensors,
    KvSnapshot,
    PagedAttention,
    SeqSlice,
    build_batch,
)

# A tiny model gains nothing from a second thread, and on a shared machine a descheduled
# OpenMP thread stalls every op (single forwards then take 10-100x their time).
torch.set_num_threads(1)

ATOL = 2e-5
RTOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=7, tokenizer=False)
    return load_model(folder)


def random_prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


# -- config ---------------------------------------------------------------------------


def test_a_hugging_face_config_document_round_trips_and_ignores_unknown_keys() -> None:
    config = tiny_config(eos_token_ids=(2, 5), tie_word_embeddings=True)
    document = config.to_dict() | {"transformers_version": "4.44.0", "pretraining_tp": 1}
    assert LlamaConfig.from_dict(document) == config
    assert LlamaConfig.from_dict(config.to_dict() | {"eos_token_id": 2}).eos_token_ids == (2,)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"sliding_window": 4096}, "sliding_window"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
        ({"torch_dtype": "float64"}, "torch_dtype"),
        ({"eos_token_id": 9999}, "eos_token_id"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_an_unsupported_or_invalid_config_names_the_field(
    change: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        LlamaConfig.from_dict(tiny_config().to_dict() | change)


def test_a_missing_required_key_is_named() -> None:
    document = tiny_config().to_dict()
    del document["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size: missing"):
        LlamaConfig.from_dict(document)


def test_kv_bytes_per_token_is_two_tensors_per_layer_per_kv_head() -> None:
    config = tiny_config()
    assert config.kv_bytes_per_token() == 2 * 4 * 2 * 32 * 4
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * 4 * 2 * 32 * 2


# -- building blocks against closed forms ---------------------------------------------


def test_rmsnorm_divides_by_the_root_mean_square() -> None:
    norm = RMSNorm(4, eps=0.0)
    x = torch.tensor([[1.0, -1.0, 3.0, -3.0]])
    assert torch.allclose(norm(x), x / math.sqrt(5.0))


def test_llama3_rope_scaling_keeps_short_wavelengths_and_slows_long_ones() -> None:
    plain = rope_inv_freq(tiny_config(head_dim=None, rope_theta=500_000.0))
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    scaled = rope_inv_freq(tiny_config(rope_theta=500_000.0, rope_scaling=scaling))
    wavelength = 2 * math.pi / plain
    short = wavelength < 64 / 4.0
    long = wavelength > 64 / 1.0
    assert short.any() and long.any()
    assert torch.equal(scaled[short], plain[short])
    assert torch.allclose(scaled[long], plain[long] / 8.0)


# -- paged attention = contiguous attention ---------------------------------------------


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
) -> torch.Tensor:
    """Causal attention in float64 with explicit loops: queries at positions start.."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    scale = q.shape[-1] ** -0.5
    for i in range(q.shape[0]):
        visible = start + i + 1
        for h in range(heads):
            kv = h // (heads // kv_heads)
            scores = (k[:visible, kv].double() @ q[i, h].double()) * scale
            out[i, h] = torch.softmax(scores, 0) @ v[:visible, kv].double()
    return out


def test_paged_attention_equals_contiguous_attention_for_decodes_and_chunks() -> None:
    """A mixed step (decodes + chunks with and without prefixes) over shuffled blocks."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 8, 4
    cache = KvCacheTensors(
        num_layers=1,
        num_blocks=64,
        block_size=block,
        num_kv_heads=kv_heads,
        head_dim=dim,
        dtype=torch.float32,
        device="cpu",
    )
    # (tokens already cached, tokens in this step): decodes, a chunk after a prefix,
    # a chunk from position 0, another decode.
    layout = [(9, 1), (6, 5), (0, 7), (14, 1), (3, 1)]
    free = torch.randperm(64, generator=gen).tolist()
    seqs = []
    for cached, new in layout:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block))]
        k_all = torch.randn(total, kv_heads, dim, generator=gen)
        v_all = torch.randn(total, kv_heads, dim, generator=gen)
        q_new = torch.randn(new, heads, dim, generator=gen)
        if cached:  # the prefix was written by earlier steps
            cache.load(table, _snapshot(k_all[:cached], v_all[:cached]))
        seqs.append((cached, new, table, k_all, v_all, q_new))

    slices = [
        SeqSlice(token_ids=[0] * new, start_pos=cached, block_table=table, sample=True)
        for cached, new, table, *_ in seqs
    ]
    batch = build_batch(slices, cache, "cpu")
    # The flat batch puts single-token slices first, in order, then the chunks.
    flat_order = [i for i, s in enumerate(seqs) if s[1] == 1] + [
        i for i, s in enumerate(seqs) if s[1] > 1
    ]
    q = torch.cat([seqs[i][5] for i in flat_order])
    k = torch.cat([seqs[i][3][seqs[i][0] :] for i in flat_order])
    v = torch.cat([seqs[i][4][seqs[i][0] :] for i in flat_order])
    out = PagedAttention(cache, batch)(0, q, k, v)

    row = 0
    for i in flat_order:
        cached, new, _table, k_all, v_all, q_new = seqs[i]
        expected = reference_attention(q_new, k_all, v_all, cached)
        assert torch.allclose(out[row : row + new].double(), expected, atol=1e-5), f"seq {i}"
        row += new


def _snapshot(k: torch.Tensor, v: torch.Tensor) -> KvSnapshot:
    return KvSnapshot(key=k[None], value=v[None])


# -- chunked prefill = full prefill ---------------------------------------------------


def chunked_logits(
    model: LlamaForCausalLM, prompt: list[int], budget: int, block: int
) -> tuple[torch.Tensor, list[int]]:
    """Logits at the last token of each chunk, the prompt run ``budget`` tokens a step."""
    runner = ModelRunner(model, num_blocks=64, block_size=block)
    cache = PagedKVCache(num_blocks=64, block_size_tokens=block)
    table = cache.allocate(0, len(prompt))
    assert table is not None
    rows, ends = [], []
    for start in range(0, len(prompt), budget):
        end = min(start + budget, len(prompt))
        piece = SeqSlice(
            token_ids=prompt[start:end], start_pos=start, block_table=table, sample=True
        )
        rows.append(runner.execute([piece])[0])
        ends.append(end - 1)
    return torch.stack(rows), ends


@pytest.mark.parametrize(("budget", "block"), [(1, 16), (7, 4), (16, 16), (33, 8), (200, 16)])
def test_chunked_prefill_logits_equal_one_full_forward(
    model: LlamaForCausalLM, budget: int, block: int
) -> None:
    prompt = random_prompt(100, seed=budget)
    full = model.full_logits(prompt)
    got, ends = chunked_logits(model, prompt, budget, block)
    assert torch.allclose(got, full[ends], atol=ATOL, rtol=RTOL)
    assert (got - full[ends]).abs().max() < 1e-4


def test_a_hybrid_batch_gives_each_sequence_its_own_logits(model: LlamaForCausalLM) -> None:
    """Decodes of two sequences and a chunk of a third in one forward = three full passes."""
    prompts = [random_prompt(n, seed=n) for n in (20, 45, 30)]
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    cache = PagedKVCache(num_blocks=64, block_size_tokens=8)
    tables = [cache.block_table(i) for i, p in enumerate(prompts) if cache.allocate(i, len(p))]
    # Prefill all but the last token of the first two and the first 10 of the third.
    runner.execute(
        [
            SeqSlice(token_ids=prompts[0][:-1], start_pos=0, block_table=tables[0], sample=False),
            SeqSlice(token_ids=prompts[1][:-1], start_pos=0, block_table=tables[1], sample=False),
            SeqSlice(token_ids=prompts[2][:10], start_pos=0, block_table=tables[2], sample=False),
        ]
    )
    logits = runner.execute(
        [
            SeqSlice(token_ids=prompts[2][10:], start_pos=10, block_table=tables[2], sample=True),
            SeqSlice(token_ids=prompts[0][-1:], start_pos=19, block_table=tables[0], sample=True),
            SeqSlice(token_ids=prompts[1][-1:], start_pos=44, block_table=tables[1], sample=True),
        ]
    )
    expected = torch.stack([model.full_logits(prompts[i])[-1] for i in (2, 0, 1)])
    assert torch.allclose(logits, expected, atol=ATOL, rtol=RTOL)


def test_a_tied_lm_head_shares_the_embedding(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(
        tmp_path, seed=1, config=tiny_config(tie_word_embeddings=True), tokenizer=False
    )
    tied = load_model(folder)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    prompt = random_prompt(12, seed=3)
    got, ends = chunked_logits(tied, prompt, 5, 4)
    assert torch.allclose(got, tied.full_logits(prompt)[ends], atol=ATOL, rtol=RTOL)
