"""Planning for the rate a worker started now will serve, with the estimate's uncertainty.

A worker added now serves only after the pool's start-up; until then the pool has
what it has. So the rate that matters is the one over the next ``lead time`` =
start-up + one tick, and the pool is sized for an *upper quantile* of it, not for a
point estimate plus a fixed margin:

- ``measure_startup``: each pool's start-up, measured online from the actuator
  (decision to ready: the tick that scaled the pool up, to the first tick that sees
  every asked-for worker ready), a running mean kept in the policy state;
- ``rate_upper``: the upper quantile of the rate over the lead time. Its spread has
  two parts: the estimate's own noise (a renewal process of inter-arrival SCV c²
  counted over W seconds has a count variance of about λ·W·c², so a rate measured
  over W has variance λ·c²/W, and the EMA keeps w/(2-w) of it), and how the rate
  actually moved over horizons of that length in the recent history (the upward
  errors of past estimates against the rate realised over the lead time after them,
  net of the counting noise of that realised rate, which the solver's queueing
  model already carries through c², and of the past estimate's own noise, which
  the first part already carries), conditioned, where the history shows a
  significant relation, on the window's gap to the estimate (an EMA's lag behind a
  moving rate), so a trough is not planned for the rising flank's errors;
- ``significant``: whether a count is beyond the noise the measured SCV implies for
  the estimate, or the window-to-window spread actually seen when that is larger
  (``window_spread``; the burst and rate-shift tests of ``smoothing``);
- ``judge_bounds``: how the pool's past bounds held against what arrived over their
  lead times, the record ``normalisation.stabilisation_window`` reads;
- ``pooled_lengths``: the length mix pooled over a longer horizon than one window, so
  a recommendation moves when the mix does and not with the sampling noise of a few
  dozen heavy-tailed requests, and ``since_mix_shift`` starts it again where the
  prompts significantly moved; ``newest_scv``: the ca², which the sources read over
  that horizon themselves.

The quantile's level is the SLO's percentile (``risk_z``): the pools are sized so
that the rate over a lead time exceeds the plan no more often than the SLO lets a
request miss (docs/backtesting.md, "Lead-time-aware provisioning").
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from statistics import NormalDist
from typing import Protocol, TypeVar

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from controller.config import ControllerConfig
from controller.observation import PoolObservation
from controller.policy.state import BoundSample, LengthWindow, PoolState, RateSample
from controller.policy.vocabulary import Reason, ReasonEntry, Stage
from queueing.lengths import LengthSamples
from queueing.pools import PerPool, Pool
from queueing.solver import CapacityModel

# The fewest past estimates whose lead-time error is known before the history's
# spread is used (below it, only the estimate's own noise is).
MIN_HISTORY = 3
# The fewest past lead-time errors before they are conditioned on the window's gap to
# the estimate (a line's slope and residual spread from fewer are too noisy).
MIN_REGRESSION = 20
# The fewest lead-time bounds whose lead time has been realised before their record may
# shorten the stabilisation window (``stabilisation_window``).
MIN_JUDGED_BOUNDS = 20
# At most this many (prompt, output) samples are kept per measurement window of the
# pooled mix (an evenly strided subset), which bounds the persisted state.
MAX_WINDOW_SAMPLES = 256
# The fewest requests a pooled length mix must hold before a P99 is sized on it: below
# about a hundred no order statistic lies past the 99th percentile, and below fifty the
# mix's own upper tail (the prompts the P99 is made of) is a handful of requests.
MIN_POOLED_REQUESTS = 50


def risk_z(quantile: float) -> float:
    """The standard-normal quantile of the SLO's percentile (2.326 for P99)."""
    if not 0.5 <= quantile < 1.0:
        raise ValueError(f"quantile: must be in [0.5, 1), got {quantile!r}")
    return NormalDist().inv_cdf(quantile)


def detection_z(quantile: float, tests: float) -> float:
    """The threshold of a test run once per tick: ``tests`` ticks (those of the
    history) share the SLO's risk, so a false alarm comes about once in a history
    whose every tick is at risk at most ``1 - quantile`` (Bonferroni): 3.77 for P99
    over 120 ticks."""
    if tests < 1:
        raise ValueError(f"tests: must be >= 1, got {tests!r}")
    return risk_z(1.0 - (1.0 - quantile) / tests)


