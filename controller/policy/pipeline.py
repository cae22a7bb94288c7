"""The decision: ``decide(observation, state, config, ...) -> Decision``.

Pure: no I/O, no clock, no randomness — the same inputs give the same decision, so
the control loop, the simulator's back-testing and the tests all run this one copy
(through ``controller.tick.run_tick``). One tick is this list of stages, each a
function in its own module returning its value and a reason (HPA-style):

1. validate   (smoothing)     — hold on missing, NaN, negative or stale data;
2. smooth     (smoothing, leadtime)
                              — start-ups measured, the length mix and SCV pooled,
                                EMA of the rate with shift, burst and overload
                                bypasses, each pool's upper quantile of the rate
                                over its lead time, the forecast read where each
                                pool's load will be (it only raises the planning
                                rate);
3. calibrate  (calibration)   — observed / predicted P99 per pool, outside transients;
4. recommend  (recommend)     — the solver at the planning rate with headroom;
5. normalise  (normalisation) — safety at the raw rate, dead-band, stabilisation,
                                cooldowns, rate limit, per pool;
6. clamp      (normalisation) — min/max and the GPU budget over both pools;
7. actuate                    — the verdict per pool, and the predictions that the
                                next tick's calibration compares with.
"""

from __future__ import annotations

from dataclasses import replace

from controller.config import ControllerConfig, Mode
from controller.observation import Observation, usable
from controller.policy.calibration import calibrate
from controller.policy.decision import Decision, PoolDecision
from controller.policy.leadtime import (
    MIN_POOLED_REQUESTS,
    MIN_REGRESSION,
    bound_entry,
    detection_z,
    drain_entry,
    drain_plan,
    forecast_at,
    forecast_horizon_s,
    judge_bounds,
    lead_ticks,
    lead_time_s,
    measure_startup,
    newest_scv,
    pool_window,
    pooled_lengths,
    pooled_requests,
    rate_upper,
    record_sample,
    response_s,
    risk_z,
    since_mix_shift,
    window_spread,
)
from controller.policy.models import CapacityModels
from controller.policy.normalisation import (
    clamp,
    configured_window,
    normalise,
    stabilisation_window,
)
from controller.policy.recommend import recommend
from controller.policy.smoothing import (
    MIX_STATISTICS,
    choose_lengths,
    plan_for_overload,
    smooth,
    validate,
    with_forecast,
)
from controller.policy.state import BoundSample, ControllerState, PoolState, RateSample
from controller.policy.steady import overloaded
from controller.policy.vocabulary import Reason, ReasonEntry, Stage, outcome
from queueing.catalog import resolve_profile
from queueing.lengths import observed_within_context
from queueing.pools import PerPool, Pool
from queueing.profile import IterationProfile
from queueing.solver import DEFAULT_QUANTILE, CapacityModel, predicted_quantile_s


