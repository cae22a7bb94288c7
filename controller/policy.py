"""The decision: ``decide(observation, state, config, *, now_s) -> Decision``.

Pure: no I/O, no clock, no randomness — the same inputs give the same decision, so
the control loop, the simulator's back-testing and the tests all run this one copy.
One tick is a pipeline of stages, each a function returning its value and a reason
(HPA-style), in this order:

1. validate  — missing, NaN, negative or stale measurements: hold (never scale down
               on missing data);
2. smooth    — EMA of the arrival rate (0.7·old + 0.3·new by default); a short
               window far above the EMA bypasses smoothing upwards (burst), and so
               does the measured rate while the serving workers fall behind it
               (overload: rate beyond their capacity, or a backlog); a
               forecast, when the caller has one, raises the planning rate (never
               lowers it) and nothing else; the EMA itself follows measurements only;
3. calibrate — observed / predicted P99 per pool, smoothed and bounded, tightens or
               relaxes the targets the solver aims at; frozen while the pool is in a
               transient its steady-state model cannot describe (workers starting, the
               measured rate beyond the serving workers' capacity, a backlog), and for
               one window after it;
4. recommend — the solver at the planning rate with headroom;
5. safety    — a scale-down must also meet the SLOs at the *current* raw rate;
6. dead-band — ignore relative changes below the band;
7. stabilise — a lower recommendation must hold for the stabilisation window, and
               the pool scales down to the highest recommendation seen in it;
8. cooldown  — separate for up and down, from the pool's last change;
9. rate limit— at most max_step_fraction of the current size per tick, at least one;
10. clamp    — per-pool min/max and the global GPU budget (split to minimise the
               predicted SLO violation when it binds).
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from controller.config import ControllerConfig, Mode
from controller.observation import Observation, usable
from queueing.catalog import resolve_profile
from queueing.lengths import LengthSamples
from queueing.profile import IterationProfile
from queueing.solver import (
    CapacityModel,
    InfeasibleSLOError,
    KvLink,
    SloTargets,
    evaluate,
    solve,
)

POOLS = ("prefill", "decode")


class Stage(enum.Enum):
    VALIDATE = "validate"
    SMOOTH = "smooth"
    CALIBRATE = "calibrate"
    RECOMMEND = "recommend"
    SAFETY = "safety"
    DEAD_BAND = "dead_band"
    STABILISE = "stabilise"
    COOLDOWN = "cooldown"
    RATE_LIMIT = "rate_limit"
    CLAMP = "clamp"
    ACTUATE = "actuate"


class Reason(enum.Enum):
    METRICS_STALE = "metrics_stale"
    METRICS_OK = "metrics_ok"
    RATE_INITIALISED = "rate_initialised"
    RATE_SMOOTHED = "rate_smoothed"
    BURST_DETECTED = "burst_detected"
    OVERLOAD_DETECTED = "overload_detected"
    LENGTHS_UPDATED = "lengths_updated"
    CALIBRATED = "calibrated"
    FORECAST_RAISED = "forecast_raised"
    CALIBRATION_SKIPPED = "calibration_skipped"
    CALIBRATION_FROZEN = "calibration_frozen"
    RECOMMENDED = "recommended"
    SLO_INFEASIBLE = "slo_infeasible"
    SCALE_DOWN_SAFE = "scale_down_safe"
    SCALE_DOWN_UNSAFE = "scale_down_unsafe"
    WITHIN_DEAD_BAND = "within_dead_band"
    STABILISING = "stabilising"
    STABILISED = "stabilised"
    COOLDOWN_UP = "cooldown_up"
    COOLDOWN_DOWN = "cooldown_down"
    RATE_LIMITED = "rate_limited"
    CLAMPED_MIN = "clamped_min"
    CLAMPED_MAX = "clamped_max"
    GPU_BUDGET = "gpu_budget"
    SCALE_UP = "scale_up"
    SCALE_DOWN = "scale_down"
    NO_CHANGE = "no_change"
    ADVISORY = "advisory"


@dataclass(frozen=True, kw_only=True)
class ReasonEntry:
    stage: Stage
    reason: Reason
    pool: str | None  # "prefill", "decode", or None for both
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage.value,
            "reason": self.reason.value,
            "pool": self.pool,
            "detail": self.detail,
        }


@dataclass(frozen=True, kw_only=True)
class PoolState:
    """What one pool remembers between ticks."""

    last_change_s: float | None = None
    below_since_s: float | None = None  # recommendations below current since then
    below_max: int | None = None  # the highest of those recommendations
    calibration: float = 1.0  # observed / predicted P99, smoothed and bounded
    predicted_p99_s: float | None = None  # at the replicas and load of the last tick
    predicted_for_replicas: int | None = None
    transient_s: float | None = None  # the last tick that saw the pool in a transient


@dataclass(frozen=True, kw_only=True)
class ControllerState:
    """Everything ``decide`` carries from one tick to the next (persisted as JSON)."""

    smoothed_rate_rps: float | None = None
    last_tick_s: float | None = None
    prefill: PoolState = field(default_factory=PoolState)
    decode: PoolState = field(default_factory=PoolState)
    lengths: LengthSamples | None = None

    def pool(self, name: str) -> PoolState:
        state: PoolState = getattr(self, name)
        return state

    def to_dict(self) -> dict[str, Any]:
        return {
            "smoothed_rate_rps": self.smoothed_rate_rps,
            "last_tick_s": self.last_tick_s,
            "prefill": vars(self.prefill).copy(),
            "decode": vars(self.decode).copy(),
            "lengths": None
            if self.lengths is None
            else {
                "prompt_tokens": self.lengths.prompt_tokens.tolist(),
                "output_tokens": self.lengths.output_tokens.tolist(),
                "source": self.lengths.source,
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ControllerState:
        lengths = data.get("lengths")
        return cls(
            smoothed_rate_rps=data.get("smoothed_rate_rps"),
            last_tick_s=data.get("last_tick_s"),
            prefill=PoolState(**data.get("prefill", {})),
            decode=PoolState(**data.get("decode", {})),
            lengths=None
            if lengths is None
            else LengthSamples(
                prompt_tokens=np.asarray(lengths["prompt_tokens"], dtype=np.int64),
                output_tokens=np.asarray(lengths["output_tokens"], dtype=np.int64),
                source=str(lengths["source"]),
            ),
        )


@dataclass(frozen=True, kw_only=True)
class Decision:
    """Both targets, the next state, and the reasons that explain them."""

    prefill_target: int
    decode_target: int
    prefill_current: int
    decode_current: int
    actuate: bool  # False in advisory mode or when holding on stale data
    state: ControllerState
    reasons: tuple[ReasonEntry, ...]
    raw_rate_rps: float | None = None
    smoothed_rate_rps: float | None = None
    forecast_rate_rps: float | None = None
    planning_rate_rps: float | None = None  # what the solver sized the pools for
    recommended: tuple[int, int] | None = None
    predicted_ttft_p99_s: float | None = None
    predicted_tpot_p99_s: float | None = None
    observed_ttft_p99_s: float | None = None
    observed_tpot_p99_s: float | None = None
    model_error: dict[str, float | None] = field(default_factory=dict)

    def target(self, pool: str) -> int:
        return self.prefill_target if pool == "prefill" else self.decode_target

    def reason_for(self, pool: str) -> Reason:
        """The one reason that best explains a pool's outcome (for metric labels).

        Stale data explains everything; a change is SCALE_UP/SCALE_DOWN; no change is
        explained by the last stage that held the pool (dead-band, stabilisation,
        cooldown, unsafe scale-down, clamp), else NO_CHANGE.
        """
        if self.reasons and self.reasons[0].reason is Reason.METRICS_STALE:
            return Reason.METRICS_STALE
        verdict = Reason.NO_CHANGE
        for entry in self.reasons:
            if (
                entry.stage is Stage.ACTUATE
                and entry.pool in (pool, None)
                and entry.reason is not Reason.ADVISORY  # the mode, not the outcome
            ):
                verdict = entry.reason
        if verdict is not Reason.NO_CHANGE:
            return verdict
        holding = (Stage.SAFETY, Stage.DEAD_BAND, Stage.STABILISE, Stage.COOLDOWN, Stage.CLAMP)
        for entry in reversed(self.reasons):
            if (
                entry.stage in holding
                and entry.pool in (pool, None)
                and entry.reason is not Reason.SCALE_DOWN_SAFE
            ):
                return entry.reason
        return Reason.NO_CHANGE

    def as_dict(self) -> dict[str, Any]:
        return {
            "prefill_target": self.prefill_target,
            "decode_target": self.decode_target,
            "prefill_current": self.prefill_current,
            "decode_current": self.decode_current,
            "actuate": self.actuate,
            "raw_rate_rps": self.raw_rate_rps,
            "smoothed_rate_rps": self.smoothed_rate_rps,
            "forecast_rate_rps": self.forecast_rate_rps,
            "planning_rate_rps": self.planning_rate_rps,
            "recommended": list(self.recommended) if self.recommended else None,
            "predicted_ttft_p99_s": self.predicted_ttft_p99_s,
            "predicted_tpot_p99_s": self.predicted_tpot_p99_s,
            "observed_ttft_p99_s": self.observed_ttft_p99_s,
            "observed_tpot_p99_s": self.observed_tpot_p99_s,
            "model_error": dict(self.model_error),
            "reasons": [r.as_dict() for r in self.reasons],
        }


# -- the capacity model, memoised on its inputs (a pure cache) ----------------------------

_MODEL_CACHE: OrderedDict[tuple[Any, ...], CapacityModel] = OrderedDict()
_MODEL_CACHE_SIZE = 8


def _lengths_key(lengths: LengthSamples) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(lengths.prompt_tokens.tobytes())
    digest.update(lengths.output_tokens.tobytes())
    return digest.hexdigest()


def capacity_model(
    lengths: LengthSamples, profile: IterationProfile, config: ControllerConfig
) -> CapacityModel:
    """The model for these inputs, built once and reused while they do not change."""
    link = KvLink(bytes_per_s=config.kv_link_gbps * 1e9 / 8.0)
    key = (_lengths_key(lengths), profile, config.slo.tpot_p99_s, link)
    model = _MODEL_CACHE.get(key)
    if model is None:
        model = CapacityModel.build(lengths, profile, tpot_slo_s=config.slo.tpot_p99_s, link=link)
        _MODEL_CACHE[key] = model
        if len(_MODEL_CACHE) > _MODEL_CACHE_SIZE:
            _MODEL_CACHE.popitem(last=False)
    else:
        _MODEL_CACHE.move_to_end(key)
    return model


# -- stages -----------------------------------------------------------------------------


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
    observation: Observation, state: ControllerState, config: ControllerConfig
) -> tuple[float, ReasonEntry]:
    """EMA of the arrival rate, bypassed upwards by a burst."""
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
        rate = max(ema, measured, burst)
        return rate, ReasonEntry(
            stage=Stage.SMOOTH,
            reason=Reason.BURST_DETECTED,
            pool=None,
            detail=f"burst {burst:.3g} req/s > {config.burst_ratio:g} x EMA {ema:.3g}: "
            f"planning for {rate:.3g} req/s",
        )
    return ema, ReasonEntry(
        stage=Stage.SMOOTH,
        reason=Reason.RATE_SMOOTHED,
        pool=None,
        detail=f"EMA {ema:.3g} req/s from {old:.3g} and measured {measured:.3g}",
    )


def with_forecast(
    rate_rps: float, forecast_rate_rps: float | None
) -> tuple[float, ReasonEntry | None]:
    """The planning rate: the smoothed rate, raised to the forecast when it is higher.

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
        pool=None,
        detail=f"forecast {forecast_rate_rps:.3g} req/s > {rate_rps:.3g}: "
        f"planning for the forecast",
    )


