"""The lead-time bound's coverage and cost, with and without conditioning on the gap.

``controller.policy.leadtime.rate_upper`` plans each pool for the SLO-percentile upper
quantile of the rate over its lead time. This replays rates whose truth is known —
a daily cycle (a sinusoid), a cycle with Gamma-bursty windows, a constant rate and a
3x step — counted in the controller's 30-s windows and smoothed by its EMA, and at
every tick after the first hour computes the bound over a three-tick lead time from
the last hour, once with this tick's measured rate (the gap to the estimate: the
conditioned bound) and once without it (the errors about zero). It prints, per
shape and over several seeds, how often the true mean rate over the lead time
exceeded each bound (the target is 1 - the SLO percentile, 1 % for P99) and the
ratio of their mean planning rates (conditioned / unconditioned, measured in the
same run).

    .venv/bin/python bench/leadtime_coverage.py [--seeds 6]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.config import ControllerConfig
from controller.policy.leadtime import rate_upper, risk_z
from controller.policy.state import RateSample
from queueing.solver import DEFAULT_QUANTILE

TICKS = 480
LEAD_TICKS = 3


def _cycle(t: np.ndarray) -> np.ndarray:
    return 6.0 - 4.0 * np.cos(2.0 * np.pi * t / 40.0)


def _step(t: np.ndarray) -> np.ndarray:
    return np.where(t < 300, 6.0, 18.0)


# (name, true rate per tick, window count SCV)
SHAPES: tuple[tuple[str, Callable[[np.ndarray], np.ndarray], float], ...] = (
    ("cycle, Poisson", _cycle, 1.0),
    ("cycle, SCV 4", _cycle, 4.0),
    ("constant 6 req/s", lambda t: np.full(len(t), 6.0), 1.0),
    ("3x step at tick 300", _step, 1.0),
)


def _windows(true: np.ndarray, scv: float, window_s: float, rng: np.random.Generator) -> np.ndarray:
    """Counts of a renewal-like process of count SCV ``scv`` (Gamma-mixed Poisson)."""
    mean = true * window_s
    if scv == 1.0:
        return rng.poisson(mean) / window_s
    # A negative-binomial count with variance scv x mean: Poisson of a Gamma mean.
    shape = mean / (scv - 1.0)
    return rng.poisson(rng.gamma(shape, (scv - 1.0))) / window_s


def run(shape: Callable[[np.ndarray], np.ndarray], scv: float, seed: int) -> tuple[float, ...]:
    config = ControllerConfig()
    rng = np.random.default_rng(seed)
    true = shape(np.arange(TICKS, dtype=np.float64))
    measured = _windows(true, scv, config.window_s, rng)
    estimates = np.empty(TICKS)
    estimates[0] = measured[0]
    w = config.ema_weight
    for i in range(1, TICKS):
        estimates[i] = (1.0 - w) * estimates[i - 1] + w * measured[i]
    rates = tuple(
        RateSample(time_s=config.interval_s * i, rate_rps=float(m), estimate_rps=float(e), scv=scv)
        for i, (m, e) in enumerate(zip(measured, estimates, strict=True))
    )
    z = risk_z(DEFAULT_QUANTILE)
    lead_s = LEAD_TICKS * config.interval_s
    over_cond = over_plain = sum_cond = sum_plain = 0.0
    ticks = 0
    for i in range(120, TICKS - LEAD_TICKS):
        common = {"estimate_rps": float(estimates[i]), "ca2": scv, "lead_s": lead_s, "z": z}
        now = config.interval_s * i
        cond = rate_upper(
            rates[:i], config=config, now_s=now, measured_rps=float(measured[i]), **common
        )
        plain = rate_upper(rates[:i], config=config, now_s=now, **common)
        realised = float(true[i + 1 : i + 1 + LEAD_TICKS].mean())
        over_cond += realised > cond.upper_rps
        over_plain += realised > plain.upper_rps
        sum_cond += cond.upper_rps
        sum_plain += plain.upper_rps
        ticks += 1
    return over_cond / ticks, over_plain / ticks, sum_cond / sum_plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=6, help="seeds per shape (default 6)")
    args = parser.parse_args()
    print(
        f"{'shape':22s} {'exceeded: conditioned':>22s} {'unconditioned':>14s} {'plan ratio':>11s}"
    )
    for name, shape, scv in SHAPES:
        rows = np.array([run(shape, scv, seed) for seed in range(args.seeds)])
        lo, hi = rows.min(axis=0), rows.max(axis=0)
        print(
            f"{name:22s} {100 * lo[0]:9.1f}-{100 * hi[0]:4.1f} %      "
            f"{100 * lo[1]:5.1f}-{100 * hi[1]:4.1f} % {lo[2]:6.3f}-{hi[2]:.3f}"
        )


if __name__ == "__main__":
    main()
