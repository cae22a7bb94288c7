"""The lead-time stages: start-up measured online, the rate's upper quantile over the
lead time, the significance tests, the pooled mix — each against a closed form."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from controller.config import ControllerConfig
from controller.observation import PoolObservation
from controller.policy import ControllerState, PoolState, Reason, ReasonEntry
from controller.policy.leadtime import (
    MAX_WINDOW_SAMPLES,
    MIN_JUDGED_BOUNDS,
    MIN_POOLED_REQUESTS,
    BoundRecord,
    RateBound,
    detection_z,
    drain_plan,
    forecast_at,
    forecast_horizon_s,
    judge_bounds,
    lead_time_s,
    measure_startup,
    newest_scv,
    pool_window,
    pooled_lengths,
    pooled_requests,
    rate_upper,
    response_s,
    risk_z,
    significant,
    since_mix_shift,
    window_spread,
)
from controller.policy.normalisation import configured_window, stabilisation_window
from controller.policy.smoothing import MIX_STATISTICS, choose_lengths
from controller.policy.state import BoundSample, LengthWindow, RateSample
from queueing.catalog import resolve_profile
from queueing.lengths import LengthSamples
from queueing.pools import PerPool, Pool
from queueing.solver import CapacityModel, KvLink

CONFIG = ControllerConfig()


def test_the_risk_level_is_the_slos_percentile_as_a_normal_quantile() -> None:
    # Phi(2.3263) = 0.99, Phi(1.6449) = 0.95.
    assert risk_z(0.99) == pytest.approx(2.3263, abs=1e-4)
    assert risk_z(0.95) == pytest.approx(1.6449, abs=1e-4)
    with pytest.raises(ValueError, match="quantile"):
        risk_z(1.0)


def test_a_test_run_every_tick_shares_the_risk_over_the_history() -> None:
    # 1 - 0.01 / 120 = 0.99991667, whose normal quantile is 3.7648.
    assert detection_z(0.99, 120) == pytest.approx(3.7648, abs=1e-3)
    assert detection_z(0.99, 1) == pytest.approx(risk_z(0.99))


def test_the_estimates_own_uncertainty_widens_the_noise() -> None:
    _, score = significant(360.0, 300.0, 1.0, 3.0, variance_factor=2.0)
    assert score == pytest.approx(60 / math.sqrt(600))


@pytest.mark.parametrize(
    ("count", "expected", "ca2", "spread", "beyond", "score"),
    [
        (330.0, 300.0, 1.0, 0.0, False, 30 / math.sqrt(300)),  # Poisson: 1.73 sd
        (360.0, 300.0, 1.0, 0.0, True, 60 / math.sqrt(300)),  # 3.46 sd
        (360.0, 300.0, 4.0, 0.0, False, 60 / math.sqrt(1200)),  # an SCV of 4 doubles the sd
        (360.0, 300.0, 1.0, 40.0, False, 60 / 40),  # a larger spread seen wins
        (3.0, 0.0, 1.0, 0.0, True, 3.0),  # from zero: one arrival's worth of noise
    ],
)
def test_a_count_is_significant_beyond_the_noise_its_scv_implies(
    count: float, expected: float, ca2: float, spread: float, beyond: bool, score: float
) -> None:
    got, z = significant(count, expected, ca2, risk_z(0.99), spread_count=spread)
    assert got is beyond
    assert z == pytest.approx(score)


def test_the_window_spread_is_half_the_mean_squared_successive_difference() -> None:
    rates = tuple(
        RateSample(time_s=30.0 * i, rate_rps=r, estimate_rps=r, scv=1.0)
        for i, r in enumerate([10.0, 12.0, 10.0, 12.0, 10.0])
    )
    # Every successive difference is 2: sqrt(0.5 * 4).
    assert window_spread(rates, now_s=150.0, pool_s=300.0, interval_s=30.0) == pytest.approx(
        math.sqrt(2.0)
    )
    assert window_spread(rates[:3], now_s=150.0, pool_s=300.0, interval_s=30.0) is None


def test_without_history_the_bound_is_the_estimates_own_noise() -> None:
    # An EMA of weight w over W-s windows of a renewal process of SCV c2 has variance
    # w / (2 - w) * rate * c2 / W.
    bound = rate_upper(
        (), estimate_rps=10.0, ca2=4.0, lead_s=130.0, z=2.0, config=CONFIG, now_s=0.0
    )
    w = CONFIG.ema_weight
    sigma = math.sqrt(w / (2 - w) * 10.0 * 4.0 / CONFIG.window_s)
    assert bound.upper_rps == pytest.approx(10.0 + 2.0 * sigma)
    assert bound.drift_rps == 0.0 and bound.history == 0


# Windows of 10 and 14 req/s about estimates of 10: every past estimate's realised
# mean over its next two ticks is 12.
ALTERNATING = [10.0, 10.0, 14.0, 10.0, 14.0, 10.0, 14.0, 10.0, 14.0]


def test_the_drift_is_the_upper_semivariance_of_past_errors_over_the_lead_time() -> None:
    # Estimates of 10 req/s, ticks of 30 s; a lead time of 60 s spans the next two
    # ticks; ``ALTERNATING`` gives every past estimate an error of +2 over it.
    measured = ALTERNATING
    rates = _history(measured, [10.0] * len(measured))
    now = 30.0 * len(measured)
    bound = rate_upper(
        rates, estimate_rps=10.0, ca2=1.0, lead_s=60.0, z=2.0, config=CONFIG, now_s=now
    )
    errors = [np.mean(measured[i + 1 : i + 3]) - 10.0 for i in range(len(measured) - 2)]
    span = 30.0 + CONFIG.window_s
    w = CONFIG.ema_weight
    noise_var = w / (2 - w) * 10.0 / CONFIG.window_s
    # Less the realised mean's counting noise and the past estimates' own noise.
    semivariance = 2 * np.mean(np.square(np.maximum(errors, 0.0)))
    drift_var = semivariance - 10.0 * 1.0 / span - noise_var
    assert bound.history == len(errors)
    assert bound.drift_rps == pytest.approx(math.sqrt(drift_var))
    unbounded = 10.0 + 2.0 * math.sqrt(noise_var + drift_var)
    # The history never realised more than 12 req/s over a lead time: the drift's
    # part stops there.
    assert unbounded > 12.0
    assert bound.upper_rps == pytest.approx(12.0)


def test_a_steady_rate_has_no_drift_beyond_its_estimates_own_noise() -> None:
    # A past estimate's error over its lead time holds the realised mean's counting
    # noise and the estimate's own noise. Both are taken off: on a steady Poisson
    # rate, counting only the first off would leave a drift variance equal to the
    # estimate's noise variance, counted again beside it. What is left is the
    # semivariance's sampling noise, clamped at zero: over forty hours of history,
    # on average well under half of the noise's variance.
    ratios = []
    for seed in range(40):
        rng = np.random.default_rng(seed)
        _, estimates, rates = _counted_and_smoothed(np.full(121, 10.0), rng)
        bound = rate_upper(
            rates[:120],
            estimate_rps=float(estimates[120]),
            ca2=1.0,
            lead_s=90.0,
            z=risk_z(0.99),
            config=CONFIG,
            now_s=3600.0,
        )
        assert bound.history > 100
        ratios.append((bound.drift_rps / bound.noise_rps) ** 2)
    assert float(np.mean(ratios)) < 0.5


def test_a_window_beyond_the_history_and_its_noise_lifts_the_drift_ceiling() -> None:
    # The history of the test above: it never realised more than 12 req/s over a lead
    # time, and its windows moved by a root half mean squared successive difference
    # of sqrt(8) req/s. A window well beyond 12 and that noise is a ramp into new
    # territory: the drift's part may reach up to it. One within the noise is not.
    measured = ALTERNATING
    rates = _history(measured, [10.0] * len(measured))
    now = 30.0 * len(measured)

    def upper(measured_rps: float) -> float:
        return rate_upper(
            rates,
            estimate_rps=10.0,
            ca2=1.0,
            lead_s=60.0,
            z=2.0,
            config=CONFIG,
            now_s=now,
            measured_rps=measured_rps,
        ).upper_rps

    # Every past error is +2, so no line in the gaps: the errors are taken about zero.
    noise_var = CONFIG.ema_weight / (2 - CONFIG.ema_weight) * 10.0 / CONFIG.window_s
    drift_var = 2 * 2.0**2 - 10.0 / (30.0 + CONFIG.window_s) - noise_var
    unbounded = 10.0 + 2.0 * math.sqrt(noise_var + drift_var)
    assert unbounded > 13.0
    # 13 is within one spread of 12: the ceiling stays at the history's 12.
    assert upper(13.0) == pytest.approx(12.0)
    # 25 is beyond 12 by more than four spreads: the ceiling moves to 25, above the tail.
    assert upper(25.0) == pytest.approx(unbounded)


def test_a_gap_in_the_history_is_not_read_as_a_lead_time() -> None:
    rates = (
        RateSample(time_s=0.0, rate_rps=10.0, estimate_rps=10.0, scv=1.0),
        RateSample(time_s=600.0, rate_rps=50.0, estimate_rps=50.0, scv=1.0),
    )
    bound = rate_upper(
        rates, estimate_rps=10.0, ca2=1.0, lead_s=30.0, z=2.0, config=CONFIG, now_s=630.0
    )
    assert bound.history == 0


def _timed(
    pstate: PoolState, *, current: int, ready: int, now_s: float, pool: Pool = Pool.PREFILL
) -> tuple[PoolState, ReasonEntry | None]:
    """``measure_startup`` at a tick that sees ``current`` workers, ``ready`` of them ready."""
    seen = PoolObservation(current_replicas=current, ready_replicas=ready)
    return measure_startup(pool, seen, pstate, CONFIG, now_s)


def test_the_startup_is_measured_from_the_decision_to_every_worker_ready() -> None:
    pending = PoolState(scale_up_since_s=100.0, scale_up_to=4)
    # Not all ready yet: still pending.
    still, entry = _timed(pending, current=4, ready=3, now_s=160.0)
    assert still == pending and entry is None
    done, entry = _timed(pending, current=4, ready=4, now_s=190.0)
    # 90 s seen at tick resolution: half a tick is taken off.
    assert done.startup_s == pytest.approx(90.0 - CONFIG.interval_s / 2)
    assert done.startup_samples == 1 and done.scale_up_since_s is None
    assert entry is not None and entry.reason is Reason.STARTUP_MEASURED
    assert lead_time_s(done, CONFIG) == pytest.approx(75.0 + CONFIG.interval_s)
    # The second sample is averaged in (weight 1/2 while under 1/ema_weight samples).
    again, _ = _timed(
        replace(done, scale_up_since_s=200.0, scale_up_to=5), current=5, ready=5, now_s=260.0
    )
    assert again.startup_s == pytest.approx((75.0 + 45.0) / 2)


def test_a_scale_up_cut_back_to_the_pools_old_size_is_dropped_unmeasured() -> None:
    # Asked 3 -> 4, then back to 3 before the new worker served: it was never timed.
    pending = PoolState(scale_up_since_s=100.0, scale_up_to=4, scale_up_from=3)
    got, entry = _timed(pending, current=3, ready=3, now_s=200.0, pool=Pool.DECODE)
    assert got.scale_up_since_s is None and got.startup_s is None and entry is None
    assert got.scale_up_from is None
    assert lead_time_s(got, CONFIG) == CONFIG.lead_time.startup_prior_s + CONFIG.interval_s
    # A pending scale-up persisted without its old size is dropped the same way.
    legacy, entry = _timed(
        PoolState(scale_up_since_s=100.0, scale_up_to=4),
        current=3,
        ready=3,
        now_s=200.0,
        pool=Pool.DECODE,
    )
    assert legacy.scale_up_since_s is None and legacy.startup_s is None and entry is None


def test_a_scale_up_partly_cut_back_is_timed_on_the_workers_it_left() -> None:
    # Asked 1 -> 4 at 100 s, cut to 3 at the next tick: the pool sheds its newest
    # workers first, so the two kept above the old 1 were started at 100 s.
    pending = PoolState(scale_up_since_s=100.0, scale_up_to=4, scale_up_from=1)
    waiting, entry = _timed(pending, current=3, ready=1, now_s=130.0, pool=Pool.DECODE)
    assert entry is None and waiting.scale_up_to == 3 and waiting.scale_up_since_s == 100.0
    done, entry = _timed(waiting, current=3, ready=3, now_s=160.0, pool=Pool.DECODE)
    assert entry is not None and entry.reason is Reason.STARTUP_MEASURED
    assert done.startup_s == pytest.approx(60.0 - CONFIG.interval_s / 2)
    assert done.scale_up_since_s is None and done.scale_up_from is None


def test_the_mix_is_pooled_over_the_last_windows() -> None:
    def mix(prompt: int, n: int) -> LengthSamples:
        return LengthSamples(
            prompt_tokens=np.full(n, prompt, dtype=np.int64),
            output_tokens=np.full(n, 10, dtype=np.int64),
            source="test",
        )

    windows: tuple[LengthWindow, ...] = ()
    for t, prompt in ((0.0, 100), (30.0, 200), (60.0, 300)):
        windows = pool_window(windows, mix(prompt, 1000), now_s=t, pool_s=60.0)
    # The window at 0 s fell out of the 60-s pool; each keeps an evenly strided subset.
    pooled = pooled_lengths(windows, now_s=60.0, window_s=30.0)
    assert pooled is not None
    assert len(pooled.prompt_tokens) == 2 * MAX_WINDOW_SAMPLES
    assert float(pooled.prompt_tokens.mean()) == pytest.approx(250.0)


def _prompts(rng: np.random.Generator, t: float, n: int, scale: float = 1.0) -> LengthWindow:
    prompts = (scale * 800.0 * rng.lognormal(0.0, 0.5, n)).astype(np.int64) + 1
    return LengthWindow(time_s=t, prompt_tokens=prompts, output_tokens=np.full(n, 10))


def test_prompts_a_half_longer_restart_the_pooled_mix_from_the_window_that_shows_them() -> None:
    rng = np.random.default_rng(3)
    before = tuple(_prompts(rng, 30.0 * i, 200) for i in range(9))
    longer = _prompts(rng, 270.0, 200, scale=1.5)
    kept, why = since_mix_shift((*before, longer), window_s=30.0, z=4.0)
    assert kept == (longer,)
    assert why is not None and "mean prompt" in why
    # The same mix again is pooled on.
    same = _prompts(rng, 270.0, 200)
    kept, why = since_mix_shift((*before, same), window_s=30.0, z=4.0)
    assert (len(kept), why) == (10, None)


def test_the_prompt_test_misses_a_steady_mix_as_often_as_its_normal_level_says() -> None:
    # Welch's statistic is close to normal for 256 prompts a window: at z = 2 a steady
    # mix reads as moved in 4.55 % of ticks (two-sided), within 3 binomial sd of 4,000.
    rng = np.random.default_rng(11)
    trials = 4000
    moved = sum(
        since_mix_shift(
            tuple(_prompts(rng, 30.0 * i, 256) for i in range(5)), window_s=30.0, z=2.0
        )[1]
        is not None
        for _ in range(trials)
    )
    nominal = 2.0 * (1.0 - 0.9772498680518208)
    sd = math.sqrt(nominal * (1.0 - nominal) / trials)
    assert abs(moved / trials - nominal) < 3.0 * sd


def test_one_long_prompt_among_many_is_no_shift_of_the_mix() -> None:
    # A 120k-token prompt among 199 of about 800 raises the window's mean by 600 tokens,
    # and its standard error by as much: about one standard error, not a shift.
    rng = np.random.default_rng(5)
    before = tuple(_prompts(rng, 30.0 * i, 200) for i in range(9))
    window = _prompts(rng, 270.0, 200)
    window.prompt_tokens[0] = 120_000
    kept, why = since_mix_shift((*before, window), window_s=30.0, z=4.0)
    assert (len(kept), why) == (10, None)


def test_the_prompt_test_needs_enough_prompts_and_windows_that_do_not_overlap() -> None:
    rng = np.random.default_rng(7)
    before = tuple(_prompts(rng, 30.0 * i, 200) for i in range(9))
    few = _prompts(rng, 270.0, MIN_POOLED_REQUESTS - 1, scale=3.0)
    assert since_mix_shift((*before, few), window_s=30.0, z=4.0) == ((*before, few), None)
    # Windows within one window's span of the newest share its requests: not compared.
    overlapping = tuple(_prompts(rng, 250.0 + 4.0 * i, 200) for i in range(5))
    longer = _prompts(rng, 270.0, 200, scale=3.0)
    assert since_mix_shift((*overlapping, longer), window_s=30.0, z=4.0)[1] is None


def _documents(rng: np.random.Generator, n: int, scale: float = 1.0) -> LengthSamples:
    # k documents of about 3,000 tokens each, P(k) ~ 1/k^2 up to 32: a heavy tail.
    k = np.arange(1, 33)
    p = 1.0 / k**2
    counts = rng.choice(k, size=n, p=p / p.sum())
    prompts = np.array([rng.lognormal(8.0, 0.4, c).sum() for c in counts]) * scale
    return LengthSamples(
        prompt_tokens=prompts.astype(np.int64) + 1,
        output_tokens=rng.integers(100, 400, n),
        source="documents",
    )


def test_a_heavy_tailed_mix_drawn_again_is_kept() -> None:
    # Two pools of 900 requests of the same mix: their P99 prompts differ by more than
    # the 5 % a fixed tolerance allowed, and by less than the pools' own noise.
    rng = np.random.default_rng(21)
    kept, seen = _documents(rng, 900), _documents(rng, 900)
    p99 = [float(np.quantile(m.prompt_tokens, 0.99)) for m in (kept, seen)]
    assert abs(p99[1] - p99[0]) > 0.05 * p99[0]
    z = detection_z(0.99, MIX_STATISTICS * 120)
    assert choose_lengths(seen, kept, z=z) == (kept, None)


def test_prompts_a_fifth_longer_are_a_move_of_the_mix() -> None:
    rng = np.random.default_rng(22)
    kept, seen = _documents(rng, 900), _documents(rng, 900, scale=1.2)
    z = detection_z(0.99, MIX_STATISTICS * 120)
    chosen, entry = choose_lengths(seen, kept, z=z)
    assert chosen is seen
    assert entry is not None and entry.reason is Reason.LENGTHS_UPDATED


def test_the_mix_is_kept_against_its_own_population_as_often_as_its_tests_allow() -> None:
    # Kept: the population (50,000 draws: its figures' own noise a tenth of 400 draws');
    # seen: 400 draws of it. Each of the four prompt figures reads as moved
    # with probability about 2 x (1 - Phi(z)) (the outputs do not vary), so at z = 2 the
    # mix moves at least as often as one figure alone does, and at most as often as the
    # four together can (Bonferroni), each within 3 binomial sd over 1,500 draws.
    rng = np.random.default_rng(23)
    population = LengthSamples(
        prompt_tokens=(800.0 * rng.lognormal(0.0, 0.8, 50_000)).astype(np.int64) + 1,
        output_tokens=np.full(50_000, 200, dtype=np.int64),
        source="population",
    )
    trials, moved = 1500, 0
    for _ in range(trials):
        rows = rng.integers(0, 50_000, 400)
        seen = LengthSamples(
            prompt_tokens=population.prompt_tokens[rows],
            output_tokens=population.output_tokens[rows],
            source="draw",
        )
        moved += choose_lengths(seen, population, z=2.0)[1] is not None
    one, four = 2.0 * (1.0 - 0.9772498680518208), 8.0 * (1.0 - 0.9772498680518208)
    low = one - 3.0 * math.sqrt(one * (1.0 - one) / trials)
    high = four + 3.0 * math.sqrt(four * (1.0 - four) / trials)
    assert low < moved / trials < high


def test_the_ca2_is_the_newest_the_source_read_over_the_pool_s_span() -> None:
    rates = tuple(
        RateSample(time_s=t, rate_rps=1.0, estimate_rps=1.0, scv=s)
        for t, s in ((0.0, 9.0), (30.0, 1.0), (60.0, 3.0), (90.0, None))
    )
    # Each estimate already spans the pool: the newest holds the older ones.
    assert newest_scv(rates[:3], now_s=60.0, pool_s=60.0) == 3.0
    # A tick that measured none keeps the newest within the span...
    assert newest_scv(rates, now_s=90.0, pool_s=60.0) == 3.0
    # ... and none older than the span stands in.
    assert newest_scv(rates, now_s=130.0, pool_s=60.0) is None


def _mix(n: int) -> LengthSamples:
    return LengthSamples(
        prompt_tokens=np.full(n, 500, dtype=np.int64),
        output_tokens=np.full(n, 10, dtype=np.int64),
        source="test",
    )


def _windows_of(finish_s: np.ndarray, ticks_s: np.ndarray, window_s: float):
    """The pooled windows a controller ticking at ``ticks_s`` gathers from requests
    finishing at ``finish_s``, each window holding one pair per request it saw."""
    windows: tuple[LengthWindow, ...] = ()
    for t in ticks_s:
        seen = int(((finish_s > t - window_s) & (finish_s <= t)).sum())
        windows = pool_window(windows, _mix(seen) if seen else None, now_s=t, pool_s=300.0)
        yield t, windows


def test_a_pooled_mix_of_too_few_requests_is_not_one_to_size_on() -> None:
    # 30-s windows every 4 s: one window of 49 requests is too few, one of 50 enough.
    few = pool_window((), _mix(MIN_POOLED_REQUESTS - 1), now_s=0.0, pool_s=300.0)
    assert pooled_lengths(few, now_s=0.0, window_s=30.0) is None
    enough = pool_window((), _mix(MIN_POOLED_REQUESTS), now_s=0.0, pool_s=300.0)
    assert pooled_lengths(enough, now_s=0.0, window_s=30.0) is not None
    # Overlapping windows count each request once: ten windows of the same 40 requests
    # (all finished in the first second) are still 40 requests.
    finish = np.linspace(0.1, 1.0, 40)
    *_, (_, same) = _windows_of(finish, np.arange(4.0, 28.0, 4.0) + 1.0, 30.0)
    assert pooled_requests(same, window_s=30.0) == pytest.approx(40)
    assert pooled_lengths(same, now_s=25.0, window_s=30.0) is None


def test_the_pooled_count_follows_the_requests_finished_through_a_start_and_a_ramp() -> None:
    # Completions from a start at 0 s at a rate rising from 0.5 to 4 req/s over 200 s
    # (their count to time t: 0.5 t + 7 t^2 / 800), windows of 30 s every 4 s. Until the
    # pool's 300 s are full every finished request is in the pool: the count must
    # follow them to within what one tick's gap per 30 s can hold, never above them.
    t_max = 200.0
    grid = np.linspace(0.0, t_max, 200_001)
    cumulative = 0.5 * grid + 7.0 * grid**2 / 800.0
    finish_s = np.interp(np.arange(1, int(cumulative[-1])) + 0.5, cumulative, grid)
    for t, windows in _windows_of(finish_s, np.arange(4.0, t_max, 4.0), 30.0):
        finished = int((finish_s <= t).sum())
        counted = pooled_requests(windows, window_s=30.0)
        assert counted <= finished * 1.01 + 1
        assert counted >= finished * 0.9 - 1, (t, counted, finished)


def test_a_hole_in_the_windows_is_not_filled_in() -> None:
    # Thirty requests finished at 5-25 s and thirty at 105-125 s; no windows between.
    finish_s = np.concatenate([np.linspace(5, 25, 30), np.linspace(105, 125, 30)])
    ticks = np.concatenate([np.arange(4.0, 32.0, 4.0), np.arange(104.0, 132.0, 4.0)])
    *_, (_, windows) = _windows_of(finish_s, ticks, 30.0)
    assert pooled_requests(windows, window_s=30.0) == pytest.approx(60)


def test_the_new_state_survives_its_json_codec() -> None:
    state = ControllerState(
        smoothed_rate_rps=3.0,
        pools=PerPool(
            prefill=PoolState(
                startup_s=80.0,
                startup_samples=2,
                scale_up_since_s=5.0,
                scale_up_to=3,
                scale_up_from=1,
                bounds=(BoundSample(time_s=1.0, upper_rps=4.5, ticks=3),),
            ),
            decode=PoolState(),
        ),
        rates=(RateSample(time_s=1.0, rate_rps=2.0, estimate_rps=2.5, scv=None),),
        length_windows=(
            LengthWindow(
                time_s=1.0, prompt_tokens=np.array([5, 6]), output_tokens=np.array([1, 2])
            ),
        ),
    )
    back = ControllerState.from_dict(state.to_dict())
    assert back.pools == state.pools and back.rates == state.rates
    assert back.length_windows[0].prompt_tokens.tolist() == [5, 6]
    assert back.to_dict() == state.to_dict()


def test_a_forecast_is_read_on_the_line_from_the_estimate_to_its_horizon() -> None:
    # 8 req/s now, 12 at 10 s ahead: 10 at 5 s; never beyond either end.
    assert forecast_at(12.0, estimate_rps=8.0, horizon_s=10.0, at_s=5.0) == pytest.approx(10.0)
    assert forecast_at(12.0, estimate_rps=8.0, horizon_s=10.0, at_s=0.0) == pytest.approx(8.0)
    assert forecast_at(12.0, estimate_rps=8.0, horizon_s=10.0, at_s=-3.0) == pytest.approx(8.0)
    assert forecast_at(12.0, estimate_rps=8.0, horizon_s=10.0, at_s=25.0) == pytest.approx(12.0)


def test_the_forecast_looks_as_far_as_the_longer_lead_time_or_the_configured_horizon() -> None:
    pools = PerPool(
        prefill=replace(PoolState(), startup_s=40.0), decode=replace(PoolState(), startup_s=90.0)
    )
    assert forecast_horizon_s(pools, CONFIG) == pytest.approx(90.0 + CONFIG.interval_s)
    off = replace(CONFIG, lead_time=replace(CONFIG.lead_time, enabled=False))
    assert forecast_horizon_s(pools, off) == CONFIG.forecast.horizon_s


def test_a_decode_batch_follows_the_rate_by_its_relaxation_time_a_prefill_queue_at_once() -> None:
    profile = resolve_profile("llama-2-70b-tp4@h100-sxm")
    lengths = LengthSamples(
        prompt_tokens=np.full(64, 800, dtype=np.int64),
        output_tokens=np.full(64, 200, dtype=np.int64),
        source="800 in, 200 out",
    )
    model = CapacityModel.build(lengths, profile, tpot_slo_s=0.1, link=KvLink(bytes_per_s=5e10))
    # One worker, 2 req/s: the relaxation time E[n] T / (1 - rho) of the mean batch,
    # more than the 199 iterations of a 200-token output at their floor t0.
    tau = response_s(Pool.DECODE, model, workers=1, rate_rps=2.0, toward_rps=3.0)
    assert tau == model.decode.relaxation_s(workers=1, arrival_rate_rps=2.0)
    assert 199 * profile.t0_s < tau
    assert response_s(Pool.PREFILL, model, workers=1, rate_rps=2.0, toward_rps=3.0) == 0.0
    # Toward a rate the worker cannot keep up with, the batch grows without a level to
    # relax to: the pool follows the forecast at once.
    limit = 1.0 / (
        model.decode.decode_fraction * model.decode.mean_steps * model.decode.member_cost_s
    )
    assert model.decode.is_stable(workers=1, arrival_rate_rps=0.99 * limit)
    assert response_s(Pool.DECODE, model, workers=1, rate_rps=2.0, toward_rps=1.01 * limit) == 0.0
    assert response_s(Pool.DECODE, model, workers=1, rate_rps=2.0, toward_rps=0.99 * limit) > 0.0


def _history(measured: list[float], estimates: list[float]) -> tuple[RateSample, ...]:
    return tuple(
        RateSample(time_s=30.0 * i, rate_rps=m, estimate_rps=e, scv=1.0)
        for i, (m, e) in enumerate(zip(measured, estimates, strict=True))
    )


def test_errors_that_follow_the_windows_gap_are_planned_along_that_line() -> None:
    # A lead time of one tick: each estimate's error is the next window's rate less
    # it. The next window realises the estimate plus 0.8 x the current gap plus a
    # noise of +-0.5, so the errors lie on a line in the gaps, and the bound follows
    # the line at today's gap rather than the spread of every error about zero.
    rng = np.random.default_rng(5)
    n = 60
    gaps = rng.uniform(-4.0, 4.0, n)
    noise = rng.choice([-0.5, 0.5], n)
    estimates = np.full(n, 20.0)
    measured = estimates + gaps
    # Measured at tick i + 1 is 20 + 0.8 * gap_i + noise_i (and becomes gap_{i+1}).
    for i in range(n - 1):
        measured[i + 1] = 20.0 + 0.8 * gaps[i] + noise[i]
        gaps[i + 1] = measured[i + 1] - 20.0
    rates = _history(list(measured), list(estimates))

    def bound_at(gap_now: float) -> RateBound:
        return rate_upper(
            rates,
            estimate_rps=20.0,
            ca2=1.0,
            lead_s=30.0,
            z=2.0,
            config=CONFIG,
            now_s=30.0 * n,
            measured_rps=20.0 + gap_now,
        )

    for gap_now in (-3.0, 0.0, 3.0):
        bound = bound_at(gap_now)
        # The independent computation: numpy's least-squares line, its residuals' upper
        # semi-variance less the counting noise, and the prediction variance at gap_now.
        x, y = gaps[:-1], measured[1:] - 20.0
        slope, intercept = np.polyfit(x, y, 1)
        residuals = y - (intercept + slope * x)
        s2 = np.sum(residuals**2) / (len(x) - 2)
        fit_var = s2 * (1 / len(x) + (gap_now - x.mean()) ** 2 / np.sum((x - x.mean()) ** 2))
        drift_var = max(0.0, 2 * np.mean(np.maximum(residuals, 0) ** 2) - 20.0 / CONFIG.window_s)
        noise_var = CONFIG.ema_weight / (2 - CONFIG.ema_weight) * 20.0 / CONFIG.window_s
        expected = (
            20.0 + intercept + slope * gap_now + 2.0 * math.sqrt(noise_var + drift_var + fit_var)
        )
        floor = 20.0 + 2.0 * math.sqrt(noise_var)
        realised_max = float(measured[1:].max())
        assert bound.conditioned
        assert bound.expected_drift_rps == pytest.approx(intercept + slope * gap_now)
        assert bound.upper_rps == pytest.approx(max(floor, min(expected, realised_max)))
    # Where the window sits below the estimate (a falling rate) the plan is lower than
    # where it sits above it.
    low, high = (bound_at(g).upper_rps for g in (-3.0, 3.0))
    assert low < high


def test_errors_unrelated_to_the_gap_are_taken_about_zero_as_before() -> None:
    # Independent errors: no line is significant, and the bound is the one without
    # a measured rate (the unconditional upper semi-variance).
    rng = np.random.default_rng(8)
    n = 80
    measured = list(20.0 + rng.normal(0.0, 2.0, n))
    rates = _history(measured, [20.0] * n)
    kwargs = dict(estimate_rps=20.0, ca2=1.0, lead_s=30.0, z=risk_z(0.99), config=CONFIG)
    with_gap = rate_upper(rates, now_s=30.0 * n, measured_rps=26.0, **kwargs)  # type: ignore[arg-type]
    without = rate_upper(rates, now_s=30.0 * n, **kwargs)  # type: ignore[arg-type]
    assert not with_gap.conditioned and not without.conditioned
    assert with_gap.upper_rps == without.upper_rps


def _counted_and_smoothed(
    true: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, tuple[RateSample, ...]]:
    """A true rate per 30-s tick counted in Poisson windows and smoothed by the
    controller's EMA: the measured rates, the estimates and their history."""
    window = CONFIG.window_s
    measured = rng.poisson(true * window) / window
    estimates = np.empty(len(true))
    estimates[0] = measured[0]
    for i in range(1, len(true)):
        estimates[i] = (1 - CONFIG.ema_weight) * estimates[i - 1] + CONFIG.ema_weight * measured[i]
    return measured, estimates, _history(list(measured), list(estimates))