def choose_lengths(
    observation: Observation, state: ControllerState
) -> tuple[LengthSamples, ReasonEntry | None]:
    """Switch to the observed length mix only when it moved (keeps the model cache warm)."""
    seen = observation.lengths
    kept = state.lengths
    if seen is None:
        assert kept is not None  # validate() guarantees one of them
        return kept, None
    if kept is not None and not _moved(kept, seen):
        return kept, None
    return seen, ReasonEntry(
        stage=Stage.SMOOTH,
        reason=Reason.LENGTHS_UPDATED,
        pool=None,
        detail=f"length mix: mean prompt {float(seen.prompt_tokens.mean()):.0f}, "
        f"mean output {float(seen.output_tokens.mean()):.0f} tokens",
    )


def _summary(values: np.ndarray) -> list[float]:
    """Mean and (nearest-rank) P50/P90/P99 from one sort: cheaper than np.quantile."""
    ordered = np.sort(values)
    n = len(ordered)
    return [float(ordered.mean())] + [
        float(ordered[min(n - 1, int(q * n))]) for q in (0.5, 0.9, 0.99)
    ]


def _moved(old: LengthSamples, new: LengthSamples, tolerance: float = 0.05) -> bool:
    """Whether the mean or a tail quantile of either length moved by more than 5 %."""
    for a, b in ((old.prompt_tokens, new.prompt_tokens), (old.output_tokens, new.output_tokens)):
        for x, y in zip(_summary(a), _summary(b), strict=True):
            if abs(y - x) > tolerance * max(x, 1.0):
                return True
    return False


