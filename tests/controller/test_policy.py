"""decide(): each stage table-driven, then behaviour over hours of simulated clock."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from controller.config import ControllerConfig, Mode, PoolLimits, SloConfig
from controller.observation import Observation, PoolObservation
from controller.observation import Observation as Seen
from controller.policy import (
    CapacityModels,
    ControllerState,
    Decision,
    PoolState,
    Reason,
)
from controller.policy import decide as decide_with
from controller.policy.forecast import RecordedArrivals
from controller.policy.leadtime import lead_time_s
from controller.policy.normalisation import (
    configured_window,
    cooldown,
    dead_band,
    normalise,
    rate_limit,
    safety,
    stabilise,
)
from controller.policy.smoothing import smooth
from controller.policy.state import RateSample
from controller.policy.steady import overloaded
from controller.policy.vocabulary import Stage
from controller.tick import run_tick
from queueing.catalog import resolve_profile
from queueing.lengths import LengthSamples, observed_within_context
from queueing.pools import PerPool, Pool
from queueing.profile import exceeds_context
from queueing.solver import CapacityModel, KvLink, SloTargets, evaluate, solve
from sim.trace_io import load_lengths

ROOT = Path(__file__).resolve().parents[2]
_ALL = load_lengths(ROOT / "data/traces/AzureLLMInferenceTrace_conv.csv")
CONFIG = ControllerConfig(
    profile="llama-2-70b-tp4@h100-sxm", slo=SloConfig(ttft_p99_s=1.0, tpot_p99_s=0.1)
)
PROFILE = resolve_profile(CONFIG.profile)
WINDOW = configured_window(CONFIG)
# What a router in front of this 4k-context model would have counted: the requests
# that fit its context (it rejects the others before they are observed).
_FITS = ~exceeds_context(_ALL.prompt_tokens, _ALL.output_tokens, PROFILE.max_context_tokens)
LENGTHS = LengthSamples(
    prompt_tokens=_ALL.prompt_tokens[_FITS][::8].copy(),
    output_tokens=_ALL.output_tokens[_FITS][::8].copy(),
    source="conv/8, within the context",
)
# A lower bound on one prompt's prefill time: its tokens at the per-token cost alone
# (no fixed cost per iteration, no attention). So N workers serve at most
# N / MIN_PROMPT_S prompts per second, whatever the model makes of the rest.
MIN_PROMPT_S = float(LENGTHS.prompt_tokens.mean()) * PROFILE.t_tok_s


def observation(
    t: float,
    rate: float | None,
    prefill: int,
    decode: int,
    *,
    burst: float | None = None,
    lengths: LengthSamples | None = LENGTHS,
    ttft: float | None = None,
    tpot: float | None = None,
    prefill_ready: int | None = None,
    queue: float | None = None,
) -> Observation:
    return Observation(
        time_s=t,
        prefill=PoolObservation(
            current_replicas=prefill,
            ready_replicas=prefill if prefill_ready is None else prefill_ready,
        ),
        decode=PoolObservation(current_replicas=decode, ready_replicas=decode),
        arrival_rate_rps=rate,
        burst_arrival_rate_rps=burst,
        interarrival_scv=1.0,
        lengths=lengths,
        ttft_p99_s=ttft,
        tpot_p99_s=tpot,
        prefill_queue_depth=queue,
    )


# The capacity-model cache is the caller's: these tests share one.
MODELS = CapacityModels()


def decide(
    observation: Seen, state: ControllerState, config: ControllerConfig, **kwargs: object
) -> Decision:
    return decide_with(observation, state, config, models=MODELS, **kwargs)  # type: ignore[arg-type]


def recommended(d: Decision) -> tuple[int, int] | None:
    """The solver's (prefill, decode) answer before normalisation, if one ran."""
    n, m = d.pools.prefill.recommended, d.pools.decode.recommended
    return None if n is None or m is None else (n, m)


class IdealActuator:
    """Workers appear (and serve) the moment they are asked for."""

    def __init__(self, start: tuple[int, int]) -> None:
        self.replicas = {Pool.PREFILL: start[0], Pool.DECODE: start[1]}

    def observe(self, pool: Pool) -> PoolObservation:
        n = self.replicas[pool]
        return PoolObservation(current_replicas=n, ready_replicas=n)

    def scale(self, pool: Pool, replicas: int) -> None:
        self.replicas[pool] = replicas


class RateSource:
    """Measures ``rate_at(t)`` (the burst window too) with the test length mix."""

    def __init__(self, rate_at: Callable[[float], float | None]) -> None:
        self.rate_at = rate_at

    def observe(self, *, now_s: float, replicas: Mapping[Pool, PoolObservation]) -> Seen:
        rate = self.rate_at(now_s)
        return observation(
            now_s,
            rate,
            replicas[Pool.PREFILL].current_replicas,
            replicas[Pool.DECODE].current_replicas,
            burst=rate,
        )


def run(
    rate_at: Callable[[float], float | None],
    hours: float,
    config: ControllerConfig = CONFIG,
    start: tuple[int, int] = (1, 1),
) -> list[Decision]:
    """The production tick in closed loop with an ideal actuator, one per interval."""
    state = ControllerState()
    actuator = IdealActuator(start)
    source = RateSource(rate_at)
    arrivals = RecordedArrivals(keep_s=3600.0)
    decisions = []
    t = 0.0
    while t < hours * 3600:
        done = run_tick(
            now_s=t,
            config=config,
            config_version="test",
            state=state,
            source=source,
            actuator=actuator,
            load_profile=resolve_profile,
            models=MODELS,
            history=arrivals,
            timer=lambda: 0.0,
        )
        assert done.record.decision is not None
        decisions.append(done.record.decision)
        state = done.state
        t += config.interval_s
    return decisions


def changes(decisions: list[Decision], after_s: float = 0.0) -> int:
    return sum(
        p.changed
        for d in decisions
        if d.state.last_tick_s is not None and d.state.last_tick_s >= after_s
        for _, p in d.pools.items()
    )


# -- defaults -----------------------------------------------------------------------------


def test_the_seed_defaults_are_the_documented_ones() -> None:
    c = ControllerConfig()
    assert (1 - c.ema_weight, c.ema_weight) == (0.7, 0.3)
    assert c.dead_band == 0.10
    assert c.max_step_fraction == 0.5
    assert c.window_s == 30.0 and c.interval_s == 30.0
    assert c.scale_up_cooldown_s == c.window_s  # one window after a change
    assert 0.10 <= c.headroom <= 0.20
    assert c.scale_down_stabilisation_s == 300.0
    assert c.mode is Mode.ACTIVE


# -- stages -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "measured", "burst", "expected", "reason"),
    [
        (None, 10.0, None, 10.0, Reason.RATE_INITIALISED),
        # Poisson (SCV 1) over the 30-s window, against an EMA (weight 0.3) that keeps
        # 0.3 / 1.7 of a window's variance: the difference's sd is sqrt(300 x 2 / 1.7).
        # 330 against 300 is 1.6 sd, under the 3.77 of one false alarm an hour.
        (10.0, 11.0, None, 10.3, Reason.RATE_SMOOTHED),  # 0.7 * 10 + 0.3 * 11
        # 600 against 300 is 16 sd: the rate moved, the estimate follows.
        (10.0, 20.0, None, 20.0, Reason.RATE_SHIFTED),
        (10.0, 5.0, None, 5.0, Reason.RATE_SHIFTED),  # 150 against 300: -8 sd
        (10.0, 10.0, 30.0, 30.0, Reason.BURST_DETECTED),  # 150 against 50 in 5 s: 14 sd
        (10.0, 10.0, 14.0, 10.0, Reason.RATE_SMOOTHED),  # 14 < 1.5 * 10: no burst
    ],
)
def test_smoothing_is_an_ema_except_where_a_count_is_beyond_its_noise(
    old: float | None, measured: float, burst: float | None, expected: float, reason: Reason
) -> None:
    state = ControllerState(smoothed_rate_rps=old)
    rate, entry = smooth(observation(0, measured, 1, 1, burst=burst), state, CONFIG)
    assert rate == pytest.approx(expected)
    assert entry.reason is reason


