"""Roofline iteration-time profiles: a model's shape on a GPU's datasheet (DESIGN §3.1).

Each coefficient of ``T = t0 + t_tok*n_tokens + t_kv*n_kv_read + t_attn*n_attn_pairs``
is one resource's cost, divided by the share of the datasheet peak a real engine
achieves (``Efficiency``):

- ``t0_s``: every iteration streams the weights from device memory once, each of the
  ``tensor_parallel`` ranks its 1/TP shard at the same time:
  ``weight_read_bytes / TP / (hbm * hbm_fraction)``, plus the fixed cost of a
  layer's kernels (``layer_overhead_s`` each layer: the start and drain of its four
  projection GEMMs and its element-wise kernels, paid whatever the batch). With
  TP > 1 each layer adds two all-reduces (after the attention output projection and
  after the MLP down projection), each costing the platform's small-message latency
  (``GpuSpec.allreduce_latency_s``) plus its launch (``allreduce_launch_s``).
- ``t_tok_s``: the matrix multiplies of one token, split over the ranks:
  ``flops_per_token / TP / (peak * compute_fraction)``; with TP > 1, plus the
  token's all-reduce traffic over the interconnect: a ring all-reduce of a
  ``hidden_size * dtype_bytes`` message sends ``2 (TP-1)/TP`` times the message from
  every rank, twice per layer.
- ``t_kv_s``: decode attention reads each cached token's K and V once per iteration:
  ``kv_bytes_per_token / TP / (hbm * hbm_fraction)``. Its arithmetic (one to a few
  FLOPs per byte) is far below any GPU's ridge point, so bandwidth is the cost.
- ``t_attn_s``: the score and value FLOPs of one causal (query, key) pair of a
  prefill chunk: ``attention_flops_per_pair / TP / (peak * attention_fraction)``.

Memory: the engine may use ``gpu_memory_fraction`` of each GPU; the weights and a
per-GPU activation/workspace reserve come off the top and the rest is KV cache:
``kv_capacity_tokens = (memory * fraction * TP - weights - reserve * TP) //
kv_bytes_per_token``. ``startup_s`` is the container start plus loading all the
weights at ``weight_load_bytes_per_s``.

Why linear although the roofline is not. A forward pass really costs about
``max(weight read, compute)``: the weights stream while the tensor cores work. The
linear model adds them instead, so it is exact far from the knee (decode at small
batch: the weight read dominates; a long prefill chunk: compute dominates) and
over-estimates near the knee ``n* = t0 / t_tok`` tokens, by up to 2x exactly there.
That error is on the safe side for an autoscaler (it asks for more workers, never
fewer). The linear form is kept because the rest of SARA depends on it: the prefill
and decode queueing models and the token budget solve it in closed form, and
``sara profile`` fits the same four coefficients by least squares to measured
iterations, so a roofline profile and a measured one are interchangeable.
Other simplifications, also on the safe side: Mistral's 4096-token sliding window is
ignored (decode is charged for the whole context), the LM head is charged to
every token, and a mixture of experts is charged the read of all its experts every
iteration (``ModelShape.weight_read_bytes``) and the FLOPs of its active ones per
token (``ModelShape.flops_per_token``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from queueing.hardware import GpuSpec, ModelShape
from queueing.profile import IterationProfile, ProfileError

_GB = 1e9


def _is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Achievable shares of the datasheet peaks, and the worker's fixed costs.

    Defaults and why:

    - ``compute_fraction`` 0.6 of dense tensor FLOP/s for the model's matrix
      multiplies. Large BF16 GEMMs reach 70-90 % of peak in cuBLAS, but a whole
      forward pass also runs norms, rotary embedding, activations and kernel launches
      that do no tensor-core work; end-to-end prefill utilisation reported for vLLM /
      Sarathi-Serve-class engines is about 50-65 %.
    - ``hbm_fraction`` 0.8 of peak memory bandwidth for streaming weights and KV
      entries: memory-bound GEMV / paged-attention kernels with CUDA graphs sustain
      roughly 75-90 % of peak in STREAM-like copies and decode benchmarks.
    - ``attention_fraction`` 0.5 of dense FLOP/s for prefill attention:
      FlashAttention-2 reports 50-73 % of peak forward on A100; chunked prefill over
      a paged KV cache and short chunks sit at the low end.
    - ``interconnect_fraction`` 0.7 of the per-direction link bandwidth for
      all-reduce: NCCL's measured bus bandwidth is about 70-80 % of the NVLink
      figure, and about 70 % of PCIe Gen4 x16.
    - ``gpu_memory_fraction`` 0.9: vLLM's ``gpu_memory_utilization`` default, the
      share of each GPU the engine lets itself use.
    - ``activation_reserve_bytes_per_gpu`` 2 GB: activations of the largest batch
      (a few thousand tokens through the MLP), logits of the sampled tokens, CUDA
      graphs, and the cuBLAS/NCCL workspaces, per GPU.
    - ``layer_overhead_s`` 43 µs per layer and iteration: the cost of a layer's
      kernels that does not scale with bytes or FLOPs. Vidur's A100 profiles (fit by
      ``bench/vidur_overheads.py``) give 4.6 µs per projection GEMM (18.5 µs for the
      four) on top of streaming at 0.79 of the datasheet bandwidth, and 24.8 µs
      (median) for the element-wise kernels of a layer at one token; the H100's are
      17.3 + 18.0 µs. The larger is used for every GPU. It is also why sharded
      weights seem to stream slower (60-74 % at TP 4-8): the same fixed cost over
      fewer bytes, not a lower bandwidth.
    - ``allreduce_launch_s`` 20 µs per all-reduce with TP > 1: the CPU launch of an
      NCCL collective, Vidur's ``nccl_cpu_launch_overhead_ms`` default, added to the
      GPU's measured all-reduce time as Vidur's predictor does. Under CUDA graphs an
      engine launches less, so this errs on the safe side.
    - ``container_start_s`` 30 s: scheduling a pod with a cached image, Python and
      CUDA initialisation, CUDA-graph capture.
    - ``weight_load_bytes_per_s`` 2 GB/s: safetensors from a local NVMe disk or a
      warm network volume into GPU memory, for the whole worker (TP ranks share it).
    """

    compute_fraction: float = 0.6
    hbm_fraction: float = 0.8
    attention_fraction: float = 0.5
    interconnect_fraction: float = 0.7
    gpu_memory_fraction: float = 0.9
    activation_reserve_bytes_per_gpu: int = 2_000_000_000
    layer_overhead_s: float = 43e-6
    allreduce_launch_s: float = 20e-6
    container_start_s: float = 30.0
    weight_load_bytes_per_s: float = 2e9

    def __post_init__(self) -> None:
        for name in (
            "compute_fraction",
            "hbm_fraction",
            "attention_fraction",
            "interconnect_fraction",
            "gpu_memory_fraction",
        ):
            value = getattr(self, name)
            if not _is_number(value) or not 0 < value <= 1:
                raise ProfileError(f"{name}: must be a fraction in (0, 1], got {value!r}")
        for name in ("layer_overhead_s", "allreduce_launch_s", "container_start_s"):
            value = getattr(self, name)
            if not _is_number(value) or value < 0:
                raise ProfileError(f"{name}: must be a finite number >= 0, got {value!r}")
        if not _is_number(self.weight_load_bytes_per_s) or self.weight_load_bytes_per_s <= 0:
            raise ProfileError(
                "weight_load_bytes_per_s: must be a finite number > 0, "
                f"got {self.weight_load_bytes_per_s!r}"
            )
        reserve = self.activation_reserve_bytes_per_gpu
        if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
            raise ProfileError(
                f"activation_reserve_bytes_per_gpu: must be an integer >= 0, got {reserve!r}"
            )