def significant(
    count: float,
    expected: float,
    ca2: float,
    z: float,
    *,
    spread_count: float = 0.0,
    variance_factor: float = 1.0,
) -> tuple[bool, float]:
    """Whether ``count`` arrivals are beyond the noise around the ``expected`` count:
    a renewal process with gap SCV ``ca2`` counts with a variance of about
    ``expected x ca2`` (at least one arrival's worth, so an estimate of zero is not
    certain), and ``spread_count`` is how much such counts were actually seen to
    move (the larger of the two is the noise); ``variance_factor`` adds the
    expectation's own uncertainty (1 + its variance over the count's). Returns
    (beyond z either way, the z score)."""
    variance = max(max(expected, 1.0) * max(ca2, 1e-6), spread_count**2) * variance_factor
    score = (count - expected) / math.sqrt(variance)
    return abs(score) > z, score


def window_spread(
    rates: tuple[RateSample, ...], *, now_s: float, pool_s: float, interval_s: float
) -> float | None:
    """How much the measured rate moved from one tick to the next over the last
    ``pool_s`` (req/s): the root of half the mean squared successive difference, the
    standard deviation of a window's rate that a slow trend does not inflate. None
    with fewer than three consecutive pairs."""
    recent = [r for r in rates if r.time_s > now_s - pool_s]
    diffs = [
        b.rate_rps - a.rate_rps
        for a, b in itertools.pairwise(recent)
        if b.time_s - a.time_s <= 1.5 * interval_s
    ]
    if len(diffs) < 3:
        return None
    return math.sqrt(0.5 * float(np.mean(np.square(diffs))))


# -- start-up ------------------------------------------------------------------------------


def measure_startup(
    pool: Pool,
    seen: PoolObservation,
    pstate: PoolState,
    config: ControllerConfig,
    now_s: float,
) -> tuple[PoolState, ReasonEntry | None]:
    """Close a pending scale-up once every asked-for worker is ready, and fold its
    decision-to-ready time into the pool's measured start-up.

    Readiness is seen only at ticks, so the elapsed time overstates the start-up by
    between 0 and one interval; half an interval is taken off (the expected
    overstatement when a worker becomes ready at a uniform moment between ticks).
    A scale-up overtaken by a smaller target is timed on the workers it leaves: a
    pool shrinks by its newest workers first (the simulator, the local actuator, and
    Kubernetes, which deletes not-ready pods first), so while the pool still holds
    more than before the decision, the ones above that were started by it. Cut back
    to what the pool had, or with no record of that, it is dropped unmeasured: a
    pool whose burst surges are released before their workers serve would otherwise
    keep the prior for good.
    """
    since, wanted = pstate.scale_up_since_s, pstate.scale_up_to
    if since is None or wanted is None:
        return pstate, None
    if seen.current_replicas < wanted:
        before = pstate.scale_up_from
        if before is None or seen.current_replicas <= before:
            dropped = replace(pstate, scale_up_since_s=None, scale_up_to=None, scale_up_from=None)
            return dropped, None
        wanted = seen.current_replicas
        pstate = replace(pstate, scale_up_to=wanted)
    if seen.ready_replicas < wanted:
        return pstate, None
    sample_s = max(0.0, now_s - since - 0.5 * config.interval_s)
    n = pstate.startup_samples
    # A running mean over the first samples, then an EMA (a start-up that changes,
    # a new image or node type, is followed within a few scale-ups).
    weight = max(1.0 / (n + 1), config.lead_time.startup_ema_weight)
    old = pstate.startup_s if pstate.startup_s is not None else sample_s
    startup_s = (1.0 - weight) * old + weight * sample_s
    return (
        replace(
            pstate,
            scale_up_since_s=None,
            scale_up_to=None,
            scale_up_from=None,
            startup_s=startup_s,
            startup_samples=n + 1,
        ),
        ReasonEntry(
            stage=Stage.SMOOTH,
            reason=Reason.STARTUP_MEASURED,
            pool=pool,
            detail=f"{wanted} workers ready {now_s - since:.0f} s after the decision: "
            f"start-up {startup_s:.0f} s over {n + 1} scale-ups",
        ),
    )


def lead_ticks(lead_s: float, interval_s: float) -> int:
    """The ticks a lead time spans: the first whose window ends at or after it (at
    least one)."""
    return max(1, math.ceil(lead_s / interval_s - 1e-9))