@pytest.mark.parametrize(
    ("target", "current", "expected"),
    [(10, 10, 10), (11, 10, 11), (19, 20, 20), (18, 20, 18), (1, 2, 1), (2, 1, 2)],
)
def test_the_dead_band_ignores_changes_under_ten_percent(
    target: int, current: int, expected: int
) -> None:
    assert dead_band(Pool.PREFILL, target, current, CONFIG)[0] == expected


@pytest.mark.parametrize(
    ("target", "current", "expected"),
    [(40, 10, 15), (1, 10, 5), (3, 1, 2), (0, 1, 0), (12, 10, 12), (5, 2, 3)],
)
def test_rate_limit_moves_at_most_half_the_pool_and_at_least_one(
    target: int, current: int, expected: int
) -> None:
    assert rate_limit(Pool.DECODE, target, current, CONFIG)[0] == expected


@pytest.mark.parametrize(
    ("target", "current", "expected"),
    [(40, 10, 40), (1, 10, 5), (3, 1, 3)],  # up in one tick; down still limited
)
def test_when_the_rate_moved_a_scale_up_is_not_rate_limited(
    target: int, current: int, expected: int
) -> None:
    assert rate_limit(Pool.DECODE, target, current, CONFIG, moved=True)[0] == expected


@pytest.mark.parametrize(
    ("target", "current", "since_change_s", "expected", "reason"),
    [
        (12, 10, 10.0, 10, Reason.COOLDOWN_UP),
        (12, 10, 30.0, 12, None),
        (8, 10, 100.0, 10, Reason.COOLDOWN_DOWN),
        (8, 10, 120.0, 8, None),
    ],
)
def test_cooldowns_are_separate_for_up_and_down(
    target: int, current: int, since_change_s: float, expected: int, reason: Reason | None
) -> None:
    pstate = PoolState(last_change_s=1000.0)
    got, entry = cooldown(Pool.PREFILL, target, current, pstate, CONFIG, 1000.0 + since_change_s)
    assert got == expected
    assert (entry.reason if entry else None) is reason


def test_scale_down_waits_for_the_stabilisation_window_then_takes_the_highest_lower_target() -> (
    None
):
    pstate = PoolState()
    got, pstate, entry = stabilise(Pool.DECODE, 6, 10, pstate, 0.0, window=WINDOW)
    assert (got, entry.reason if entry else None) == (10, Reason.STABILISING)
    got, pstate, _ = stabilise(Pool.DECODE, 8, 10, pstate, 150.0, window=WINDOW)
    assert got == 10
    got, pstate, entry = stabilise(Pool.DECODE, 5, 10, pstate, 300.0, window=WINDOW)
    assert (got, entry.reason if entry else None) == (8, Reason.STABILISED)
    # A recommendation at or above current resets the window.
    got, pstate, _ = stabilise(Pool.DECODE, 10, 10, pstate, 330.0, window=WINDOW)
    assert pstate.below_since_s is None


def test_a_surge_for_a_queue_is_released_at_once_when_the_queue_has_cleared() -> None:
    pstate = PoolState()
    # 4 workers, a steady plan of 5 and 9 to clear a queue: the surge's base is 5.
    got, pstate, _ = stabilise(Pool.PREFILL, 9, 4, pstate, 0.0, steady=5, window=WINDOW)
    assert (got, pstate.surge_base) == (9, 5)
    # Still draining, the steady plan grew: so does the base.
    got, pstate, _ = stabilise(Pool.PREFILL, 9, 9, pstate, 30.0, steady=6, window=WINDOW)
    assert (got, pstate.surge_base) == (9, 6)
    # The queue has cleared: back to the base at once, not after the 300-s window.
    got, pstate, entry = stabilise(Pool.PREFILL, 4, 9, pstate, 60.0, steady=4, window=WINDOW)
    assert (got, entry.reason if entry else None) == (6, Reason.DRAINED)
    # Once there, the window holds it as before.
    got, pstate, entry = stabilise(Pool.PREFILL, 4, 6, pstate, 90.0, steady=4, window=WINDOW)
    assert (got, entry.reason if entry else None) == (6, Reason.STABILISING)
    assert pstate.surge_base is None


def test_a_surge_is_held_while_the_queue_it_is_for_is_still_there() -> None:
    # 4 workers, a steady plan of 5 and 9 to clear a queue.
    pstate = PoolState()
    got, pstate, _ = stabilise(Pool.PREFILL, 9, 4, pstate, 0.0, steady=5, window=WINDOW)
    assert (got, pstate.surge_base) == (9, 5)
    # A re-plan of the drain asks for fewer, or none, while the backlog is still
    # observed: the workers still starting are kept.
    behind = "backlog of 169 prompts takes 8.9 s to clear (> the predicted P99 1.8 s)"
    for smaller in (7, 5):
        got, pstate, entry = stabilise(
            Pool.PREFILL,
            smaller,
            9,
            pstate,
            30.0,
            steady=5,
            queue_left=behind,
            window=WINDOW,
        )
        assert (got, entry.reason if entry else None) == (9, Reason.SURGE_HELD)
        assert entry is not None and behind in entry.detail
        assert pstate.surge_base == 5
    # Once the queue is observed gone, back to the base at once.
    got, pstate, entry = stabilise(Pool.PREFILL, 5, 9, pstate, 60.0, steady=5, window=WINDOW)
    assert (got, entry.reason if entry else None) == (5, Reason.DRAINED)


def test_a_burst_is_a_surge_released_once_a_full_window_no_longer_shows_it() -> None:
    # 4 workers; the burst window's rate asks for 7 (no queue: the steady plan is 7).
    got, pstate, _ = stabilise(
        Pool.PREFILL, 7, 4, PoolState(), 0.0, steady=7, burst=True, window=WINDOW
    )
    assert (got, pstate.surge_base) == (7, 4)
    # The next window measures the rate where it was: back to 4 at once, no window.
    got, pstate, entry = stabilise(Pool.PREFILL, 4, 7, pstate, 30.0, steady=4, window=WINDOW)
    assert (got, entry.reason if entry else None) == (4, Reason.DRAINED)


def test_a_burst_the_next_window_confirms_is_held_as_a_measured_rate() -> None:
    got, pstate, _ = stabilise(
        Pool.PREFILL, 7, 4, PoolState(), 0.0, steady=7, burst=True, window=WINDOW
    )
    # The full window shows the rate too: no surge any more, a plan like any other...
    got, pstate, _ = stabilise(Pool.PREFILL, 7, 7, pstate, 30.0, steady=7, window=WINDOW)
    assert (got, pstate.surge_base) == (7, None)
    # ... which the stabilisation window holds.
    got, pstate, entry = stabilise(Pool.PREFILL, 4, 7, pstate, 60.0, steady=4, window=WINDOW)
    assert (got, entry.reason if entry else None) == (7, Reason.STABILISING)


