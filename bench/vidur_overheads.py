"""The roofline's fixed costs, read off Vidur's published GPU profiling data.

Vidur (microsoft/vidur, MIT) publishes per-operator CUDA timings of Llama-style
layers (``data/profiling/compute/<gpu>/<model>/mlp.csv``: the four projections and
the element-wise kernels of one layer, per token count and tensor-parallel degree)
and of NCCL all-reduce (``data/profiling/network/<platform>/all_reduce.csv``). From
them this prints, per GPU:

- the weight-streaming fit of the four projection GEMMs at one to eight tokens,
  ``time = 4 * c + bytes / B`` by least squares over models and TP degrees: B as a
  share of the datasheet bandwidth (the roofline's ``hbm_fraction``) and the fixed
  cost per GEMM c, which is why sharded (TP 4-8) GEMMs stream at only 60-74 % of the
  datasheet: the same fixed cost over fewer bytes;
- the element-wise kernels of a layer (two RMSNorms, rotary embedding, activation,
  residual add) at one token, which do no work that scales with anything the
  profile counts;
- the median small-message (<= 64 KiB) all-reduce time among 2, 4 and 8 GPUs.

Usage: ``.venv/bin/python bench/vidur_overheads.py --vidur PATH`` with PATH a
checkout of microsoft/vidur. No data of Vidur's is bundled with SARA.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections import defaultdict
from pathlib import Path

import numpy as np

_HBM_BYTES_PER_S = {"a100": 2039e9, "h100": 3350e9}  # the catalogue's datasheet figures
_GEMMS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
_ELEMENTWISE = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")


def _gemm_bytes(row: dict[str, str], tp: int) -> float:
    """FP16 bytes of one layer's projection weights on one rank (q, k, v; o; gate,
    up; down)."""
    h, e = int(row["n_embd"]), int(row["n_expanded_embd"])
    heads, kv_heads = int(row["n_head"]), int(row["n_kv_head"])
    kv_width = kv_heads * (h // heads)
    params = h * (h + 2 * kv_width) + h * h + 2 * h * e + e * h
    return 2.0 * params / tp


def compute_fit(vidur: Path, gpu: str) -> None:
    times: list[float] = []
    sizes: list[float] = []
    elementwise: list[float] = []
    for path in sorted((vidur / "data/profiling/compute" / gpu).glob("*/*/mlp.csv")):
        with path.open() as handle:
            for row in csv.DictReader(handle):
                tokens, tp = int(row["num_tokens"]), int(row["num_tensor_parallel_workers"])
                if tokens > 8:
                    continue
                times.append(sum(float(row[f"time_stats.{k}.median"]) for k in _GEMMS) * 1e-3)
                sizes.append(_gemm_bytes(row, tp))
                if tokens == 1:
                    elementwise.append(
                        sum(float(row[f"time_stats.{k}.median"]) for k in _ELEMENTWISE) * 1e-3
                    )
    if not times:
        print(f"{gpu}: no compute profiles found")
        return
    design = np.column_stack([np.full(len(sizes), 4.0), np.asarray(sizes)])
    (per_gemm_s, inverse_bandwidth), *_ = np.linalg.lstsq(design, np.asarray(times), rcond=None)
    bandwidth = 1.0 / inverse_bandwidth
    fitted = design @ np.array([per_gemm_s, inverse_bandwidth])
    worst = float(np.max(np.abs(fitted / np.asarray(times) - 1.0)))
    print(
        f"{gpu}: {len(times)} rows; GEMM weight streaming {bandwidth / 1e12:.3f} TB/s = "
        f"{bandwidth / _HBM_BYTES_PER_S[gpu]:.3f} of the datasheet, fixed "
        f"{per_gemm_s * 1e6:.1f} us per GEMM ({4 * per_gemm_s * 1e6:.1f} us a layer; "
        f"fit within {worst:.1%}); element-wise kernels at one token: median "
        f"{statistics.median(elementwise) * 1e6:.1f} us a layer "
        f"(range {min(elementwise) * 1e6:.0f}-{max(elementwise) * 1e6:.0f})"
    )


def allreduce(vidur: Path) -> None:
    for path in sorted((vidur / "data/profiling/network").glob("*/all_reduce.csv")):
        small: dict[int, list[float]] = defaultdict(list)
        with path.open() as handle:
            for row in csv.DictReader(handle):
                gpus = int(row["num_workers"])
                if gpus != int(row["devices_per_node"]) or int(row["size"]) > 65536:
                    continue
                small[gpus].append(float(row["time_stats.all_reduce.median"]) * 1e3)
        cells = ", ".join(
            f"{gpus} GPUs {statistics.median(values):.0f} us"
            for gpus, values in sorted(small.items())
        )
        print(f"all-reduce <= 64 KiB, {path.parent.name}: median {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vidur", type=Path, required=True, help="a checkout of microsoft/vidur")
    args = parser.parse_args()
    for gpu in _HBM_BYTES_PER_S:
        compute_fit(args.vidur, gpu)
    allreduce(args.vidur)


if __name__ == "__main__":
    main()
