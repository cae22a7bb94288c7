"""Online correction of the capacity model by what each pool really shows.

The observed P99 is compared with the prediction the last tick made at its measured
rate (never a forecast) on the same replicas; the ratio, smoothed and bounded, is a
per-pool factor that tightens (or relaxes) the target the solver aims at.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.config import ControllerConfig
from controller.observation import Observation, usable
from controller.policy.state import ControllerState
from controller.policy.steady import transient
from controller.policy.vocabulary import Reason, ReasonEntry, Stage
from queueing.pools import PerPool, Pool

# The SLOs are P99s. A window of n requests has order statistics at the ranks
# k / (n + 1): below n = 1 / (1 - 0.99) = 100 none lies above the 99th percentile,
# so its "P99" is its maximum's neighbourhood — an estimate of the 1 - 1/n quantile,
# biased low and as noisy as one sample. Such a window says nothing about the model's
# P99 error, and learning from it walked the factor to its bounds on calm traffic.
MIN_REQUESTS_FOR_P99 = 100


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """One pool's calibration after this tick."""

    factor: float  # the correction the solver's target is divided by
    model_error: float | None  # observed / predicted P99 - 1, when comparable
    transient_s: float | None  # the latest tick that saw the pool in a transient
    entry: ReasonEntry | None


def calibrate_pool(
    pool: Pool,
    observation: Observation,
    state: ControllerState,
    config: ControllerConfig,
    behind: str | None,
    now_s: float,
) -> Calibration:
    """The pool's new correction factor, model error and latest transient.

    Calibration learns the model's steady-state bias only: while the pool is in a
    transient (``steady.transient``; ``behind`` says why its serving workers fall
    behind, if they do), and for one measurement window after it (the window's P99
    still holds requests that queued behind it), the factor is kept as it is.
    """
    pstate = state.pools[pool]
    seen = observation.observed_p99_s(pool)
    predicted = pstate.predicted_p99_s
    why = transient(pool, observation, behind)
    transient_s = now_s if why is not None else pstate.transient_s
    kept = Calibration(
        factor=pstate.calibration, model_error=None, transient_s=transient_s, entry=None
    )
    if (
        not usable(seen)
        or seen is None
        or seen == 0
        or predicted is None
        or predicted <= 0
        or pstate.predicted_for_replicas != observation.replicas(pool).current_replicas
    ):
        return kept
    ratio = seen / predicted
    cal = config.calibration
    if not cal.enabled:
        return Calibration(
            factor=pstate.calibration,
            model_error=ratio - 1.0,
            transient_s=transient_s,
            entry=ReasonEntry(
                stage=Stage.CALIBRATE,
                reason=Reason.CALIBRATION_SKIPPED,
                pool=pool,
                detail=f"observed/predicted P99 {ratio:.3f}; calibration is disabled",
            ),
        )
    if why is None and pstate.transient_s is not None:
        since_s = now_s - pstate.transient_s
        if since_s <= config.window_s:
            why = f"a transient {since_s:.0f} s ago is still in the {config.window_s:g}-s window"
    requests = (observation.arrival_rate_rps or 0.0) * config.window_s
    if why is None and requests < MIN_REQUESTS_FOR_P99:
        why = (
            f"about {requests:.0f} requests in the {config.window_s:g}-s window, fewer than "
            f"the {MIN_REQUESTS_FOR_P99} a P99 needs"
        )
    if why is not None:
        return Calibration(
            factor=pstate.calibration,
            model_error=ratio - 1.0,
            transient_s=transient_s,
            entry=ReasonEntry(
                stage=Stage.CALIBRATE,
                reason=Reason.CALIBRATION_FROZEN,
                pool=pool,
                detail=f"observed/predicted P99 {ratio:.3f} not learnt: {why}; "
                f"correction stays {pstate.calibration:.3f}",
            ),
        )
    updated = (1.0 - cal.ema_weight) * pstate.calibration + cal.ema_weight * ratio
    factor = min(cal.max_factor, max(cal.min_factor, updated))
    return Calibration(
        factor=factor,
        model_error=ratio - 1.0,
        transient_s=transient_s,
        entry=ReasonEntry(
            stage=Stage.CALIBRATE,
            reason=Reason.CALIBRATED,
            pool=pool,
            detail=f"observed/predicted P99 {ratio:.3f}; correction {factor:.3f}",
        ),
    )


def calibrate(
    observation: Observation,
    state: ControllerState,
    config: ControllerConfig,
    behind: PerPool[str | None],
    now_s: float,
) -> PerPool[Calibration]:
    """``calibrate_pool`` for each pool."""
    return PerPool.build(
        lambda pool: calibrate_pool(pool, observation, state, config, behind[pool], now_s)
    )