def test_a_held_surge_follows_the_steady_plan_of_the_windows_not_of_the_burst() -> None:
    # 5 workers; a burst with a queue: 12 to drain it, 8 steady at the burst's rate.
    behind = "backlog of 300 prompts"
    got, pstate, _ = stabilise(
        Pool.PREFILL, 12, 5, PoolState(), 0.0, steady=8, burst=True, window=WINDOW
    )
    assert (got, pstate.surge_base) == (12, 5)
    # Held for its queue; the full window measures a rate that needs 6.
    got, pstate, _ = stabilise(
        Pool.PREFILL, 10, 12, pstate, 30.0, steady=6, queue_left=behind, window=WINDOW
    )
    assert (got, pstate.surge_base) == (12, 6)
    # The queue gone: back to what the windows measured, not the burst's 8.
    got, pstate, entry = stabilise(Pool.PREFILL, 5, 12, pstate, 60.0, steady=5, window=WINDOW)
    assert (got, entry.reason if entry else None) == (6, Reason.DRAINED)


def test_a_surge_releases_only_what_it_added_to_a_pool_the_window_was_holding() -> None:
    # 6 workers held by the window against a steady plan of 3; a queue asks for 10.
    held = PoolState(below_since_s=0.0, below_max=3)
    got, pstate, _ = stabilise(Pool.PREFILL, 10, 6, held, 30.0, steady=3, window=WINDOW)
    assert (got, pstate.surge_base) == (10, 6)
    got, pstate, entry = stabilise(Pool.PREFILL, 3, 10, pstate, 60.0, steady=3, window=WINDOW)
    assert (got, entry.reason if entry else None) == (6, Reason.DRAINED)


def _normalise_kwargs() -> dict[str, object]:
    """``normalise``'s arguments at 1 req/s, Poisson, the default config and SLOs."""
    model = CapacityModel.build(LENGTHS, PROFILE, tpot_slo_s=0.1)
    aimed = SloTargets(ttft_p99_s=1.0, tpot_p99_s=0.1)
    return {
        "model": model,
        "raw_rate_rps": 1.0,
        "ca2": 1.0,
        "aimed": aimed,
        "config": CONFIG,
        "window": WINDOW,
    }


def test_a_drained_surge_is_not_held_by_the_down_cooldown() -> None:
    surged = PoolState(surge_base=3, last_change_s=0.0)
    kwargs = _normalise_kwargs()
    got, _, entries = normalise(Pool.PREFILL, 3, 6, surged, now_s=30.0, steady=3, **kwargs)  # type: ignore[arg-type]
    assert got == 3
    assert Reason.DRAINED in {e.reason for e in entries}
    # A plain scale-down 30 s after a change waits for the cooldown.
    plain = PoolState(last_change_s=0.0, below_since_s=-600.0, below_max=3)
    got, _, entries = normalise(Pool.PREFILL, 3, 6, plain, now_s=30.0, **kwargs)  # type: ignore[arg-type]
    assert got == 6
    assert Reason.COOLDOWN_DOWN in {e.reason for e in entries}


def test_a_drained_surge_goes_back_to_its_base_in_one_step_not_one_per_halving() -> None:
    # A surge from 3 to 13 workers whose queue has gone: the rate limit (half of 13 per
    # tick) would take 13 -> 7 -> 4 -> 3, three scale events for one release.
    surged = PoolState(surge_base=3, last_change_s=0.0)
    kwargs = _normalise_kwargs()
    got, _, entries = normalise(Pool.PREFILL, 3, 13, surged, now_s=60.0, steady=3, **kwargs)  # type: ignore[arg-type]
    assert got == 3
    assert Reason.RATE_LIMITED not in {e.reason for e in entries}
    # A plain scale-down from 13 after its window is limited as before.
    plain = PoolState(last_change_s=-600.0, below_since_s=-600.0, below_max=3)
    got, _, entries = normalise(Pool.PREFILL, 3, 13, plain, now_s=60.0, **kwargs)  # type: ignore[arg-type]
    assert got == 13 - math.floor(CONFIG.max_step_fraction * 13)
    assert Reason.RATE_LIMITED in {e.reason for e in entries}


def test_a_queue_the_serving_workers_cannot_clear_raises_both_pools_then_goes() -> None:
    # Beyond what two prefill workers clear, so the queue grows until a worker
    # asked for now serves.
    d0 = _steady()
    flood = 1.5 * 2 / MIN_PROMPT_S
    calm = decide(observation(30.0, flood, 2, 1, queue=0.0), d0.state, CONFIG, now_s=30.0)
    queued = decide(observation(30.0, flood, 2, 1, queue=300.0), d0.state, CONFIG, now_s=30.0)
    surge = (queued.target(Pool.PREFILL), queued.target(Pool.DECODE))
    assert surge[0] > calm.target(Pool.PREFILL) and surge[1] > calm.target(Pool.DECODE)
    assert Reason.QUEUE_DRAIN in _reasons_of(queued)
    # The next tick finds the queue cleared (the new workers serving): back at once.
    after = decide(observation(60.0, flood, *surge), queued.state, CONFIG, now_s=60.0)
    assert after.target(Pool.PREFILL) < surge[0]
    assert Reason.DRAINED in _reasons_of(after)


@pytest.mark.parametrize(
    "bad",
    [
        {"rate": None},
        {"rate": math.nan},
        {"rate": -1.0},
        {"age_s": 600.0},
    ],
)
def test_missing_nan_negative_or_stale_metrics_hold_with_metrics_stale(
    bad: dict[str, float | None],
) -> None:
    rate = bad.get("rate", 5.0)
    obs = observation(1000.0 - bad.get("age_s", 0.0), rate, 4, 3)
    d = decide(obs, ControllerState(smoothed_rate_rps=50.0), CONFIG, now_s=1000.0)
    assert (d.target(Pool.PREFILL), d.target(Pool.DECODE)) == (4, 3)
    assert not d.actuate
    assert d.reasons[0].reason is Reason.METRICS_STALE


def test_a_scale_down_unsafe_at_the_current_raw_rate_is_refused() -> None:
    # The pools hold exactly what 40 req/s needs (the solver's answer), so a plan for
    # one worker each, made for a lower rate, would miss the SLO at the rate the
    # safety stage judges at: it keeps the smallest safe count instead.
    model = MODELS.get(LENGTHS, PROFILE, CONFIG)
    slo = SloTargets(ttft_p99_s=CONFIG.slo.ttft_p99_s, tpot_p99_s=CONFIG.slo.tpot_p99_s)
    needed = solve(model, arrival_rate_rps=40.0, ca2=1.0, slo=slo, headroom=CONFIG.headroom)
    n = needed.prefill_workers
    assert n > 1
    got, entry = safety(Pool.PREFILL, 1, n, model, 40.0, 1.0, slo, CONFIG.headroom)
    assert got == n
    assert entry is not None and entry.reason is Reason.SCALE_DOWN_UNSAFE