def lead_time_s(pstate: PoolState, config: ControllerConfig) -> float:
    """The pool's lead time: its measured start-up (the prior until one is measured)
    plus one tick."""
    startup_s = pstate.startup_s
    if startup_s is None:
        startup_s = config.lead_time.startup_prior_s
    return startup_s + config.interval_s


def forecast_horizon_s(pools: PerPool[PoolState], config: ControllerConfig) -> float:
    """How far ahead the forecaster looks: with lead-time planning, the longer of the
    pools' lead times, so it sees as far as a worker started now takes to serve;
    otherwise the configured ``forecast.horizon_s``."""
    if not config.lead_time.enabled:
        return config.forecast.horizon_s
    return max(lead_time_s(pstate, config) for _, pstate in pools.items())


def response_s(
    pool: Pool, model: CapacityModel, *, workers: int, rate_rps: float, toward_rps: float
) -> float:
    """How long the pool's load takes to follow the arrival rate from ``rate_rps``
    toward ``toward_rps``.

    A decode pool's batch is the requests still decoding: it follows the rate through
    its relaxation time (``DecodeModel.relaxation_s``, the linearised response of the
    mean batch around the current rate; tens of seconds for outputs of hundreds of
    tokens), so on a line λ(t) = a + b·t the batch at time H is the one a steady rate
    λ(H - τ) would keep. Where the pool could not keep up at ``toward_rps`` there is no
    steady batch to relax to (the batch grows for as long as the rate stays there):
    zero, so the pool follows the forecast whole — as it does at zero rate, and as a
    prefill queue does, which follows within a few prompt service times (the safe
    side)."""
    if pool is Pool.PREFILL or rate_rps <= 0:
        return 0.0
    workers = max(1, workers)
    if not model.decode.is_stable(workers=workers, arrival_rate_rps=max(rate_rps, toward_rps)):
        return 0.0
    return model.decode.relaxation_s(workers=workers, arrival_rate_rps=rate_rps)


def forecast_at(
    forecast_rps: float, *, estimate_rps: float, horizon_s: float, at_s: float
) -> float:
    """The forecast for ``horizon_s`` ahead read at ``at_s`` ahead instead: on the line
    from the estimate now to the forecast (the trend is a line; over a lead time the
    daily cycle nearly is one), never beyond either end."""
    if horizon_s <= 0:
        return forecast_rps
    share = min(max(at_s / horizon_s, 0.0), 1.0)
    return estimate_rps + (forecast_rps - estimate_rps) * share


# -- the rate's upper quantile -------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RateBound:
    """The planning rate of one pool and what it is made of (req/s)."""

    upper_rps: float
    estimate_rps: float
    sigma_rps: float  # the standard deviation the upper quantile is built from
    noise_rps: float  # the estimate's own part of it
    drift_rps: float  # the recent history's part of it
    lead_s: float
    history: int  # past estimates whose lead-time error was known
    # The error expected from the window's gap to the estimate (0 when the history
    # shows no significant relation), and whether that condition was used.
    expected_drift_rps: float = 0.0
    conditioned: bool = False


