"""An empirical joint distribution of (prompt, output) request lengths.

Pure data, like ``sim.trace``. ``sim.trace_io.load_lengths`` reads one from a file;
``sim.workload.synthesize`` samples rows of it to give generated arrivals lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.trace import IntArray, Trace, TraceError


@dataclass(frozen=True, kw_only=True, eq=False)
class LengthSamples:
    """Observed requests' lengths, one row per request, in tokens.

    Row ``i`` of ``prompt_tokens`` and row ``i`` of ``output_tokens`` belong to the
    same request: keep them together, because prompt and output lengths are
    correlated in real workloads (summarisation: long in, short out). At least one
    row; every length >= 1. ``source`` says where the rows came from.
    """

    prompt_tokens: IntArray
    output_tokens: IntArray
    source: str

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "output_tokens"):
            values = getattr(self, name)
            if not isinstance(values, np.ndarray) or values.ndim != 1:
                raise TraceError(f"{name}: expected a 1-D numpy array")
            if not np.issubdtype(values.dtype, np.integer):
                raise TraceError(f"{name}: expected integers, got dtype {values.dtype}")
            if len(values) == 0:
                raise TraceError(f"{name}: no samples")
            if values.min() < 1:
                raise TraceError(f"{name}: every length must be >= 1, found {values.min()}")
        if len(self.prompt_tokens) != len(self.output_tokens):
            raise TraceError(
                f"output_tokens: length {len(self.output_tokens)} != "
                f"prompt_tokens length {len(self.prompt_tokens)}"
            )

    def __len__(self) -> int:
        return len(self.prompt_tokens)

    @classmethod
    def from_trace(cls, trace: Trace) -> LengthSamples:
        """The lengths of a trace's requests, without their arrival times."""
        return cls(
            prompt_tokens=trace.prompt_tokens.copy(),
            output_tokens=trace.output_tokens.copy(),
            source=trace.source,
        )