def test_the_decode_pool_is_predicted_behind_the_prefill_pool_the_tick_asks_for() -> None:
    # Bursty arrivals (SCV 6) at 35 req/s reach one worker of each pool: the tick
    # scales up, and the decode P99 its decision shows is the what-if's behind the
    # prefill pool it asked for, whose departures are smoother than the arrivals.
    seen = replace(observation(0.0, 35.0, 1, 1), interarrival_scv=6.0)
    d = decide(seen, ControllerState(), CONFIG, now_s=0.0)
    n, m = d.target(Pool.PREFILL), d.target(Pool.DECODE)
    assert (n, m) != (1, 1)
    # The model of the mix the tick pooled (its windows' requests within the context).
    assert d.state.lengths is not None
    mix = observed_within_context(d.state.lengths, PROFILE.max_context_tokens)
    model = MODELS.get(mix, PROFILE, CONFIG)
    rate = d.planning_rate_rps
    what_if = evaluate(
        model,
        prefill_workers=n,
        decode_workers=m,
        arrival_rate_rps=rate,
        ca2=6.0,
        slo=SloTargets(ttft_p99_s=CONFIG.slo.ttft_p99_s, tpot_p99_s=CONFIG.slo.tpot_p99_s),
    )
    assert d.pools.decode.predicted_p99_s == pytest.approx(what_if.decode.p99_s, rel=1e-12)
    at_arrivals_scv = model.decode.tpot_quantile_s(
        workers=m, arrival_rate_rps=rate, ca2=6.0, quantile=0.99
    )
    assert d.pools.decode.predicted_p99_s < at_arrivals_scv


def test_advisory_mode_decides_but_never_actuates() -> None:
    config = replace(CONFIG, mode=Mode.ADVISORY)
    d = decide(observation(0.0, 40.0, 1, 1), ControllerState(), config, now_s=0.0)
    assert d.target(Pool.PREFILL) > 1
    assert not d.actuate
    assert Reason.ADVISORY in {r.reason for r in d.reasons}


def worst_ratio(n: int, m: int, rate: float) -> float:
    """max(predicted P99 / SLO) of n + m workers, from the solver's own what-if."""
    model = CapacityModel.build(
        LENGTHS, PROFILE, tpot_slo_s=0.1, link=KvLink(bytes_per_s=CONFIG.kv_link_gbps * 1e9 / 8)
    )
    ev = evaluate(
        model,
        prefill_workers=n,
        decode_workers=m,
        arrival_rate_rps=rate,
        ca2=1.0,
        slo=SloTargets(ttft_p99_s=1.0, tpot_p99_s=0.1),
    )
    ttft = math.inf if ev.prefill.p99_s is None else ev.prefill.p99_s / 1.0
    tpot = math.inf if ev.decode.p99_s is None else ev.decode.p99_s / 0.1
    return max(ttft, tpot)


def test_the_gpu_budget_splits_workers_to_minimise_the_worst_slo_ratio() -> None:
    config = replace(CONFIG, gpu_budget=4 * 6, prefill=PoolLimits(max_replicas=64))  # 6 TP4
    # 35 req/s needs 5 + 2 workers (the solver), one more than the budget holds.
    d = decide(observation(0.0, 35.0, 5, 2), ControllerState(), config, now_s=0.0)
    n, m = d.target(Pool.PREFILL), d.target(Pool.DECODE)
    assert n + m == 6
    assert any(r.reason is Reason.GPU_BUDGET for r in d.reasons)
    # Brute force over every split of the six workers: none has a smaller worst ratio.
    ratios = [worst_ratio(k, 6 - k, 35.0) for k in range(1, 6)]
    assert math.isfinite(min(ratios)) and len(set(ratios)) > 2  # a real choice to make
    assert worst_ratio(n, m, 35.0) == pytest.approx(min(ratios))


def test_min_and_max_replicas_bound_every_target() -> None:
    config = replace(
        CONFIG,
        prefill=PoolLimits(min_replicas=2, max_replicas=3),
        decode=PoolLimits(min_replicas=2, max_replicas=2),
    )
    d = decide(observation(0.0, 80.0, 2, 2), ControllerState(), config, now_s=0.0)
    assert d.target(Pool.PREFILL) == 3 and d.target(Pool.DECODE) == 2


def test_calibration_is_bounded_and_follows_observed_over_predicted() -> None:
    d0 = decide(observation(0.0, 8.0, 2, 1), ControllerState(), CONFIG, now_s=0.0)
    predicted = d0.state.pools.prefill.predicted_p99_s
    assert predicted is not None
    obs = observation(30.0, 8.0, 2, 1, ttft=predicted * 10)  # the model is 10x optimistic
    d1 = decide(obs, d0.state, CONFIG, now_s=30.0)
    factor = d1.state.pools.prefill.calibration
    assert factor == pytest.approx(min(2.0, 0.8 + 0.2 * 10))
    assert d1.pools.prefill.model_error == pytest.approx(9.0)


def test_a_window_too_small_for_a_p99_teaches_calibration_nothing() -> None:
    # 2 req/s over the 30-s window: 60 requests, whose top rank sits below their
    # 99th percentile — the window's "P99" is its maximum's neighbourhood.
    rate = 2.0
    assert rate * CONFIG.window_s < 1 / (1 - 0.99)
    d0 = decide(observation(0.0, rate, 2, 1), ControllerState(), CONFIG, now_s=0.0)
    predicted = d0.state.pools.prefill.predicted_p99_s
    assert predicted is not None
    d1 = decide(observation(30.0, rate, 2, 1, ttft=predicted * 10), d0.state, CONFIG, now_s=30.0)
    assert d1.state.pools.prefill.calibration == 1.0
    assert d1.pools.prefill.model_error == pytest.approx(9.0)  # still reported
    assert any(r.reason is Reason.CALIBRATION_FROZEN and r.pool is Pool.PREFILL for r in d1.reasons)


def test_state_survives_a_json_round_trip() -> None:
    d = decide(observation(0.0, 8.0, 1, 1), ControllerState(), CONFIG, now_s=0.0)
    again = ControllerState.from_dict(d.state.to_dict())
    assert again.to_dict() == d.state.to_dict()


def _steady(rate: float = 8.0, workers: tuple[int, int] = (2, 1)) -> Decision:
    """A first tick whose state carries a prediction for ``workers`` at ``rate``."""
    return decide(observation(0.0, rate, *workers), ControllerState(), CONFIG, now_s=0.0)


@pytest.mark.parametrize(
    ("case", "extra"),
    [
        # One of the two prefill workers is still starting: it served nothing.
        ("a worker starting", {"prefill_ready": 1}),
        # 1.5x what two workers could serve even at the per-token cost alone.
        ("the rate beyond the serving workers' capacity", {"rate": 1.5 * 2 / MIN_PROMPT_S}),
        # A queue that would take the two workers twice the predicted P99 to clear.
        ("a backlog", {"queue_x_predicted": 2.0}),
    ],
)
def test_calibration_is_frozen_while_the_pool_is_in_a_transient(
    case: str, extra: dict[str, float]
) -> None:
    d0 = _steady()
    predicted = d0.state.pools.prefill.predicted_p99_s
    assert predicted is not None
    queue = None
    if "queue_x_predicted" in extra:
        queue = math.ceil(extra["queue_x_predicted"] * predicted * 2 / MIN_PROMPT_S)
    obs = observation(
        30.0,
        extra.get("rate", 8.0),
        2,
        1,
        ttft=predicted * 5,  # a transient's P99, far above the steady state
        prefill_ready=int(extra.get("prefill_ready", 2)),
        queue=queue,
    )
    d1 = decide(obs, d0.state, CONFIG, now_s=30.0)
    assert d1.state.pools.prefill.calibration == 1.0, case
    assert d1.pools.prefill.model_error == pytest.approx(4.0)  # still reported
    frozen = [r for r in d1.reasons if r.reason is Reason.CALIBRATION_FROZEN]
    assert [r.pool for r in frozen] == [Pool.PREFILL], case


