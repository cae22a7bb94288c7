"""The Sarathi scheduler keeps to its budget, never stalls decodes, and prices steps exactly."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.profiles import TEST_8B
from workers.kv_cache import PagedKVCache
from workers.scheduler import (
    ScheduledChunk,
    Scheduler,
    SchedulingPolicy,
    Sequence,
    SequenceStatus,
    StepPlan,
)

CHUNKED = SchedulingPolicy.CHUNKED_PREFILL
PREFILL_FIRST = SchedulingPolicy.PREFILL_FIRST

PROFILE = TEST_8B


def make_scheduler(
    budget: int,
    *,
    num_blocks: int = 10_000,
    block_size: int = 16,
    policy: SchedulingPolicy = CHUNKED,
    reserve: bool = True,
    max_running: int | None = None,
    keep_finished_kv: bool = False,
) -> Scheduler:
    return Scheduler(
        token_budget=budget,
        kv_cache=PagedKVCache(num_blocks=num_blocks, block_size_tokens=block_size),
        policy=policy,
        max_running=max_running,
        reserve_output_tokens=reserve,
        keep_finished_kv=keep_finished_kv,
    )


def decoding(seq_id: int, prompt: int, out: int) -> Sequence:
    """A sequence as a decode worker receives it: prompt computed, first token made."""
    return Sequence(
        seq_id=seq_id,
        num_prompt_tokens=prompt,
        max_new_tokens=out,
        num_computed_tokens=prompt,
        num_generated_tokens=1,
    )


def step(scheduler: Scheduler, waiting: deque[Sequence]) -> tuple[StepPlan, list[Sequence]]:
    plan = scheduler.schedule(waiting)
    return plan, scheduler.complete_step(plan)


def step_time_s(plan: StepPlan) -> float:
    return PROFILE.iteration_s(
        n_tokens=plan.num_batched_tokens,
        n_kv_read=plan.num_kv_read_tokens,
        n_attn_pairs=plan.num_attention_pairs,
    )


# -- sequences -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_prompt_tokens": 0, "max_new_tokens": 1}, "num_prompt_tokens"),
        ({"num_prompt_tokens": 5, "max_new_tokens": 0}, "max_new_tokens"),
        ({"num_prompt_tokens": 5, "max_new_tokens": 2, "num_generated_tokens": 3}, "num_generated"),
        ({"num_prompt_tokens": 5, "max_new_tokens": 2, "num_computed_tokens": 6}, "num_computed"),
    ],
)
def test_an_impossible_sequence_is_rejected_naming_the_field(
    kwargs: dict[str, int], field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        Sequence(seq_id=1, **kwargs)  # type: ignore[arg-type]


def test_a_sequence_prefills_until_its_prompt_is_computed() -> None:
    seq = Sequence(seq_id=1, num_prompt_tokens=10, max_new_tokens=3, num_computed_tokens=4)
    assert seq.is_prefilling and seq.remaining_prompt_tokens == 6 and seq.context_tokens == 10
    arrived = decoding(2, 10, 3)
    assert not arrived.is_prefilling and arrived.remaining_prompt_tokens == 0
    assert arrived.context_tokens == 11


# -- chunking --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "budget"), [(1, 8), (8, 8), (9, 8), (100, 7), (4096, 512), (5000, 512)]
)
def test_a_long_prompt_spreads_over_ceil_L_over_budget_steps(prompt: int, budget: int) -> None:
    scheduler = make_scheduler(budget)
    waiting = deque([Sequence(seq_id=1, num_prompt_tokens=prompt, max_new_tokens=1)])
    chunks: list[ScheduledChunk] = []
    finished: list[Sequence] = []
    while not finished:
        plan, finished = step(scheduler, waiting)
        assert len(plan.prefill_chunks) == 1 and not plan.decode_seq_ids
        chunks.append(plan.prefill_chunks[0])
    steps = math.ceil(prompt / budget)
    assert len(chunks) == steps
    assert [c.start_token for c in chunks] == [i * budget for i in range(steps)]
    assert [c.num_tokens for c in chunks] == [budget] * (steps - 1) + [
        prompt - (steps - 1) * budget
    ]
    assert [c.completes_prompt for c in chunks] == [False] * (steps - 1) + [True]
    assert finished[0].num_generated_tokens == 1 and finished[0].status is SequenceStatus.FINISHED
    assert not scheduler.has_unfinished and scheduler.kv_cache.num_used_blocks == 0


def test_several_short_prompts_share_one_step_and_the_next_takes_the_rest_of_the_budget() -> None:
    scheduler = make_scheduler(100)
    waiting = deque(
        Sequence(seq_id=i, num_prompt_tokens=n, max_new_tokens=1)
        for i, n in enumerate([10, 20, 30, 50])
    )
    plan, finished = step(scheduler, waiting)
    assert [(c.seq_id, c.num_tokens) for c in plan.prefill_chunks] == [
        (0, 10),
        (1, 20),
        (2, 30),
        (3, 40),
    ]
    assert plan.num_batched_tokens == 100 and not waiting
    assert [s.seq_id for s in finished] == [0, 1, 2]
    plan, finished = step(scheduler, waiting)
    assert [(c.seq_id, c.start_token, c.num_tokens) for c in plan.prefill_chunks] == [(3, 40, 10)]
    assert [s.seq_id for s in finished] == [3]


def test_a_prompt_completing_generates_the_first_token_and_then_decodes() -> None:
    scheduler = make_scheduler(8)
    seq = Sequence(seq_id=1, num_prompt_tokens=12, max_new_tokens=3)
    waiting = deque([seq])
    plans = [step(scheduler, waiting)[0] for _ in range(4)]
    assert [len(p.prefill_chunks) for p in plans] == [1, 1, 0, 0]
    assert [p.decode_seq_ids for p in plans] == [(), (), (1,), (1,)]
    assert seq.status is SequenceStatus.FINISHED and seq.num_generated_tokens == 3
    # Decodes read the prompt plus the tokens generated so far, their own input included.
    assert [p.num_kv_read_tokens for p in plans[2:]] == [13, 14]


# -- token accounting ------------------------------------------------------------------------


def test_a_plan_prices_decodes_by_context_and_chunks_by_causal_pairs() -> None:
    scheduler = make_scheduler(100)
    for seq in (decoding(1, 30, 5), decoding(2, 7, 5)):
        assert scheduler.admit(seq)
    partly = Sequence(seq_id=3, num_prompt_tokens=50, max_new_tokens=1, num_computed_tokens=20)
    assert scheduler.admit(partly)
    waiting = deque([Sequence(seq_id=4, num_prompt_tokens=40, max_new_tokens=1)])
    plan = scheduler.schedule(waiting)

    assert plan.decode_seq_ids == (1, 2)
    assert [(c.seq_id, c.start_token, c.num_tokens) for c in plan.prefill_chunks] == [
        (3, 20, 30),
        (4, 0, 40),
    ]
    assert plan.num_batched_tokens == 2 + 30 + 40
    # Each decode attends to its prompt and its one generated token (its own input).
    assert plan.num_kv_read_tokens == (30 + 1) + (7 + 1)
    # Query token q (1-based position) of a causal chunk attends to q keys.
    pairs = sum(range(21, 51)) + sum(range(1, 41))
    assert plan.num_attention_pairs == pairs


# -- decodes and stalls ----------------------------------------------------------------------


def test_decode_arrivals_join_the_step_that_admits_them_and_leave_after_out_minus_1_steps() -> None:
    scheduler = make_scheduler(4)
    waiting = deque([decoding(1, 100, 5)])
    reads = []
    finished: list[Sequence] = []
    while not finished:
        plan, finished = step(scheduler, waiting)
        assert plan.decode_seq_ids == (1,)
        reads.append(plan.num_kv_read_tokens)
    assert reads == [101, 102, 103, 104]


def test_prefill_first_stalls_decodes_for_a_whole_long_prompt_while_chunked_does_not() -> None:
    budget, long_prompt = 64, 256

    def gaps(policy: SchedulingPolicy) -> tuple[list[StepPlan], float]:
        scheduler = make_scheduler(budget, policy=policy)
        assert scheduler.admit(decoding(1, 10, 1000))
        waiting = deque([Sequence(seq_id=2, num_prompt_tokens=long_prompt, max_new_tokens=1)])
        plans: list[StepPlan] = []
        clock_s, last_token_s, worst_gap_s = 0.0, 0.0, 0.0
        # Enough steps for the prompt under either policy, and a decode after it.
        for _ in range(math.ceil(long_prompt / (budget - 1)) + 1):
            plan, _ = step(scheduler, waiting)
            plans.append(plan)
            clock_s += step_time_s(plan)
            if 1 in plan.decode_seq_ids:
                worst_gap_s = max(worst_gap_s, clock_s - last_token_s)
                last_token_s = clock_s
        return plans, worst_gap_s

    first, stalled_gap_s = gaps(PREFILL_FIRST)
    # The whole prompt runs in one step over the budget, and the decode gets no token in it.
    assert [c.num_tokens for c in first[0].prefill_chunks] == [long_prompt]
    assert first[0].decode_seq_ids == ()
    assert first[1].decode_seq_ids == (1,)

    chunked, chunked_gap_s = gaps(CHUNKED)
    prompt_steps = [p for p in chunked if p.prefill_chunks]
    assert len(prompt_steps) == math.ceil(long_prompt / (budget - 1))
    assert all(p.decode_seq_ids == (1,) for p in chunked)
    assert all(p.num_batched_tokens <= budget for p in chunked)

    # The stall is a whole-prompt iteration plus the next decode; chunked steps stay small.
    whole_prompt_s = PROFILE.iteration_s(
        n_tokens=long_prompt, n_attn_pairs=long_prompt * (long_prompt + 1) / 2
    )
    assert stalled_gap_s >= whole_prompt_s
    assert chunked_gap_s < whole_prompt_s


def test_prefill_first_runs_whole_prompts_that_fit_together_and_decodes_only_when_none_waits() -> (
    None
):
    scheduler = make_scheduler(100, policy=PREFILL_FIRST)
    waiting = deque(
        Sequence(seq_id=i, num_prompt_tokens=n, max_new_tokens=2)
        for i, n in enumerate([40, 50, 30])
    )
    plan, _ = step(scheduler, waiting)
    assert [(c.seq_id, c.num_tokens) for c in plan.prefill_chunks] == [(0, 40), (1, 50)]
    assert [s.seq_id for s in waiting] == [2]
    plan, _ = step(scheduler, waiting)
    assert [(c.seq_id, c.num_tokens) for c in plan.prefill_chunks] == [(2, 30)]
    plan, finished = step(scheduler, waiting)
    assert plan.decode_seq_ids == (0, 1, 2) and not plan.prefill_chunks
    assert len(finished) == 3


# -- admission -------------------------------------------------------------------------------


def test_a_sequence_waits_while_the_cache_is_full_and_is_admitted_once_space_frees() -> None:
    # 10 blocks of 16 tokens: A reserves ceil(120/16) = 8, B needs ceil(60/16) = 4.
    scheduler = make_scheduler(1000, num_blocks=10)
    a = Sequence(seq_id=1, num_prompt_tokens=100, max_new_tokens=20)
    b = Sequence(seq_id=2, num_prompt_tokens=50, max_new_tokens=10)
    waiting = deque([a, b])
    steps_of_a = 0
    while a.status is not SequenceStatus.FINISHED:
        plan, _ = step(scheduler, waiting)
        assert list(waiting) == [b]
        assert 2 not in plan.decode_seq_ids and all(c.seq_id == 1 for c in plan.prefill_chunks)
        if a.status is SequenceStatus.RUNNING:
            assert scheduler.kv_cache.num_used_blocks == 8
        steps_of_a += 1
    # A's prompt takes one step and its 19 decodes the rest; B enters the next step.
    assert steps_of_a == 20
    plan, _ = step(scheduler, waiting)
    assert [c.seq_id for c in plan.prefill_chunks] == [2] and not waiting
    assert scheduler.kv_cache.num_used_blocks == 4


def test_a_sequence_that_can_never_fit_raises_naming_it_and_leaves_the_queue_alone() -> None:
    scheduler = make_scheduler(1000, num_blocks=4)  # 64 tokens in all
    fits = Sequence(seq_id=8, num_prompt_tokens=20, max_new_tokens=5)
    too_big = Sequence(seq_id=9, num_prompt_tokens=60, max_new_tokens=10)
    waiting = deque([fits, too_big])
    plan = scheduler.schedule(waiting)  # admits the first, stops before the second
    assert [c.seq_id for c in plan.prefill_chunks] == [8]
    scheduler.complete_step(plan)
    with pytest.raises(ValueError, match="seq_id 9"):
        scheduler.schedule(waiting)
    assert list(waiting) == [too_big]
    with pytest.raises(ValueError, match="seq_id 9"):
        scheduler.admit(too_big)


def test_two_workers_sharing_one_deque_take_sequences_in_arrival_order() -> None:
    first, second = make_scheduler(10), make_scheduler(10)
    waiting = deque(Sequence(seq_id=i, num_prompt_tokens=10, max_new_tokens=1) for i in range(3))
    assert [c.seq_id for c in first.schedule(waiting).prefill_chunks] == [0]
    assert [c.seq_id for c in second.schedule(waiting).prefill_chunks] == [1]
    assert [s.seq_id for s in waiting] == [2]


def test_max_running_caps_the_running_set() -> None:
    scheduler = make_scheduler(100, max_running=2)
    waiting = deque(Sequence(seq_id=i, num_prompt_tokens=5, max_new_tokens=10) for i in range(4))
    plan = scheduler.schedule(waiting)
    assert len(plan.prefill_chunks) == 2 and scheduler.num_running == 2 and len(waiting) == 2
    with pytest.raises(ValueError, match="max_running"):
        make_scheduler(8, max_running=9)


# -- completion ----------------------------------------------------------------------------------


def test_finishing_frees_the_kv_and_early_finish_ends_a_sequence_at_once() -> None:
    scheduler = make_scheduler(100)
    waiting = deque([Sequence(seq_id=1, num_prompt_tokens=30, max_new_tokens=50)])
    step(scheduler, waiting)
    assert scheduler.kv_cache.num_used_blocks == math.ceil(80 / 16)
    seq = scheduler.finish(1)
    assert seq.status is SequenceStatus.FINISHED and not scheduler.has_unfinished
    assert scheduler.kv_cache.num_used_blocks == 0
    with pytest.raises(KeyError, match="seq_id 1"):
        scheduler.finish(1)


def test_a_finished_prefill_can_keep_its_kv_until_it_is_handed_off() -> None:
    scheduler = make_scheduler(100, keep_finished_kv=True)
    waiting = deque([Sequence(seq_id=1, num_prompt_tokens=40, max_new_tokens=1)])
    _, finished = step(scheduler, waiting)
    assert [s.seq_id for s in finished] == [1] and not scheduler.has_unfinished
    held = scheduler.kv_cache.block_table(1)
    assert len(held) == math.ceil(41 / 16)
    assert scheduler.release(1) == len(held)
    assert scheduler.kv_cache.num_used_blocks == 0
    with pytest.raises(KeyError, match="seq_id 1"):
        scheduler.release(1)


def test_a_stale_plan_is_rejected_and_changes_nothing() -> None:
    scheduler = make_scheduler(10)
    seq = Sequence(seq_id=1, num_prompt_tokens=30, max_new_tokens=1)
    plan = scheduler.schedule(deque([seq]))
    scheduler.complete_step(plan)
    with pytest.raises(ValueError, match="seq_id 1"):
        scheduler.complete_step(plan)
    assert seq.num_computed_tokens == 10


# -- plan invariants -----------------------------------------------------------------------------


def chunk(seq_id: int, start: int, n: int) -> ScheduledChunk:
    return ScheduledChunk(seq_id=seq_id, start_token=start, num_tokens=n, completes_prompt=True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefill_chunks": (chunk(1, 0, 20),), "num_batched_tokens": 20}, "exceeds"),
        ({"prefill_chunks": (chunk(1, 0, 5),), "num_batched_tokens": 6}, "num_batched"),
        ({"decode_seq_ids": (1, 1), "num_batched_tokens": 2, "num_kv_read_tokens": 9}, "twice"),
        ({"decode_seq_ids": (1,), "num_batched_tokens": 1, "num_kv_read_tokens": 1}, "kv_read"),
        (
            {
                "prefill_chunks": (chunk(1, 0, 5), chunk(2, 0, 9)),
                "num_batched_tokens": 14,
                "policy": PREFILL_FIRST,
            },
            "exceeds",
        ),
        (
            {
                "prefill_chunks": (chunk(1, 0, 2),),
                "decode_seq_ids": (2,),
                "num_batched_tokens": 3,
                "num_kv_read_tokens": 5,
                "policy": PREFILL_FIRST,
            },
            "mixes",
        ),
    ],
)
def test_a_plan_that_breaks_an_invariant_is_rejected(
    kwargs: dict[str, object], message: str
) -> None:
    fields: dict[str, object] = {
        "decode_seq_ids": (),
        "prefill_chunks": (),
        "num_batched_tokens": 0,
        "num_kv_read_tokens": 0,
        "token_budget": 10,
    }
    fields.update(kwargs)
    chunks = fields["prefill_chunks"]
    assert isinstance(chunks, tuple)
    fields["num_attention_pairs"] = sum(c.num_tokens * (c.num_tokens + 1) // 2 for c in chunks)
    with pytest.raises(ValueError, match=message):
        StepPlan(**fields)  # type: ignore[arg-type]


def test_prefill_first_may_run_one_whole_prompt_over_the_budget() -> None:
    plan = StepPlan(
        decode_seq_ids=(),
        prefill_chunks=(chunk(1, 0, 50),),
        num_batched_tokens=50,
        num_kv_read_tokens=0,
        num_attention_pairs=50 * 51 // 2,
        token_budget=10,
        policy=PREFILL_FIRST,
    )
    assert not plan.is_empty


# -- properties under random workloads -------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    prompt: int
    out: int
    arrives_at_step: int


requests_strategy = st.lists(
    st.builds(Request, st.integers(1, 120), st.integers(1, 12), st.integers(0, 15)),
    min_size=1,
    max_size=8,
)


def drive(
    scheduler: Scheduler, requests: list[Request], *, check_decodes_kept: bool
) -> list[Sequence]:
    """Run a workload to completion, checking the per-step invariants on the way."""
    seqs = [
        Sequence(seq_id=i, num_prompt_tokens=r.prompt, max_new_tokens=r.out)
        for i, r in enumerate(requests)
    ]
    waiting: deque[Sequence] = deque()
    budget = scheduler.token_budget
    kv = scheduler.kv_cache
    for step_no in range(20_000):
        waiting.extend(
            s for s, r in zip(seqs, requests, strict=True) if r.arrives_at_step == step_no
        )
        decoding_before = {s.seq_id for s in scheduler.running if not s.is_prefilling}
        plan = scheduler.schedule(waiting)
        by_id = {s.seq_id: s for s in scheduler.running}
        if scheduler.policy is CHUNKED:
            assert plan.num_batched_tokens <= budget
            if check_decodes_kept:
                assert decoding_before <= set(plan.decode_seq_ids)
        elif plan.num_batched_tokens > budget:
            assert len(plan.prefill_chunks) == 1 and not plan.decode_seq_ids
        # Every scheduled token has a KV slot, and the reads are the decoders' contexts.
        for c in plan.prefill_chunks:
            assert (
                len(kv.block_table(c.seq_id)) * kv.block_size_tokens >= c.start_token + c.num_tokens
            )
        for seq_id in plan.decode_seq_ids:
            need = by_id[seq_id].num_computed_tokens + 1
            assert len(kv.block_table(seq_id)) * kv.block_size_tokens >= need
        assert plan.num_kv_read_tokens == sum(
            by_id[i].num_computed_tokens + 1 for i in plan.decode_seq_ids
        )
        assert kv.num_used_blocks <= kv.num_blocks
        scheduler.complete_step(plan)
        last_arrival = max(r.arrives_at_step for r in requests)
        if step_no > last_arrival and not waiting and not scheduler.has_unfinished:
            break
    else:
        raise AssertionError("the workload did not finish")
    return seqs


@settings(max_examples=120, deadline=None)
@given(
    requests=requests_strategy,
    budget=st.integers(1, 48),
    block=st.integers(1, 16),
    spare_blocks=st.integers(0, 30),
    policy=st.sampled_from(list(SchedulingPolicy)),
)
def test_random_workloads_stay_in_budget_never_skip_a_decode_and_all_finish(
    requests: list[Request], budget: int, block: int, spare_blocks: int, policy: SchedulingPolicy
) -> None:
    largest = max(math.ceil((r.prompt + r.out) / block) for r in requests)
    scheduler = make_scheduler(
        budget, num_blocks=largest + spare_blocks, block_size=block, policy=policy
    )
    seqs = drive(scheduler, requests, check_decodes_kept=policy is CHUNKED)
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert [s.num_generated_tokens for s in seqs] == [r.out for r in requests]
    assert scheduler.kv_cache.num_used_blocks == 0


@settings(max_examples=120, deadline=None)
@given(
    requests=requests_strategy,
    budget=st.integers(1, 48),
    block=st.integers(1, 16),
    spare_blocks=st.integers(0, 6),
    policy=st.sampled_from(list(SchedulingPolicy)),
)
def test_without_reservation_preemption_lets_every_random_workload_finish_within_the_cache(
    requests: list[Request], budget: int, block: int, spare_blocks: int, policy: SchedulingPolicy
) -> None:
    largest = max(math.ceil((r.prompt + r.out) / block) for r in requests)
    scheduler = make_scheduler(
        budget, num_blocks=largest + spare_blocks, block_size=block, policy=policy, reserve=False
    )
    seqs = drive(scheduler, requests, check_decodes_kept=False)
    assert [s.num_generated_tokens for s in seqs] == [r.out for r in requests]
    assert scheduler.kv_cache.num_used_blocks == 0


def test_without_reservation_the_newest_sequence_is_preempted_and_recomputed() -> None:
    # 6 blocks of 4 tokens. Two 8-token prompts each decode 9 tokens: together they
    # outgrow the cache when the older one needs its 13th token's slot.
    scheduler = make_scheduler(100, num_blocks=6, block_size=4, reserve=False)
    older = Sequence(seq_id=1, num_prompt_tokens=8, max_new_tokens=10)
    newer = Sequence(seq_id=2, num_prompt_tokens=8, max_new_tokens=10)
    waiting = deque([older, newer])
    # Step 1 prefills both, steps 2-5 decode both (contexts 9..12 fit in 3 blocks each);
    # step 6 needs a 4th block for the older one: the newer one is preempted.
    plans = [step(scheduler, waiting)[0] for _ in range(5)]
    assert [p.decode_seq_ids for p in plans[1:]] == [(1, 2)] * 4
    assert newer in scheduler.running
    plan, _ = step(scheduler, waiting)
    assert plan.decode_seq_ids == (1,) and newer.status is SequenceStatus.WAITING
    assert list(waiting) == [newer] and newer.num_computed_tokens == 0
    assert newer.num_generated_tokens == 5 and newer.num_prefill_tokens == 8 + 4
    while scheduler.has_unfinished or waiting:
        step(scheduler, waiting)
    assert older.num_generated_tokens == newer.num_generated_tokens == 10