def overloaded(
    pool: str,
    observation: Observation,
    model: CapacityModel,
    predicted_p99_s: float | None,
) -> str | None:
    """Why the pool's serving workers are falling behind, or None.

    - the measured rate at or beyond what the serving workers can process (the queue
      grows without bound, which no stationary P99 describes);
    - (prefill) a backlog: the queue at the end of the window would take the serving
      workers longer to clear than the whole predicted P99 TTFT (``predicted_p99_s``,
      the last tick's), which a stationary queue shows less than 1 % of the time.
    """
    seen = observation.prefill if pool == "prefill" else observation.decode
    rate = observation.arrival_rate_rps
    if seen.ready_replicas == 0 or rate is None or not usable(rate) or rate == 0:
        return None
    stable = (
        model.prefill.is_stable(workers=seen.ready_replicas, arrival_rate_rps=rate)
        if pool == "prefill"
        else model.decode.is_stable(workers=seen.ready_replicas, arrival_rate_rps=rate)
    )
    if not stable:
        return f"{rate:.3g} req/s is beyond the capacity of {seen.ready_replicas} serving workers"
    queue = observation.prefill_queue_depth
    if pool == "prefill" and usable(queue) and queue is not None and predicted_p99_s is not None:
        drain_s = queue * model.prefill.packed_service_s / seen.ready_replicas
        if drain_s > predicted_p99_s:
            return (
                f"backlog of {queue:.0f} prompts takes {drain_s:.2f} s to clear "
                f"(> the predicted P99 {predicted_p99_s:.2f} s)"
            )
    return None


