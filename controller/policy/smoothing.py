"""Which measurements a tick may act on, and what rate and length mix it plans for.

- ``validate``: missing, NaN, negative or stale measurements hold the pools (never
  scale down on missing data);
- ``smooth``: EMA of the arrival rate (0.7·old + 0.3·new by default), except where a
  count is significantly beyond the noise the measured SCV implies: a window's rate
  that moved (shift) is taken as it is, a short window far above it (burst) bypasses
  smoothing upwards;
- ``plan_for_overload``: the measured rate while a pool's serving workers fall
  behind it (the EMA's lag is then on the wrong side);
- ``with_forecast``: a forecast raises the planning rate (never lowers it) and
  nothing else; the EMA itself follows measurements only;
- ``choose_lengths``: the pooled length mix, switched to only when it moved.
"""

from __future__ import annotations

import math

import numpy as np

from controller.config import ControllerConfig
from controller.observation import Observation, usable
from controller.policy.leadtime import detection_z, significant
from controller.policy.state import ControllerState
from controller.policy.vocabulary import Reason, ReasonEntry, Stage
from queueing.lengths import LengthSamples
from queueing.pools import PerPool, Pool
from queueing.solver import DEFAULT_QUANTILE

# The shift and burst tests' threshold with the default tick and history (3.77).
DETECT_Z = detection_z(DEFAULT_QUANTILE, 3600.0 / 30.0)


def validate(
    observation: Observation, state: ControllerState, config: ControllerConfig, now_s: float
) -> tuple[bool, ReasonEntry]:
    """Whether the observation can drive a decision."""
    age_s = now_s - observation.time_s
    problems = []
    if age_s > config.stale_after_s:
        problems.append(
            f"observation is {age_s:.0f} s old (stale after {config.stale_after_s:g} s)"
        )
    if age_s < 0:
        problems.append(f"observation is {-age_s:.0f} s in the future")
    if not usable(observation.arrival_rate_rps):
        problems.append(f"arrival rate is {observation.arrival_rate_rps!r}")
    if observation.lengths is None and state.lengths is None:
        problems.append("no request-length distribution observed yet")
    if problems:
        return False, ReasonEntry(
            stage=Stage.VALIDATE,
            reason=Reason.METRICS_STALE,
            pool=None,
            detail="; ".join(problems) + ": holding the current replicas",
        )
    return True, ReasonEntry(
        stage=Stage.VALIDATE, reason=Reason.METRICS_OK, pool=None, detail="measurements usable"
    )


def smooth(
    observation: Observation,
    state: ControllerState,
    config: ControllerConfig,
    *,
    ca2: float = 1.0,
    spread_rps: float = 0.0,
    z: float = DETECT_Z,
) -> tuple[float, ReasonEntry]:
    """EMA of the arrival rate, except where the evidence says the rate moved.

    Both tests judge a count against the noise a renewal process of gap SCV ``ca2``
    (the pooled measurement) would show at the old estimate, or the spread of the
    window's rate seen over the last ticks (``spread_rps``, ``leadtime.window_spread``)
    when larger, at ``z`` standard deviations (``leadtime.significant``):

    - a *shift*: the window's count is significantly above or below the estimate's
      (the rate stepped: the estimate takes the measured rate, rather than reaching
      it over several ticks of EMA);
    - a *burst*: the short burst window's count is significantly above the estimate's
      and its rate is above ``burst_ratio`` x the EMA (a practical size as well as
      a significant one): the plan takes the largest of the EMA, the window's rate
      and the burst's.
    """
    measured = float(observation.arrival_rate_rps or 0.0)
    old = state.smoothed_rate_rps
    if old is None:
        return measured, ReasonEntry(
            stage=Stage.SMOOTH,
            reason=Reason.RATE_INITIALISED,
            pool=None,
            detail=f"first measurement {measured:.3g} req/s",
        )
    ema = (1.0 - config.ema_weight) * old + config.ema_weight * measured
    burst = observation.burst_arrival_rate_rps
    if usable(burst) and burst is not None and burst > config.burst_ratio * ema:
        window_s = config.burst_window_s
        beyond, score = significant(
            burst * window_s, old * window_s, ca2, z, spread_count=spread_rps * window_s
        )
        if beyond and score > 0:
            rate = max(ema, measured, burst)
            return rate, ReasonEntry(
                stage=Stage.SMOOTH,
                reason=Reason.BURST_DETECTED,
                pool=None,
                detail=f"burst {burst:.3g} req/s, {score:.1f} sd above the estimate "
                f"{old:.3g} (SCV {ca2:.3g}) and > {config.burst_ratio:g} x EMA {ema:.3g}: "
                f"planning for {rate:.3g} req/s",
            )
    # The window against the estimate: both are noisy, and the EMA of windows keeps
    # w / (2 - w) of a window's variance, so their difference has 2 / (2 - w) of it.
    window_s = config.window_s
    beyond, score = significant(
        measured * window_s,
        old * window_s,
        ca2,
        z,
        spread_count=spread_rps * window_s,
        variance_factor=2.0 / (2.0 - config.ema_weight),
    )
    if beyond:
        return measured, ReasonEntry(
            stage=Stage.SMOOTH,
            reason=Reason.RATE_SHIFTED,
            pool=None,
            detail=f"measured {measured:.3g} req/s is {score:+.1f} sd from the estimate "
            f"{old:.3g} (SCV {ca2:.3g}): the rate moved, the estimate follows",
        )
    return ema, ReasonEntry(
        stage=Stage.SMOOTH,
        reason=Reason.RATE_SMOOTHED,
        pool=None,
        detail=f"EMA {ema:.3g} req/s from {old:.3g} and measured {measured:.3g}",
    )