def test_on_a_daily_cycle_the_conditioned_bound_covers_the_lead_time_and_plans_less() -> None:
    # A sinusoidal rate (period 40 ticks, 2-10 req/s) counted in Poisson windows and
    # smoothed by the controller's EMA. At each tick after the first hour the bound over
    # a three-tick lead time is computed from the last hour: it must still cover the
    # true rate over the lead time about as often as the SLO's percentile asks (the
    # windows' counting noise is the queueing model's, through c²: at most 3 %
    # exceedances, where 1 % is the target and 3 % lies beyond the binomial's 99.9 %
    # point for 1 % over these ticks), and on average plan for less than the
    # unconditioned bound, whose spread is every phase's.
    rng = np.random.default_rng(21)
    ticks, k = 480, 3
    true = 6.0 - 4.0 * np.cos(2 * np.pi * np.arange(ticks) / 40.0)
    measured, estimates, rates = _counted_and_smoothed(true, rng)
    z = risk_z(0.99)
    exceed = conditioned_sum = plain_sum = 0.0
    checked = 0
    for i in range(120, ticks - k):
        kwargs = dict(
            estimate_rps=float(estimates[i]), ca2=1.0, lead_s=30.0 * k, z=z, config=CONFIG
        )
        history = rates[:i]
        cond = rate_upper(history, now_s=30.0 * i, measured_rps=float(measured[i]), **kwargs)  # type: ignore[arg-type]
        plain = rate_upper(history, now_s=30.0 * i, **kwargs)  # type: ignore[arg-type]
        realised = float(true[i + 1 : i + 1 + k].mean())
        exceed += realised > cond.upper_rps
        conditioned_sum += cond.upper_rps
        plain_sum += plain.upper_rps
        checked += 1
    assert exceed / checked <= 0.03
    assert conditioned_sum < plain_sum