def decide(
    observation: Observation,
    state: ControllerState,
    config: ControllerConfig,
    *,
    now_s: float,
    models: CapacityModels,
    profile: IterationProfile | None = None,
    forecast_rate_rps: float | None = None,
) -> Decision:
    """One tick. ``profile`` defaults to the built-in one named in ``config.profile``
    (a profile file is read by the caller, since this function does no I/O);
    ``models`` is the caller's cache of capacity models.

    ``forecast_rate_rps`` (optional, req/s) is a forecaster's rate for
    ``leadtime.forecast_horizon_s`` ahead (``forecast.forecast_rate_rps``); each pool
    reads it on the line from the estimate at its own horizon, its lead time less the
    time its load takes to follow the rate (``leadtime.response_s``). It raises the
    planning rate and nothing else (see ``smoothing.with_forecast``); missing, NaN or
    negative means no forecast."""
    current = PerPool.build(lambda pool: observation.replicas(pool).current_replicas)
    ok, entry = validate(observation, state, config, now_s)
    if not ok:
        return _hold(observation, state, current, entry, now_s)
    reasons: list[ReasonEntry] = [entry]
    profile = profile or resolve_profile(config.profile)
    raw_rate = float(observation.arrival_rate_rps or 0.0)
    z = risk_z(DEFAULT_QUANTILE)
    lead = config.lead_time
    seen_scv = observation.interarrival_scv if usable(observation.interarrival_scv) else None

    # Start-ups measured from the actuator's replicas (decision to ready).
    measured_pools: dict[Pool, PoolState] = {}
    for pool in Pool:
        pstate, maybe = measure_startup(
            pool, observation.replicas(pool), state.pools[pool], config, now_s
        )
        measured_pools[pool] = pstate
        reasons.extend([maybe] if maybe else [])

    # The shift, burst and overload tests share one threshold (Bonferroni over the
    # history's ticks, ``leadtime.detection_z``), and so does the prompts' test.
    ticks = max(1.0, lead.history_s / config.interval_s)
    detect_z = detection_z(DEFAULT_QUANTILE, ticks)
    # The length mix pooled over lead.pool_s of windows, this one included (the ca², read
    # over that span by the source, is the newest).
    windows = pool_window(
        state.length_windows, observation.lengths, now_s=now_s, pool_s=lead.pool_s
    )
    windows, shifted = since_mix_shift(windows, window_s=config.window_s, z=detect_z)
    if shifted is not None:
        reasons.append(
            ReasonEntry(
                stage=Stage.SMOOTH, reason=Reason.LENGTHS_SHIFTED, pool=None, detail=shifted
            )
        )
    seen_lengths = pooled_lengths(windows, now_s=now_s, window_s=config.window_s)
    if seen_lengths is not None and not seen_lengths.decoding.any():
        # Every request of the pool ended at its first token (scoring, embedding or
        # max_tokens=1 probes): none reached the decode pool, so the mix says nothing
        # of what the decode pool serves, and no decode model can be built from it.
        # The decode pool's load is the last mix that decoded; without one, hold.
        no_decode = (
            "no request of the pooled length mix has more than one output token: "
            "the decode pool cannot be sized from it"
        )
        if state.lengths is None:
            idle = ReasonEntry(
                stage=Stage.VALIDATE,
                reason=Reason.METRICS_STALE,
                pool=None,
                detail=f"{no_decode}; holding the current replicas",
            )
            return _hold(observation, replace(state, length_windows=windows), current, idle, now_s)
        reasons.append(
            ReasonEntry(
                stage=Stage.SMOOTH,
                reason=Reason.LENGTHS_KEPT,
                pool=None,
                detail=f"{no_decode}; the mix it last moved to stays",
            )
        )
        seen_lengths = None
    if seen_lengths is None and state.lengths is None:
        # A first mix of a few requests would size a P99 on a handful of prompts (the
        # first to finish after a start are the short ones): wait, gathering windows.
        few = ReasonEntry(
            stage=Stage.VALIDATE,
            reason=Reason.METRICS_STALE,
            pool=None,
            detail=f"length mix of about {pooled_requests(windows, window_s=config.window_s):.0f} "
            f"requests, fewer than the {MIN_POOLED_REQUESTS} a P99 needs: holding the "
            "current replicas",
        )
        return _hold(observation, replace(state, length_windows=windows), current, few, now_s)
    # The kept mix is judged on MIX_STATISTICS figures a tick: Bonferroni over them too.
    mix_z = detection_z(DEFAULT_QUANTILE, MIX_STATISTICS * ticks)
    lengths, lengths_entry = choose_lengths(seen_lengths, state.lengths, z=mix_z)
    this_tick = RateSample(time_s=now_s, rate_rps=raw_rate, estimate_rps=raw_rate, scv=seen_scv)
    pooled = newest_scv((*state.rates, this_tick), now_s=now_s, pool_s=lead.pool_s)
    ca2_value = 1.0 if pooled is None else pooled
    # Observed requests fit the context; pairs rebuilt from histograms may not.
    fitting = observed_within_context(lengths, profile.max_context_tokens)
    model = models.get(fitting, profile, config)
    behind = PerPool.build(
        lambda pool: overloaded(
            pool,
            observation,
            model,
            state.pools[pool].predicted_p99_s,
            ca2=ca2_value,
            window_s=config.window_s,
            z=detect_z,
        )
    )

    # The spread over the whole history: over a few windows it is too noisy an
    # estimate (a low one by chance would read ordinary noise as a shift).
    spread = window_spread(
        state.rates, now_s=now_s, pool_s=lead.history_s, interval_s=config.interval_s
    )
    smoothed, entry = smooth(
        observation,
        state,
        config,
        ca2=ca2_value,
        spread_rps=spread or 0.0,
        z=detect_z,
    )
    reasons.append(entry)
    if lengths_entry is not None:
        reasons.append(lengths_entry)
    estimate, maybe = plan_for_overload(smoothed, raw_rate, behind)
    reasons.extend([maybe] if maybe else [])
    keep_s = lead.history_s + 2 * max(lead_time_s(p, config) for p in measured_pools.values())
    rates = record_sample(state.rates, replace(this_tick, estimate_rps=estimate), keep_s=keep_s)
    # Each pool plans for the upper quantile of the rate over its own lead time.
    upper = PerPool.build(
        lambda pool: rate_upper(
            rates[:-1],
            estimate_rps=estimate,
            ca2=ca2_value,
            lead_s=lead_time_s(measured_pools[pool], config),
            z=z,
            config=config,
            now_s=now_s,
            measured_rps=raw_rate,
        )
    )
    queue = observation.prefill_queue_depth
    queued = queue if usable(queue) and queue is not None and queue > 0 else 0.0
    # The arrivals each pool plans for over its lead time (the drain below starts
    # from them).
    arriving = upper.map(lambda b: b.upper_rps)
    if lead.enabled:
        reasons.extend(bound_entry(pool, b, z) for pool, b in upper.items())
        # What the prefill pool must absorb over its lead time is the arrivals and
        # the prompts already queued: the queue adds its size over the lead time.
        planned = arriving.with_value(
            Pool.PREFILL, arriving.prefill + queued / upper.prefill.lead_s
        )
    else:
        planned = PerPool.both(estimate)
    forecast = forecast_rate_rps if usable(forecast_rate_rps) else None
    if forecast is not None:
        horizon = forecast_horizon_s(state.pools, config)
        for pool in Pool:
            # Each pool reads the forecast where its load will be when a worker asked
            # for now serves: its lead time less the time its load takes to follow
            # the rate (a decode batch lags the arrivals by its relaxation time).
            lag = response_s(
                pool, model, workers=current[pool], rate_rps=estimate, toward_rps=forecast
            )
            pool_lead = lead_time_s(measured_pools[pool], config) if lead.enabled else horizon
            ahead_s = min(max(pool_lead - lag, 0.0), horizon)
            seen = forecast_at(forecast, estimate_rps=estimate, horizon_s=horizon, at_s=ahead_s)
            value, maybe = with_forecast(planned[pool], seen, pool=pool, read_at_s=ahead_s)
            planned = planned.with_value(pool, value)
            reasons.extend([maybe] if maybe else [])
    rate = max(planned.prefill, planned.decode)

    moved = any(
        r.reason in (Reason.RATE_SHIFTED, Reason.BURST_DETECTED, Reason.OVERLOAD_DETECTED)
        for r in reasons
    )
    burst = any(r.reason is Reason.BURST_DETECTED for r in reasons)
    calibration = calibrate(observation, state, config, behind, now_s)
    reasons.extend(c.entry for _, c in calibration.items() if c.entry is not None)
    factors = calibration.map(lambda c: c.factor)
    recommended, aimed, entry = recommend(model, planned, ca2_value, config, factors)
    steady = recommended
    # The new workers serve only in the lead time's last tick, and the queue grows
    # until they do: what the pools must absorb to clear it by the lead time's end
    # (the workers beyond the steady plan released once they have).
    drain = (
        drain_plan(
            arriving,
            queue=queued,
            serving_workers=observation.replicas(Pool.PREFILL).ready_replicas,
            packed_service_s=model.prefill.packed_service_s,
            startup_s=upper.prefill.lead_s - config.interval_s,
            interval_s=config.interval_s,
        )
        if lead.enabled
        else None
    )
    if drain is not None:
        reasons.append(drain_entry(drain, upper.prefill.lead_s - config.interval_s))
        recommended, aimed, entry = recommend(model, drain.rates_rps, ca2_value, config, factors)
        recommended = PerPool.build(lambda pool: max(recommended[pool], steady[pool]))
    reasons.append(entry)

    normalised: dict[Pool, tuple[int, PoolState]] = {}
    for pool in Pool:
        bounds = measured_pools[pool].bounds
        window = configured_window(config)
        if lead.enabled:
            # How long a lower recommendation must hold follows how the pool's bounds
            # held. This tick's bound is judged once its lead time has passed, if it
            # rests on as many errors as the gap line needs: a cold start's bounds,
            # from a few minutes of history, are not the ones the window would trust.
            record = judge_bounds(
                bounds,
                rates,
                now_s=now_s,
                history_s=lead.history_s,
                interval_s=config.interval_s,
            )
            window = stabilisation_window(
                record, lead_s=upper[pool].lead_s, config=config, quantile=DEFAULT_QUANTILE
            )
            if upper[pool].history >= MIN_REGRESSION:
                ticks = lead_ticks(upper[pool].lead_s, config.interval_s)
                sample = BoundSample(time_s=now_s, upper_rps=upper[pool].upper_rps, ticks=ticks)
                bounds = record_sample(bounds, sample, keep_s=keep_s)
        pstate = replace(
            measured_pools[pool],
            calibration=calibration[pool].factor,
            transient_s=calibration[pool].transient_s,
            bounds=bounds,
        )
        judged_rps = max(raw_rate, planned[pool]) if lead.enabled else raw_rate
        target, pstate, entries = normalise(
            pool,
            recommended[pool],
            current[pool],
            pstate,
            model=model,
            raw_rate_rps=judged_rps,
            # The decode pool's arrivals are the prefill pool's departures; a scale-down
            # is judged behind the larger of its current and recommended sizes, which
            # smooths the bursts least.
            ca2=model.arrival_scv(
                pool,
                prefill_workers=max(current.prefill, recommended.prefill),
                arrival_rate_rps=max(judged_rps, 1e-9),
                ca2=ca2_value,
            ),
            aimed=aimed,
            config=config,
            now_s=now_s,
            moved=moved,
            steady=steady[pool],
            # Both pools' surges are for the prefill queue (the decode pool's for its
            # drain's departures): held while it lasts.
            queue_left=behind.prefill,
            burst=burst,
            window=window,
        )
        reasons.extend(entries)
        normalised[pool] = target, pstate
    targets, clamp_entries = clamp(
        PerPool.build(lambda pool: normalised[pool][0]), config, profile, model, rate, ca2_value
    )
    reasons.extend(clamp_entries)

    advisory = config.mode is Mode.ADVISORY
    pool_states: dict[Pool, PoolState] = {}
    for pool in Pool:
        pstate = normalised[pool][1]
        if targets[pool] != current[pool]:
            pstate = replace(pstate, last_change_s=now_s, below_since_s=None, below_max=None)
            if targets[pool] > current[pool] and not advisory and pstate.scale_up_since_s is None:
                # Timed until every asked-for worker is ready (``measure_startup``).
                # While one is being timed, a further scale-up is not: its workers
                # serve after the pending ones, so restarting the clock on each step
                # of a climb (or of a surge that is then cut back) would leave
                # nothing timed.
                pstate = replace(
                    pstate,
                    scale_up_since_s=now_s,
                    scale_up_to=targets[pool],
                    scale_up_from=current[pool],
                )
            verdict = Reason.SCALE_UP if targets[pool] > current[pool] else Reason.SCALE_DOWN
            detail = f"{current[pool]} -> {targets[pool]}"
        else:
            verdict, detail = Reason.NO_CHANGE, f"stays at {current[pool]}"
        if advisory:
            detail += " (advisory: not applied)"
        reasons.append(ReasonEntry(stage=Stage.ACTUATE, reason=verdict, pool=pool, detail=detail))
        # The prediction at the *current* replicas and raw load feeds next tick's
        # calibration (it is compared with what this window will show).
        pool_states[pool] = replace(
            pstate,
            predicted_p99_s=_predict(model, pool, current, raw_rate, ca2_value),
            predicted_for_replicas=current[pool],
        )
    if advisory:
        reasons.append(
            ReasonEntry(
                stage=Stage.ACTUATE,
                reason=Reason.ADVISORY,
                pool=None,
                detail="advisory mode: decided and published, not applied",
            )
        )
    explained = tuple(reasons)
    changed = targets != current

    def pool_decision(pool: Pool) -> PoolDecision:
        # What the status shows: the prediction at the target and the planning rate
        # (the same as the one at the current replicas when nothing changes, which
        # is most ticks).
        shown = pool_states[pool].predicted_p99_s
        if changed:
            shown = _predict(model, pool, targets, rate, ca2_value)
        return PoolDecision(
            target=targets[pool],
            current=current[pool],
            outcome=outcome(explained, pool),
            reasons=tuple(r for r in explained if r.concerns(pool)),
            recommended=recommended[pool],
            predicted_p99_s=shown,
            observed_p99_s=observation.observed_p99_s(pool),
            model_error=calibration[pool].model_error,
        )

    return Decision(
        pools=PerPool.build(pool_decision),
        actuate=changed and not advisory,
        state=ControllerState(
            smoothed_rate_rps=smoothed,
            last_tick_s=now_s,
            pools=PerPool.build(lambda pool: pool_states[pool]),
            lengths=lengths,
            rates=rates,
            length_windows=windows,
        ),
        reasons=explained,
        raw_rate_rps=raw_rate,
        smoothed_rate_rps=smoothed,
        forecast_rate_rps=forecast,
        planning_rate_rps=rate,
    )