def plan_for_overload(
    rate_rps: float,
    measured_rps: float,
    behind: PerPool[str | None],
) -> tuple[float, ReasonEntry | None]:
    """While a pool's serving workers fall behind (``behind``, from ``steady.overloaded``),
    plan for the measured rate when it is above the smoothed one: the EMA's lag is
    then on the wrong side, and every tick of it adds to a backlog that the new
    workers (after their startup) must also clear."""
    why = "; ".join(f"{pool.value}: {text}" for pool, text in behind.items() if text)
    if not why or measured_rps <= rate_rps:
        return rate_rps, None
    return measured_rps, ReasonEntry(
        stage=Stage.SMOOTH,
        reason=Reason.OVERLOAD_DETECTED,
        pool=None,
        detail=f"{why}: planning for the measured {measured_rps:.3g} req/s "
        f"(smoothed {rate_rps:.3g})",
    )


def with_forecast(
    rate_rps: float,
    forecast_rate_rps: float | None,
    *,
    pool: Pool | None = None,
    read_at_s: float | None = None,
) -> tuple[float, ReasonEntry | None]:
    """The planning rate: the smoothed rate, raised to the forecast when it is higher
    (``read_at_s``: how far ahead the pool read the forecast, said in the reason).

    The forecast only raises the rate the pools are sized for: the EMA keeps tracking
    measurements, and calibration and the safety check stay on the measured rate, so
    a forecast never biases what the controller learns about its model.
    """
    if forecast_rate_rps is None or not usable(forecast_rate_rps):
        return rate_rps, None
    if forecast_rate_rps <= rate_rps:
        return rate_rps, None
    return forecast_rate_rps, ReasonEntry(
        stage=Stage.SMOOTH,
        reason=Reason.FORECAST_RAISED,
        pool=pool,
        detail=f"forecast {forecast_rate_rps:.3g} req/s"
        + ("" if read_at_s is None else f" ({read_at_s:.3g} s ahead)")
        + f" > {rate_rps:.3g}: planning for the forecast",
    )


def choose_lengths(
    seen: LengthSamples | None, kept: LengthSamples | None, *, z: float
) -> tuple[LengthSamples, ReasonEntry | None]:
    """Switch to the ``seen`` mix (the pooled one) only when it moved from the ``kept``
    one beyond the pooled sample's own noise at ``z`` (``_moved``): the model cache
    stays warm, and the recommendation still, while only the sampling moves."""
    if seen is None:
        assert kept is not None  # validate() guarantees one of them
        return kept, None
    if kept is not None and not _moved(kept, seen, z=z):
        return kept, None
    return seen, ReasonEntry(
        stage=Stage.SMOOTH,
        reason=Reason.LENGTHS_UPDATED,
        pool=None,
        detail=f"length mix ({seen.source}): mean prompt {float(seen.prompt_tokens.mean()):.0f}, "
        f"mean output {float(seen.output_tokens.mean()):.0f} tokens",
    )


# The figures ``_moved`` compares: the mean and three quantiles of each length.
MIX_STATISTICS = 8


def _moved(old: LengthSamples, new: LengthSamples, *, z: float) -> bool:
    """Whether the ``new`` sample's mean or one of its P50/P90/P99 lies beyond its own
    sampling noise from the ``old`` one's, for either length.

    The mean by Welch's statistic (the difference over the root of each sample's
    variance over its size); each quantile by the distribution-free interval of the
    new sample's order statistics: the q-quantile of n draws lies between the ranks
    n·q -/+ z·sqrt(n·q·(1 - q)) (the binomial count of draws below it), and the old
    value outside them is a move. A fixed tolerance (5 % of each figure, before)
    read a heavy-tailed mix's noise as moves: the P99 of a few hundred prompts of up
    to 128k tokens swings by more than that from one pool to the next at a constant
    mix, and each swing moved the recommendation by a worker."""
    for a, b in ((old.prompt_tokens, new.prompt_tokens), (old.output_tokens, new.output_tokens)):
        x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if len(x) < 2 or len(y) < 2:
            return True
        se = math.sqrt(float(np.var(x, ddof=1)) / len(x) + float(np.var(y, ddof=1)) / len(y))
        if abs(float(y.mean()) - float(x.mean())) > z * se:
            return True
        ordered_x, ordered_y = np.sort(x), np.sort(y)
        n = len(ordered_y)
        for q in (0.5, 0.9, 0.99):
            half = z * math.sqrt(n * q * (1.0 - q))
            lo = int(min(max(math.floor(n * q - half), 0), n - 1))
            hi = int(min(max(math.ceil(n * q + half), 0), n - 1))
            value = float(ordered_x[min(len(x) - 1, int(q * len(x)))])
            if value < ordered_y[lo] or value > ordered_y[hi]:
                return True
    return False
