"""From the solver's recommendation to the target a pool is set to.

Applied per pool in this order (HPA-style: each step returns its value and, when it
changed something, a reason):

safety     — a scale-down must also meet the SLOs at the *current* raw rate and at
             the upper quantile of the rate over a scale-up's lead time (a
             smaller pool is safe when it holds what may come before a worker
             added back would serve);
dead-band  — ignore relative changes below the band;
stabilise  — a lower recommendation must hold for the stabilisation window (the
             configured one, or the pool's lead time where its lead-time bounds
             held: ``stabilisation_window``), and the pool scales down to the
             highest recommendation seen in it; a
             surge for a queue or a burst is released at once when it is over,
             and held while the queue lasts;
cooldown   — separate for up and down, from the pool's last change;
rate limit — at most max_step_fraction of the current size per tick, at least one;

then, over both pools, ``clamp``: per-pool min/max and the global GPU budget (split
to minimise the worst predicted P99/SLO ratio when it binds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from controller.config import ControllerConfig, PoolLimits
from controller.policy.leadtime import MIN_JUDGED_BOUNDS, BoundRecord
from controller.policy.state import PoolState
from controller.policy.vocabulary import Reason, ReasonEntry, Stage
from queueing.pools import PerPool, Pool
from queueing.profile import IterationProfile
from queueing.solver import CapacityModel, SloTargets, evaluate_pool


def limits(config: ControllerConfig, pool: Pool) -> PoolLimits:
    return config.prefill if pool is Pool.PREFILL else config.decode


def meets_at(
    model: CapacityModel,
    pool: Pool,
    workers: int,
    rate_rps: float,
    ca2: float,
    aimed: SloTargets,
    headroom: float,
) -> bool:
    """Whether ``workers`` meet the pool's aimed target (with headroom) at ``rate_rps``;
    ``ca2`` is the SCV of the pool's own arrivals (``CapacityModel.arrival_scv``)."""
    if workers < 1 or rate_rps <= 0:
        return rate_rps <= 0
    return evaluate_pool(
        model,
        pool,
        workers=workers,
        arrival_rate_rps=rate_rps,
        ca2=ca2,
        target_s=aimed.of(pool) / (1.0 + headroom),
        quantile=aimed.quantile,
    ).meets_slo


def safety(
    pool: Pool,
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
    if meets_at(model, pool, recommended, raw_rate_rps, ca2, aimed, headroom):
        return recommended, ReasonEntry(
            stage=Stage.SAFETY,
            reason=Reason.SCALE_DOWN_SAFE,
            pool=pool,
            detail=f"{recommended} workers meet the SLO at the current {raw_rate_rps:.3g} req/s",
        )
    # Find the smallest count between recommended and current that is safe now.
    for n in range(recommended + 1, current):
        if meets_at(model, pool, n, raw_rate_rps, ca2, aimed, headroom):
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
    pool: Pool, target: int, current: int, config: ControllerConfig
) -> tuple[int, ReasonEntry | None]:
    if current > 0 and target != current and abs(target - current) / current < config.dead_band:
        return current, ReasonEntry(
            stage=Stage.DEAD_BAND,
            reason=Reason.WITHIN_DEAD_BAND,
            pool=pool,
            detail=f"{target} is within {config.dead_band:.0%} of {current}",
        )
    return target, None


@dataclass(frozen=True, kw_only=True)
class StabilisationWindow:
    """How long a lower recommendation must hold before the pool scales down, and why."""

    window_s: float
    detail: str


def configured_window(config: ControllerConfig) -> StabilisationWindow:
    """The configured ``scale_down_stabilisation_s``."""
    configured = config.scale_down_stabilisation_s
    return StabilisationWindow(window_s=configured, detail=f"{configured:g}-s stabilisation window")