def test_a_queue_left_when_a_new_worker_serves_is_planned_to_clear_in_the_tick_after() -> None:
    # Two serving workers clear 20 req/s (0.1 s a packed prompt); 30 req/s arrive and
    # 100 are queued, so after the 40-s start-up 100 + (30 - 20) x 40 = 500 are.
    plan = drain_plan(
        PerPool(prefill=30.0, decode=28.0),
        queue=100.0,
        serving_workers=2,
        packed_service_s=0.1,
        startup_s=40.0,
        interval_s=30.0,
    )
    assert plan is not None
    assert plan.queue_at_ready == pytest.approx(500.0)
    assert plan.rates_rps.prefill == pytest.approx(30.0 + 500.0 / 30.0)
    # The decode pool's arrivals are the prefill pool's departures: the drain rate.
    assert plan.rates_rps.decode == pytest.approx(plan.rates_rps.prefill)


def test_a_queue_the_serving_workers_clear_before_a_new_one_serves_asks_for_nothing() -> None:
    # 10 req/s on workers that clear 20: the 100 queued are gone in 10 s.
    kwargs = {"serving_workers": 2, "packed_service_s": 0.1, "startup_s": 40.0}
    assert drain_plan(PerPool.both(10.0), queue=100.0, interval_s=30.0, **kwargs) is None
    assert drain_plan(PerPool.both(30.0), queue=0.0, interval_s=30.0, **kwargs) is None


