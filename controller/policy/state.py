"""What ``decide`` carries from one tick to the next, and its JSON codec.

The state is persisted after every tick (a file beside the controller, or the
``SLOAutoscaler``'s ``status.policyState``), so a restarted controller resumes its
EMA, cooldowns, stabilisation windows, calibration, measured start-ups, the recent
rates the lead-time bound reads, the bounds the stabilisation window judges and the
pooled length mix instead of starting over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from queueing.lengths import LengthSamples
from queueing.pools import PerPool


@dataclass(frozen=True, kw_only=True)
class BoundSample:
    """One tick's upper quantile of the rate over a pool's lead time, kept to be
    judged against the rate the ``ticks`` after it realise."""

    time_s: float
    upper_rps: float
    ticks: int


@dataclass(frozen=True, kw_only=True)
class PoolState:
    """What one pool remembers between ticks."""

    last_change_s: float | None = None
    below_since_s: float | None = None  # recommendations below current since then
    below_max: int | None = None  # the highest of those recommendations
    # While a scale-up beyond the steady plan drains a queue, or serves a burst: the
    # size without it (the pool's size before the surge or the steady plan of the
    # windows since, the larger).
    surge_base: int | None = None
    calibration: float = 1.0  # observed / predicted P99, smoothed and bounded
    predicted_p99_s: float | None = None  # at the replicas and load of the last tick
    predicted_for_replicas: int | None = None
    transient_s: float | None = None  # the last tick that saw the pool in a transient
    scale_up_since_s: float | None = None  # a scale-up not yet all ready: decided then
    scale_up_to: int | None = None  # ... to this many workers
    scale_up_from: int | None = None  # ... from this many (the workers it did not start)
    startup_s: float | None = None  # measured decision-to-ready start-up, seconds
    startup_samples: int = 0  # scale-ups measured
    # The lead-time bounds this pool planned for, built from a full history, whose
    # record decides how long a lower recommendation must hold (oldest first).
    bounds: tuple[BoundSample, ...] = ()


@dataclass(frozen=True, kw_only=True)
class RateSample:
    """One tick's measured arrival rate, the estimate after it, and the window's SCV."""

    time_s: float
    rate_rps: float
    estimate_rps: float
    scv: float | None


@dataclass(frozen=True, kw_only=True, eq=False)
class LengthWindow:
    """One measurement window's share of the pooled length mix."""

    time_s: float
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray


def _pool_to_dict(pstate: PoolState) -> dict[str, Any]:
    data = vars(pstate).copy()
    data["bounds"] = [vars(b).copy() for b in pstate.bounds]
    return data


def _pool_from_dict(data: dict[str, Any]) -> PoolState:
    fields = dict(data)
    fields["bounds"] = tuple(
        BoundSample(
            time_s=float(b["time_s"]), upper_rps=float(b["upper_rps"]), ticks=int(b["ticks"])
        )
        for b in fields.get("bounds", ())
    )
    return PoolState(**fields)


def _fresh_pools() -> PerPool[PoolState]:
    return PerPool.both(PoolState())


@dataclass(frozen=True, kw_only=True)
class ControllerState:
    """Everything ``decide`` carries from one tick to the next (persisted as JSON)."""

    smoothed_rate_rps: float | None = None
    last_tick_s: float | None = None
    pools: PerPool[PoolState] = field(default_factory=_fresh_pools)
    lengths: LengthSamples | None = None
    rates: tuple[RateSample, ...] = ()
    length_windows: tuple[LengthWindow, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "smoothed_rate_rps": self.smoothed_rate_rps,
            "last_tick_s": self.last_tick_s,
            **{pool.value: _pool_to_dict(pstate) for pool, pstate in self.pools.items()},
            "lengths": None
            if self.lengths is None
            else {
                "prompt_tokens": self.lengths.prompt_tokens.tolist(),
                "output_tokens": self.lengths.output_tokens.tolist(),
                "source": self.lengths.source,
            },
            "rates": [vars(r).copy() for r in self.rates],
            "length_windows": [
                {
                    "time_s": w.time_s,
                    "prompt_tokens": w.prompt_tokens.tolist(),
                    "output_tokens": w.output_tokens.tolist(),
                }
                for w in self.length_windows
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ControllerState:
        lengths = data.get("lengths")
        return cls(
            smoothed_rate_rps=data.get("smoothed_rate_rps"),
            last_tick_s=data.get("last_tick_s"),
            pools=PerPool.build(lambda pool: _pool_from_dict(data.get(pool.value, {}))),
            lengths=None
            if lengths is None
            else LengthSamples(
                prompt_tokens=np.asarray(lengths["prompt_tokens"], dtype=np.int64),
                output_tokens=np.asarray(lengths["output_tokens"], dtype=np.int64),
                source=str(lengths["source"]),
            ),
            rates=tuple(RateSample(**r) for r in data.get("rates", ())),
            length_windows=tuple(
                LengthWindow(
                    time_s=float(w["time_s"]),
                    prompt_tokens=np.asarray(w["prompt_tokens"], dtype=np.int64),
                    output_tokens=np.asarray(w["output_tokens"], dtype=np.int64),
                )
                for w in data.get("length_windows", ())
            ),
        )