def rate_upper(
    rates: tuple[RateSample, ...],
    *,
    estimate_rps: float,
    ca2: float,
    lead_s: float,
    z: float,
    config: ControllerConfig,
    now_s: float,
    measured_rps: float | None = None,
) -> RateBound:
    """The upper ``z``-quantile of the rate over the next ``lead_s``.

    ``rates`` are the past ticks' measured rates and estimates; ``measured_rps`` this
    tick's measured rate. For each past estimate whose next
    ``k = ceil(lead_s / interval)`` ticks are all recorded, the error
    e = (mean measured rate over those ticks) - estimate.

    How far the rate moves over a lead time depends on where it is going: an EMA lags
    a moving rate, and the lag shows now as the window's rate less the estimate (on a
    daily cycle large on the rising flank, about zero at the trough). The spread of
    the errors over the whole history is the envelope of every phase. So the error
    is conditioned on that gap (``_conditional_errors``: the least-squares line of
    the past errors on the past gaps, used when at least ``MIN_REGRESSION`` errors
    are known and its slope is significant at ``z``; a line through noise would move
    the plan with the noise): the bound is the estimate plus the line's value at
    today's gap plus ``z`` standard deviations of what the line leaves, the line's
    own uncertainty at that gap included. Without such a line, the errors are taken
    about zero. Either way the drift variance is 2·mean(max(r, 0)²) of the
    residuals r (the upper semi-variance, which for a symmetric error is the
    variance: a fall in the rate is no risk for the plan) less the counting noise of
    the realised mean (estimate·c²/span) and the past estimate's own noise (w/(2-w)
    of a window's), never below zero: the first the queueing model carries, the
    second the noise part, so a steady rate's bound is its estimate's noise alone.
    The drift's part of the bound reaches no higher than the highest rate the
    history realised over a lead time or the window measured now (a ramp into new
    territory has been seen there), and the bound is never below the estimate plus
    its own noise part.
    """
    interval = config.interval_s
    window = config.window_s
    w = config.ema_weight
    noise_var = w / (2.0 - w) * max(estimate_rps, 0.0) * ca2 / window
    k = lead_ticks(lead_s, interval)
    span_s = (k - 1) * interval + window
    times = np.array([r.time_s for r in rates], dtype=np.float64)
    measured = np.array([r.rate_rps for r in rates], dtype=np.float64)
    estimates = np.array([r.estimate_rps for r in rates], dtype=np.float64)
    scvs = np.array([ca2 if r.scv is None else r.scv for r in rates], dtype=np.float64)
    # Tick i's lead time is ticks i + 1 .. i + k: every tick with k recorded after it,
    # within the history, whose k ticks follow at the tick interval (no gap, no restart).
    starts = np.arange(max(len(rates) - k, 0))
    known = starts[
        (times[starts] >= now_s - config.lead_time.history_s)
        & (times[starts + k] - times[starts] <= (k + 0.5) * interval)
    ]
    if len(known):
        realised = sliding_window_view(measured[1:], k)[known].mean(axis=1)
        realised_max = float(realised.max())
    else:
        realised, realised_max = np.zeros(0), 0.0
    errors = realised - estimates[known]
    gaps = measured[known] - estimates[known]
    # An error holds the realised mean's counting noise (the solver's queueing model
    # carries it through c²) and the past estimate's own noise (the bound's noise
    # part carries today's): neither is the rate moving.
    counted = np.maximum(estimates[known], 0.0) * scvs[known]
    counting = counted / span_s + w / (2.0 - w) * counted / window
    floor = max(estimate_rps, 0.0) + z * math.sqrt(noise_var)
    drift_var, expected, fit_var = 0.0, 0.0, 0.0
    line = None
    if len(errors) >= MIN_HISTORY:
        residuals = errors
        if measured_rps is not None:
            line = _conditional_errors(errors, gaps, measured_rps - estimate_rps, z)
        if line is not None:
            residuals, expected, fit_var = line
        drift_var = max(
            0.0, 2.0 * float(np.mean(np.maximum(residuals, 0.0) ** 2)) - float(np.mean(counting))
        )
        with_drift = (
            max(estimate_rps, 0.0) + expected + z * math.sqrt(noise_var + drift_var + fit_var)
        )
        # The history's moves are evidence up to the highest lead-time rate it holds:
        # beyond that the normal tail would be extrapolation (an on/off load at its
        # peak does not rise by the size of its own jumps), so the drift's part of
        # the bound stops there; the window measured now is evidence too, or a ramp
        # beyond anything the history holds would be planned below its own level.
        ceiling = realised_max
        if measured_rps is not None and measured_rps > realised_max:
            # Beyond the history only where the window is beyond its noise about
            # that ceiling (counting, or how much windows were seen to move).
            spread = window_spread(
                rates, now_s=now_s, pool_s=config.lead_time.history_s, interval_s=interval
            )
            beyond, _ = significant(
                measured_rps * window,
                realised_max * window,
                ca2,
                z,
                spread_count=0.0 if spread is None else spread * window,
            )
            if beyond:
                ceiling = measured_rps
        upper = max(floor, min(with_drift, ceiling))
    else:
        upper = floor
    return RateBound(
        upper_rps=upper,
        estimate_rps=estimate_rps,
        sigma_rps=math.sqrt(noise_var + drift_var + fit_var),
        noise_rps=math.sqrt(noise_var),
        drift_rps=math.sqrt(drift_var),
        lead_s=lead_s,
        history=len(errors),
        expected_drift_rps=expected,
        conditioned=line is not None,
    )