# -- how the bounds held: the stabilisation window -----------------------------------------


JUDGE = {"history_s": 3600.0, "interval_s": 30.0}


def test_a_bound_is_judged_against_the_mean_rate_of_the_ticks_its_lead_time_spans() -> None:
    # Ticks every 30 s measuring 3, 4, 5, 6, 9, 1 req/s. A bound at 0 s over three
    # ticks meets what arrived over the three ticks after it: (4 + 5 + 6) / 3 = 5 req/s.
    rates = _history([3.0, 4.0, 5.0, 6.0, 9.0, 1.0], [3.0] * 6)

    def judged(*bounds: BoundSample) -> BoundRecord:
        return judge_bounds(bounds, rates, now_s=150.0, **JUDGE)

    assert judged(BoundSample(time_s=0.0, upper_rps=4.9, ticks=3)) == BoundRecord(
        judged=1, exceeded=1
    )
    assert judged(BoundSample(time_s=0.0, upper_rps=5.1, ticks=3)) == BoundRecord(
        judged=1, exceeded=0
    )
    # 60 s meets (6 + 9 + 1) / 3 = 5.33 over its 5.3; 90 s has only two ticks after it.
    assert judged(
        BoundSample(time_s=60.0, upper_rps=5.3, ticks=3),
        BoundSample(time_s=90.0, upper_rps=0.1, ticks=3),
    ) == BoundRecord(judged=1, exceeded=1)


