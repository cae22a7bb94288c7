"""Measure this machine's iteration-time profile (DESIGN §3.1) with the real engine.

The engine's ``ModelRunner`` runs one forward pass over synthetic batches on a grid
of shapes — a prefill chunk of ``P`` tokens after ``p`` cached ones, beside ``B``
decodes of context ``C`` — and each shape is timed ``repeats`` times (after warm-up
passes, in a shuffled order each round so that drifts of the machine do not line up
with the grid, the garbage collector paused, CUDA synchronised) and reduced to its
median. The four coefficients of

    T = t0_s + t_tok_s * n_tokens + t_kv_s * n_kv_read + t_attn_s * n_attn_pairs

are then fitted by non-negative least squares on the relative error (each row
divided by its measured time, so that a 2 ms iteration counts as much as a 50 ms
one), and the fit is reported as R² (on the times themselves) and the largest
relative error over the grid.

Block tables come from a ``PagedKVCache``, like in the engine; the KV contents are
whatever the cache holds (timing does not depend on the values).
"""

from __future__ import annotations

import gc
import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import nnls

from queueing.profile import IterationProfile, attention_pairs
from workers.checkpoint import load_model
from workers.engine import ModelRunner
from workers.kv_cache import PagedKVCache
from workers.model import LlamaForCausalLM
from workers.paged_attention import SeqSlice


class ProfileFitError(ValueError):
    """The measurements cannot give a usable profile; the message says why."""