def _conditional_errors(
    errors: np.ndarray, gaps: np.ndarray, gap_now: float, z: float
) -> tuple[np.ndarray, float, float] | None:
    """The lead-time errors as a least-squares line in the gaps (measured rate less
    estimate) at their estimates' ticks: (the residuals, the line's value at
    ``gap_now``, the variance of that value). None where fewer than
    ``MIN_REGRESSION`` errors are known, the gaps do not vary, or the slope is within
    ``z`` standard errors of zero."""
    n = len(errors)
    if n < MIN_REGRESSION:
        return None
    gap_mean, error_mean = float(gaps.mean()), float(errors.mean())
    sxx = float(np.sum((gaps - gap_mean) ** 2))
    if sxx <= 0.0:
        return None
    slope = float(np.sum((gaps - gap_mean) * (errors - error_mean))) / sxx
    residuals = errors - (error_mean + slope * (gaps - gap_mean))
    s2 = float(np.sum(residuals**2)) / (n - 2)
    if abs(slope) <= z * math.sqrt(s2 / sxx):
        return None
    at_now = error_mean + slope * (gap_now - gap_mean)
    fit_var = s2 * (1.0 / n + (gap_now - gap_mean) ** 2 / sxx)
    return residuals, at_now, fit_var


def bound_entry(pool: Pool, bound: RateBound, z: float) -> ReasonEntry:
    return ReasonEntry(
        stage=Stage.SMOOTH,
        reason=Reason.LEAD_TIME_PLANNED,
        pool=pool,
        detail=f"planning for {bound.upper_rps:.3g} req/s over the {bound.lead_s:.0f}-s lead "
        f"time: estimate {bound.estimate_rps:.3g} + {z:.2f} x {bound.sigma_rps:.3g} "
        f"(noise {bound.noise_rps:.3g}, drift {bound.drift_rps:.3g} from "
        f"{bound.history} past estimates"
        + (
            f"; {bound.expected_drift_rps:+.3g} expected from the window's gap to the estimate"
            if bound.conditioned
            else ""
        )
        + ")",
    )


# -- how the bounds held: the stabilisation window ------------------------------------------


@dataclass(frozen=True, kw_only=True)
class BoundRecord:
    """How a pool's past lead-time bounds fared: of ``judged`` bounds whose lead time
    has been realised, ``exceeded`` were below the mean rate that arrived over it."""

    judged: int
    exceeded: int


def judge_bounds(
    bounds: tuple[BoundSample, ...],
    rates: tuple[RateSample, ...],
    *,
    now_s: float,
    history_s: float,
    interval_s: float,
) -> BoundRecord:
    """Each bound of the last ``history_s`` against the rate its lead time brought:
    the mean measured rate over the ``ticks`` recorded after it, judged only where
    they follow at the tick interval (as ``rate_upper`` reads its errors).

    What is judged is what arrived, counting noise included, not the rate the bound
    is a quantile of: a pool whose plan covered every lead time's arrivals has held.
    So the record errs toward holding: on a steady Poisson rate, whose bound is
    about the estimate's own noise, the counting noise of the lead time's mean takes
    it above the bound in a few per cent of lead times."""
    times = np.array([r.time_s for r in rates], dtype=np.float64)
    measured = np.array([r.rate_rps for r in rates], dtype=np.float64)
    judged = exceeded = 0
    for bound in bounds:
        if bound.time_s < now_s - history_s:
            continue
        first = int(np.searchsorted(times, bound.time_s, side="right"))
        last = first + bound.ticks
        if last > len(times) or times[last - 1] - bound.time_s > (bound.ticks + 0.5) * interval_s:
            continue
        judged += 1
        exceeded += int(measured[first:last].mean() > bound.upper_rps)
    return BoundRecord(judged=judged, exceeded=exceeded)


@dataclass(frozen=True, kw_only=True)
class DrainPlan:
    """The rates each pool must absorb while the prefill queue drains (req/s)."""

    rates_rps: PerPool[float]
    queue_at_ready: float  # the prompts queued when a worker asked for now serves
    capacity_rps: float  # what the serving prefill workers clear meanwhile