def test_a_bound_whose_lead_time_has_a_hole_or_lies_before_the_history_is_not_judged() -> None:
    whole = _history([5.0] * 8, [5.0] * 8)
    with_hole = tuple(r for r in whole if r.time_s != 60.0)
    bound = BoundSample(time_s=0.0, upper_rps=1.0, ticks=3)
    assert judge_bounds((bound,), whole, now_s=210.0, **JUDGE) == BoundRecord(judged=1, exceeded=1)
    assert judge_bounds((bound,), with_hole, now_s=210.0, **JUDGE) == BoundRecord(
        judged=0, exceeded=0
    )
    short = {**JUDGE, "history_s": 100.0}
    assert judge_bounds((bound,), whole, now_s=210.0, **short) == BoundRecord(judged=0, exceeded=0)


@pytest.mark.parametrize(
    ("judged", "exceeded", "holds"),
    [
        # n x (1 - 0.99) exceedances are what the risk allows: none below a hundred.
        (MIN_JUDGED_BOUNDS, 0, True),
        (99, 1, False),
        (100, 1, True),
        (250, 2, True),
        (250, 3, False),
        # Too few judged bounds say nothing yet, however well they held.
        (MIN_JUDGED_BOUNDS - 1, 0, False),
    ],
)
def test_the_window_is_the_lead_time_only_where_the_bound_held_as_often_as_the_risk_allows(
    judged: int, exceeded: int, holds: bool
) -> None:
    lead_s = 135.0
    window = stabilisation_window(
        BoundRecord(judged=judged, exceeded=exceeded), lead_s=lead_s, config=CONFIG, quantile=0.99
    )
    expected = lead_s if holds else CONFIG.scale_down_stabilisation_s
    assert window.window_s == expected
    assert f"{exceeded} of the last {judged}" in window.detail or judged < MIN_JUDGED_BOUNDS


