"""The paged KV cache as tensors, and attention over block tables.

Layout (per layer, for K and for V): ``[num_blocks, block_size, num_kv_heads,
head_dim]``. Physical block ``b`` holds token slots ``b * block_size ..
(b + 1) * block_size - 1`` of the flattened ``[num_blocks * block_size, ...]`` view;
token ``i`` of a sequence whose block table is ``table`` lives in slot
``table[i // block_size] * block_size + i % block_size``. The block tables come from
``workers.kv_cache.PagedKVCache``, the same bookkeeping the simulator runs: this
module never decides which blocks a sequence owns.

What must stay true:
- every slot holds finite numbers (the cache starts zeroed), because padded gathers
  read slots that the mask then hides, and ``NaN * 0`` would leak through softmax;
- a step writes its tokens' K/V before any query of the step reads them (a prefill
  chunk attends to itself, a decode to its own token).

Attention is gather-based plain PyTorch (``scaled_dot_product_attention`` with a
boolean mask): decodes are one batched call over their padded block tables; each
prefill chunk is one call over its cached prefix plus itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class KvShapeError(ValueError):
    """KV tensors do not match this cache's model shape; the message names the field."""


@dataclass(frozen=True, kw_only=True)
class KvSnapshot:
    """One sequence's K and V in token order, independent of any block layout.

    ``key`` and ``value`` are ``[num_layers, num_tokens, num_kv_heads, head_dim]``.
    """

    key: torch.Tensor
    value: torch.Tensor

    def __post_init__(self) -> None:
        if self.key.dim() != 4:
            raise KvShapeError(f"key: expected 4 dimensions, got shape {tuple(self.key.shape)}")
        if self.key.shape != self.value.shape:
            raise KvShapeError(
                f"value: shape {tuple(self.value.shape)} != key shape {tuple(self.key.shape)}"
            )
        if self.key.dtype != self.value.dtype:
            raise KvShapeError(f"value: dtype {self.value.dtype} != key dtype {self.key.dtype}")

    @property
    def num_tokens(self) -> int:
        return int(self.key.shape[1])

    @property
    def nbytes(self) -> int:
        return 2 * self.key.numel() * self.key.element_size()

    def to(self, device: torch.device | str) -> KvSnapshot:
        return KvSnapshot(key=self.key.to(device), value=self.value.to(device))

    def to_bytes(self) -> bytes:
        """Serialise (safetensors: shapes and dtype travel in the header)."""
        from safetensors.torch import save

        return save({"key": self.key.contiguous().cpu(), "value": self.value.contiguous().cpu()})

    @classmethod
    def from_bytes(cls, data: bytes) -> KvSnapshot:
        """Inverse of ``to_bytes`` (CPU tensors). ``KvShapeError`` for a malformed payload."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            tensors = load(data)
        except SafetensorError as exc:
            raise KvShapeError(f"payload: not a KV snapshot ({exc})") from exc
        if set(tensors) != {"key", "value"}:
            raise KvShapeError(f"payload: expected tensors key and value, got {sorted(tensors)}")
        return cls(key=tensors["key"], value=tensors["value"])


class KvCacheTensors:
    """Preallocated K and V tensors for every layer, addressed by physical block id."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # Zeroed, not empty: see the module docstring.
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.key.dtype

    @property
    def device(self) -> torch.device:
        return self.key.device

    @property
    def nbytes(self) -> int:
        return 2 * self.key.numel() * self.key.element_size()

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V as ``[num_blocks * block_size, kv_heads, head_dim]`` views."""
        flat = (-1, self.num_kv_heads, self.head_dim)
        return self.key[layer].view(flat), self.value[layer].view(flat)

    def slots(self, block_table: Sequence[int], start: int, stop: int) -> list[int]:
        """Slot indices of tokens ``start .. stop - 1`` of a sequence with ``block_table``."""
        bs = self.block_size
        if stop > len(block_table) * bs:
            raise ValueError(
                f"block_table: {len(block_table)} blocks hold {len(block_table) * bs} tokens, "
                f"not {stop}"
            )
        return [block_table[i // bs] * bs + i % bs for i in range(start, stop)]

    def export(self, block_table: Sequence[int], num_tokens: int) -> KvSnapshot:
        """Copy the first ``num_tokens`` tokens of a sequence out of the cache."""
        index = torch.tensor(self.slots(block_table, 0, num_tokens), device=self.device)
        flat = (self.num_layers, -1, self.num_kv_heads, self.head_dim)
        return KvSnapshot(
            key=self.key.view(flat).index_select(1, index),
            value=self.value.view(flat).index_select(1, index),
        )

    def load(self, block_table: Sequence[int], snapshot: KvSnapshot) -> None:
        """Write ``snapshot`` into a sequence's first slots (its table must be big enough)."""
        expected = (self.num_layers, snapshot.num_tokens, self.num_kv_heads, self.head_dim)
        if tuple(snapshot.key.shape) != expected:
            raise KvShapeError(
                f"key: shape {tuple(snapshot.key.shape)} does not fit this cache "
                f"(layers, tokens, kv_heads, head_dim) = {expected}"
            )
        index = torch.tensor(self.slots(block_table, 0, snapshot.num_tokens), device=self.device)
        flat = (self.num_layers, -1, self.num_kv_heads, self.head_dim)
        self.key.view(flat).index_copy_(1, index, snapshot.key.to(self.device, self.dtype))
        self.value.view(flat).index_copy_(1, index, snapshot.value.to(self.device, self.dtype))