def transient(pool: str, observation: Observation, behind: str | None) -> str | None:
    """Why the pool is not in the steady state its model describes, or None.

    The model predicts the P99 of a pool serving a stationary load with every worker
    up. Workers still starting (the prediction counts them, but they served nothing)
    and serving workers falling behind (``behind``, from ``overloaded``) break that,
    and a P99 observed during them says nothing about the model's bias.
    """
    seen = observation.prefill if pool == "prefill" else observation.decode
    if seen.ready_replicas < seen.current_replicas:
        starting = seen.current_replicas - seen.ready_replicas
        return f"{starting} of {seen.current_replicas} workers starting"
    return behind


def plan_for_overload(
    rate_rps: float,
    measured_rps: float,
    behind: dict[str, str | None],
) -> tuple[float, ReasonEntry | None]:
    """While a pool's serving workers fall behind (``behind``, from ``overloaded``),
    plan for the measured rate when it is above the smoothed one: the EMA's lag is
    then on the wrong side, and every tick of it adds to a backlog that the new
    workers (after their startup) must also clear."""
    why = "; ".join(f"{pool}: {text}" for pool, text in behind.items() if text)
    if not why or measured_rps <= rate_rps:
        return rate_rps, None
    return measured_rps, ReasonEntry(
        stage=Stage.SMOOTH,
        reason=Reason.OVERLOAD_DETECTED,
        pool=None,
        detail=f"{why}: planning for the measured {measured_rps:.3g} req/s "
        f"(smoothed {rate_rps:.3g})",
    )


def calibrate(
    observation: Observation,
    state: ControllerState,
    config: ControllerConfig,
    behind: dict[str, str | None],
    now_s: float,
) -> tuple[dict[str, float], dict[str, float | None], dict[str, float | None], list[ReasonEntry]]:
    """New correction factors, the model error (observed / predicted - 1) and the time
    of the latest transient, per pool.

    The observed P99 is compared with the prediction the last tick made at its
    measured rate (never a forecast) on the same replicas. Calibration learns the
    model's steady-state bias only: while a pool is in a transient (``transient``;
    ``behind`` says per pool why its serving workers fall behind, if they do), and
    for one measurement window after it (the window's P99 still holds requests that
    queued behind it), the factor is kept as it is.
    """
    factors: dict[str, float] = {}
    errors: dict[str, float | None] = {}
    transients: dict[str, float | None] = {}
    entries: list[ReasonEntry] = []
    observed = {"prefill": observation.ttft_p99_s, "decode": observation.tpot_p99_s}
    current = {
        "prefill": observation.prefill.current_replicas,
        "decode": observation.decode.current_replicas,
    }
    cal = config.calibration
    for pool in POOLS:
        pstate = state.pool(pool)
        seen = observed[pool]
        predicted = pstate.predicted_p99_s
        factors[pool] = pstate.calibration
        errors[pool] = None
        why = transient(pool, observation, behind[pool])
        transients[pool] = now_s if why is not None else pstate.transient_s
        if (
            not usable(seen)
            or seen is None
            or seen == 0
            or predicted is None
            or predicted <= 0
            or pstate.predicted_for_replicas != current[pool]
        ):
            continue
        ratio = seen / predicted
        errors[pool] = ratio - 1.0
        if not cal.enabled:
            entries.append(
                ReasonEntry(
                    stage=Stage.CALIBRATE,
                    reason=Reason.CALIBRATION_SKIPPED,
                    pool=pool,
                    detail=f"observed/predicted P99 {ratio:.3f}; calibration is disabled",
                )
            )
            continue
        if why is None and pstate.transient_s is not None:
            since_s = now_s - pstate.transient_s
            if since_s <= config.window_s:
                why = (
                    f"a transient {since_s:.0f} s ago is still in the "
                    f"{config.window_s:g}-s window"
                )
        if why is not None:
            entries.append(
                ReasonEntry(
                    stage=Stage.CALIBRATE,
                    reason=Reason.CALIBRATION_FROZEN,
                    pool=pool,
                    detail=f"observed/predicted P99 {ratio:.3f} not learnt: {why}; "
                    f"correction stays {factors[pool]:.3f}",
                )
            )
            continue
        updated = (1.0 - cal.ema_weight) * pstate.calibration + cal.ema_weight * ratio
        factors[pool] = min(cal.max_factor, max(cal.min_factor, updated))
        entries.append(
            ReasonEntry(
                stage=Stage.CALIBRATE,
                reason=Reason.CALIBRATED,
                pool=pool,
                detail=f"observed/predicted P99 {ratio:.3f}; correction {factors[pool]:.3f}",
            )
        )
    return factors, errors, transients, entries