def test_calibration_learns_again_one_window_after_a_transient() -> None:
    d0 = _steady()
    predicted = d0.state.pools.prefill.predicted_p99_s
    assert predicted is not None
    seen = 2 * predicted
    # 30 s: a worker restarting; 60 s: its window still holds the requests that queued
    # then; 90 s: a clean window, learnt with the EMA weight 0.2.
    d1 = decide(
        observation(30.0, 8.0, 2, 1, ttft=seen, prefill_ready=1), d0.state, CONFIG, now_s=30.0
    )
    d2 = decide(observation(60.0, 8.0, 2, 1, ttft=seen), d1.state, CONFIG, now_s=60.0)
    d3 = decide(observation(90.0, 8.0, 2, 1, ttft=seen), d2.state, CONFIG, now_s=90.0)
    assert [d.state.pools.prefill.calibration for d in (d1, d2)] == [1.0, 1.0]
    ratio = seen / (d2.state.pools.prefill.predicted_p99_s or math.nan)
    assert d3.state.pools.prefill.calibration == pytest.approx(0.8 * 1.0 + 0.2 * ratio)
    assert any(r.reason is Reason.CALIBRATED and r.pool is Pool.PREFILL for r in d3.reasons)


def test_a_forecast_raises_the_plan_to_the_solvers_answer_for_it_and_biases_nothing_else() -> None:
    d0 = _steady()
    predicted = d0.state.pools.prefill.predicted_p99_s or math.nan
    obs = observation(30.0, 8.0, 2, 1, ttft=1.5 * predicted)
    plain = decide(obs, d0.state, CONFIG, now_s=30.0)
    forecast = 24.0
    ahead = decide(obs, d0.state, CONFIG, now_s=30.0, forecast_rate_rps=forecast)
    # Sized for the forecast: the solver's answer at that rate (same calibration).
    model = CapacityModel.build(
        LENGTHS, PROFILE, tpot_slo_s=0.1, link=KvLink(bytes_per_s=400e9 / 8)
    )
    factor = plain.state.pools.prefill.calibration
    expected = solve(
        model,
        arrival_rate_rps=forecast,
        ca2=1.0,
        slo=SloTargets(
            ttft_p99_s=1.0 / factor, tpot_p99_s=0.1 / plain.state.pools.decode.calibration
        ),
        headroom=CONFIG.headroom,
    )
    assert recommended(ahead) == (expected.prefill_workers, expected.decode_workers)
    assert ahead.planning_rate_rps == forecast and ahead.forecast_rate_rps == forecast
    # ... and nothing else moved: the EMA, what calibration learnt, the prediction the
    # next tick will calibrate against (all at the measured 8 req/s).
    assert ahead.smoothed_rate_rps == plain.smoothed_rate_rps == pytest.approx(8.0)
    assert ahead.raw_rate_rps == 8.0
    for pool in Pool:
        assert ahead.state.pools[pool].calibration == plain.state.pools[pool].calibration
        assert ahead.state.pools[pool].predicted_p99_s == plain.state.pools[pool].predicted_p99_s
    assert ahead.state.smoothed_rate_rps == plain.state.smoothed_rate_rps


@pytest.mark.parametrize("forecast", [4.0, math.nan, -3.0, None])
def test_a_forecast_below_the_smoothed_rate_or_unusable_changes_nothing(
    forecast: float | None,
) -> None:
    d0 = _steady()
    obs = observation(30.0, 8.0, 2, 1)
    plain = decide(obs, d0.state, CONFIG, now_s=30.0)
    other = decide(obs, d0.state, CONFIG, now_s=30.0, forecast_rate_rps=forecast)
    assert recommended(other) == recommended(plain)
    assert other.planning_rate_rps == plain.planning_rate_rps
    assert not any(r.reason is Reason.FORECAST_RAISED for r in other.reasons)


def _forecast_read(d: Decision, pool: Pool) -> tuple[float, float] | None:
    """(rate, seconds ahead) of the pool's FORECAST_RAISED reason, if it has one."""
    for r in d.reasons:
        if r.reason is Reason.FORECAST_RAISED and r.pool is pool:
            found = re.search(r"forecast ([\d.e+]+) req/s \(([\d.e+-]+) s ahead\)", r.detail)
            assert found, r.detail
            return float(found[1]), float(found[2])
    return None


def test_the_decode_pool_reads_the_forecast_its_batchs_relaxation_time_short_of_its_lead() -> None:
    # The batch on one decode worker follows the rate with the relaxation time tau, so
    # at the lead time it holds what a steady rate lambda(lead - tau) would keep: on
    # the line from the estimate (8 req/s) to the forecast (24 req/s at the lead).
    d0 = _steady()
    ahead = decide(
        observation(30.0, 8.0, 2, 1), d0.state, CONFIG, now_s=30.0, forecast_rate_rps=24.0
    )
    model = CapacityModel.build(
        LENGTHS, PROFILE, tpot_slo_s=0.1, link=KvLink(bytes_per_s=400e9 / 8)
    )
    tau = model.decode.relaxation_s(workers=1, arrival_rate_rps=8.0)
    lead = CONFIG.lead_time.startup_prior_s + CONFIG.interval_s
    assert 0 < tau < lead
    assert _forecast_read(ahead, Pool.PREFILL) == pytest.approx((24.0, lead), rel=5e-3)
    decode = _forecast_read(ahead, Pool.DECODE)
    assert decode == pytest.approx((8.0 + 16.0 * (lead - tau) / lead, lead - tau), rel=5e-3)


def test_a_decode_batch_slower_than_the_lead_time_is_not_raised_by_a_forecast() -> None:
    # Workers that start in a second, ticks every 5 s: a 6-s lead time, shorter than
    # the decode batch's relaxation time (about 9 s here), so the decode pool's load
    # when a worker asked for now serves is today's; the prefill queue's is the
    # forecast's.
    fast = replace(CONFIG, interval_s=5.0, lead_time=replace(CONFIG.lead_time, startup_prior_s=1.0))
    d0 = decide(observation(0.0, 8.0, 2, 1), ControllerState(), fast, now_s=0.0)
    ahead = decide(observation(5.0, 8.0, 2, 1), d0.state, fast, now_s=5.0, forecast_rate_rps=24.0)
    model = CapacityModel.build(
        LENGTHS, PROFILE, tpot_slo_s=0.1, link=KvLink(bytes_per_s=400e9 / 8)
    )
    assert model.decode.relaxation_s(workers=1, arrival_rate_rps=8.0) > 6.0
    assert _forecast_read(ahead, Pool.PREFILL) == pytest.approx((24.0, 6.0), rel=5e-3)
    assert _forecast_read(ahead, Pool.DECODE) is None
    plain = decide(observation(5.0, 8.0, 2, 1), d0.state, fast, now_s=5.0)
    assert ahead.pools.decode.recommended == plain.pools.decode.recommended


def test_while_the_serving_workers_fall_behind_the_plan_follows_the_measured_rate() -> None:
    flood = 2 * 2 / MIN_PROMPT_S  # twice what two workers could ever serve
    # 3 % above the last estimate is within the Poisson noise of a 30-s window (the
    # shift test does not fire), so only the overload rule lifts the plan to it.
    assert 0.03 * flood * 30 < 2.326 * math.sqrt(0.97 * flood * 30)
    d0 = _steady(rate=0.97 * flood)
    behind = decide(observation(30.0, flood, 2, 1), d0.state, CONFIG, now_s=30.0)
    ema = 0.7 * 0.97 * flood + 0.3 * flood
    assert behind.smoothed_rate_rps == pytest.approx(ema)
    assert behind.planning_rate_rps is not None and behind.planning_rate_rps >= flood
    assert any(r.reason is Reason.OVERLOAD_DETECTED for r in behind.reasons)
    # The same rise on a pool with room for it: the EMA as usual.
    roomy = decide(observation(0.0, 0.97 * flood, 40, 4), ControllerState(), CONFIG, now_s=0.0)
    calm = decide(observation(30.0, flood, 40, 4), roomy.state, CONFIG, now_s=30.0)
    assert calm.smoothed_rate_rps == pytest.approx(ema)
    assert not any(r.reason is Reason.OVERLOAD_DETECTED for r in calm.reasons)