DEFAULT_EFFICIENCY = Efficiency()


def default_profile_name(model: ModelShape, gpu: GpuSpec, tensor_parallel: int) -> str:
    """``"<model>@<gpu>"``, or ``"<model>-tp<N>@<gpu>"`` when N > 1."""
    parallel = f"-tp{tensor_parallel}" if tensor_parallel > 1 else ""
    return f"{model.name}{parallel}@{gpu.name}"


def roofline_profile(
    model: ModelShape,
    gpu: GpuSpec,
    *,
    tensor_parallel: int = 1,
    efficiency: Efficiency = DEFAULT_EFFICIENCY,
    name: str | None = None,
) -> IterationProfile:
    """The roofline ``IterationProfile`` of ``model`` on ``tensor_parallel`` x ``gpu``.

    Raises ``ProfileError`` when ``tensor_parallel`` is not a positive integer that
    divides both head counts, or when the weights and the activation reserve leave
    no room for a KV cache (e.g. Llama-2-70B on one L40S); the message names the
    model, the GPU and the tensor-parallel degree.
    """
    tp = tensor_parallel
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ProfileError(f"tensor_parallel: must be an integer >= 1, got {tp!r}")
    if model.num_attention_heads % tp or model.num_kv_heads % tp:
        raise ProfileError(
            f"tensor_parallel: {tp} does not divide {model.name}'s "
            f"{model.num_attention_heads} attention heads and {model.num_kv_heads} KV heads"
        )
    eff = efficiency
    memory_bytes_per_s = gpu.hbm_bytes_per_s * eff.hbm_fraction
    gemm_flops = gpu.peak_dense_flops * eff.compute_fraction
    attention_flops = gpu.peak_dense_flops * eff.attention_fraction
    link_bytes_per_s = gpu.interconnect_bytes_per_s * eff.interconnect_fraction

    allreduces = 2 * model.num_layers if tp > 1 else 0
    ring_bytes_per_token = allreduces * model.hidden_size * model.dtype_bytes * 2 * (tp - 1) / tp
    allreduce_s = gpu.allreduce_latency_s + eff.allreduce_launch_s
    t0_s = (
        model.weight_read_bytes / tp / memory_bytes_per_s
        + model.num_layers * eff.layer_overhead_s
        + allreduces * allreduce_s
    )
    t_tok_s = model.flops_per_token / tp / gemm_flops + ring_bytes_per_token / link_bytes_per_s
    t_kv_s = model.kv_bytes_per_token / tp / memory_bytes_per_s
    t_attn_s = model.attention_flops_per_pair / tp / attention_flops

    usable_bytes = gpu.memory_bytes * eff.gpu_memory_fraction * tp
    reserve_bytes = eff.activation_reserve_bytes_per_gpu * tp
    kv_room_bytes = usable_bytes - model.weight_bytes - reserve_bytes
    kv_capacity_tokens = math.floor(max(kv_room_bytes, 0.0) / model.kv_bytes_per_token)
    if kv_capacity_tokens < 1:
        raise ProfileError(
            f"kv_capacity_tokens: {model.name} does not fit on {gpu.name} at "
            f"tensor_parallel={tp}: weights {model.weight_bytes / _GB:.1f} GB plus the "
            f"{reserve_bytes / _GB:.1f} GB activation reserve exceed the usable "
            f"{usable_bytes / _GB:.1f} GB ({eff.gpu_memory_fraction:.0%} of "
            f"{tp} x {gpu.memory_bytes / _GB:.0f} GB); use a higher tensor_parallel "
            "or a larger GPU"
        )
    startup_s = eff.container_start_s + model.weight_bytes / eff.weight_load_bytes_per_s

    source = (
        f"roofline of {model.name} ({model.source}) on {tp} x {gpu.name} ({gpu.source}); "
        f"efficiency: compute {eff.compute_fraction:g}, memory bandwidth "
        f"{eff.hbm_fraction:g}, attention {eff.attention_fraction:g}, interconnect "
        f"{eff.interconnect_fraction:g}, GPU memory {eff.gpu_memory_fraction:g}, "
        f"reserve {eff.activation_reserve_bytes_per_gpu / _GB:g} GB/GPU, layer overhead "
        f"{eff.layer_overhead_s * 1e6:g} µs, all-reduce {gpu.allreduce_latency_s * 1e6:g} "
        f"+ {eff.allreduce_launch_s * 1e6:g} µs launch, startup "
        f"{eff.container_start_s:g} s + weights at {eff.weight_load_bytes_per_s / _GB:g} GB/s"
    )
    return IterationProfile(
        name=name if name is not None else default_profile_name(model, gpu, tp),
        model=model.name,
        hardware=gpu.name,
        tensor_parallel=tp,
        t0_s=t0_s,
        t_tok_s=t_tok_s,
        t_kv_s=t_kv_s,
        t_attn_s=t_attn_s,
        kv_capacity_tokens=kv_capacity_tokens,
        kv_bytes_per_token=model.kv_bytes_per_token,
        startup_s=startup_s,
        source=source,
        max_context_tokens=model.max_context_tokens,
    )
