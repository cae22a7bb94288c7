"""The two inputs of a roofline profile: a GPU's datasheet and a model's shape.

``GpuSpec`` holds the handful of datasheet numbers a roofline needs (dense tensor
FLOP/s, memory bandwidth and size, the link used by tensor-parallel all-reduce);
``ModelShape`` holds a decoder-only, Llama-style transformer's configuration and
derives its parameter count, weight bytes, KV-cache bytes per token and FLOPs.
Both are plain data: the concrete GPUs and models, with their sources, are in
``queueing.catalog``; turning them into an ``IterationProfile`` is
``queueing.roofline``.

Units: bytes, bytes per second, FLOPs, FLOP/s. Invalid values raise ``ProfileError``
whose message starts with the field's name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from queueing.profile import ProfileError


def _check_text(owner: str, field: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ProfileError(f"{field}: {owner} needs a non-empty string, got {value!r}")


def _check_positive_int(owner: str, field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ProfileError(f"{field}: {owner} needs an integer >= 1, got {value!r}")


def _check_positive_number(owner: str, field: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ProfileError(f"{field}: {owner} needs a finite number > 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One GPU's datasheet numbers.

    - ``peak_dense_flops``: dense BF16/FP16 tensor-core FLOP/s. NVIDIA datasheets
      print the 2:4 structured-sparsity figure first; this is half of it.
    - ``hbm_bytes_per_s``: peak device-memory bandwidth.
    - ``memory_bytes``: device memory, the datasheet's "GB" read as 10^9 bytes (the
      real capacity is a few per cent larger; reading it this way is conservative).
    - ``interconnect_bytes_per_s``: GPU-to-GPU bandwidth in one direction over the
      link tensor-parallel all-reduce uses (NVLink, or PCIe where there is none).
    - ``allreduce_latency_s``: the time of one small (activation-sized) all-reduce
      among four of these GPUs on the node's link, the part of it that does not
      shrink with the message: measured where a measurement is published, else the
      assumption the source says.
    - ``source``: where the numbers come from.
    """

    name: str
    peak_dense_flops: float
    hbm_bytes_per_s: float
    memory_bytes: int
    interconnect_bytes_per_s: float
    allreduce_latency_s: float
    source: str

    def __post_init__(self) -> None:
        _check_text("GpuSpec", "name", self.name)
        _check_text("GpuSpec", "source", self.source)
        for field in (
            "peak_dense_flops",
            "hbm_bytes_per_s",
            "interconnect_bytes_per_s",
            "allreduce_latency_s",
        ):
            _check_positive_number("GpuSpec", field, getattr(self, field))
        _check_positive_int("GpuSpec", "memory_bytes", self.memory_bytes)


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A Llama-style decoder: RMSNorm, grouped-query attention, SwiGLU MLP, untied head.

    Field names follow the Hugging Face ``config.json`` of such models
    (``num_layers`` is ``num_hidden_layers``, ``num_kv_heads`` is
    ``num_key_value_heads``, ``max_context_tokens`` is ``max_position_embeddings``).
    ``dtype_bytes`` is the bytes per weight and per KV element (2 for FP16/BF16).
    The input embedding and the LM head are separate matrices (none of the catalogue's
    models ties them).

    A mixture-of-experts model (Mixtral-style: ``num_local_experts`` SwiGLU MLPs of
    width ``intermediate_size`` per layer, a linear router, ``num_experts_per_tok``
    of them run per token) has ``num_experts`` > 1; a dense model has one expert,
    always active. ``attention_bias`` is Qwen2's bias on the q, k and v projections.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_context_tokens: int
    dtype_bytes: int
    source: str
    num_experts: int = 1
    experts_per_token: int = 1
    attention_bias: bool = False

    def __post_init__(self) -> None:
        _check_text("ModelShape", "name", self.name)
        _check_text("ModelShape", "source", self.source)
        for field in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_kv_heads",
            "intermediate_size",
            "vocab_size",
            "max_context_tokens",
            "dtype_bytes",
            "num_experts",
            "experts_per_token",
        ):
            _check_positive_int("ModelShape", field, getattr(self, field))
        if self.experts_per_token > self.num_experts:
            raise ProfileError(
                f"experts_per_token: {self.experts_per_token} is more than the "
                f"{self.num_experts} experts"
            )
        if not isinstance(self.attention_bias, bool):
            raise ProfileError(f"attention_bias: must be a bool, got {self.attention_bias!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ProfileError(
                f"num_attention_heads: {self.num_attention_heads} does not divide "
                f"hidden_size {self.hidden_size}"
            )
        if self.num_attention_heads % self.num_kv_heads:
            raise ProfileError(
                f"num_kv_heads: {self.num_kv_heads} does not divide "
                f"num_attention_heads {self.num_attention_heads}"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_attention_heads

    @property
    def embedding_params(self) -> int:
        """Parameters of the input embedding table (looked up, never multiplied)."""
        return self.vocab_size * self.hidden_size

    def _layer_params(self, experts: int) -> int:
        """One layer's parameters with ``experts`` of its MLP experts counted.

        q and o projections are hidden x hidden; k and v are hidden x (kv_heads *
        head_dim) (grouped-query attention), plus their biases where the model has
        them; each SwiGLU expert has three hidden x intermediate matrices (gate, up,
        down); a mixture adds its router (hidden x experts); two RMSNorm weight
        vectors of width hidden.
        """
        h = self.hidden_size
        kv_width = self.num_kv_heads * self.head_dim
        attention = 2 * h * h + 2 * h * kv_width
        if self.attention_bias:
            attention += h + 2 * kv_width
        mlp = experts * 3 * h * self.intermediate_size
        router = h * self.num_experts if self.num_experts > 1 else 0
        norms = 2 * h
        return attention + mlp + router + norms

    @property
    def param_count(self) -> int:
        """All parameters: embedding + layers (every expert) + final norm + LM head."""
        h = self.hidden_size
        lm_head = self.hidden_size * self.vocab_size
        layers = self.num_layers * self._layer_params(self.num_experts)
        return self.embedding_params + layers + h + lm_head

    @property
    def active_param_count(self) -> int:
        """Parameters one token passes through: its ``experts_per_token`` experts only
        (the whole model for a dense one)."""
        h = self.hidden_size
        lm_head = self.hidden_size * self.vocab_size
        layers = self.num_layers * self._layer_params(self.experts_per_token)
        return self.embedding_params + layers + h + lm_head

    def expert_read_fraction(self, batch_tokens: int) -> float:
        """Expected share of a layer's experts an iteration of ``batch_tokens`` reads.

        Each token picks ``experts_per_token`` of ``num_experts``; taking the picks
        as independent and uniform (what a router's load-balancing loss aims at), an
        expert is left unread with probability (1 - k/E)^n. 1 for a dense model.
        """
        if batch_tokens < 1:
            raise ProfileError(f"batch_tokens: must be >= 1, got {batch_tokens!r}")
        unread = (1.0 - self.experts_per_token / self.num_experts) ** batch_tokens
        return 1.0 - unread

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights (what must fit in GPU memory and be loaded at startup)."""
        return self.param_count * self.dtype_bytes

    @property
    def weight_read_bytes(self) -> int:
        """Bytes of weights streamed from memory by every forward pass.

        Everything but the input embedding table, of which an iteration gathers only
        the rows of its tokens (a few kilobytes each, negligible). For a mixture this
        counts every expert: an iteration reads the experts its tokens picked, all of
        them from a few tokens on (``expert_read_fraction``: Mixtral's 2 of 8 are
        90 % read at 8 tokens, 99 % at 16), so it is exact for prefill iterations and
        loaded decode batches and an over-estimate (the safe side) for a handful of
        decoding sequences.
        """
        return (self.param_count - self.embedding_params) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes of one token: K and V, every layer, every KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def flops_per_token(self) -> int:
        """Matrix-multiply FLOPs of one token through the model, attention scores aside.

        Two FLOPs (multiply, add) per weight of every matrix the token passes through:
        all layer weights (of a mixture, only the token's active experts) and the LM
        head, i.e. 2 x (active params - input embedding). The
        head is charged to every token; an engine computes logits only where it
        samples (the last prompt token, every decode token), so for prefill this is
        a slight over-estimate. Norms, rotary embedding and activations are
        element-wise and left out.
        """
        return 2 * (self.active_param_count - self.embedding_params)

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one causal (query, key) pair, summed over heads and layers.

        For one pair, each of the ``num_attention_heads`` query heads computes a
        score q.k (``head_dim`` multiply-adds = 2 x head_dim FLOPs) and adds
        score x v into its output (another 2 x head_dim FLOPs). Grouped-query
        attention shares K and V between heads but not the arithmetic, so the count is
        4 x num_attention_heads x head_dim per layer = 4 x hidden_size x num_layers.
        (Softmax is element-wise per pair and left out.)
        """
        return 4 * self.num_layers * self.num_attention_heads * self.head_dim