def drain_plan(
    planned: PerPool[float],
    *,
    queue: float,
    serving_workers: int,
    packed_service_s: float,
    startup_s: float,
    interval_s: float,
) -> DrainPlan | None:
    """The planning rates that clear the prefill queue by the end of the lead time.

    A worker asked for now serves after ``startup_s``. Until then the serving workers
    clear at most ``serving / packed_service_s`` prompts a second while the planned
    rate keeps arriving, so the queue the new workers find is the queue now plus that
    shortfall over the start-up. The lead time is the start-up and one tick, so the
    pool is sized to take the arrivals and that queue within the tick that follows:
    each tick of backlog left after it is a tick whose prompts all wait behind it.
    The decode pool's arrivals are the prefill pool's departures, which run at the
    drain rate while the queue lasts, so it plans for at least as much. None without
    a queue, or when the serving workers clear it before a new one would serve. The
    extra workers are for a known amount of work, not for uncertainty about the
    rate: ``normalisation.stabilise`` releases them when it is done.
    """
    capacity = serving_workers / packed_service_s
    at_ready = queue + (planned.prefill - capacity) * startup_s
    if queue <= 0 or at_ready <= 0:
        return None
    drain = planned.prefill + at_ready / interval_s
    return DrainPlan(
        rates_rps=PerPool(prefill=drain, decode=max(planned.decode, drain)),
        queue_at_ready=at_ready,
        capacity_rps=capacity,
    )


def drain_entry(plan: DrainPlan, startup_s: float) -> ReasonEntry:
    return ReasonEntry(
        stage=Stage.SMOOTH,
        reason=Reason.QUEUE_DRAIN,
        pool=None,
        detail=f"about {plan.queue_at_ready:.0f} prompts queued when a worker asked for now "
        f"serves ({startup_s:.0f} s, the serving workers clearing {plan.capacity_rps:.3g} "
        f"req/s meanwhile): planning for {plan.rates_rps.prefill:.3g} req/s to clear them "
        "within the next tick",
    )


class _Timed(Protocol):
    @property
    def time_s(self) -> float: ...


TimedT = TypeVar("TimedT", bound=_Timed)


def record_sample(
    samples: tuple[TimedT, ...],
    sample: TimedT,
    *,
    keep_s: float,
) -> tuple[TimedT, ...]:
    """``samples`` (rates, bounds) with this tick's ``sample``, those older than
    ``keep_s`` dropped."""
    kept = tuple(r for r in samples if sample.time_s - keep_s <= r.time_s < sample.time_s)
    return (*kept, sample)


# -- pooled length mix and SCV -------------------------------------------------------------


def _strided(values: np.ndarray, keep: int) -> np.ndarray:
    if len(values) <= keep:
        return values
    return values[np.linspace(0, len(values) - 1, keep).round().astype(np.int64)]


def pool_window(
    windows: tuple[LengthWindow, ...],
    lengths: LengthSamples | None,
    *,
    now_s: float,
    pool_s: float,
) -> tuple[LengthWindow, ...]:
    """The windows of the pooled mix after this tick: this window's samples added (an
    evenly strided subset of at most ``MAX_WINDOW_SAMPLES``, sorted by prompt so the
    subset keeps the mix's shape), those older than ``pool_s`` dropped."""
    kept = tuple(w for w in windows if now_s - pool_s < w.time_s < now_s)
    if lengths is None:
        return kept
    order = np.argsort(lengths.prompt_tokens, kind="stable")
    index = _strided(order, MAX_WINDOW_SAMPLES)
    added = LengthWindow(
        time_s=now_s,
        prompt_tokens=lengths.prompt_tokens[index].copy(),
        output_tokens=lengths.output_tokens[index].copy(),
    )
    return (*kept, added)


