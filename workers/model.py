"""A Llama-architecture decoder in PyTorch (DESIGN §1: the workers' model).

RMSNorm, rotary position embeddings (``rope_theta``, optional Llama-3 or linear
scaling), grouped-query attention, SwiGLU MLP, and a tied or untied LM head. The
module tree and parameter names are those of Hugging Face's ``LlamaForCausalLM``
(``model.embed_tokens.weight``, ``model.layers.N.self_attn.q_proj.weight``, ...,
``model.norm.weight``, ``lm_head.weight``), so a ``state_dict`` is a checkpoint.

The model works on a *flat* batch: ``T`` tokens from any number of sequences, each
with its absolute position. Attention across tokens is the only operation that
needs to know which sequence a token belongs to, so it is delegated to an
``Attention`` callable: ``DenseCausalAttention`` (no cache, whole sequences: the
reference) or ``workers.paged_attention.PagedAttention`` (the engine's paged KV
cache). Everything else is per token, which is what makes a hybrid batch of
prefill chunks and decodes one forward pass.

Runs on CPU in float32 and on CUDA in bfloat16/float16; nothing here is CUDA
specific. Norms, rotary tables and softmax are computed in float32 whatever the
weights' dtype, as Hugging Face does, so checkpoints give the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A model configuration is invalid or unsupported; the message names the field."""


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """The fields of a Hugging Face Llama ``config.json`` that define the network.

    ``head_dim`` defaults to ``hidden_size // num_attention_heads``. ``rope_scaling``
    is ``None`` or a mapping with ``rope_type`` (or ``type``) ``"linear"`` (needs
    ``factor``) or ``"llama3"`` (needs ``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    rope_scaling: Mapping[str, Any] | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    torch_dtype: str = "float32"
    head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"num_attention_heads: {self.num_attention_heads} does not divide "
                    f"hidden_size {self.hidden_size} (give head_dim)"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        elif isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int):
            raise ConfigError(f"head_dim: must be an even integer >= 2, got {self.head_dim!r}")
        if self.head_size < 2 or self.head_size % 2:
            raise ConfigError(f"head_dim: must be an even integer >= 2, got {self.head_size}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name}: must be a finite number > 0, got {value!r}")
        if self.torch_dtype not in _DTYPES:
            raise ConfigError(
                f"torch_dtype: must be one of {sorted(_DTYPES)}, got {self.torch_dtype!r}"
            )
        for tid in (self.bos_token_id, *self.eos_token_ids):
            if tid is not None and not (isinstance(tid, int) and 0 <= tid < self.vocab_size):
                raise ConfigError(
                    f"eos_token_id/bos_token_id: {tid!r} is not a token id below "
                    f"vocab_size {self.vocab_size}"
                )
        _check_rope_scaling(self.rope_scaling)

    @property
    def head_size(self) -> int:
        """``head_dim`` as an int (always set after validation)."""
        assert self.head_dim is not None
        return self.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.torch_dtype]

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of K and V one token occupies over all layers (in ``dtype``, default own)."""
        itemsize = torch.empty((), dtype=dtype or self.dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_size * itemsize

    # -- Hugging Face config.json --------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LlamaConfig:
        """Read a Hugging Face ``config.json`` document (unknown keys are ignored).

        Raises ``ConfigError`` naming the field for a missing required key or a
        feature this model does not implement (biases, another activation, sliding
        windows, other rope scalings).
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"config: expected a JSON object, got {type(data).__name__}")
        if data.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act: only 'silu' is supported, got {data['hidden_act']!r}")
        for flag in ("attention_bias", "mlp_bias"):
            if data.get(flag):
                raise ConfigError(f"{flag}: biases are not supported")
        if data.get("sliding_window") is not None and data.get("use_sliding_window", True):
            raise ConfigError("sliding_window: sliding-window attention is not supported")
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        for key in required:
            if key not in data:
                raise ConfigError(f"{key}: missing from the config")
        eos = data.get("eos_token_id", 2)
        eos_ids: tuple[int, ...]
        if eos is None:
            eos_ids = ()
        elif isinstance(eos, list | tuple):
            eos_ids = tuple(eos)
        else:
            eos_ids = (eos,)
        dtype = data.get("torch_dtype", data.get("dtype")) or "float32"
        return cls(
            vocab_size=data["vocab_size"],
            hidden_size=data["hidden_size"],
            intermediate_size=data["intermediate_size"],
            num_hidden_layers=data["num_hidden_layers"],
            num_attention_heads=data["num_attention_heads"],
            num_key_value_heads=data.get("num_key_value_heads") or data["num_attention_heads"],
            max_position_embeddings=data.get("max_position_embeddings", 2048),
            rms_norm_eps=data.get("rms_norm_eps", 1e-5),
            rope_theta=data.get("rope_theta", 10_000.0),
            rope_scaling=data.get("rope_scaling"),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=dtype,
            head_dim=data.get("head_dim"),
        )

    def to_dict(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` document for this model."""
        eos: int | list[int] | None
        if not self.eos_token_ids:
            eos = None
        elif len(self.eos_token_ids) == 1:
            eos = self.eos_token_ids[0]
        else:
            eos = list(self.eos_token_ids)
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": self.torch_dtype,
        }


