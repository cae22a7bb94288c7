"""Request lengths for the simulator: the capacity model's ``LengthSamples``.

There is one length type in the project, defined with the models in
``queueing.lengths``; this module adds the conversion from a trace.
"""

from __future__ import annotations

from queueing.lengths import LengthSamples
from sim.trace import Trace

__all__ = ["LengthSamples", "lengths_of"]


def lengths_of(trace: Trace) -> LengthSamples:
    """The lengths of a trace's requests, without their arrival times."""
    return LengthSamples(
        prompt_tokens=trace.prompt_tokens.copy(),
        output_tokens=trace.output_tokens.copy(),
        source=trace.source,
    )