def stabilisation_window(
    record: BoundRecord, *, lead_s: float, config: ControllerConfig, quantile: float
) -> StabilisationWindow:
    """The configured stabilisation window, or the pool's lead time where its
    lead-time bound has held.

    The window keeps a pool from following noisy or bursty recommendations down and
    up again; the lead-time bound already asks that a smaller pool hold the rate's
    upper quantile for as long as a worker added back would take to serve. Where the
    bound is known to hold, waiting a lead time is enough: what arrives before a
    scale-up could come back was planned for. Known from the record
    (``leadtime.judge_bounds``): at least ``MIN_JUDGED_BOUNDS`` bounds, each built
    from the errors of a history long enough to condition them, judged against what
    arrived over their lead time, exceeded no more often than the risk allows (at
    most n x (1 - quantile) of n: none below a hundred). Bursts that recur between
    silences exceed the bound before each burst and keep the configured window; so
    does a cold start, whose bounds rest on too few errors to be judged."""
    configured = config.scale_down_stabilisation_s
    allowed = math.floor(record.judged * (1.0 - quantile) + 1e-9)
    record_text = (
        f"the rate over a lead time exceeded its bound on {record.exceeded} of the last "
        f"{record.judged}"
    )
    kept = configured_window(config)
    if lead_s >= configured:
        return kept
    if record.judged < MIN_JUDGED_BOUNDS:
        why = f"{record.judged} lead-time bounds judged, fewer than {MIN_JUDGED_BOUNDS}"
        return replace(kept, detail=f"{kept.detail} ({why})")
    if record.exceeded > allowed:
        return replace(kept, detail=f"{kept.detail} ({record_text}, more than {allowed})")
    return StabilisationWindow(window_s=lead_s, detail=f"{lead_s:.0f}-s lead time ({record_text})")


def stabilise(
    pool: Pool,
    target: int,
    current: int,
    pstate: PoolState,
    now_s: float,
    *,
    steady: int | None = None,
    queue_left: str | None = None,
    burst: bool = False,
    window: StabilisationWindow,
) -> tuple[int, PoolState, ReasonEntry | None]:
    """Scale down only after lower recommendations held for the stabilisation window
    (``window``: the configured one, or the lead time where the pool's lead-time
    bound has held, ``stabilisation_window``).

    ``steady`` is the recommendation without the workers that drain a prefill queue
    (``leadtime.drain_plan``; None: the same as ``target``). The window holds a pool
    against noise in the rate; a surge for a queue is sized for a known amount of
    work, so once the queue is gone the pool goes back at once to what it would
    have been without it (``surge_base``: its size before the surge, or the steady
    plan since if that is higher), and the window applies below that. Gone means
    observed gone: while ``queue_left`` says why the prefill pool still falls behind
    (a backlog, or arrivals beyond its serving workers: ``steady.overloaded``), the
    surge is held, whatever a re-plan of the drain says. The drain is planned from a
    model of what the serving workers clear, which a queue still growing
    contradicts, and a worker released while it starts is a start-up lost: asked for
    again a tick later, it serves a start-up later than the one that was cancelled.

    ``burst``: this tick planned for the short burst window's rate
    (``smoothing.smooth``). A scale-up for it is a surge too, and its steady plan,
    sized for those few seconds' rate, does not become the base: the window holds
    what the measurement window saw, and a burst is acted on at once but held only
    once a window of the full length shows the rate (a later tick's steady plan,
    which the base then follows). Held as a measured rate, one 5-s cluster of a
    bursty diurnal kept two more prefill and two more decode workers for the 300-s
    window after its queue had cleared and the next window had measured the rate
    back where it was.
    """
    steady = target if steady is None else min(steady, target)
    surging = target > steady
    base = pstate.surge_base
    if base is not None and (current <= base or (target >= current and not surging)):
        # Released (or needed again at the size it reached): no surge any more.
        base = None
    if base is None and (surging or burst) and target >= current:
        base = current
    if base is not None and not burst:
        base = max(base, steady)
    if target >= current:
        return target, replace(pstate, below_since_s=None, below_max=None, surge_base=base), None
    if base is not None:
        if queue_left is not None:
            value, reason = current, Reason.SURGE_HELD
            detail = f"the queue the surge to {current} is for is still there ({queue_left}): held"
        else:
            # Kept until the pool is back at its base: a rate-limited release goes on
            # next tick.
            value, reason = max(target, base), Reason.DRAINED
            detail = (
                f"the queue or burst the surge to {current} was for is "
                + ("smaller" if surging else "over")
                + f": back to {value} at once"
            )
        return (
            value,
            replace(pstate, surge_base=base, below_since_s=None, below_max=None),
            ReasonEntry(stage=Stage.STABILISE, reason=reason, pool=pool, detail=detail),
        )
    pstate = replace(pstate, surge_base=None)
    since = pstate.below_since_s if pstate.below_since_s is not None else now_s
    highest = max(target, pstate.below_max or 0)
    held_s = now_s - since
    if held_s < window.window_s:
        return (
            current,
            replace(pstate, below_since_s=since, below_max=highest),
            ReasonEntry(
                stage=Stage.STABILISE,
                reason=Reason.STABILISING,
                pool=pool,
                detail=f"lower target held {held_s:.0f} s of the {window.detail}",
            ),
        )
    return (
        highest,
        replace(pstate, below_since_s=since, below_max=highest),
        ReasonEntry(
            stage=Stage.STABILISE,
            reason=Reason.STABILISED,
            pool=pool,
            detail=f"lower target held {held_s:.0f} s, the {window.detail}: down to the "
            f"highest seen, {highest}",
        ),
    )