def test_a_calibration_that_makes_the_slo_infeasible_still_lets_oversized_pools_shrink() -> None:
    # TTFT SLO 0.6 s: feasible as configured, but a correction of 2 aims at 0.3 s,
    # below the prefill floor of the longest prompts. The plan falls back to 1.2 x
    # the floor, and the scale-down safety check must use that same target.
    config = replace(CONFIG, slo=SloConfig(ttft_p99_s=0.6, tpot_p99_s=0.1))
    state = ControllerState(
        smoothed_rate_rps=2.0,
        lengths=LENGTHS,
        pools=PerPool(prefill=PoolState(calibration=2.0), decode=PoolState()),
    )
    first = decide(observation(0.0, 2.0, 8, 8), state, config, now_s=0.0)
    assert any(r.reason is Reason.SLO_INFEASIBLE for r in first.reasons)
    assert first.state.pools.prefill.calibration == 2.0  # nothing observed: kept
    later = decide(observation(400.0, 2.0, 8, 8), first.state, config, now_s=400.0)
    assert later.target(Pool.PREFILL) < 8
    assert not any(
        r.reason is Reason.SCALE_DOWN_UNSAFE and r.pool is Pool.PREFILL for r in later.reasons
    )


@pytest.mark.parametrize("headroom", [0.15, 0.5])
def test_an_infeasible_slo_plans_for_1_2_times_the_floor_whatever_the_headroom(
    headroom: float,
) -> None:
    # A TTFT SLO of 10 ms is below any prompt's prefill: the plan falls back to the
    # fewest workers whose predicted P99 TTFT is within 1.2 x the floor, never to the
    # maximum replicas (which a headroom above 20 % used to cause).
    config = replace(CONFIG, headroom=headroom, slo=SloConfig(ttft_p99_s=0.01, tpot_p99_s=0.1))
    rate = 12.0
    d = decide(observation(0.0, rate, 4, 2), ControllerState(), config, now_s=0.0)
    assert any(r.reason is Reason.SLO_INFEASIBLE for r in d.reasons)
    model = CapacityModel.build(
        LENGTHS, PROFILE, tpot_slo_s=0.1, link=KvLink(bytes_per_s=400e9 / 8)
    )
    aim_s = 1.2 * model.prefill.floor_quantile_s(0.99)
    fewest = next(
        n
        for n in range(1, 64)
        if model.prefill.is_stable(workers=n, arrival_rate_rps=rate)
        and model.prefill.ttft_quantile_s(workers=n, arrival_rate_rps=rate, ca2=1.0, quantile=0.99)
        <= aim_s
    )
    assert recommended(d) is not None and recommended(d)[0] == fewest


# -- behaviour over time --------------------------------------------------------------------


@pytest.mark.parametrize("rate", [3.0, 12.0, 40.0])
def test_constant_load_with_15_percent_noise_makes_no_changes_after_settling(rate: float) -> None:
    # The pools are sized for the rate's upper quantile over the lead time, whose
    # centre (the EMA) still walks with the noise: over two hours it may cross a
    # worker boundary upwards once, but it never comes back down (no flapping).
    rng = np.random.default_rng(int(rate))
    decisions = run(lambda t: rate * (1 + rng.uniform(-0.15, 0.15)), hours=2)
    late = [d for d in decisions if (d.state.last_tick_s or 0.0) >= 600]
    assert changes(late) <= 1
    assert not any(p.target < p.current for d in late for _, p in d.pools.items())


def test_a_load_between_one_and_two_workers_does_not_oscillate() -> None:
    # Find a rate whose answer flips between 1 and 2 prefill workers within +-15 %.
    d_low = decide(observation(0.0, 2.0, 1, 1), ControllerState(), CONFIG, now_s=0.0)
    rate = 2.0
    while recommended(d_low) and recommended(d_low)[0] < 2:
        rate *= 1.05
        d_low = decide(observation(0.0, rate, 1, 1), ControllerState(), CONFIG, now_s=0.0)
    rng = np.random.default_rng(5)
    decisions = run(lambda t: rate * (1 + rng.uniform(-0.15, 0.15)), hours=2)
    prefill = [d.target(Pool.PREFILL) for d in decisions[20:]]
    flips = sum(a != b for a, b in itertools.pairwise(prefill))
    assert flips <= 1


def test_a_three_fold_step_is_scaled_up_on_the_first_tick_that_sees_it() -> None:
    step_at = 1800.0
    decisions = run(lambda t: 10.0 if t < step_at else 30.0, hours=1)
    first = next(d for d in decisions if d.state.last_tick_s == step_at)
    assert first.target(Pool.PREFILL) > first.pools.prefill.current


def test_ten_minutes_of_missing_metrics_never_scale_down() -> None:
    decisions = run(lambda t: 30.0 if t < 1200 or t >= 1800 else None, hours=1)
    gap = [d for d in decisions if 1200 <= (d.state.last_tick_s or 0) < 1800]
    assert gap and all(d.target(Pool.PREFILL) == d.pools.prefill.current for d in gap)
    assert all(d.target(Pool.DECODE) == d.pools.decode.current for d in gap)
    assert all(d.reasons[0].reason is Reason.METRICS_STALE for d in gap)


# -- every reason has a scenario that produces it ----------------------------------------


# The conversation mix's prompts, each answered with a single token (a scoring or
# max_tokens=1 request): none of them reaches the decode pool.
SINGLE_TOKEN = replace(LENGTHS, output_tokens=np.ones_like(LENGTHS.output_tokens))


def test_requests_that_end_at_their_first_token_keep_the_mix_the_decode_pool_was_sized_on() -> None:
    settled = decide(observation(0.0, 40.0, 1, 1), ControllerState(), CONFIG, now_s=0.0).state
    d = decide(observation(400.0, 40.0, 2, 2, lengths=SINGLE_TOKEN), settled, CONFIG, now_s=400.0)
    assert Reason.LENGTHS_KEPT in _reasons_of(d)
    assert d.state.lengths is settled.lengths
    assert recommended(d) is not None


def test_a_first_mix_whose_requests_never_decode_holds_the_replicas() -> None:
    d = decide(
        observation(0.0, 40.0, 3, 2, lengths=SINGLE_TOKEN), ControllerState(), CONFIG, now_s=0.0
    )
    assert Reason.METRICS_STALE in _reasons_of(d)
    assert (d.target(Pool.PREFILL), d.target(Pool.DECODE)) == (3, 2)
    assert not d.actuate


def _reasons_of(d: Decision) -> set[Reason]:
    return {r.reason for r in d.reasons}


