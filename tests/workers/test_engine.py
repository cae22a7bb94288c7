"""The engine generates what the model would, whatever the batching, paging or hand-off."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("torch")

import torch

from workers.checkpoint import load_model, write_tiny_checkpoint
from workers.engine import Engine, FinishReason, KvCacheFullError
from workers.model import LlamaForCausalLM
from workers.paged_attention import KvShapeError, KvSnapshot
from workers.sampling import SamplingParams, sample_one
from workers.scheduler import SchedulingPolicy

# A tiny model gains nothing from a second thread, and on a shared machine a descheduled
# OpenMP thread stalls every op (single forwards then take 10-100x their time).
torch.set_num_threads(1)

CHUNKED = SchedulingPolicy.CHUNKED_PREFILL
PREFILL_FIRST = SchedulingPolicy.PREFILL_FIRST
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=11, tokenizer=False)
    return load_model(folder)


def prompt_of(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=gen).tolist()


PROMPTS = [prompt_of(n, seed=n) for n in (3, 17, 40, 61)]


def naive_greedy(model: LlamaForCausalLM, prompt: list[int], max_tokens: int) -> list[int]:
    """Recompute the whole sequence for every token: no cache, no batching."""
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(model.full_logits(ids)[-1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def reference(model: LlamaForCausalLM) -> list[list[int]]:
    return [naive_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]


def first_token(engine: Engine, seq_id: int) -> list[int]:
    """Step until ``seq_id`` has generated its first token."""
    while True:
        tokens = [tok for sid, tok in engine.step() if sid == seq_id]
        if tokens:
            return tokens


def make_engine(model: LlamaForCausalLM, **kwargs: Any) -> Engine:
    options = {"token_budget": 16, "num_blocks": 64, "block_size": 8, "seed": 0} | kwargs
    return Engine(model, **options)


@pytest.mark.parametrize(
    ("budget", "block", "policy"),
    [(4, 4, CHUNKED), (16, 8, CHUNKED), (64, 16, CHUNKED), (16, 8, PREFILL_FIRST)],
)
def test_greedy_generation_equals_a_naive_full_recompute_loop(
    model: LlamaForCausalLM,
    reference: list[list[int]],
    budget: int,
    block: int,
    policy: SchedulingPolicy,
) -> None:
    engine = make_engine(model, token_budget=budget, block_size=block, policy=policy)
    assert engine.generate(PROMPTS, GREEDY) == reference


def test_requests_arriving_while_others_decode_get_the_same_tokens(
    model: LlamaForCausalLM, reference: list[list[int]]
) -> None:
    engine = make_engine(model, token_budget=8)
    outputs: dict[int, list[int]] = {}
    ids = [engine.add_request(PROMPTS[0], GREEDY)]
    for step in range(200):
        if step in (2, 5, 9):
            ids.append(engine.add_request(PROMPTS[len(ids)], GREEDY))
        for seq_id, token in engine.step():
            outputs.setdefault(seq_id, []).append(token)
        if len(ids) == 4 and not engine.has_unfinished:
            break
    assert [outputs[i] for i in ids] == reference
    finished = {f.seq_id: f for f in engine.take_finished()}
    assert all(finished[i].finish_reason is FinishReason.LENGTH for i in ids)
    assert finished[ids[1]].output_token_ids == tuple(reference[1])
    assert engine.kv_cache.num_used_blocks == 0


def test_recompute_preemption_under_a_small_cache_changes_no_token(
    model: LlamaForCausalLM, reference: list[list[int]]
) -> None:
    # 12 blocks of 8 = 96 slots for four sequences of up to 73 tokens: they preempt.
    engine = make_engine(model, num_blocks=12, reserve_output_tokens=False)
    assert engine.generate(PROMPTS, GREEDY) == reference


def test_eos_stops_a_request_and_max_tokens_bounds_it(
    model: LlamaForCausalLM, reference: list[list[int]]
) -> None:
    expected = reference[2]
    eos = expected[4]
    stop_at = expected.index(eos)
    original = model.config
    model.config = replace(original, eos_token_ids=(eos,))
    try:
        engine = make_engine(model)
        stopping = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=12))
        ignoring = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=12, ignore_eos=True))
        short = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=3, ignore_eos=True))
        while engine.has_unfinished:
            engine.step()
    finally:
        model.config = original
    done = {f.seq_id: f for f in engine.take_finished()}
    assert done[stopping].output_token_ids == tuple(expected[: stop_at + 1])
    assert done[stopping].finish_reason is FinishReason.STOP
    assert done[ignoring].output_token_ids == tuple(expected)
    assert done[short].output_token_ids == tuple(expected[:3])
    assert done[short].finish_reason is FinishReason.LENGTH


def test_kv_export_and_import_continue_generation_identically(
    model: LlamaForCausalLM, reference: list[list[int]]
) -> None:
    """Prefill on one engine (max_tokens=1, KV kept), decode on another of other geometry."""
    prefill = make_engine(model, keep_finished_kv=True, block_size=8)
    decode = make_engine(model, block_size=4, num_blocks=128)
    # Fragment the decode engine's free list so the imported blocks are not in order.
    for i, n in enumerate((5, 9, 3)):
        decode.add_request(prompt_of(n, seed=100 + i), SamplingParams(max_tokens=2))
    decode.step()

    for prompt, expected in zip(PROMPTS, reference, strict=True):
        seq_id = prefill.add_request(prompt, replace(GREEDY, max_tokens=1))
        first = first_token(prefill, seq_id)
        kv = KvSnapshot.from_bytes(prefill.export_kv(seq_id).to_bytes())
        prefill.release(seq_id)
        assert kv.num_tokens == len(prompt)
        decode.import_kv(
            1000 + seq_id,
            kv,
            kv.num_tokens,
            prompt_token_ids=prompt,
            output_token_ids=first,
            params=GREEDY,
        )
        assert first == expected[:1]
    outputs: dict[int, list[int]] = {}
    while decode.has_unfinished:
        for sid, tok in decode.step():
            outputs.setdefault(sid, []).append(tok)
    for i, expected in enumerate(reference):
        assert outputs[1000 + i] == expected[1:]
    assert prefill.kv_cache.num_used_blocks == 0


def test_a_sequence_exported_mid_decode_continues_elsewhere(
    model: LlamaForCausalLM, reference: list[list[int]]
) -> None:
    source = make_engine(model)
    seq_id = source.add_request(PROMPTS[3], GREEDY)
    while len(source.output_token_ids(seq_id)) < 5:
        source.step()
    so_far = source.output_token_ids(seq_id)
    kv = source.export_kv(seq_id)
    source.abort(seq_id)
    target = make_engine(model, block_size=16)
    target.import_kv(
        seq_id,
        kv,
        len(PROMPTS[3]) + len(so_far) - 1,
        prompt_token_ids=PROMPTS[3],
        output_token_ids=so_far,
        params=GREEDY,
    )
    rest = []
    while target.has_unfinished:
        rest += [tok for _, tok in target.step()]
    assert so_far + rest == reference[3]
    assert source.kv_cache.num_used_blocks == 0


def test_an_import_without_room_is_retryable_and_changes_nothing(model: LlamaForCausalLM) -> None:
    source = make_engine(model, keep_finished_kv=True)
    seq_id = source.add_request(PROMPTS[3], SamplingParams(max_tokens=1))
    first = first_token(source, seq_id)
    kv = source.export_kv(seq_id)
    small = make_engine(model, num_blocks=10, block_size=8)  # 80 slots < 61 + 30 tokens
    small.add_request(prompt_of(30, seed=5), SamplingParams(max_tokens=2))
    small.step()
    free = small.kv_cache.num_free_blocks
    with pytest.raises(KvCacheFullError, match="no KV room"):
        small.import_kv(
            77,
            kv,
            kv.num_tokens,
            prompt_token_ids=PROMPTS[3],
            output_token_ids=first,
            params=SamplingParams(max_tokens=12),
        )
    assert small.kv_cache.num_free_blocks == free
    assert not small.can_admit(61 + 12)


def test_kv_of_another_shape_is_rejected_naming_the_field(model: LlamaForCausalLM) -> None:
    engine = make_engine(model)
    bad = KvSnapshot(key=torch.zeros(4, 10, 3, 32), value=torch.zeros(4, 10, 3, 32))
    with pytest.raises(KvShapeError, match="key: shape"):
        engine.import_kv(
            1,
            bad,
            10,
            prompt_token_ids=list(range(3, 13)),
            output_token_ids=[5],
            params=GREEDY,
        )
    assert engine.kv_cache.num_used_blocks == 0
    with pytest.raises(KvShapeError, match="num_tokens"):
        engine.import_kv(
            2, bad, 9, prompt_token_ids=list(range(3, 13)), output_token_ids=[5], params=GREEDY
        )


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(
    model: LlamaForCausalLM,
) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    alone = make_engine(model).generate([PROMPTS[1]], params)[0]
    crowd = make_engine(model, token_budget=8).generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[2]], [GREEDY, params, replace(params, seed=99)]
    )
    assert crowd[1] == alone
    assert crowd[2] != alone
    other_seed = make_engine(model).generate([PROMPTS[1]], replace(params, seed=7))[0]
    assert other_seed != alone


def test_a_tiny_top_p_is_greedy() -> None:
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    gen = torch.Generator().manual_seed(0)
    nucleus = SamplingParams(temperature=1.0, top_p=1e-6)
    assert {sample_one(logits, nucleus, gen) for _ in range(20)} == {1}
    spread = SamplingParams(temperature=1.0)
    assert len({sample_one(logits, spread, gen) for _ in range(200)}) > 2


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], GREEDY, "prompt_token_ids: must not be empty"),
        ([3, 512], GREEDY, "token 512 is outside the vocabulary"),
        ([3] * 4090, SamplingParams(max_tokens=10), "context of 4096"),
        ([3] * 500, SamplingParams(max_tokens=100), "exceeds the KV cache"),
    ],
)
def test_an_impossible_request_is_refused_naming_the_field(
    model: LlamaForCausalLM, prompt: list[int], params: SamplingParams, message: str
) -> None:
    engine = make_engine(model)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_abort_frees_a_waiting_or_running_request(model: LlamaForCausalLM) -> None:
    engine = make_engine(model, token_budget=8)
    running = engine.add_request(PROMPTS[2], GREEDY)
    waiting = engine.add_request(PROMPTS[3], GREEDY)
    engine.step()
    engine.abort(running)
    engine.abort(waiting)
    assert not engine.has_unfinished
    assert engine.kv_cache.num_used_blocks == 0
    reasons = {f.seq_id: f.finish_reason for f in engine.take_finished()}
    assert reasons == {running: FinishReason.ABORT, waiting: FinishReason.ABORT}


def test_a_kv_payload_that_is_not_a_snapshot_is_refused() -> None:
    with pytest.raises(KvShapeError, match="payload: not a KV snapshot"):
        KvSnapshot.from_bytes(b"not safetensors")
