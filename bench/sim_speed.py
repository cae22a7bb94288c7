"""Simulator speed: simulated seconds per wall-clock second on the Azure conversation hour.

The whole hour (19,366 requests) runs on a 4 + 4 worker cluster; the target is
>= 300x real time (the hour in under 12 s). The reference, measured in the same run
on the first minutes of the same trace, is the obvious decode model: one
``Scheduler.schedule``/``complete_step`` per decode iteration per worker, fed the
same KV-ready times. It must give the same token times (checked) and is what the
closed-form fast-forward of the decode workers replaces; the ratio printed is the
fast simulator (prefill and decode) against that stepped decode pool alone.

    .venv/bin/python bench/sim_speed.py
"""

from __future__ import annotations

import csv
import math
import sys
import time
from collections import deque
from datetime import datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from queueing.profile import IterationProfile
from sim.cluster import Cluster, ClusterConfig
from sim.results import SimResults
from sim.trace import Trace
from workers.kv_cache import PagedKVCache
from workers.scheduler import Scheduler, Sequence, StepPlan

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "data/traces/AzureLLMInferenceTrace_conv.csv"
TARGET_X = 300.0
SLICE_S = 300.0

PROFILE = IterationProfile(
    name="bench-8b",
    model="llama-3-8b-like",
    hardware="h100-like",
    tensor_parallel=1,
    t0_s=0.012,
    t_tok_s=2.5e-5,
    t_kv_s=2e-8,
    t_attn_s=1e-9,
    kv_capacity_tokens=400_000,
    kv_bytes_per_token=131_072,
    startup_s=60.0,
    source="bench/sim_speed.py: round numbers of the right size",
)
CONFIG = ClusterConfig(
    prefill_workers=4,
    decode_workers=4,
    profile=PROFILE,
    token_budget=512,
    kv_link_bytes_per_s=25e9,
    kv_link_latency_s=0.001,
)


def load_azure(path: Path) -> Trace:
    """TIMESTAMP,ContextTokens,GeneratedTokens -> a trace starting at 0, sorted."""
    stamps: list[float] = []
    prompt: list[int] = []
    output: list[int] = []
    with path.open(newline="") as f:
        reader = csv.reader(f)
        next(reader)
        for row in reader:
            # Seven fractional digits; datetime takes six.
            stamps.append(datetime.fromisoformat(row[0][:26]).timestamp())
            prompt.append(int(row[1]))
            output.append(int(row[2]))
    t = np.asarray(stamps)
    order = np.argsort(t, kind="stable")
    return Trace(
        arrival_s=t[order] - t[order[0]],
        prompt_tokens=np.asarray(prompt, dtype=np.int64)[order],
        output_tokens=np.asarray(output, dtype=np.int64)[order],
        source=path.name,
    )


def stepped_decode_finish_s(res: SimResults) -> np.ndarray:
    """Finish times from stepping one Scheduler per decode worker, iteration by iteration."""
    workers = CONFIG.decode_workers
    ready = sorted(
        (r for r in range(len(res)) if res.output_tokens[r] > 1),
        key=lambda r: (res.kv_ready_s[r], r),
    )
    schedulers = [
        Scheduler(
            token_budget=CONFIG.token_budget,
            kv_cache=PagedKVCache(
                num_blocks=CONFIG.kv_blocks_per_worker, block_size_tokens=CONFIG.block_size_tokens
            ),
        )
        for _ in range(workers)
    ]
    plans: list[StepPlan | None] = [None] * workers
    ends_s = [math.inf] * workers
    queue: deque[Sequence] = deque()
    finish_s = res.first_token_s.copy()

    def start(w: int, now_s: float) -> None:
        plan = schedulers[w].schedule(queue)
        if plan.is_empty:
            plans[w], ends_s[w] = None, math.inf
        else:
            plans[w] = plan
            ends_s[w] = now_s + PROFILE.iteration_s(
                n_tokens=plan.num_batched_tokens, n_kv_read=plan.num_kv_read_tokens
            )

    i = 0
    while i < len(ready) or any(p is not None for p in plans):
        ready_s = float(res.kv_ready_s[ready[i]]) if i < len(ready) else math.inf
        w = min(range(workers), key=lambda k: (ends_s[k], k))
        if ready_s <= ends_s[w]:
            r = ready[i]
            i += 1
            p = int(res.prompt_tokens[r])
            queue.append(
                Sequence(
                    seq_id=r,
                    num_prompt_tokens=p,
                    max_new_tokens=int(res.output_tokens[r]),
                    num_computed_tokens=p,
                    num_generated_tokens=1,
                )
            )
            for k in range(workers):
                if plans[k] is None and queue:
                    start(k, ready_s)
            continue
        plan = plans[w]
        assert plan is not None
        for seq in schedulers[w].complete_step(plan):
            finish_s[seq.seq_id] = ends_s[w]
        start(w, ends_s[w])
    return finish_s