def cooldown(
    pool: Pool,
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
    pool: Pool, target: int, current: int, config: ControllerConfig, *, moved: bool = False
) -> tuple[int, ReasonEntry | None]:
    """At most ``max_step_fraction`` of the current size per tick (at least one).

    The limit keeps a noisy recommendation from moving the pool far; when the tick's
    evidence says the rate itself moved (``moved``: a significant shift, a burst, or
    serving workers falling behind), a scale-up is not held back by it: each tick
    of delay is a tick more of arrivals that the workers, once up, must also clear.
    """
    step = max(1, math.floor(config.max_step_fraction * current))
    up = target - current if moved else step
    limited = min(max(target, current - step), current + max(step, up))
    if limited != target:
        return limited, ReasonEntry(
            stage=Stage.RATE_LIMIT,
            reason=Reason.RATE_LIMITED,
            pool=pool,
            detail=f"{target} is more than {step} from {current}: {limited} this tick",
        )
    return target, None


def normalise(
    pool: Pool,
    recommended: int,
    current: int,
    pstate: PoolState,
    *,
    model: CapacityModel,
    raw_rate_rps: float,
    ca2: float,
    aimed: SloTargets,
    config: ControllerConfig,
    now_s: float,
    moved: bool = False,
    steady: int | None = None,
    queue_left: str | None = None,
    burst: bool = False,
    window: StabilisationWindow,
) -> tuple[int, PoolState, list[ReasonEntry]]:
    """safety -> dead-band -> stabilise -> cooldown -> rate limit, for one pool; a
    drained surge's release (``stabilise``'s ``drained``) ends the chain there.

    ``raw_rate_rps`` is the rate the safety check judges a scale-down at: the larger
    of the window's measured rate and the pool's lead-time upper quantile; ``ca2`` the
    SCV of the pool's own arrivals (``CapacityModel.arrival_scv``); ``steady`` the
    recommendation without the workers that drain a queue and ``queue_left`` why the
    prefill queue is still there, and ``window`` how long a lower recommendation must
    hold (``stabilise``)."""
    entries: list[ReasonEntry] = []

    def note(entry: ReasonEntry | None) -> None:
        if entry is not None:
            entries.append(entry)

    target, entry = safety(
        pool, recommended, current, model, raw_rate_rps, ca2, aimed, config.headroom
    )
    note(entry)
    target, entry = dead_band(pool, target, current, config)
    note(entry)
    target, pstate, entry = stabilise(
        pool,
        target,
        current,
        pstate,
        now_s,
        steady=steady,
        queue_left=queue_left,
        burst=burst,
        window=window,
    )
    note(entry)
    if entry is not None and entry.reason is Reason.DRAINED:
        # A drained surge is released without the down cooldown or the rate limit: both
        # hold a pool against noisy recommendations, and the surge's end is no noise.
        # Its base is the size the pool had before it (or the steady plan of the
        # windows since), so the release lands where the pool was, in one scale event
        # rather than one per halving.
        return target, pstate, entries
    target, entry = cooldown(pool, target, current, pstate, config, now_s)
    note(entry)
    target, entry = rate_limit(pool, target, current, config, moved=moved)
    note(entry)
    return target, pstate, entries


