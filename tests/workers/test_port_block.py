"""A block of worker ports is free and sits where outgoing connections cannot take it."""

from __future__ import annotations

import socket

import pytest

from workers.redis_util import LOOPBACK, ephemeral_port_range, free_port_block


def test_a_port_block_is_below_the_ephemeral_range_and_every_port_binds() -> None:
    base = free_port_block(12, seed=7)
    low, _ = ephemeral_port_range()
    assert base >= 10_000 and base + 12 <= low
    for port in range(base, base + 12):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((LOOPBACK, port))


def test_a_taken_port_moves_the_block() -> None:
    base = free_port_block(4, seed=3)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind((LOOPBACK, base + 2))
        held.listen()
        again = free_port_block(4, seed=3)  # the same first guess, now partly taken
    assert not again <= base + 2 < again + 4


def test_an_empty_block_is_refused_naming_the_count() -> None:
    with pytest.raises(ValueError, match="count"):
        free_port_block(0)