def main() -> None:
    t = time.perf_counter()
    trace = load_azure(TRACE)
    parse_s = time.perf_counter() - t
    span_s = trace.duration_s
    print(
        f"{TRACE.name}: {len(trace)} requests over {span_s:.0f} s "
        f"({trace.mean_rate_rps:.2f} req/s, mean prompt {trace.prompt_tokens.mean():.0f}, "
        f"mean output {trace.output_tokens.mean():.0f} tokens)"
    )
    print(
        f"cluster: {CONFIG.prefill_workers} prefill + {CONFIG.decode_workers} decode workers, "
        f"budget {CONFIG.token_budget}, profile t0 {PROFILE.t0_s} s, t_tok {PROFILE.t_tok_s} s"
    )
    print(f"parse + sort the CSV (context):           {parse_s:8.2f} s wall")

    t = time.perf_counter()
    res = Cluster(CONFIG, trace).run()
    wall_s = time.perf_counter() - t
    hour_x = res.end_s / wall_s
    s = res.summary(ttft_slo_s=1.0, tpot_slo_s=0.05)
    print(
        f"whole trace, fast simulator:              {wall_s:8.2f} s wall for {res.end_s:.0f} s "
        f"simulated = {hour_x:7.0f}x real time"
    )
    print(
        f"  {res.decode_iterations} decode iterations (mean batch {s.decode_mean_batch:.1f}), "
        f"P99 TTFT {s.ttft_p99_s:.3f} s, P99 TPOT {s.tpot_p99_s:.4f} s, lost {s.lost_requests}"
    )

    # Reference on a slice: the same requests, decode stepped one iteration at a time.
    n_slice = int(np.searchsorted(trace.arrival_s, SLICE_S))
    piece = Trace(
        arrival_s=trace.arrival_s[:n_slice],
        prompt_tokens=trace.prompt_tokens[:n_slice],
        output_tokens=trace.output_tokens[:n_slice],
        source=f"first {SLICE_S:.0f} s of {TRACE.name}",
    )
    t = time.perf_counter()
    fast = Cluster(CONFIG, piece).run()
    fast_s = time.perf_counter() - t
    t = time.perf_counter()
    stepped_finish_s = stepped_decode_finish_s(fast)
    stepped_s = time.perf_counter() - t
    worst_diff_s = float(np.max(np.abs(stepped_finish_s - fast.finish_s)))
    print(
        f"first {SLICE_S:.0f} s ({n_slice} requests), fast simulator:  {fast_s:8.2f} s wall "
        f"= {fast.end_s / fast_s:7.0f}x real time"
    )
    print(
        f"first {SLICE_S:.0f} s, decode stepped per iteration:  {stepped_s:8.2f} s wall "
        f"= {fast.end_s / stepped_s:7.0f}x real time (reference)"
    )
    print(
        f"speed-up of the fast simulator over the stepped decode alone: "
        f"{stepped_s / fast_s:.1f}x; finish times agree to {worst_diff_s:.1e} s"
    )
    verdict = "met" if hour_x >= TARGET_X else "NOT met"
    print(f"target >= {TARGET_X:.0f}x real time on the whole hour: {verdict} ({hour_x:.0f}x)")


if __name__ == "__main__":
    main()
