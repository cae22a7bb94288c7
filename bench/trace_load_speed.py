"""Trace loading speed: ``sim.trace_io.load_trace`` on the Azure conversation hour.

The target is the whole file (19,366 requests) in well under a second. The reference,
measured in the same run on the same file, is the obvious loader: ``csv.reader`` and
``datetime.fromisoformat`` row by row (``bench/sim_speed.py``'s ``load_azure``). Both
must give the same trace (checked); the ratio printed is the reference's time over
``load_trace``'s, each the best of a few runs.

    .venv/bin/python bench/trace_load_speed.py
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_speed import load_azure

from sim.trace import Trace
from sim.trace_io import load_trace

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "data/traces/AzureLLMInferenceTrace_conv.csv"
TARGET_S = 1.0
REPEATS = 5


def best_of(load: Callable[[Path], Trace]) -> tuple[float, Trace]:
    best_s, trace = float("inf"), None
    for _ in range(REPEATS):
        t = time.perf_counter()
        trace = load(TRACE)
        best_s = min(best_s, time.perf_counter() - t)
    assert trace is not None
    return best_s, trace


def main() -> None:
    fast_s, fast = best_of(load_trace)
    ref_s, ref = best_of(load_azure)
    assert len(fast) == len(ref)
    np.testing.assert_array_equal(fast.prompt_tokens, ref.prompt_tokens)
    np.testing.assert_array_equal(fast.output_tokens, ref.output_tokens)
    # datetime keeps six of the file's seven fractional digits.
    worst_s = float(np.max(np.abs(fast.arrival_s - ref.arrival_s)))
    assert worst_s < 1e-5, worst_s
    print(f"{TRACE.name}: {len(fast)} requests, best of {REPEATS}")
    print(f"load_trace:                          {fast_s * 1000:8.1f} ms")
    print(f"csv + datetime reference:            {ref_s * 1000:8.1f} ms")
    print(
        f"speed-up of load_trace over the reference: {ref_s / fast_s:.1f}x; "
        f"arrivals agree to {worst_s:.1e} s"
    )
    verdict = "met" if fast_s < TARGET_S else "NOT met"
    print(f"target < {TARGET_S:.0f} s for the whole file: {verdict} ({fast_s:.3f} s)")


if __name__ == "__main__":
    main()