@dataclass(frozen=True, kw_only=True)
class SeqSlice:
    """Tokens ``start_pos .. start_pos + len(token_ids) - 1`` of one sequence in a step.

    ``block_table`` must cover ``start_pos + len(token_ids)`` tokens; the tokens
    before ``start_pos`` are already in the cache. ``sample``: the logits of the last
    token are wanted.
    """

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    sample: bool

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("token_ids: a slice needs at least one token")
        if self.start_pos < 0:
            raise ValueError(f"start_pos: must be >= 0, got {self.start_pos}")

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, kw_only=True)
class _Chunk:
    query_start: int
    num_tokens: int
    start_pos: int
    block_ids: torch.Tensor  # blocks covering start_pos + num_tokens


@dataclass(frozen=True, kw_only=True)
class PagedBatch:
    """Device tensors of one step: inputs, where to write K/V, what to attend to.

    Built by ``build_batch``; single-token slices (decodes, and a one-token chunk,
    which attends exactly like a decode) come first in the flat batch, then the
    multi-token chunks, each in the order given.
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks]
    decode_context_mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size]
    chunks: tuple[_Chunk, ...]
    # Rows of the flat batch whose logits are wanted, in the order the slices were given.
    sample_rows: torch.Tensor


def build_batch(
    slices: Sequence[SeqSlice], cache: KvCacheTensors, device: torch.device | str
) -> PagedBatch:
    """Lay ``slices`` out as one flat batch (single tokens first). ``ValueError`` if empty."""
    if not slices:
        raise ValueError("slices: a step needs at least one")
    bs = cache.block_size
    decode_idx = [i for i, s in enumerate(slices) if len(s.token_ids) == 1]
    chunk_idx = [i for i, s in enumerate(slices) if len(s.token_ids) > 1]
    order = decode_idx + chunk_idx
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    last_row: dict[int, int] = {}
    chunks: list[_Chunk] = []
    for i in order:
        s = slices[i]
        query_start = len(ids)
        ids.extend(s.token_ids)
        positions.extend(range(s.start_pos, s.end_pos))
        slots.extend(cache.slots(s.block_table, s.start_pos, s.end_pos))
        last_row[i] = len(ids) - 1
        if len(s.token_ids) > 1:
            nb = -(-s.end_pos // bs)
            chunks.append(
                _Chunk(
                    query_start=query_start,
                    num_tokens=len(s.token_ids),
                    start_pos=s.start_pos,
                    block_ids=torch.tensor(s.block_table[:nb], dtype=torch.long, device=device),
                )
            )
    num_decodes = len(decode_idx)
    max_blocks = max((-(-slices[i].end_pos // bs) for i in decode_idx), default=0)
    tables = torch.zeros((num_decodes, max_blocks), dtype=torch.long)
    for row, i in enumerate(decode_idx):
        s = slices[i]
        nb = -(-s.end_pos // bs)
        tables[row, :nb] = torch.tensor(s.block_table[:nb], dtype=torch.long)
    sample_rows = [last_row[i] for i, s in enumerate(slices) if s.sample]
    context = torch.tensor([slices[i].end_pos for i in decode_idx], dtype=torch.long)
    key_pos = torch.arange(max_blocks * bs)
    mask = (key_pos[None, :] < context[:, None]).view(num_decodes, 1, 1, max_blocks * bs)
    return PagedBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decodes=num_decodes,
        decode_block_tables=tables.to(device),
        decode_context_mask=mask.to(device),
        chunks=tuple(chunks),
        sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
    )


def _grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Attention of one query set over one key set, grouped-query without copying K/V.

    ``q`` ``[Tq, H, D]``, ``k``/``v`` ``[Tk, KvH, D]``, ``mask`` ``[Tq, Tk]`` (True =
    attend) or ``None`` for plain causal with ``Tq == Tk``; returns ``[Tq, H, D]``.
    Query head ``h`` uses KV head ``h // (H / KvH)`` (Hugging Face's ``repeat_kv``):
    the ``H / KvH`` query heads of a group become extra query rows of their KV head.
    """
    tq, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    # [Tq, KvH, G, D] -> [KvH, G * Tq, D], rows ordered (g, t).
    qg = q.view(tq, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * tq, dim)
    if mask is None and group > 1:
        mask = torch.ones(tq, tq, dtype=torch.bool, device=q.device).tril()
    full_mask = None if mask is None else mask.repeat(group, 1)
    out = F.scaled_dot_product_attention(
        qg,
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=full_mask,
        is_causal=mask is None,
    )
    return out.view(kv_heads, group, tq, dim).permute(2, 0, 1, 3).reshape(tq, heads, dim)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Rows of ``cache`` ``[num_blocks, block_size, KvH, D]`` for ``block_ids`` (any shape).

    Returns ``[*block_ids.shape[:-1], len * block_size, KvH, D]``; one ``index_select``
    over whole blocks (a contiguous copy, much faster than advanced indexing on CPU).
    """
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1))
    return rows.view(*block_ids.shape[:-1], -1, cache.shape[2], cache.shape[3])


def paged_attention(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KvCacheTensors,
    batch: PagedBatch,
) -> torch.Tensor:
    """Write this step's ``k``/``v`` into the cache, then attend over the block tables.

    ``q`` ``[T, heads, head_dim]``, ``k``/``v`` ``[T, kv_heads, head_dim]`` in the
    batch's flat order; returns ``[T, heads, head_dim]``.
    """
    k_slots, v_slots = cache.layer_slots(layer)
    k_slots[batch.slot_mapping] = k.to(cache.dtype)
    v_slots[batch.slot_mapping] = v.to(cache.dtype)
    out = torch.empty_like(q)
    nd = batch.num_decodes
    if nd:
        # Whole blocks gathered per decode, padded to the longest; the mask hides the
        # padding and the unwritten tail of the last block. A decode's query heads of
        # one group share its mask, so they ride as query rows of their KV head.
        kv_heads, dim = cache.num_kv_heads, cache.head_dim
        group = q.shape[1] // kv_heads
        keys = _gather(cache.key[layer], batch.decode_block_tables).transpose(1, 2)
        values = _gather(cache.value[layer], batch.decode_block_tables).transpose(1, 2)
        decoded = F.scaled_dot_product_attention(
            q[:nd].view(nd, kv_heads, group, dim),
            keys,
            values,
            attn_mask=batch.decode_context_mask,
        )
        out[:nd] = decoded.reshape(nd, kv_heads * group, dim)
    for chunk in batch.chunks:
        rows = slice(chunk.query_start, chunk.query_start + chunk.num_tokens)
        if chunk.start_pos == 0:
            # No cached prefix: the chunk's own K/V are all it attends to.
            out[rows] = _grouped_attention(q[rows], k[rows], v[rows], None)
            continue
        context = chunk.start_pos + chunk.num_tokens
        keys = _gather(cache.key[layer], chunk.block_ids[None])[0, :context]
        values = _gather(cache.value[layer], chunk.block_ids[None])[0, :context]
        query_pos = torch.arange(chunk.start_pos, context, device=q.device)
        mask = torch.arange(context, device=q.device)[None, :] <= query_pos[:, None]
        out[rows] = _grouped_attention(q[rows], keys, values, mask)
    return out


@dataclass(frozen=True)
class PagedAttention:
    """The model's ``Attention`` for one step over the paged cache."""

    cache: KvCacheTensors
    batch: PagedBatch

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return paged_attention(layer, q, k, v, self.cache, self.batch)