def _scenarios() -> dict[Reason, Decision]:
    base = ControllerState()
    up = decide(observation(0.0, 40.0, 1, 1), base, CONFIG, now_s=0.0)
    settled = up.state
    out: dict[Reason, Decision] = {
        Reason.METRICS_STALE: decide(observation(0.0, None, 2, 2), base, CONFIG, now_s=0.0),
        Reason.METRICS_OK: up,
        Reason.RATE_INITIALISED: up,
        Reason.LENGTHS_UPDATED: up,
        Reason.RECOMMENDED: up,
        Reason.SCALE_UP: up,
        Reason.RATE_LIMITED: up,  # 1 -> many is limited to 1 -> 2
        Reason.RATE_SMOOTHED: decide(observation(30.0, 40.0, 2, 2), settled, CONFIG, now_s=30.0),
        Reason.BURST_DETECTED: decide(
            observation(30.0, 40.0, 2, 2, burst=200.0), settled, CONFIG, now_s=30.0
        ),
        Reason.COOLDOWN_UP: decide(observation(10.0, 40.0, 2, 2), settled, CONFIG, now_s=10.0),
        Reason.ADVISORY: decide(
            observation(0.0, 40.0, 1, 1), base, replace(CONFIG, mode=Mode.ADVISORY), now_s=0.0
        ),
        Reason.SLO_INFEASIBLE: decide(
            observation(0.0, 5.0, 1, 1),
            base,
            replace(CONFIG, slo=SloConfig(ttft_p99_s=0.01, tpot_p99_s=0.1)),
            now_s=0.0,
        ),
        Reason.CLAMPED_MIN: decide(
            observation(0.0, 0.5, 2, 2),
            base,
            replace(CONFIG, prefill=PoolLimits(min_replicas=3, max_replicas=8)),
            now_s=0.0,
        ),
        Reason.CLAMPED_MAX: decide(
            observation(0.0, 400.0, 6, 6),
            base,
            replace(CONFIG, prefill=PoolLimits(min_replicas=1, max_replicas=4)),
            now_s=0.0,
        ),
        Reason.GPU_BUDGET: decide(
            observation(0.0, 60.0, 3, 3), base, replace(CONFIG, gpu_budget=24), now_s=0.0
        ),
    }
    # A pool far above need, long after its last change: stabilise, then scale down.
    idle = ControllerState(smoothed_rate_rps=2.0, lengths=LENGTHS)
    first = decide(observation(0.0, 2.0, 8, 8), idle, CONFIG, now_s=0.0)
    out[Reason.STABILISING] = first
    out[Reason.SCALE_DOWN_SAFE] = first
    later = decide(observation(400.0, 2.0, 8, 8), first.state, CONFIG, now_s=400.0)
    out[Reason.STABILISED] = later
    out[Reason.SCALE_DOWN] = later
    out[Reason.COOLDOWN_DOWN] = decide(
        observation(430.0, 0.5, later.target(Pool.PREFILL), later.target(Pool.DECODE)),
        later.state,
        replace(CONFIG, scale_down_stabilisation_s=0.0),
        now_s=430.0,
    )
    out[Reason.WITHIN_DEAD_BAND] = decide(
        observation(0.0, 40.0, 20, 20), base, replace(CONFIG, dead_band=0.99), now_s=0.0
    )
    out[Reason.NO_CHANGE] = out[Reason.WITHIN_DEAD_BAND]
    # Calibration: the observed P99 of the allocation predicted last tick.
    steady = decide(observation(0.0, 8.0, 2, 1), base, CONFIG, now_s=0.0)
    predicted = steady.state.pools.prefill.predicted_p99_s or 1.0
    seen = observation(30.0, 8.0, 2, 1, ttft=2 * predicted)
    out[Reason.CALIBRATED] = decide(seen, steady.state, CONFIG, now_s=30.0)
    off = replace(CONFIG, calibration=replace(CONFIG.calibration, enabled=False))
    out[Reason.CALIBRATION_SKIPPED] = decide(seen, steady.state, off, now_s=30.0)
    # A P99 observed while a worker of the pool is still starting is not learnt.
    starting = observation(30.0, 8.0, 2, 1, ttft=2 * predicted, prefill_ready=1)
    out[Reason.CALIBRATION_FROZEN] = decide(starting, steady.state, CONFIG, now_s=30.0)
    out[Reason.FORECAST_RAISED] = decide(
        observation(30.0, 8.0, 2, 1), steady.state, CONFIG, now_s=30.0, forecast_rate_rps=16.0
    )
    # Twice the most two workers could serve (within the noise of the last estimate,
    # so not a shift): they fall behind, the EMA's lag is skipped.
    flood = 2 * 2 / MIN_PROMPT_S
    near = _steady(rate=0.97 * flood)
    out[Reason.OVERLOAD_DETECTED] = decide(
        observation(30.0, flood, 2, 1), near.state, CONFIG, now_s=30.0
    )
    # A queue the serving workers cannot clear before a new worker would serve; once
    # it has cleared, the workers beyond the steady plan go at once.
    out[Reason.QUEUE_DRAIN] = decide(
        observation(30.0, flood, 2, 1, queue=300.0), steady.state, CONFIG, now_s=30.0
    )
    surged = replace(steady.state, pools=PerPool.both(PoolState(surge_base=2, last_change_s=0.0)))
    out[Reason.DRAINED] = decide(observation(30.0, 8.0, 6, 6), surged, CONFIG, now_s=30.0)
    # The same surge while the queue it was for is still there: held.
    # (A backlog: the queue takes the six serving workers longer to clear than the
    # P99 predicted last tick, which they clear before a new worker would serve.)
    backlogged = replace(
        surged,
        pools=PerPool.both(PoolState(surge_base=2, last_change_s=0.0, predicted_p99_s=0.1)),
    )
    out[Reason.SURGE_HELD] = decide(
        observation(30.0, 8.0, 6, 6, queue=60.0), backlogged, CONFIG, now_s=30.0
    )
    # The planning rate has fallen (a plan for fewer workers) but the pools hold what
    # the current raw rate needs: removing workers is unsafe at the current load.
    need = recommended(decide(observation(0.0, 40.0, 1, 1), base, CONFIG, now_s=0.0)) or (1, 1)
    out[Reason.SCALE_DOWN_UNSAFE] = _unsafe_scale_down(need)
    out[Reason.RATE_SHIFTED] = decide(observation(30.0, 80.0, 2, 2), settled, CONFIG, now_s=30.0)
    # Two windows of the conversation mix, then one of prompts twice as long: the
    # pooled mix starts again from it.
    pooled = decide(observation(30.0, 40.0, 2, 2), settled, CONFIG, now_s=30.0)
    longer = replace(LENGTHS, prompt_tokens=2 * LENGTHS.prompt_tokens)
    out[Reason.LENGTHS_SHIFTED] = decide(
        observation(60.0, 40.0, 2, 2, lengths=longer), pooled.state, CONFIG, now_s=60.0
    )
    # Past the pooling span, a window whose every request ended at its first token.
    out[Reason.LENGTHS_KEPT] = decide(
        observation(400.0, 40.0, 2, 2, lengths=SINGLE_TOKEN), settled, CONFIG, now_s=400.0
    )
    out[Reason.LEAD_TIME_PLANNED] = out[Reason.RATE_SMOOTHED]
    # A scale-up to 3 decided at 0 s, all 3 ready at the 60-s tick.
    pending = ControllerState(
        smoothed_rate_rps=40.0,
        lengths=LENGTHS,
        pools=PerPool.both(PoolState(scale_up_since_s=0.0, scale_up_to=3)),
    )
    out[Reason.STARTUP_MEASURED] = decide(
        observation(60.0, 40.0, 3, 3), pending, CONFIG, now_s=60.0
    )
    return out


