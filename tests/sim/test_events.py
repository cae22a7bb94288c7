"""The event heap hands events out by time, and in push order among equal times."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.events import EventQueue


def test_events_come_out_by_time_and_ties_in_the_order_they_were_pushed() -> None:
    queue: EventQueue[str, int] = EventQueue()
    for time_s, kind, payload in [(2.0, "b", 1), (1.0, "a", 2), (2.0, "c", 3), (1.0, "d", 4)]:
        queue.push(time_s, kind, payload)
    assert queue.peek_time_s() == 1.0 and len(queue) == 4
    assert [tuple(queue.pop()) for _ in range(4)] == [
        (1.0, "a", 2),
        (1.0, "d", 4),
        (2.0, "b", 1),
        (2.0, "c", 3),
    ]
    assert not queue and queue.peek_time_s() is None


@given(st.lists(st.integers(0, 5), max_size=40))
def test_any_sequence_of_pushes_pops_as_a_stable_sort_by_time(times: list[int]) -> None:
    queue: EventQueue[None, int] = EventQueue()
    for i, t in enumerate(times):
        queue.push(float(t), None, i)
    popped = [queue.pop().payload for _ in times]
    assert popped == sorted(range(len(times)), key=lambda i: times[i])


def test_popping_an_empty_queue_is_an_index_error() -> None:
    with pytest.raises(IndexError):
        EventQueue[None, None]().pop()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_an_event_at_a_non_finite_time_is_rejected(bad: float) -> None:
    with pytest.raises(ValueError, match="time_s"):
        EventQueue[None, None]().push(bad, None, None)
