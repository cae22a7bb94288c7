"""Paged KV bookkeeping keeps every block owned once, within capacity, in ceil-sized tables."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.kv_cache import PagedKVCache


@pytest.mark.parametrize(
    ("num_blocks", "block_size_tokens", "field"),
    [(0, 16, "num_blocks"), (4, 0, "block_size_tokens"), (-1, 16, "num_blocks")],
)
def test_a_cache_without_blocks_or_slots_is_rejected_naming_the_field(
    num_blocks: int, block_size_tokens: int, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        PagedKVCache(num_blocks=num_blocks, block_size_tokens=block_size_tokens)


@given(tokens=st.integers(0, 10_000), block=st.integers(1, 64))
def test_blocks_needed_is_the_ceiling_of_tokens_over_block_size(tokens: int, block: int) -> None:
    cache = PagedKVCache(num_blocks=1, block_size_tokens=block)
    assert cache.blocks_needed(tokens) == math.ceil(tokens / block)


def test_a_fresh_cache_is_empty_and_holds_blocks_times_block_size_tokens() -> None:
    cache = PagedKVCache(num_blocks=10, block_size_tokens=16)
    assert cache.capacity_tokens == 160
    assert (cache.num_free_blocks, cache.num_used_blocks, cache.utilization) == (10, 0, 0.0)


def test_a_table_grows_to_ceil_tokens_over_block_size_and_keeps_its_blocks() -> None:
    cache = PagedKVCache(num_blocks=10, block_size_tokens=4)
    first = cache.allocate(7, 5)
    assert first is not None and len(first) == 2
    grown = cache.allocate(7, 13)
    assert grown is not None and len(grown) == 4
    assert grown[:2] == first  # growing never moves the tokens already stored
    assert cache.allocate(7, 3) == grown  # asking for less shrinks nothing
    assert cache.block_table(7) == grown
    assert 7 in cache and 8 not in cache
    assert cache.utilization == pytest.approx(0.4)


def test_a_failed_allocation_changes_nothing() -> None:
    cache = PagedKVCache(num_blocks=5, block_size_tokens=4)
    cache.allocate(1, 12)
    before = (cache.block_table(1), cache.num_free_blocks)
    assert not cache.can_fit(2, 9)
    assert cache.allocate(2, 9) is None
    assert cache.allocate(1, 21) is None  # growing an existing table past the free blocks
    assert (cache.block_table(1), cache.num_free_blocks) == before
    assert 2 not in cache


def test_freed_blocks_are_reused_by_the_next_allocation() -> None:
    cache = PagedKVCache(num_blocks=4, block_size_tokens=2)
    cache.allocate(1, 4)
    released = cache.block_table(1)
    cache.allocate(2, 4)
    assert cache.num_free_blocks == 0
    assert cache.free(1) == 2
    again = cache.allocate(3, 4)
    assert again is not None and sorted(again) == sorted(released)


def test_freeing_an_unknown_sequence_is_a_key_error_that_names_it() -> None:
    cache = PagedKVCache(num_blocks=4, block_size_tokens=2)
    with pytest.raises(KeyError, match="seq_id 42"):
        cache.free(42)
    cache.allocate(42, 1)
    cache.free(42)
    with pytest.raises(KeyError, match="seq_id 42"):
        cache.free(42)


@settings(max_examples=200)
@given(
    num_blocks=st.integers(1, 24),
    block=st.integers(1, 8),
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 5), st.integers(1, 80)), min_size=1, max_size=60
    ),
)
def test_random_allocations_never_exceed_capacity_or_share_a_block(
    num_blocks: int, block: int, ops: list[tuple[bool, int, int]]
) -> None:
    cache = PagedKVCache(num_blocks=num_blocks, block_size_tokens=block)
    held: dict[int, int] = {}  # seq -> most tokens granted, the model the cache must match
    for is_free, seq, tokens in ops:
        if is_free:
            if seq in held:
                assert cache.free(seq) == math.ceil(held.pop(seq) / block)
            continue
        wanted = max(tokens, held.get(seq, 0))
        extra = math.ceil(wanted / block) - math.ceil(held.get(seq, 0) / block)
        fits = extra <= num_blocks - sum(math.ceil(t / block) for t in held.values())
        assert cache.can_fit(seq, tokens) == fits
        table = cache.allocate(seq, tokens)
        assert (table is not None) == fits
        if fits:
            held[seq] = wanted
        owned = [b for s in held for b in cache.block_table(s)]
        assert len(owned) == len(set(owned)) == cache.num_used_blocks <= num_blocks
        assert all(0 <= b < num_blocks for b in owned)
        for s, t in held.items():
            assert len(cache.block_table(s)) == math.ceil(t / block)
        assert cache.num_used_blocks + cache.num_free_blocks == num_blocks