def recommend(
    model: CapacityModel,
    rate_rps: float,
    ca2: float,
    config: ControllerConfig,
    factors: dict[str, float],
) -> tuple[tuple[int, int], SloTargets, ReasonEntry]:
    """The solver's answer at the planning rate, the (calibrated, possibly relaxed) SLO
    it aimed at — the safety stage judges scale-downs against the same targets — and
    the reason."""
    slo = SloTargets(
        ttft_p99_s=config.slo.ttft_p99_s / factors["prefill"],
        tpot_p99_s=config.slo.tpot_p99_s / factors["decode"],
    )
    if rate_rps <= 0:
        return (
            (config.prefill.min_replicas, config.decode.min_replicas),
            slo,
            ReasonEntry(
                stage=Stage.RECOMMEND,
                reason=Reason.RECOMMENDED,
                pool=None,
                detail="no traffic: the minimum of each pool",
            ),
        )
    try:
        result = solve(model, arrival_rate_rps=rate_rps, ca2=ca2, slo=slo, headroom=config.headroom)
    except InfeasibleSLOError as exc:
        # Best effort: plan for just above the floor that blocks the SLO, which still
        # sizes the pools for stability and KV room, and say so. The solver divides
        # its target by (1 + headroom), so the relaxed target carries that factor: the
        # solver then aims at 1.2 x the floor whatever the headroom (without it, a
        # headroom above 20 % would put the aim below the floor again, and the plan
        # would fall through to the maximum).
        above_floor = 1.2 * (1.0 + config.headroom)
        relaxed = SloTargets(
            ttft_p99_s=max(slo.ttft_p99_s, model.prefill.floor_quantile_s(0.99) * above_floor),
            tpot_p99_s=max(slo.tpot_p99_s, model.decode.floor_quantile_s(0.99) * above_floor),
        )
        try:
            result = solve(
                model, arrival_rate_rps=rate_rps, ca2=ca2, slo=relaxed, headroom=config.headroom
            )
        except InfeasibleSLOError:
            big = (config.prefill.max_replicas, config.decode.max_replicas)
            return (
                big,
                relaxed,
                ReasonEntry(
                    stage=Stage.RECOMMEND,
                    reason=Reason.SLO_INFEASIBLE,
                    pool=None,
                    detail=f"{exc}; planning for the maximum",
                ),
            )
        return (
            (result.prefill_workers, result.decode_workers),
            relaxed,
            ReasonEntry(
                stage=Stage.RECOMMEND,
                reason=Reason.SLO_INFEASIBLE,
                pool=None,
                detail=f"{exc}; planning for 1.2 x the floor instead",
            ),
        )
    return (
        (result.prefill_workers, result.decode_workers),
        slo,
        ReasonEntry(
            stage=Stage.RECOMMEND,
            reason=Reason.RECOMMENDED,
            pool=None,
            detail=f"{result.prefill_workers} prefill ({result.prefill_bound.value}), "
            f"{result.decode_workers} decode ({result.decode_bound.value}) at {rate_rps:.3g} req/s",
        ),
    )


def _meets_at(
    model: CapacityModel,
    pool: str,
    workers: int,
    rate_rps: float,
    ca2: float,
    aimed: SloTargets,
    headroom: float,
) -> bool:
    if workers < 1 or rate_rps <= 0:
        return rate_rps <= 0
    target = aimed.ttft_p99_s if pool == "prefill" else aimed.tpot_p99_s
    target = target / (1.0 + headroom)
    slo = SloTargets(
        ttft_p99_s=target if pool == "prefill" else 1e9,
        tpot_p99_s=target if pool == "decode" else 1e9,
    )
    ev = evaluate(
        model,
        prefill_workers=workers if pool == "prefill" else 1,
        decode_workers=workers if pool == "decode" else 1,
        arrival_rate_rps=rate_rps,
        ca2=ca2,
        slo=slo,
    )
    return (ev.prefill if pool == "prefill" else ev.decode).meets_slo


def safety(
    pool: str,
    recommended: int,
    current: int,
    model: CapacityModel,
    raw_rate_rps: float,
    ca2: float,
    aimed: SloTargets,
    headroom: float,
) -> tuple[int, ReasonEntry | None]:
    """A scale-down must also hold at the current raw rate, not only the smoothed one
    (judged against the targets the recommendation aimed at)."""
    if recommended >= current:
        return recommended, None
    if _meets_at(model, pool, recommended, raw_rate_rps, ca2, aimed, headroom):
        return recommended, ReasonEntry(
            stage=Stage.SAFETY,
            reason=Reason.SCALE_DOWN_SAFE,
            pool=pool,
            detail=f"{recommended} workers meet the SLO at the current {raw_rate_rps:.3g} req/s",
        )
    # Find the smallest count between recommended and current that is safe now.
    for n in range(recommended + 1, current):
        if _meets_at(model, pool, n, raw_rate_rps, ca2, aimed, headroom):
            return n, ReasonEntry(
                stage=Stage.SAFETY,
                reason=Reason.SCALE_DOWN_UNSAFE,
                pool=pool,
                detail=f"{recommended} would miss the SLO at the current "
                f"{raw_rate_rps:.3g} req/s; {n} is safe",
            )
    return current, ReasonEntry(
        stage=Stage.SAFETY,
        reason=Reason.SCALE_DOWN_UNSAFE,
        pool=pool,
        detail=f"fewer than {current} would miss the SLO at the current {raw_rate_rps:.3g} req/s",
    )