def _unsafe_scale_down(need: tuple[int, int]) -> Decision:
    """A tick whose plan is below ``need`` while the raw rate needs all of it: the
    estimate 0.5 req/s and the raw 40 req/s, with the shift test out of reach (the
    window-to-window spread of the recorded rates is huge)."""
    rates = tuple(
        RateSample(time_s=t, rate_rps=r, estimate_rps=0.5, scv=1.0)
        for t, r in zip((-120.0, -90.0, -60.0, -30.0), (0.0, 400.0, 0.0, 400.0), strict=True)
    )
    low = ControllerState(smoothed_rate_rps=0.5, lengths=LENGTHS, rates=rates)
    config = replace(CONFIG, ema_weight=0.01, lead_time=replace(CONFIG.lead_time, enabled=False))
    return decide(observation(0.0, 40.0, *need), low, config, now_s=0.0)


SCENARIOS = _scenarios()


@pytest.mark.parametrize("reason", list(Reason), ids=lambda r: r.value)
def test_every_reason_is_produced_by_its_scenario(reason: Reason) -> None:
    assert reason in SCENARIOS, f"no scenario for {reason}"
    assert reason in _reasons_of(SCENARIOS[reason])


def test_with_an_infeasible_slo_oversized_pools_still_scale_down_to_the_relaxed_plan() -> None:
    # The TTFT SLO is below the floor, so the recommendation plans for 1.2 x the floor;
    # the scale-down safety check must judge against that same relaxed target, or no
    # scale-down would ever pass and the pools would stay oversized for good.
    config = replace(CONFIG, slo=SloConfig(ttft_p99_s=0.01, tpot_p99_s=0.1))
    state = ControllerState(smoothed_rate_rps=2.0, lengths=LENGTHS)
    first = decide(observation(0.0, 2.0, 8, 8), state, config, now_s=0.0)
    assert any(r.reason is Reason.SLO_INFEASIBLE for r in first.reasons)
    later = decide(observation(400.0, 2.0, 8, 8), first.state, config, now_s=400.0)
    assert later.target(Pool.PREFILL) < 8
    assert not any(r.reason is Reason.SCALE_DOWN_UNSAFE for r in later.reasons)


def test_a_window_beyond_capacity_by_less_than_its_counting_noise_is_no_overload() -> None:
    # Two prefill workers keep up while rate x E[packed service] < 2 (the model's
    # stability bound), so their capacity is c = 2 / E[S]. A 30-s window of a renewal
    # process with gap SCV 4 counts with a standard deviation of sqrt(rate x 30 x 4):
    # a rate 2 % above c is well within z = 3.77 of it, one 2 z sd above is not.
    model = CapacityModel.build(
        LENGTHS, PROFILE, tpot_slo_s=0.1, link=KvLink(bytes_per_s=400e9 / 8)
    )
    capacity = 2 / model.prefill.packed_service_s
    window_s, ca2, z = 30.0, 4.0, 3.77
    noise = math.sqrt(capacity * ca2 / window_s)  # the rate's sd near the capacity
    slightly = 1.02 * capacity
    assert slightly - capacity < z * math.sqrt(slightly * ca2 / window_s)
    judged = {"ca2": ca2, "window_s": window_s, "z": z}
    seen = observation(0.0, slightly, 2, 2)
    assert overloaded(Pool.PREFILL, seen, model, None, **judged) is None
    # Judged on the measured rate alone (no window: no noise), it is beyond capacity.
    assert overloaded(Pool.PREFILL, seen, model, None) is not None
    clearly = capacity + 2 * z * noise
    assert clearly - z * math.sqrt(clearly * ca2 / window_s) > capacity
    assert overloaded(Pool.PREFILL, observation(0.0, clearly, 2, 2), model, None, **judged)


def _first_scale_down_after_a_fall(
    history: list[float], fallen_rps: float
) -> tuple[float, float, str]:
    """Run ``decide`` over ``history`` (one measured rate per 30-s tick, the pools set
    to each target and ready by the next tick), then at ``fallen_rps``: how long after
    the fall the prefill pool first scaled down, its lead time then, and the
    stabilisation entry that let it."""
    state, current, t = ControllerState(), (1, 1), 0.0
    for rate in history:
        d = decide(observation(t, rate, *current), state, CONFIG, now_s=t)
        state, current, t = d.state, (d.target(Pool.PREFILL), d.target(Pool.DECODE)), t + 30.0
    fell_s, lead_s = t, lead_time_s(state.pools.prefill, CONFIG)
    for _ in range(20):
        d = decide(observation(t, fallen_rps, *current), state, CONFIG, now_s=t)
        if d.target(Pool.PREFILL) < current[0]:
            entry = next(
                r for r in d.reasons if r.stage is Stage.STABILISE and r.pool is Pool.PREFILL
            )
            return t - fell_s, lead_s, entry.detail
        state, current, t = d.state, (d.target(Pool.PREFILL), d.target(Pool.DECODE)), t + 30.0
    raise AssertionError("the prefill pool never scaled down")


def test_a_pool_whose_bounds_held_scales_down_a_lead_time_after_a_fall() -> None:
    # An hour at a steady 40 req/s: every lead time brought no more than its bound.
    # After a fall to 10 req/s the pool waits for its lead time (its measured start-up
    # and a tick), not for the configured window.
    after_s, lead_s, detail = _first_scale_down_after_a_fall([40.0] * 130, 10.0)
    assert lead_s + CONFIG.interval_s < CONFIG.scale_down_stabilisation_s
    assert lead_s <= after_s < lead_s + CONFIG.interval_s
    assert "lead time" in detail


def test_a_pool_whose_bounds_were_exceeded_keeps_the_configured_window() -> None:
    # The same hour with a two-tick burst to 120 req/s every ten minutes: the ticks
    # before each burst planned for 40, and the record keeps the configured window.
    history = [120.0 if i % 20 in (18, 19) else 40.0 for i in range(130)]
    window_s = CONFIG.scale_down_stabilisation_s
    after_s, _, detail = _first_scale_down_after_a_fall(history, 10.0)
    assert window_s <= after_s < window_s + CONFIG.interval_s
    assert f"{window_s:g}-s stabilisation window" in detail


def test_a_scale_up_is_timed_from_the_size_it_started_from() -> None:
    # What the pool had is kept beside the target, so a target cut back before every
    # new worker serves can still be timed on the workers the cut left.
    up = decide(observation(0.0, 40.0, 1, 1), ControllerState(), CONFIG, now_s=0.0)
    for pool in Pool:
        pstate = up.state.pools[pool]
        assert up.target(pool) > 1
        assert (pstate.scale_up_since_s, pstate.scale_up_to, pstate.scale_up_from) == (
            0.0,
            up.target(pool),
            1,
        )


def test_a_scale_up_while_one_is_being_timed_leaves_its_clock_running() -> None:
    # Asked 1 -> 3 at 0 s, none of the two ready at 30 s, and the load asks for more:
    # the new workers serve after the pending ones, so the clock stays on those.
    pending = ControllerState(
        smoothed_rate_rps=40.0,
        lengths=LENGTHS,
        pools=PerPool.both(PoolState(scale_up_since_s=0.0, scale_up_to=3, scale_up_from=1)),
    )
    seen = replace(
        observation(30.0, 400.0, 3, 3, prefill_ready=1),
        decode=PoolObservation(current_replicas=3, ready_replicas=1),
    )
    more = decide(seen, pending, CONFIG, now_s=30.0)
    for pool in Pool:
        assert more.target(pool) > 3
        pstate = more.state.pools[pool]
        assert (pstate.scale_up_since_s, pstate.scale_up_to, pstate.scale_up_from) == (0.0, 3, 1)