def _predict(
    model: CapacityModel,
    pool: Pool,
    workers: PerPool[int],
    rate_rps: float,
    ca2: float,
) -> float | None:
    """The pool's predicted P99 at ``workers`` (at least one each) and ``rate_rps``;
    the decode pool's behind the prefill pool's departures."""
    rate = rate_rps if rate_rps > 0 else 1e-9
    return predicted_quantile_s(
        model,
        pool,
        workers=max(1, workers[pool]),
        arrival_rate_rps=rate,
        ca2=model.arrival_scv(
            pool, prefill_workers=max(1, workers.prefill), arrival_rate_rps=rate, ca2=ca2
        ),
    )


def _hold(
    observation: Observation,
    state: ControllerState,
    current: PerPool[int],
    entry: ReasonEntry,
    now_s: float,
) -> Decision:
    """Stale or missing data: keep every pool as it is and say so."""
    reasons = (
        entry,
        ReasonEntry(
            stage=Stage.ACTUATE,
            reason=Reason.NO_CHANGE,
            pool=None,
            detail="holding on stale or missing metrics",
        ),
    )
    return Decision(
        pools=PerPool.build(
            lambda pool: PoolDecision(
                target=current[pool],
                current=current[pool],
                outcome=outcome(reasons, pool),
                reasons=reasons,
                observed_p99_s=observation.observed_p99_s(pool),
            )
        ),
        actuate=False,
        state=replace(state, last_tick_s=now_s),
        reasons=reasons,
        raw_rate_rps=observation.arrival_rate_rps,
        smoothed_rate_rps=state.smoothed_rate_rps,
    )