def test_a_configured_window_shorter_than_the_lead_time_is_kept() -> None:
    config = replace(CONFIG, scale_down_stabilisation_s=60.0)
    window = stabilisation_window(
        BoundRecord(judged=200, exceeded=0), lead_s=135.0, config=config, quantile=0.99
    )
    assert window == configured_window(config)


def test_bursts_after_silence_exceed_their_bounds_more_often_than_the_risk_allows() -> None:
    # The controller's own bound, built at every tick from the hour before it and
    # judged against what the next three ticks measured. Bursts that come unannounced
    # after silences (3 minutes at 20 req/s in every 20, Poisson) find the ticks before
    # each one planned for the silence: their record keeps the configured window.
    rng = np.random.default_rng(5)
    ticks, k = 240, 3
    true = np.where((np.arange(ticks) % 40) >= 34, 20.0, 0.0)
    measured, estimates, rates = _counted_and_smoothed(true, rng)
    bounds = tuple(
        BoundSample(
            time_s=30.0 * i,
            upper_rps=rate_upper(
                rates[:i],
                estimate_rps=float(estimates[i]),
                ca2=1.0,
                lead_s=30.0 * k,
                z=risk_z(0.99),
                config=CONFIG,
                now_s=30.0 * i,
                measured_rps=float(measured[i]),
            ).upper_rps,
            ticks=k,
        )
        for i in range(120, ticks)
    )
    record = judge_bounds(bounds, rates, now_s=30.0 * (ticks - 1), **JUDGE)
    assert record.judged >= MIN_JUDGED_BOUNDS
    assert record.exceeded > math.floor(record.judged * 0.01 + 1e-9)
    window = stabilisation_window(record, lead_s=30.0 * k, config=CONFIG, quantile=0.99)
    assert window == replace(window, window_s=CONFIG.scale_down_stabilisation_s)
