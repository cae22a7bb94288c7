"""The two pools of a disaggregated deployment, and a value per pool.

``Pool`` is the one name of a pool everywhere in the project: the capacity model,
the controller's decision, the simulator, the data plane (Redis streams, registry,
metrics) and the actuators. ``PerPool[T]`` holds one value of a kind for each pool,
so a per-pool quantity is one field, not a ``prefill_x``/``decode_x`` pair or a dict
keyed by strings.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")


class Pool(enum.Enum):
    PREFILL = "prefill"  # turns prompts into KV caches and first tokens (TTFT)
    DECODE = "decode"  # generates the remaining tokens (TPOT)

    @property
    def latency(self) -> str:
        """The latency the pool's size sets, as metric and field names spell it."""
        return "ttft" if self is Pool.PREFILL else "tpot"


@dataclass(frozen=True, kw_only=True)
class PerPool(Generic[T]):
    """One value for each pool; immutable, indexed by ``Pool``."""

    prefill: T
    decode: T

    @classmethod
    def build(cls, value: Callable[[Pool], T]) -> PerPool[T]:
        """``value(pool)`` for each pool."""
        return cls(prefill=value(Pool.PREFILL), decode=value(Pool.DECODE))

    @classmethod
    def both(cls, value: T) -> PerPool[T]:
        """The same value for both pools."""
        return cls(prefill=value, decode=value)

    def __getitem__(self, pool: Pool) -> T:
        return self.prefill if pool is Pool.PREFILL else self.decode

    def items(self) -> Iterator[tuple[Pool, T]]:
        yield Pool.PREFILL, self.prefill
        yield Pool.DECODE, self.decode

    def map(self, fn: Callable[[T], U]) -> PerPool[U]:
        return PerPool(prefill=fn(self.prefill), decode=fn(self.decode))

    def with_value(self, pool: Pool, value: T) -> PerPool[T]:
        """A copy with ``pool``'s value replaced."""
        if pool is Pool.PREFILL:
            return PerPool(prefill=value, decode=self.decode)
        return PerPool(prefill=self.prefill, decode=value)

    def as_dict(self) -> dict[str, T]:
        """``{"prefill": ..., "decode": ...}``, the shape of every JSON document."""
        return {pool.value: value for pool, value in self.items()}