def dead_band(
    pool: str, target: int, current: int, config: ControllerConfig
) -> tuple[int, ReasonEntry | None]:
    if current > 0 and target != current and abs(target - current) / current < config.dead_band:
        return current, ReasonEntry(
            stage=Stage.DEAD_BAND,
            reason=Reason.WITHIN_DEAD_BAND,
            pool=pool,
            detail=f"{target} is within {config.dead_band:.0%} of {current}",
        )
    return target, None


def stabilise(
    pool: str,
    target: int,
    current: int,
    pstate: PoolState,
    config: ControllerConfig,
    now_s: float,
) -> tuple[int, PoolState, ReasonEntry | None]:
    """Scale down only after lower recommendations held for the stabilisation window."""
    if target >= current:
        return target, replace(pstate, below_since_s=None, below_max=None), None
    since = pstate.below_since_s if pstate.below_since_s is not None else now_s
    highest = max(target, pstate.below_max or 0)
    held_s = now_s - since
    if held_s < config.scale_down_stabilisation_s:
        return (
            current,
            replace(pstate, below_since_s=since, below_max=highest),
            ReasonEntry(
                stage=Stage.STABILISE,
                reason=Reason.STABILISING,
                pool=pool,
                detail=f"lower target held {held_s:.0f} s of "
                f"{config.scale_down_stabilisation_s:g} s",
            ),
        )
    return (
        highest,
        replace(pstate, below_since_s=since, below_max=highest),
        ReasonEntry(
            stage=Stage.STABILISE,
            reason=Reason.STABILISED,
            pool=pool,
            detail=f"lower target held {held_s:.0f} s: down to the highest seen, {highest}",
        ),
    )


def cooldown(
    pool: str,
    target: int,
    current: int,
    pstate: PoolState,
    config: ControllerConfig,
    now_s: float,
) -> tuple[int, ReasonEntry | None]:
    if target == current or pstate.last_change_s is None:
        return target, None
    waited_s = now_s - pstate.last_change_s
    if target > current and waited_s < config.scale_up_cooldown_s:
        return current, ReasonEntry(
            stage=Stage.COOLDOWN,
            reason=Reason.COOLDOWN_UP,
            pool=pool,
            detail=f"{waited_s:.0f} s since the last change (up cooldown "
            f"{config.scale_up_cooldown_s:g} s)",
        )
    if target < current and waited_s < config.scale_down_cooldown_s:
        return current, ReasonEntry(
            stage=Stage.COOLDOWN,
            reason=Reason.COOLDOWN_DOWN,
            pool=pool,
            detail=f"{waited_s:.0f} s since the last change (down cooldown "
            f"{config.scale_down_cooldown_s:g} s)",
        )
    return target, None


def rate_limit(
    pool: str, target: int, current: int, config: ControllerConfig
) -> tuple[int, ReasonEntry | None]:
    step = max(1, math.floor(config.max_step_fraction * current))
    limited = min(max(target, current - step), current + step)
    if limited != target:
        return limited, ReasonEntry(
            stage=Stage.RATE_LIMIT,
            reason=Reason.RATE_LIMITED,
            pool=pool,
            detail=f"{target} is more than {step} from {current}: {limited} this tick",
        )
    return target, None


def clamp(
    targets: dict[str, int],
    config: ControllerConfig,
    profile: IterationProfile,
    model: CapacityModel | None,
    rate_rps: float,
    ca2: float,
) -> tuple[dict[str, int], list[ReasonEntry]]:
    entries: list[ReasonEntry] = []
    out = dict(targets)
    for pool in POOLS:
        limits = config.prefill if pool == "prefill" else config.decode
        if out[pool] < limits.min_replicas:
            entries.append(
                ReasonEntry(
                    stage=Stage.CLAMP,
                    reason=Reason.CLAMPED_MIN,
                    pool=pool,
                    detail=f"{out[pool]} raised to min {limits.min_replicas}",
                )
            )
            out[pool] = limits.min_replicas
        if out[pool] > limits.max_replicas:
            entries.append(
                ReasonEntry(
                    stage=Stage.CLAMP,
                    reason=Reason.CLAMPED_MAX,
                    pool=pool,
                    detail=f"{out[pool]} lowered to max {limits.max_replicas}",
                )
            )
            out[pool] = limits.max_replicas
    if config.gpu_budget is None:
        return out, entries
    workers_budget = config.gpu_budget // profile.tensor_parallel
    if out["prefill"] + out["decode"] <= workers_budget:
        return out, entries
    split = _split_budget(workers_budget, config, model, rate_rps, ca2)
    entries.append(
        ReasonEntry(
            stage=Stage.CLAMP,
            reason=Reason.GPU_BUDGET,
            pool=None,
            detail=f"{out['prefill']}+{out['decode']} workers exceed the budget of "
            f"{config.gpu_budget} GPUs ({workers_budget} workers of TP{profile.tensor_parallel}): "
            f"{split['prefill']}+{split['decode']} minimises the predicted SLO violation",
        )
    )
    return split, entries