def _check_rope_scaling(scaling: Mapping[str, Any] | None) -> None:
    if scaling is None:
        return
    if not isinstance(scaling, Mapping):
        raise ConfigError(f"rope_scaling: expected an object or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise ConfigError(f"rope_scaling: rope_type {kind!r} is not supported ({_ROPE_TYPES})")
    needed = {
        "default": (),
        "linear": ("factor",),
        "llama3": (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ),
    }[kind]
    for key in needed:
        value = scaling.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"rope_scaling.{key}: must be a number > 0, got {value!r}")


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies (float32, CPU, ``head_dim / 2`` of them) with the config's scaling."""
    dim = config.head_size
    exponents = torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    kind = "default" if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if scaling is not None and kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif scaling is not None and kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band
        # between them interpolated smoothly.
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        wavelength = 2 * math.pi / inv_freq
        smooth = (old_context / wavelength - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(
            wavelength < old_context / high,
            inv_freq,
            torch.where(wavelength > old_context / low, inv_freq / factor, blended),
        )
    return inv_freq.to(torch.float32)


class Attention(Protocol):
    """Attention over a flat batch, for one layer.

    ``q`` is ``[T, num_heads, head_dim]``, ``k`` and ``v`` ``[T, num_kv_heads,
    head_dim]`` (rotary already applied); returns ``[T, num_heads, head_dim]``. The
    implementation knows which sequence and position each of the ``T`` tokens is.
    """

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class DenseCausalAttention:
    """Causal attention within whole sequences laid end to end, without a cache.

    ``seq_lens`` are the lengths of the sequences in batch order; each must start at
    position 0. The reference the paged engine is tested against.
    """

    seq_lens: Sequence[int] = field(default_factory=tuple)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        lens = list(self.seq_lens) or [q.shape[0]]
        if sum(lens) != q.shape[0]:
            raise ValueError(f"seq_lens: sum {sum(lens)} != batch tokens {q.shape[0]}")
        outs = []
        parts = zip(torch.split(q, lens), torch.split(k, lens), torch.split(v, lens), strict=True)
        for qs, ks, vs in parts:
            out = F.scaled_dot_product_attention(
                qs.transpose(0, 1).unsqueeze(0),
                ks.transpose(0, 1).unsqueeze(0),
                vs.transpose(0, 1).unsqueeze(0),
                is_causal=True,
                enable_gqa=True,
            )
            outs.append(out.squeeze(0).transpose(0, 1))
        return torch.cat(outs)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, normalised in float32 (Hugging Face's order of casts)."""

    def __init__(self, hidden_size: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by per-token ``cos``/``sin`` ``[T, head_dim]``.

    The "rotate half" convention of Hugging Face checkpoints (their q/k projections
    are permuted for it).
    """
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int, **factory: Any) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_size
        hidden = config.hidden_size
        q_width = self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_width, bias=False, **factory)
        self.k_proj = nn.Linear(hidden, kv_width, bias=False, **factory)
        self.v_proj = nn.Linear(hidden, kv_width, bias=False, **factory)
        self.o_proj = nn.Linear(q_width, hidden, bias=False, **factory)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = attention(self.layer, q, k, v)
        projected: torch.Tensor = self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))
        return projected


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig, **factory: Any) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=False, **factory)
        self.up_proj = nn.Linear(hidden, inter, bias=False, **factory)
        self.down_proj = nn.Linear(inter, hidden, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int, **factory: Any) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer, **factory)
        self.mlp = LlamaMLP(config, **factory)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, **factory)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        mlp_out: torch.Tensor = self.mlp(self.post_attention_layernorm(x))
        return x + mlp_out


class Embedding(nn.Module):
    """A token-embedding table (``weight`` ``[vocab, hidden]``), left uninitialised.

    Unlike ``nn.Embedding`` it does not draw random values at construction, which on
    the meta device goes through a slow decomposition path (about a second and a half).
    """

    def __init__(self, num_embeddings: int, dim: int, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, **factory))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, **factory: Any) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, **factory)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, **factory) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head, with Hugging Face's parameter names.

    ``device`` and ``dtype`` are where the parameters are created: ``"meta"`` builds
    the shapes without memory (``workers.checkpoint.load_model`` does that, then
    loads real weights); elsewhere they are not meaningfully initialised (the
    embedding is left empty): load weights before use.
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.config = config
        self.model = LlamaModel(config, **factory)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        self.tie_weights()
        # Not a buffer: it must survive meta-device construction and ``to_empty``.
        self._inv_freq_cpu = rope_inv_freq(config)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def tie_weights(self) -> None:
        """Share the input embedding with the LM head when the config ties them.

        Must be called again after ``to_empty``, which gives each module new tensors.
        """
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``cos``, ``sin`` ``[T, head_dim]`` for absolute ``positions``, computed in float32."""
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq[positions.device] = self._inv_freq_cpu.to(positions.device)
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of a flat batch of ``T`` tokens.

        ``input_ids`` and ``positions`` are ``[T]`` integer tensors on the model's device.
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attention)
        normed: torch.Tensor = self.model.norm(x)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[..., vocab]`` of the given hidden states."""
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()

    @torch.inference_mode()
    def full_logits(self, input_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Logits ``[T, vocab]`` of one whole sequence in one pass without a cache (reference)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).reshape(-1)
        positions = torch.arange(ids.shape[0], device=self.device)
        hidden = self.forward(ids, positions, DenseCausalAttention((ids.shape[0],)))
        return self.compute_logits(hidden)
