"""Paged KV-cache bookkeeping: which physical blocks each sequence owns.

The cache is ``num_blocks`` blocks of ``block_size_tokens`` token slots each. A
sequence owns a *block table*: the physical block ids, in order, that hold its
tokens' keys and values. Block ids are real indices ``0 .. num_blocks - 1`` (an
engine indexes its KV tensor with them) and are reused after ``free``.

Pure bookkeeping: no tensors, no I/O. What must stay true:

- every block id is either free or owned by exactly one sequence;
- a sequence holding ``n`` tokens owns exactly ``ceil(n / block_size_tokens)``
  blocks (tables only grow, until ``free`` releases them all);
- an allocation that cannot be satisfied changes nothing.
"""

from __future__ import annotations


class PagedKVCache:
    """Block tables for sequences sharing a fixed pool of KV blocks.

    Raises ``ValueError`` (naming the argument) for a non-positive size.
    """

    def __init__(self, *, num_blocks: int, block_size_tokens: int) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size_tokens", block_size_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        self._num_blocks = num_blocks
        self._block_size_tokens = block_size_tokens
        # A stack: the most recently freed blocks are handed out first. Reversed so
        # that a fresh cache hands out 0, 1, 2, ... in order (readable tables).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}

    # -- sizes ------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size_tokens(self) -> int:
        return self._block_size_tokens

    @property
    def capacity_tokens(self) -> int:
        """Token slots in the whole cache."""
        return self._num_blocks * self._block_size_tokens

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - len(self._free)

    @property
    def utilization(self) -> float:
        """Fraction of the blocks owned by some sequence, in [0, 1]."""
        return self.num_used_blocks / self._num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size_tokens)``."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens: must be >= 0, got {num_tokens}")
        return -(-num_tokens // self._block_size_tokens)

    # -- per sequence -------------------------------------------------------------

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        """The physical block ids of ``seq_id`` in token order; KeyError if it has none."""
        return tuple(self._table(seq_id))

    def can_fit(self, seq_id: int, num_tokens: int) -> bool:
        """Whether ``seq_id`` could grow (from what it owns now) to hold ``num_tokens`` in total."""
        owned = len(self._tables.get(seq_id, ()))
        return self.blocks_needed(num_tokens) - owned <= len(self._free)

    def allocate(self, seq_id: int, num_tokens: int) -> tuple[int, ...] | None:
        """Grow ``seq_id``'s table so it holds ``num_tokens`` tokens in total.

        Returns the whole block table, or ``None`` when the free blocks are too few,
        in which case nothing changes. Asking for no more than the table already
        holds returns it unchanged (tables never shrink; use ``free``).
        ``num_tokens`` must be >= 1.
        """
        if num_tokens < 1:
            raise ValueError(f"num_tokens: must be >= 1, got {num_tokens}")
        table = self._tables.get(seq_id)
        owned = 0 if table is None else len(table)
        extra = self.blocks_needed(num_tokens) - owned
        if extra > len(self._free):
            return None
        if table is None:
            table = self._tables[seq_id] = []
        if extra > 0:
            # Take from the top of the stack, newest-freed first, in stack order.
            taken = self._free[-extra:]
            del self._free[-extra:]
            taken.reverse()
            table.extend(taken)
        return tuple(table)

    def free(self, seq_id: int) -> int:
        """Release every block of ``seq_id``; returns how many. KeyError if unknown."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            raise KeyError(f"seq_id {seq_id}: owns no KV blocks (never allocated or already freed)")
        # Pushed in reverse so that the next allocation gets them back in table order.
        self._free.extend(reversed(table))
        return len(table)

    def _table(self, seq_id: int) -> list[int]:
        table = self._tables.get(seq_id)
        if table is None:
            raise KeyError(f"seq_id {seq_id}: owns no KV blocks")
        return table