def _split_budget(
    workers: int,
    config: ControllerConfig,
    model: CapacityModel | None,
    rate_rps: float,
    ca2: float,
) -> dict[str, int]:
    """The (prefill, decode) split of ``workers`` with the smallest worst P99/SLO ratio."""
    lo = max(config.prefill.min_replicas, 1)
    hi = min(config.prefill.max_replicas, workers - max(config.decode.min_replicas, 1))
    best: tuple[float, int] | None = None
    for n in range(lo, max(lo, hi) + 1):
        m = min(workers - n, config.decode.max_replicas)
        if m < max(config.decode.min_replicas, 1):
            continue
        violation = _violation(n, m, config, model, rate_rps, ca2)
        if best is None or violation < best[0]:
            best = (violation, n)
    if best is None:
        return {"prefill": config.prefill.min_replicas, "decode": config.decode.min_replicas}
    n = best[1]
    return {"prefill": n, "decode": min(workers - n, config.decode.max_replicas)}


def _violation(
    n: int,
    m: int,
    config: ControllerConfig,
    model: CapacityModel | None,
    rate_rps: float,
    ca2: float,
) -> float:
    if model is None or rate_rps <= 0:
        return 0.0
    slo = SloTargets(ttft_p99_s=config.slo.ttft_p99_s, tpot_p99_s=config.slo.tpot_p99_s)
    ev = evaluate(
        model, prefill_workers=n, decode_workers=m, arrival_rate_rps=rate_rps, ca2=ca2, slo=slo
    )
    ttft = math.inf if ev.prefill.p99_s is None else ev.prefill.p99_s / slo.ttft_p99_s
    tpot = math.inf if ev.decode.p99_s is None else ev.decode.p99_s / slo.tpot_p99_s
    return max(ttft, tpot)


# -- the pipeline -----------------------------------------------------------------------


