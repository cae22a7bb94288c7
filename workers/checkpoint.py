"""Hugging Face–layout checkpoints on local disk: load, save, and generate tiny ones.

A checkpoint folder holds ``config.json`` and the weights, either one
``model.safetensors`` or shards ``model-0000i-of-0000n.safetensors`` listed by
``model.safetensors.index.json`` (``{"weight_map": {tensor name: file}}``), with
Hugging Face's parameter names. ``tokenizer.json`` (the ``tokenizers`` library's
format) is optional. Nothing is ever downloaded: tests, benchmarks and the demo use
``write_tiny_checkpoint``, which generates a small random model (fixed seed) and a
byte-level BPE tokenizer trained on a text shipped in this module, and then load it
through the same code as a real checkpoint.

Every loading error is a ``CheckpointError`` that names the file or the tensor:
a missing or unexpected tensor, a shape that does not match ``config.json``, a
shard listed in the index but absent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from workers.model import ConfigError, LlamaConfig, LlamaForCausalLM

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
# Tensors some checkpoints carry that are not parameters (recomputed here).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class CheckpointError(ValueError):
    """A checkpoint folder cannot be loaded; the message names the file or tensor."""


# -- configs --------------------------------------------------------------------------


def tiny_config(**overrides: Any) -> LlamaConfig:
    """A small Llama with grouped-query attention (~1.2 M parameters), for tests and demos.

    4 layers, hidden 128, 4 query heads over 2 KV heads of 32, SwiGLU 384, vocabulary
    512, context 4096, untied LM head, float32. ``overrides`` replace fields.
    """
    fields: dict[str, Any] = {
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10_000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_ids": (2,),
        "torch_dtype": "float32",
    }
    fields.update(overrides)
    return LlamaConfig(**fields)


def load_config(path: str | Path) -> LlamaConfig:
    """The ``LlamaConfig`` of the checkpoint folder ``path``."""
    file = Path(path) / CONFIG_FILE
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CheckpointError(f"{CONFIG_FILE}: not found in {path}") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{CONFIG_FILE}: not valid JSON in {path} ({exc})") from exc
    try:
        return LlamaConfig.from_dict(data)
    except ConfigError as exc:
        raise CheckpointError(f"{CONFIG_FILE} in {path}: {exc}") from exc


# -- loading ----------------------------------------------------------------------------


def weight_map(path: str | Path) -> dict[str, Path]:
    """Which file holds each tensor: from the shard index, else from ``model.safetensors``."""
    folder = Path(path)
    index = folder / INDEX_FILE
    if index.exists():
        try:
            listed = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{INDEX_FILE}: no valid weight_map in {folder} ({exc})") from exc
        files: dict[str, Path] = {}
        for name, file in listed.items():
            shard = folder / file
            if not shard.exists():
                raise CheckpointError(
                    f"{file}: listed in {INDEX_FILE} (for {name}) but not found in {folder}"
                )
            files[name] = shard
        return files
    single = folder / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"{SINGLE_FILE}: not found in {folder} (nor {INDEX_FILE})")
    with safe_open(str(single), framework="pt", device="cpu") as f:
        return dict.fromkeys(f.keys(), single)


def _default_dtype(config: LlamaConfig, device: torch.device) -> torch.dtype:
    # Half precision matmuls are slow on CPU: float32 there unless asked.
    return config.dtype if device.type == "cuda" else torch.float32


def load_model(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> LlamaForCausalLM:
    """Build the model of the folder ``path`` and load its weights, ready for inference.

    ``dtype`` defaults to the config's ``torch_dtype`` on CUDA and float32 on CPU;
    weights are converted as they are copied. Raises ``CheckpointError`` (naming the
    file or tensor) for a missing, unexpected or wrongly shaped tensor.
    """
    folder = Path(path)
    config = load_config(folder)
    device = torch.device(device)
    dtype = dtype or _default_dtype(config, device)
    files = weight_map(folder)

    model = LlamaForCausalLM(config, device="meta", dtype=dtype).to_empty(device=device)
    model.tie_weights()
    params = dict(model.named_parameters())

    wanted = {
        name: file
        for name, file in files.items()
        if not name.endswith(_IGNORED_SUFFIXES)
        and not (config.tie_word_embeddings and name == "lm_head.weight")
    }
    missing = sorted(set(params) - set(wanted))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{missing[0]}: missing from the checkpoint in {folder}{more}")
    unexpected = sorted(set(wanted) - set(params))
    if unexpected:
        name = unexpected[0]
        raise CheckpointError(
            f"{name}: unexpected tensor in {wanted[name].name} "
            f"(not a parameter of this Llama config)"
        )

    by_file: dict[Path, list[str]] = {}
    for name, file in wanted.items():
        by_file.setdefault(file, []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(
                            f"{name}: listed in {INDEX_FILE} for {file.name} but not in it"
                        )
                    shape = tuple(f.get_slice(name).get_shape())
                    expected = tuple(params[name].shape)
                    if shape != expected:
                        raise CheckpointError(
                            f"{name}: shape {shape} in {file.name}, expected {expected} "
                            f"from {CONFIG_FILE}"
                        )
                    params[name].copy_(f.get_tensor(name))
    model.requires_grad_(False)
    return model.eval()


# -- saving -------------------------------------------------------------------------


def _shard_names(names: list[str], sizes: Mapping[str, int], shards: int) -> list[list[str]]:
    """Split ``names`` (in order) into ``shards`` consecutive groups of similar bytes."""
    if not 1 <= shards <= len(names):
        raise ValueError(f"shards: must be in [1, {len(names)}], got {shards}")
    total = sum(sizes.values())
    groups: list[list[str]] = [[]]
    done = 0
    for i, name in enumerate(names):
        left_names = len(names) - i
        left_groups = shards - len(groups)
        # Close the group at its share of the bytes, or when the rest must each get one.
        if (
            groups[-1]
            and left_groups > 0
            and (done >= total * len(groups) / shards or left_names == left_groups)
        ):
            groups.append([])
        groups[-1].append(name)
        done += sizes[name]
    return groups


def write_checkpoint(
    path: str | Path,
    config: LlamaConfig,
    tensors: Mapping[str, torch.Tensor],
    *,
    shards: int = 1,
) -> Path:
    """Write ``config.json`` and ``tensors`` (HF names) as one file or ``shards`` shards."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(
        json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    if shards == 1:
        save_file(cpu, str(folder / SINGLE_FILE), metadata={"format": "pt"})
        return folder
    sizes = {name: t.numel() * t.element_size() for name, t in cpu.items()}
    groups = _shard_names(list(cpu), sizes, shards)
    index: dict[str, str] = {}
    for i, names in enumerate(groups, start=1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: cpu[n] for n in names}, str(folder / file), metadata={"format": "pt"})
        index.update(dict.fromkeys(names, file))
    document = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": index}
    (folder / INDEX_FILE).write_text(
        json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    return folder


def save_model(model: LlamaForCausalLM, path: str | Path, *, shards: int = 1) -> Path:
    """Save ``model`` as a checkpoint (a tied LM head is not stored, as HF does)."""
    dtype_name = _DTYPE_NAMES.get(model.dtype)
    if dtype_name is None:
        raise ValueError(f"model: dtype {model.dtype} cannot be saved")
    config = replace(model.config, torch_dtype=dtype_name)
    return write_checkpoint(path, config, dict(model.named_parameters()), shards=shards)


def random_weights(config: LlamaConfig, *, seed: int) -> dict[str, torch.Tensor]:
    """Random parameters for ``config`` (HF names, config dtype), a function of ``seed``.

    Scaled so that activations and logits stay O(1): linear weights ~ N(0, 1/fan_in),
    norm weights ~ 1 + N(0, 0.1²), so greedy decoding has clear winners.
    """
    meta = LlamaForCausalLM(config, device="meta")
    shapes = {n: tuple(p.shape) for n, p in meta.named_parameters()}
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * noise
        elif name == "model.embed_tokens.weight":
            # Tied: the same matrix is the LM head, so keep logits at unit scale.
            value = noise * (config.hidden_size**-0.25 if config.tie_word_embeddings else 1.0)
        else:
            value = noise / shape[1] ** 0.5
        out[name] = value.to(config.dtype)
    return out


def write_tiny_checkpoint(
    path: str | Path,
    *,
    seed: int,
    config: LlamaConfig | None = None,
    shards: int = 1,
    tokenizer: bool = True,
) -> Path:
    """Generate a random model (``tiny_config()`` by default) as a checkpoint folder.

    With ``tokenizer``, also a ``tokenizer.json`` trained on the text in this module
    (its vocabulary fits the model's). Returns the folder.
    """
    config = config or tiny_config()
    folder = write_checkpoint(path, config, random_weights(config, seed=seed), shards=shards)
    if tokenizer:
        train_tokenizer(config).save(str(folder / TOKENIZER_FILE))
    return folder


# -- tokenizer ------------------------------------------------------------------------

_CORPUS = """\
A language model answers a request in two phases. The prefill reads the whole prompt
in one pass and writes its keys and values into the cache; it decides the time to the
first token. The decode then produces one token per step and reads the cache each
time; it decides the time per output token. Disaggregated serving runs the two phases
on separate pools of workers and moves the cache from one to the other.
The scheduler splits a long prompt into chunks under a token budget, so that the
requests already decoding get their next token every step and never stall behind a
prompt. The budget is the largest batch whose iteration still meets the target time.
An autoscaler measures the arrival rate and the lengths of prompts and answers, and
asks a queueing model how many workers each pool needs so that the ninety-ninth
percentile of both latencies stays under its objective at the lowest cost.
Hello, world! How are you today? The quick brown fox jumps over the lazy dog.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096.
Once upon a time there was a small model that learned to count, to greet, and to wait
its turn in the queue. It was not clever, but it was always on time.
"""

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def train_tokenizer(config: LlamaConfig) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` whose ids fit ``config.vocab_size``.

    ``<unk>``, ``<s>``, ``</s>`` are ids 0, 1, 2; encoding prepends ``<s>``. Byte-level,
    so any text encodes. ``CheckpointError`` if the config's BOS/EOS ids differ or the
    vocabulary is too small for the 256 bytes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    floor = 256 + len(SPECIAL_TOKENS)
    if config.vocab_size < floor:
        raise CheckpointError(f"vocab_size: a byte-level tokenizer needs >= {floor}")
    if config.bos_token_id != 1 or config.eos_token_ids[:1] != (2,):
        raise CheckpointError("bos_token_id/eos_token_id: the tiny tokenizer uses 1 and 2")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tok


def load_tokenizer(path: str | Path) -> Any | None:
    """The folder's ``tokenizer.json`` as a ``tokenizers.Tokenizer``, or ``None`` if absent."""
    file = Path(path) / TOKENIZER_FILE
    if not file.exists():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises a bare Exception subclass
        raise CheckpointError(f"{TOKENIZER_FILE}: cannot be read in {path} ({exc})") from exc