@dataclass(frozen=True, kw_only=True)
class BatchShape:
    """One iteration's batch: a chunk of ``prefill_tokens`` after ``prefix_tokens``, and
    ``decode_batch`` decodes each attending ``decode_context`` tokens (itself included)."""

    prefill_tokens: int
    prefix_tokens: int
    decode_batch: int
    decode_context: int

    def __post_init__(self) -> None:
        for name in ("prefill_tokens", "prefix_tokens", "decode_batch"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.prefill_tokens + self.decode_batch < 1:
            raise ValueError("prefill_tokens: a batch needs a prefill chunk or a decode")
        if self.decode_batch and self.decode_context < 2:
            raise ValueError(f"decode_context: must be >= 2, got {self.decode_context}")

    @property
    def n_tokens(self) -> int:
        return self.prefill_tokens + self.decode_batch

    @property
    def n_kv_read(self) -> int:
        return self.decode_batch * self.decode_context

    @property
    def n_attn_pairs(self) -> int:
        return attention_pairs(self.prefill_tokens, self.prefix_tokens)

    @property
    def kv_tokens(self) -> int:
        """KV slots the shape occupies."""
        prefill = self.prefix_tokens + self.prefill_tokens if self.prefill_tokens else 0
        return prefill + self.n_kv_read

    def features(self) -> tuple[float, float, float, float]:
        return (1.0, float(self.n_tokens), float(self.n_kv_read), float(self.n_attn_pairs))


@dataclass(frozen=True, kw_only=True)
class ProfileGrid:
    """The shapes measured: every prefill size with every prefix (``0`` and each
    context), crossed with every decode batch at every context; the empty batch is left out.
    """

    prefill_tokens: tuple[int, ...] = (0, 64, 256, 512)
    decode_batch: tuple[int, ...] = (0, 4, 16, 64)
    context_tokens: tuple[int, ...] = (256, 1024)

    def __post_init__(self) -> None:
        for name in ("prefill_tokens", "decode_batch", "context_tokens"):
            values = getattr(self, name)
            if not values or any(v < 0 for v in values):
                raise ValueError(f"{name}: must be a non-empty list of integers >= 0")
        if any(c < 2 for c in self.context_tokens):
            raise ValueError("context_tokens: every context must be >= 2")

    def shapes(self) -> list[BatchShape]:
        prefixes = sorted({0, *self.context_tokens})
        contexts = sorted(set(self.context_tokens))
        out: list[BatchShape] = []
        for p_tokens, b in itertools.product(sorted(set(self.prefill_tokens)), self.decode_batch):
            if p_tokens == 0 and b == 0:
                continue
            for prefix in prefixes if p_tokens else [0]:
                for ctx in contexts if b else [0]:
                    out.append(
                        BatchShape(
                            prefill_tokens=p_tokens,
                            prefix_tokens=prefix,
                            decode_batch=b,
                            decode_context=ctx,
                        )
                    )
        if len(out) < 4:
            raise ValueError("grid: fewer than 4 shapes cannot determine 4 coefficients")
        return sorted(set(out), key=lambda s: (s.prefill_tokens, s.prefix_tokens, s.decode_batch))

    def max_kv_tokens(self) -> int:
        return max(s.kv_tokens for s in self.shapes())


@dataclass(frozen=True, kw_only=True)
class Measurement:
    shape: BatchShape
    median_s: float
    samples_s: tuple[float, ...]


@dataclass(frozen=True, kw_only=True)
class ProfileFit:
    """Fitted coefficients (seconds) and how well they describe the measurements."""

    t0_s: float
    t_tok_s: float
    t_kv_s: float
    t_attn_s: float
    r2: float
    max_rel_error: float
    worst_shape: BatchShape
    num_shapes: int

    def predict_s(self, shape: BatchShape) -> float:
        return (
            self.t0_s
            + self.t_tok_s * shape.n_tokens
            + self.t_kv_s * shape.n_kv_read
            + self.t_attn_s * shape.n_attn_pairs
        )


def fit_profile(measurements: Iterable[Measurement]) -> ProfileFit:
    """Non-negative least squares on the relative error; ``ProfileFitError`` if degenerate."""
    rows = list(measurements)
    if len(rows) < 4:
        raise ProfileFitError(f"measurements: {len(rows)} shapes cannot fit 4 coefficients")
    x = np.array([m.shape.features() for m in rows], dtype=np.float64)
    y = np.array([m.median_s for m in rows], dtype=np.float64)
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise ProfileFitError("measurements: every time must be finite and > 0")
    weighted = x / y[:, None]
    # Columns span ~1 to ~1e6: scale them to unit norm so NNLS is well conditioned.
    norms = np.linalg.norm(weighted, axis=0)
    norms[norms == 0] = 1.0
    coef_scaled, _ = nnls(weighted / norms, np.ones_like(y))
    coef = coef_scaled / norms
    if coef[0] + coef[1] <= 0:
        raise ProfileFitError("fit: t0_s and t_tok_s are both 0; the grid cannot separate them")
    predicted = x @ coef
    residual = float(np.sum((y - predicted) ** 2))
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - residual / total if total > 0 else (1.0 if residual == 0 else 0.0)
    rel = np.abs(predicted - y) / y
    worst = int(np.argmax(rel))
    return ProfileFit(
        t0_s=float(coef[0]),
        t_tok_s=float(coef[1]),
        t_kv_s=float(coef[2]),
        t_attn_s=float(coef[3]),
        r2=r2,
        max_rel_error=float(rel[worst]),
        worst_shape=rows[worst].shape,
        num_shapes=len(rows),
    )


def _slices(shape: BatchShape, cache: PagedKVCache, *, vocab: int) -> list[SeqSlice]:
    """Allocate the shape's sequences in ``cache`` and describe one step over them."""
    slices: list[SeqSlice] = []
    token = 3 % vocab
    for i in range(shape.decode_batch):
        table = cache.allocate(i, shape.decode_context)
        assert table is not None, "the caller sized the cache for the grid"
        slices.append(
            SeqSlice(
                token_ids=[token],
                start_pos=shape.decode_context - 1,
                block_table=table,
                sample=True,
            )
        )
    if shape.prefill_tokens:
        total = shape.prefix_tokens + shape.prefill_tokens
        table = cache.allocate(shape.decode_batch, total)
        assert table is not None, "the caller sized the cache for the grid"
        slices.append(
            SeqSlice(
                token_ids=[token] * shape.prefill_tokens,
                start_pos=shape.prefix_tokens,
                block_table=table,
                sample=True,
            )
        )
    return slices


def measure(
    runner: ModelRunner,
    shapes: list[BatchShape],
    *,
    repeats: int = 11,
    warmup: int = 1,
    rng: np.random.Generator,
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[int, int], None] | None = None,
) -> list[Measurement]:
    """Time one forward of each shape ``repeats`` times (rounds in shuffled order)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats: must be >= 1 (warmup >= 0), got {repeats} ({warmup})")
    kv = runner.kv
    cache = PagedKVCache(num_blocks=kv.num_blocks, block_size_tokens=kv.block_size)
    vocab = runner.model.config.vocab_size
    samples: dict[int, list[float]] = {i: [] for i in range(len(shapes))}
    rounds = warmup + repeats
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            for i in rng.permutation(len(shapes)):
                slices = _slices(shapes[i], cache, vocab=vocab)
                runner.synchronize()
                start = clock()
                runner.execute(slices)
                runner.synchronize()
                elapsed = clock() - start
                for seq_id in range(shapes[i].decode_batch + 1):
                    if seq_id in cache:
                        cache.free(seq_id)
                if r >= warmup:
                    samples[int(i)].append(elapsed)
            if progress is not None:
                progress(r + 1, rounds)
    finally:
        if was_enabled:
            gc.enable()
    return [
        Measurement(shape=s, median_s=statistics.median(samples[i]), samples_s=tuple(samples[i]))
        for i, s in enumerate(shapes)
    ]


def remeasure_outliers(
    runner: ModelRunner,
    measurements: list[Measurement],
    fit: ProfileFit,
    *,
    repeats: int,
    rng: np.random.Generator,
    clock: Callable[[], float] = time.perf_counter,
    max_fraction: float = 0.25,
) -> tuple[list[Measurement], int]:
    """Give the shapes the fit misses most ``repeats`` more samples each.

    On a shared machine another process's burst can land on most of one shape's
    samples and move even its median. A shape is re-measured when its relative
    residual exceeds twice the median one (and 5 %), at most ``max_fraction`` of the
    shapes, worst first; its new median is over all its samples, old and new, so a
    shape the linear form truly misses stays missed. Returns the measurements and
    how many shapes were re-measured.
    """
    rel = [abs(fit.predict_s(m.shape) - m.median_s) / m.median_s for m in measurements]
    threshold = max(2 * statistics.median(rel), 0.05)
    ranked = sorted(range(len(rel)), key=lambda i: rel[i], reverse=True)
    chosen = [i for i in ranked if rel[i] > threshold][: int(max_fraction * len(rel))]
    if not chosen:
        return measurements, 0
    extra = measure(
        runner,
        [measurements[i].shape for i in chosen],
        repeats=repeats,
        warmup=0,
        rng=rng,
        clock=clock,
    )
    out = list(measurements)
    for i, more in zip(chosen, extra, strict=True):
        samples = out[i].samples_s + more.samples_s
        out[i] = Measurement(
            shape=out[i].shape, median_s=statistics.median(samples), samples_s=samples
        )
    return out, len(chosen)


@dataclass(frozen=True, kw_only=True)
class ProfileRun:
    profile: IterationProfile
    fit: ProfileFit
    measurements: tuple[Measurement, ...]
    remeasured_shapes: int


def hardware_name(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu {model or 'unknown'} ({torch.get_num_threads()} threads)"


def default_kv_cache_tokens(
    model: LlamaForCausalLM, device: torch.device, *, block_size: int, cpu_bytes: int = 1 << 29
) -> int:
    """KV slots a worker would get: 90 % of free GPU memory on CUDA, 512 MiB on CPU."""
    per_token = model.config.kv_bytes_per_token(model.dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * 0.9)
    else:
        budget = cpu_bytes
    return max(budget // per_token // block_size, 1) * block_size


def profile_model(
    model_dir: str | Path,
    *,
    model_name: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    grid: ProfileGrid | None = None,
    repeats: int = 11,
    warmup: int = 1,
    block_size: int = 16,
    kv_cache_tokens: int | None = None,
    seed: int = 0,
    refine_rounds: int = 2,
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[int, int], None] | None = None,
) -> ProfileRun:
    """Load the model, measure the grid, fit, and build the ``IterationProfile``.

    ``startup_s`` is the measured time to load the checkpoint onto the device and
    allocate the KV cache. Up to ``refine_rounds`` times, the shapes the fit misses
    most are measured again (``remeasure_outliers``) and the fit redone. Raises
    ``ValueError`` naming ``kv_cache_tokens`` when the cache cannot hold the grid's
    largest batch.
    """
    device = torch.device(device)
    grid = grid or ProfileGrid()
    shapes = grid.shapes()
    start = clock()
    model = load_model(model_dir, device=device, dtype=dtype)
    if kv_cache_tokens is None:
        kv_cache_tokens = default_kv_cache_tokens(model, device, block_size=block_size)
    need = grid.max_kv_tokens() + block_size * (max(grid.decode_batch) + 1)
    if kv_cache_tokens < need:
        raise ValueError(
            f"kv_cache_tokens: {kv_cache_tokens} cannot hold the grid's largest batch "
            f"(about {need} tokens); give a larger cache or a smaller grid"
        )
    runner = ModelRunner(model, num_blocks=kv_cache_tokens // block_size, block_size=block_size)
    runner.synchronize()
    startup_s = clock() - start

    rng = np.random.default_rng(seed)
    measurements = measure(
        runner,
        shapes,
        repeats=repeats,
        warmup=warmup,
        rng=rng,
        clock=clock,
        progress=progress,
    )
    fit = fit_profile(measurements)
    remeasured: set[BatchShape] = set()
    for _ in range(refine_rounds):
        measurements, count = remeasure_outliers(
            runner, measurements, fit, repeats=repeats, rng=rng, clock=clock
        )
        if count == 0:
            break
        fit = fit_profile(measurements)
        remeasured.update(m.shape for m in measurements if len(m.samples_s) > repeats)
    hardware = hardware_name(device)
    dtype_name = str(model.dtype).removeprefix("torch.")
    source = (
        f"sara profile: measured on {hardware}, {dtype_name}; {len(shapes)} batch shapes x "
        f"{repeats} repeats (median; {len(remeasured)} noisy shapes re-measured) of one engine "
        f"forward; NNLS fit on relative error: "
        f"R^2 = {fit.r2:.4f}, max relative error {fit.max_rel_error:.1%}; "
        f"startup_s = checkpoint load + KV allocation"
    )
    profile = IterationProfile(
        name=f"{model_name}@{device.type}",
        model=model_name,
        hardware=hardware,
        tensor_parallel=1,
        t0_s=fit.t0_s,
        t_tok_s=fit.t_tok_s,
        t_kv_s=fit.t_kv_s,
        t_attn_s=fit.t_attn_s,
        kv_capacity_tokens=runner.kv.num_blocks * block_size,
        kv_bytes_per_token=model.config.kv_bytes_per_token(model.dtype),
        startup_s=max(startup_s, 0.0),
        source=source,
        # The model's context (config.json's max_position_embeddings), which the
        # router, the simulator and the capacity model enforce alike.
        max_context_tokens=model.config.max_position_embeddings,
    )
    return ProfileRun(
        profile=profile,
        fit=fit,
        measurements=tuple(measurements),
        remeasured_shapes=len(remeasured),
    )


def format_report(run: ProfileRun) -> str:
    """Human-readable summary: coefficients, R², the largest relative error."""
    fit, p = run.fit, run.profile
    w = fit.worst_shape
    lines = [
        f"profile {p.name}: {fit.num_shapes} batch shapes on {p.hardware} "
        f"({run.remeasured_shapes} re-measured as outliers)",
        f"  t0      = {fit.t0_s * 1e3:10.4f} ms",
        f"  t_tok   = {fit.t_tok_s * 1e6:10.4f} us / token",
        f"  t_kv    = {fit.t_kv_s * 1e9:10.4f} ns / KV entry read",
        f"  t_attn  = {fit.t_attn_s * 1e9:10.4f} ns / attention pair",
        f"  R^2 = {fit.r2:.4f}; largest relative error {fit.max_rel_error:.1%} at prefill "
        f"{w.prefill_tokens} after {w.prefix_tokens}, {w.decode_batch} decodes x "
        f"{w.decode_context} context",
        f"  KV capacity {p.kv_capacity_tokens:,} tokens x {p.kv_bytes_per_token:,} bytes; "
        f"startup {p.startup_s:.3f} s",
    ]
    if not math.isfinite(fit.r2):
        lines.append("  (R^2 undefined: all times equal)")
    return "\n".join(lines)