def clamp(
    targets: PerPool[int],
    config: ControllerConfig,
    profile: IterationProfile,
    model: CapacityModel | None,
    rate_rps: float,
    ca2: float,
) -> tuple[PerPool[int], list[ReasonEntry]]:
    """Per-pool bounds, then the GPU budget over both pools."""
    entries: list[ReasonEntry] = []
    out = targets
    for pool, value in targets.items():
        bounds = limits(config, pool)
        if value < bounds.min_replicas:
            entries.append(
                ReasonEntry(
                    stage=Stage.CLAMP,
                    reason=Reason.CLAMPED_MIN,
                    pool=pool,
                    detail=f"{value} raised to min {bounds.min_replicas}",
                )
            )
            value = bounds.min_replicas
        if value > bounds.max_replicas:
            entries.append(
                ReasonEntry(
                    stage=Stage.CLAMP,
                    reason=Reason.CLAMPED_MAX,
                    pool=pool,
                    detail=f"{value} lowered to max {bounds.max_replicas}",
                )
            )
            value = bounds.max_replicas
        out = out.with_value(pool, value)
    if config.gpu_budget is None:
        return out, entries
    workers_budget = config.gpu_budget // profile.tensor_parallel
    if out.prefill + out.decode <= workers_budget:
        return out, entries
    split = split_budget(workers_budget, config, model, rate_rps, ca2)
    entries.append(
        ReasonEntry(
            stage=Stage.CLAMP,
            reason=Reason.GPU_BUDGET,
            pool=None,
            detail=f"{out.prefill}+{out.decode} workers exceed the budget of "
            f"{config.gpu_budget} GPUs ({workers_budget} workers of TP{profile.tensor_parallel}): "
            f"{split.prefill}+{split.decode} minimises the predicted SLO violation",
        )
    )
    return split, entries


def split_budget(
    workers: int,
    config: ControllerConfig,
    model: CapacityModel | None,
    rate_rps: float,
    ca2: float,
) -> PerPool[int]:
    """The (prefill, decode) split of ``workers`` with the smallest worst P99/SLO ratio."""
    lo = max(config.prefill.min_replicas, 1)
    hi = min(config.prefill.max_replicas, workers - max(config.decode.min_replicas, 1))
    best: tuple[float, int] | None = None
    for n in range(lo, max(lo, hi) + 1):
        m = min(workers - n, config.decode.max_replicas)
        if m < max(config.decode.min_replicas, 1):
            continue
        violation = worst_slo_ratio(PerPool(prefill=n, decode=m), config, model, rate_rps, ca2)
        if best is None or violation < best[0]:
            best = (violation, n)
    if best is None:
        return PerPool(prefill=config.prefill.min_replicas, decode=config.decode.min_replicas)
    n = best[1]
    return PerPool(prefill=n, decode=min(workers - n, config.decode.max_replicas))


def worst_slo_ratio(
    workers: PerPool[int],
    config: ControllerConfig,
    model: CapacityModel | None,
    rate_rps: float,
    ca2: float,
) -> float:
    """The larger of predicted P99 / SLO over both pools (inf when one is unstable)."""
    if model is None or rate_rps <= 0:
        return 0.0
    slo = SloTargets(ttft_p99_s=config.slo.ttft_p99_s, tpot_p99_s=config.slo.tpot_p99_s)
    ratios = []
    for pool, n in workers.items():
        pool_ca2 = model.arrival_scv(
            pool, prefill_workers=workers.prefill, arrival_rate_rps=rate_rps, ca2=ca2
        )
        p99 = evaluate_pool(
            model, pool, workers=n, arrival_rate_rps=rate_rps, ca2=pool_ca2, target_s=slo.of(pool)
        ).p99_s
        ratios.append(math.inf if p99 is None else p99 / slo.of(pool))
    return max(ratios)