def since_mix_shift(
    windows: tuple[LengthWindow, ...], *, window_s: float, z: float
) -> tuple[tuple[LengthWindow, ...], str | None]:
    """The pooled windows from the newest on, where the prompts moved: the newest
    window's mean prompt length is more than ``z`` standard errors (Welch's: each
    sample's own variance over its size) from that of the windows before it that do
    not overlap it; with the reason why, or the windows unchanged and None.

    Pooling over ``pool_s`` keeps a recommendation from moving with the sampling
    noise of a few dozen heavy-tailed requests, and for as long makes it lag a mix
    that did move: the work a prompt brings is its length, so prompts 40 % longer at
    the same rate are 40 % more prefill work, which a mix pooled over five minutes
    still reads as the old one while the queue builds. The test weighs the window's
    evidence by its own noise, as the rate tests do the rate's: one long prompt
    among n raises the window's mean and its standard error alike, and is no shift.
    Each sample needs ``MIN_POOLED_REQUESTS`` pairs to be judged.

    Only the prompts are tested. A window's pairs are those of the requests that
    completed in it, and a request completes about its output length in decode
    steps after it arrived: when the rate moves, the short outputs of the newest
    arrivals finish first and the longer ones a minute later, so the window's mean
    output swings with the rate's moves (by 4-5 standard errors on a 3x step) where
    the mix did not change. A prompt's wait is its prefill's, the same for short
    and long outputs."""
    if not windows:
        return windows, None
    newest = windows[-1]
    older = [w.prompt_tokens for w in windows[:-1] if w.time_s <= newest.time_s - window_s]
    new = newest.prompt_tokens
    old = np.concatenate(older) if older else new[:0]
    if len(new) < MIN_POOLED_REQUESTS or len(old) < MIN_POOLED_REQUESTS:
        return windows, None
    se = math.sqrt(float(np.var(new, ddof=1)) / len(new) + float(np.var(old, ddof=1)) / len(old))
    score = (float(np.mean(new)) - float(np.mean(old))) / se if se > 0 else 0.0
    if abs(score) <= z:
        return windows, None
    return (newest,), (
        f"mean prompt {float(np.mean(new)):.0f} tokens in the window to {newest.time_s:.0f} s "
        f"is {score:+.1f} standard errors from the {float(np.mean(old)):.0f} of the "
        f"{len(older)} windows before it: the prompts moved, the pooled mix starts again "
        "from this window"
    )


def pooled_requests(windows: tuple[LengthWindow, ...], *, window_s: float) -> float:
    """About how many distinct requests the windows' pairs describe, each window giving
    one pair per request it saw (at most ``MAX_WINDOW_SAMPLES``).

    Consecutive windows overlap (a 30-s window every 4-s tick), so their pairs cannot
    simply be summed. Counted here: the newest window whole, then, going back, each
    window that ends where the counted span begins or before it — windows that do not
    overlap, whose requests are all distinct — plus, for the few seconds between such
    a window's end and the counted span (less than a tick), that window's own rate.
    Where no window ends within ``window_s`` of the counted span the record has a hole
    and nothing is assumed about it; nor about what the oldest window reaches beyond
    the last counted one, so the count errs low, by at most that one window's span.

    Taking each later window for the share of its span the one before did not cover
    assumes its requests evenly spread over it; after a start and in a ramp they pile
    up at its recent end, and the demo's counts fell 30-40 % short of the requests
    finished (44 counted where 64 had finished, 76 s into it)."""
    total = 0.0
    counted_from_s = math.inf  # every request after this is counted
    for window in reversed(windows):
        if window.time_s > counted_from_s:
            continue  # overlaps the counted span
        pairs = len(window.prompt_tokens)
        gap_s = 0.0 if math.isinf(counted_from_s) else counted_from_s - window.time_s
        total += pairs * (1.0 + gap_s / window_s) if gap_s < window_s else pairs
        counted_from_s = window.time_s - window_s
    return total


def pooled_lengths(
    windows: tuple[LengthWindow, ...], *, now_s: float, window_s: float
) -> LengthSamples | None:
    """The pooled mix, or None while it describes fewer than ``MIN_POOLED_REQUESTS``
    requests (``pooled_requests``)."""
    if not windows or pooled_requests(windows, window_s=window_s) < MIN_POOLED_REQUESTS:
        return None
    return LengthSamples(
        prompt_tokens=np.concatenate([w.prompt_tokens for w in windows]),
        output_tokens=np.concatenate([w.output_tokens for w in windows]),
        source=f"{len(windows)} windows to {now_s:.0f} s",
    )


def newest_scv(rates: tuple[RateSample, ...], *, now_s: float, pool_s: float) -> float | None:
    """The newest ca² measured in the last ``pool_s``. The sources read it over that
    span already (``controller.counters.interarrival_scv`` over ``lead_time.pool_s``),
    so each estimate holds the ones before it: a mean of the overlapping estimates
    would smooth twice, over up to twice the span, and lag a change of burstiness by
    as much. An older one stands in for a tick that measured none."""
    seen = [r.scv for r in rates if r.scv is not None and r.time_s > now_s - pool_s]
    if not seen:
        return None
    return float(seen[-1])