def decide(
    observation: Observation,
    state: ControllerState,
    config: ControllerConfig,
    *,
    now_s: float,
    profile: IterationProfile | None = None,
    forecast_rate_rps: float | None = None,
) -> Decision:
    """One tick. ``profile`` defaults to the built-in one named in ``config.profile``
    (a profile file is read by the caller, since this function does no I/O).

    ``forecast_rate_rps`` (optional, req/s) is a forecaster's rate for when a worker
    started now would serve (a trend or a daily cycle, computed by the caller). It
    raises the planning rate and nothing else (see ``with_forecast``); missing, NaN
    or negative means no forecast."""
    current = {
        "prefill": observation.prefill.current_replicas,
        "decode": observation.decode.current_replicas,
    }
    ok, entry = validate(observation, state, config, now_s)
    reasons: list[ReasonEntry] = [entry]
    if not ok:
        reasons.append(
            ReasonEntry(
                stage=Stage.ACTUATE,
                reason=Reason.NO_CHANGE,
                pool=None,
                detail="holding on stale or missing metrics",
            )
        )
        return Decision(
            prefill_target=current["prefill"],
            decode_target=current["decode"],
            prefill_current=current["prefill"],
            decode_current=current["decode"],
            actuate=False,
            state=replace(state, last_tick_s=now_s),
            reasons=tuple(reasons),
            raw_rate_rps=observation.arrival_rate_rps,
            smoothed_rate_rps=state.smoothed_rate_rps,
            observed_ttft_p99_s=observation.ttft_p99_s,
            observed_tpot_p99_s=observation.tpot_p99_s,
        )
    profile = profile or resolve_profile(config.profile)
    raw_rate = float(observation.arrival_rate_rps or 0.0)
    ca2 = observation.interarrival_scv if usable(observation.interarrival_scv) else None
    ca2_value = 1.0 if ca2 is None else float(ca2)

    lengths, lengths_entry = choose_lengths(observation, state)
    model = capacity_model(lengths, profile, config)
    behind = {
        pool: overloaded(pool, observation, model, state.pool(pool).predicted_p99_s)
        for pool in POOLS
    }

    smoothed, entry = smooth(observation, state, config)
    reasons.append(entry)
    if lengths_entry is not None:
        reasons.append(lengths_entry)
    rate, maybe = plan_for_overload(smoothed, raw_rate, behind)
    reasons.extend([maybe] if maybe else [])
    forecast = forecast_rate_rps if usable(forecast_rate_rps) else None
    rate, maybe = with_forecast(rate, forecast)
    reasons.extend([maybe] if maybe else [])

    factors, errors, transients, cal_entries = calibrate(observation, state, config, behind, now_s)
    reasons.extend(cal_entries)
    (rec_prefill, rec_decode), aimed, entry = recommend(model, rate, ca2_value, config, factors)
    reasons.append(entry)
    recommended = {"prefill": rec_prefill, "decode": rec_decode}

    targets: dict[str, int] = {}
    pool_states: dict[str, PoolState] = {}
    for pool in POOLS:
        pstate = replace(
            state.pool(pool), calibration=factors[pool], transient_s=transients[pool]
        )
        target = recommended[pool]
        cur = current[pool]
        target, maybe = safety(
            pool, target, cur, model, raw_rate, ca2_value, aimed, config.headroom
        )
        reasons.extend([maybe] if maybe else [])
        target, maybe = dead_band(pool, target, cur, config)
        reasons.extend([maybe] if maybe else [])
        target, pstate, maybe = stabilise(pool, target, cur, pstate, config, now_s)
        reasons.extend([maybe] if maybe else [])
        target, maybe = cooldown(pool, target, cur, pstate, config, now_s)
        reasons.extend([maybe] if maybe else [])
        target, maybe = rate_limit(pool, target, cur, config)
        reasons.extend([maybe] if maybe else [])
        targets[pool] = target
        pool_states[pool] = pstate

    targets, clamp_entries = clamp(targets, config, profile, model, rate, ca2_value)
    reasons.extend(clamp_entries)

    advisory = config.mode is Mode.ADVISORY
    final_states: dict[str, PoolState] = {}
    for pool in POOLS:
        pstate = pool_states[pool]
        if targets[pool] != current[pool]:
            pstate = replace(pstate, last_change_s=now_s, below_since_s=None, below_max=None)
            verdict = Reason.SCALE_UP if targets[pool] > current[pool] else Reason.SCALE_DOWN
            detail = f"{current[pool]} -> {targets[pool]}"
        else:
            verdict, detail = Reason.NO_CHANGE, f"stays at {current[pool]}"
        if advisory:
            detail += " (advisory: not applied)"
        reasons.append(ReasonEntry(stage=Stage.ACTUATE, reason=verdict, pool=pool, detail=detail))
        final_states[pool] = pstate

    if advisory:
        reasons.append(
            ReasonEntry(
                stage=Stage.ACTUATE,
                reason=Reason.ADVISORY,
                pool=None,
                detail="advisory mode: decided and published, not applied",
            )
        )
    # Predictions at the *current* replicas and raw load feed next tick's calibration;
    # predictions at the targets and planning rate are what the status shows (the same
    # evaluation when nothing changes, which is most ticks).
    slo_targets = SloTargets(ttft_p99_s=config.slo.ttft_p99_s, tpot_p99_s=config.slo.tpot_p99_s)
    now_eval = evaluate(
        model,
        prefill_workers=max(1, current["prefill"]),
        decode_workers=max(1, current["decode"]),
        arrival_rate_rps=raw_rate if raw_rate > 0 else 1e-9,
        ca2=ca2_value,
        slo=slo_targets,
    )
    for pool, pred in (("prefill", now_eval.prefill.p99_s), ("decode", now_eval.decode.p99_s)):
        final_states[pool] = replace(
            final_states[pool], predicted_p99_s=pred, predicted_for_replicas=current[pool]
        )
    at_target = now_eval
    if targets != current:
        at_target = evaluate(
            model,
            prefill_workers=max(1, targets["prefill"]),
            decode_workers=max(1, targets["decode"]),
            arrival_rate_rps=rate if rate > 0 else 1e-9,
            ca2=ca2_value,
            slo=slo_targets,
        )
    next_state = ControllerState(
        smoothed_rate_rps=smoothed,
        last_tick_s=now_s,
        prefill=final_states["prefill"],
        decode=final_states["decode"],
        lengths=lengths,
    )
    changed = targets != current
    return Decision(
        prefill_target=targets["prefill"],
        decode_target=targets["decode"],
        prefill_current=current["prefill"],
        decode_current=current["decode"],
        actuate=changed and not advisory,
        state=next_state,
        reasons=tuple(reasons),
        raw_rate_rps=raw_rate,
        smoothed_rate_rps=smoothed,
        forecast_rate_rps=forecast,
        planning_rate_rps=rate,
        recommended=(rec_prefill, rec_decode),
        predicted_ttft_p99_s=at_target.prefill.p99_s,
        predicted_tpot_p99_s=at_target.decode.p99_s,
        observed_ttft_p99_s=observation.ttft_p99_s,
        observed_tpot_p99_s=observation.tpot_p99_s,
        model_error=errors,
    )
