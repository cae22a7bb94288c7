"""``oracle``: a clairvoyant planner, the cost floor to compare against.

**What "floor" means.** Every policy is judged on the whole run: the share of its
requests that meet both the TTFT and the TPOT SLO (``SimSummary.slo_attainment``),
against the SLO's percentile (``TARGET_ATTAINMENT``, 0.99 for P99 SLOs), with no
request lost. The oracle is the cheapest plan it can find that the simulator,
replaying the *whole run* exactly as it replays every other policy, confirms meets
that target. It is a floor over a family of plans: one allocation per window
(300 s by default), each grown ``startup_s`` ahead so its new workers serve from
the window's start and shrunk (draining) when the window ends, and the constant
allocations. The floor is over the run rather than per window because that is the
criterion every other policy is held to: a per-window floor is not a floor for it
(on a bursty load a constant allocation can meet the run's target for less than a
plan that must meet every window's P99 at once).

How it is found:

1. **Per window** (``plan_window``): the smallest pools that meet both P99s of the
   requests arriving in the window, simulated on fixed pools with the previous
   ``warmup_s`` seconds of requests replayed first (so a window inherits its
   predecessor's backlog) and not counted. TTFT depends only on the prefill pool
   and TPOT (almost) only on the decode pool, so one simulation tests both counts;
   each pool gallops from the solver's zero-headroom answer and then bisects.
2. **Confirmed and repaired over the run** (``confirm``): the window plan is
   replayed end to end. What the per-window checks cannot see — scale-downs whose
   draining workers still hold long requests, backlogs carried across a
   boundary, the two SLOs missing on different requests — shows as windows whose
   requests attain less than the target in the run. Each such window gets one more
   worker in the pool that spends more than half of the window's miss budget
   (TTFT misses for prefill, TPOT misses for decode: the budget ``1 - target`` is
   split evenly between the two SLOs, so at least one pool qualifies), and the run
   is replayed again, until it meets the target or every failing window is at the
   cap.
3. **Never worse than a constant plan**: ``static-peak`` (the solver's allocation
   for the busiest minute) is replayed too. When it meets the target it is a
   feasible plan, so the window plan is also tried capped at it (repaired only up
   to it), and the cheapest confirmed plan of the three is the oracle's.

The answer is the cheapest *confirmed* plan the search meets, an upper bound on the
true minimum over the family (the search does not try every combination of
windows); ``OraclePlan`` records its confirmed attainment and GPU-hours.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from queueing.solver import DEFAULT_QUANTILE
from sim.cluster import Cluster
from sim.policies.base import (
    Allocation,
    ClusterView,
    Scenario,
    replay,
    slo_met,
    window_allocation,
)
from sim.policies.static import static_peak
from sim.trace import Trace

DEFAULT_WINDOW_S = 300.0
DEFAULT_WARMUP_S = 60.0
# The SLOs are P99s: the share of the run's requests that must meet both.
TARGET_ATTAINMENT = DEFAULT_QUANTILE


@dataclass(frozen=True, kw_only=True)
class OracleWindow:
    """One window's smallest SLO-meeting allocation and what finding it cost."""

    start_s: float
    end_s: float
    requests: int
    allocation: Allocation
    met: bool  # False when even the replica cap misses an SLO in this window
    simulations: int


@dataclass(frozen=True, kw_only=True)
class WindowCheck:
    ttft_ok: bool
    tpot_ok: bool
    ttft_p99_s: float | None
    tpot_p99_s: float | None


def check_window(
    trace: Trace,
    scenario: Scenario,
    allocation: Allocation,
    *,
    start_s: float,
    end_s: float,
    warmup_s: float = DEFAULT_WARMUP_S,
) -> WindowCheck:
    """Simulate the requests of [start_s - warmup_s, end_s) on fixed pools and check
    the SLOs on those arriving in [start_s, end_s)."""
    lo, first, hi = (
        int(i)
        for i in np.searchsorted(
            trace.arrival_s, [max(0.0, start_s - warmup_s), start_s, end_s], side="left"
        )
    )
    origin = float(max(0.0, start_s - warmup_s))
    sub = Trace(
        arrival_s=trace.arrival_s[lo:hi] - origin,
        prompt_tokens=trace.prompt_tokens[lo:hi],
        output_tokens=trace.output_tokens[lo:hi],
        source=f"{trace.source} [{origin:g} s, {end_s:g} s)",
    )
    results = Cluster(scenario.cluster_config(allocation), sub).run()
    counted = slice(first - lo, hi - lo)
    # Requests that never get a first token (beyond the model's context: rejected at
    # arrival, whatever the pools) say nothing about the pools' sizes.
    ttft = results.ttft_s[counted]
    ttft = ttft[np.isfinite(ttft)]
    tpot = results.tpot_s[counted]
    tpot = tpot[np.isfinite(tpot)]
    ttft_p99 = float(np.percentile(ttft, 99)) if len(ttft) else None
    tpot_p99 = float(np.percentile(tpot, 99)) if len(tpot) else None
    return WindowCheck(
        ttft_ok=ttft_p99 is None or ttft_p99 <= scenario.slo.ttft_p99_s,
        tpot_ok=tpot_p99 is None or tpot_p99 <= scenario.slo.tpot_p99_s,
        ttft_p99_s=ttft_p99,
        tpot_p99_s=tpot_p99,
    )


@dataclass
class _Search:
    """Smallest passing count of one pool: ``lo`` fails (0 always does), ``hi`` passes."""

    cap: int
    lo: int = 0
    hi: int | None = None
    step: int = 1

    def record(self, workers: int, ok: bool) -> None:
        if ok:
            self.hi = workers if self.hi is None else min(self.hi, workers)
        else:
            self.lo = max(self.lo, workers)

    @property
    def done(self) -> bool:
        if self.hi is None:
            return self.lo >= self.cap
        return self.hi - self.lo <= 1

    @property
    def answer(self) -> int:
        return self.cap if self.hi is None else self.hi

    def probe(self) -> int:
        """The next count to test (gallop away from the last result, then bisect)."""
        if self.done:
            return self.answer
        if self.hi is None:
            nxt = min(self.cap, self.lo + self.step)
        else:
            nxt = max((self.lo + self.hi) // 2, self.hi - self.step, self.lo + 1)
        self.step *= 2
        return nxt


def plan_window(
    trace: Trace,
    scenario: Scenario,
    *,
    start_s: float,
    end_s: float,
    warmup_s: float = DEFAULT_WARMUP_S,
) -> OracleWindow:
    """The smallest allocation the simulator confirms meets both SLOs in the window."""
    first, hi = (int(i) for i in np.searchsorted(trace.arrival_s, [start_s, end_s], side="left"))
    if hi == first:
        return OracleWindow(
            start_s=start_s,
            end_s=end_s,
            requests=0,
            allocation=Allocation(prefill=1, decode=1),
            met=True,
            simulations=0,
        )
    guess = window_allocation(trace, scenario, start_s=start_s, end_s=end_s, headroom=0.0)
    cap = scenario.max_replicas
    prefill, decode = _Search(cap=cap), _Search(cap=cap)
    n, m = guess.prefill, guess.decode
    simulations = 0
    while True:
        check = check_window(
            trace,
            scenario,
            Allocation(prefill=n, decode=m),
            start_s=start_s,
            end_s=end_s,
            warmup_s=warmup_s,
        )
        simulations += 1
        if not prefill.done:
            prefill.record(n, check.ttft_ok)
        if not decode.done:
            decode.record(m, check.tpot_ok)
        if prefill.done and decode.done:
            break
        n, m = prefill.probe(), decode.probe()
    return OracleWindow(
        start_s=start_s,
        end_s=end_s,
        requests=hi - first,
        allocation=Allocation(prefill=prefill.answer, decode=decode.answer),
        met=prefill.hi is not None and decode.hi is not None,
        simulations=simulations,
    )


def plan_windows(
    trace: Trace,
    scenario: Scenario,
    *,
    window_s: float = DEFAULT_WINDOW_S,
    warmup_s: float = DEFAULT_WARMUP_S,
    progress: Callable[[float], None] | None = None,
) -> tuple[OracleWindow, ...]:
    """Every window's own smallest allocation (step 1), from time 0 to the last arrival."""
    if not (math.isfinite(window_s) and window_s > 0):
        raise ValueError(f"window_s: must be a finite number > 0, got {window_s!r}")
    end_s = float(trace.arrival_s[-1]) if len(trace) else 0.0
    count = max(1, math.floor(end_s / window_s) + 1)
    plan = []
    for k in range(count):
        plan.append(
            plan_window(
                trace,
                scenario,
                start_s=k * window_s,
                end_s=(k + 1) * window_s,
                warmup_s=warmup_s,
            )
        )
        if progress is not None:
            progress((k + 1) / count)
    return tuple(plan)


@dataclass(frozen=True, kw_only=True)
class Confirmed:
    """A plan and what replaying the whole run on it gave."""

    windows: tuple[OracleWindow, ...]
    attainment: float
    gpu_hours: float
    lost_requests: int
    replays: int

    @property
    def meets(self) -> bool:
        return self.lost_requests == 0 and self.attainment >= TARGET_ATTAINMENT


@dataclass(frozen=True, kw_only=True)
class OraclePlan:
    """The oracle's plan: the cheapest confirmed candidate (``chosen``: which one)."""

    windows: tuple[OracleWindow, ...]
    chosen: str  # "windows", "windows capped at static-peak" or "static-peak"
    attainment: float
    gpu_hours: float
    met: bool
    replays: int
    candidates: tuple[tuple[str, Confirmed], ...]


def _replay_plan(
    trace: Trace, scenario: Scenario, windows: tuple[OracleWindow, ...]
) -> tuple[float, float, int, np.ndarray, np.ndarray, np.ndarray]:
    """Replay the whole run on ``windows``: attainment, GPU-hours, lost requests, and
    per request whether it met both SLOs, its TTFT and its TPOT SLO."""
    results = replay(trace, OraclePolicy(scenario, windows), scenario).results
    summary = results.summary(
        ttft_slo_s=scenario.slo.ttft_p99_s, tpot_slo_s=scenario.slo.tpot_p99_s
    )
    met = slo_met(results, scenario.slo)
    ttft_ok = np.isfinite(results.ttft_s) & (results.ttft_s <= scenario.slo.ttft_p99_s)
    tpot = results.tpot_s
    tpot_ok = (results.output_tokens == 1) | (np.isfinite(tpot) & (tpot <= scenario.slo.tpot_p99_s))
    return (
        summary.slo_attainment or 0.0,
        summary.gpu_hours,
        summary.lost_requests,
        met,
        ttft_ok,
        tpot_ok,
    )


def confirm(
    trace: Trace,
    scenario: Scenario,
    windows: tuple[OracleWindow, ...],
    *,
    cap: Allocation | None = None,
    max_rounds: int = 12,
) -> Confirmed:
    """Replay the run on ``windows`` and repair it (step 2) until it meets the target.

    ``cap`` bounds every window's pools (default: the scenario's ``max_replicas``);
    ``max_rounds`` bounds the replays (a round grows every failing window at once)."""
    limit = cap or Allocation(prefill=scenario.max_replicas, decode=scenario.max_replicas)
    plan = tuple(
        replace(
            w,
            allocation=Allocation(
                prefill=min(w.allocation.prefill, limit.prefill),
                decode=min(w.allocation.decode, limit.decode),
            ),
        )
        for w in windows
    )
    budget = 1.0 - TARGET_ATTAINMENT
    replays = 0
    while True:
        attainment, gpu_hours, lost, met, ttft_ok, tpot_ok = _replay_plan(trace, scenario, plan)
        replays += 1
        confirmed = Confirmed(
            windows=plan,
            attainment=attainment,
            gpu_hours=gpu_hours,
            lost_requests=lost,
            replays=replays,
        )
        if confirmed.meets or replays >= max_rounds:
            return confirmed
        grown = []
        changed = False
        for w in plan:
            lo, hi = (
                int(i) for i in np.searchsorted(trace.arrival_s, [w.start_s, w.end_s], side="left")
            )
            n = hi - lo
            prefill, decode = w.allocation.prefill, w.allocation.decode
            if n and np.count_nonzero(met[lo:hi]) < TARGET_ATTAINMENT * n:
                if np.count_nonzero(~ttft_ok[lo:hi]) > budget / 2 * n:
                    prefill = min(prefill + 1, limit.prefill)
                if np.count_nonzero(~tpot_ok[lo:hi]) > budget / 2 * n:
                    decode = min(decode + 1, limit.decode)
            allocation = Allocation(prefill=prefill, decode=decode)
            changed = changed or allocation != w.allocation
            grown.append(replace(w, allocation=allocation))
        if not changed:
            return confirmed
        plan = tuple(grown)


def plan_oracle(
    trace: Trace,
    scenario: Scenario,
    *,
    window_s: float = DEFAULT_WINDOW_S,
    warmup_s: float = DEFAULT_WARMUP_S,
    progress: Callable[[float], None] | None = None,
) -> OraclePlan:
    """The oracle's plan: steps 1-3 of the module's description."""
    windows = plan_windows(trace, scenario, window_s=window_s, warmup_s=warmup_s, progress=progress)
    candidates: list[tuple[str, Confirmed]] = [("windows", confirm(trace, scenario, windows))]
    peak = static_peak(trace, scenario).initial
    constant = tuple(replace(w, allocation=peak) for w in windows)
    at_peak = confirm(trace, scenario, constant, cap=peak, max_rounds=1)
    if at_peak.meets:
        candidates.append(("static-peak", at_peak))
        capped = confirm(trace, scenario, windows, cap=peak)
        candidates.append(("windows capped at static-peak", capped))
    meeting = [c for c in candidates if c[1].meets]
    if meeting:
        chosen, best = min(meeting, key=lambda c: c[1].gpu_hours)
    else:
        chosen, best = max(candidates, key=lambda c: c[1].attainment)
    return OraclePlan(
        windows=best.windows,
        chosen=chosen,
        attainment=best.attainment,
        gpu_hours=best.gpu_hours,
        met=best.meets,
        replays=sum(c.replays for _, c in candidates),
        candidates=tuple(candidates),
    )


class OraclePolicy:
    """Follows a precomputed plan, provisioning each window ``startup_s`` ahead."""

    name = "oracle"

    def __init__(
        self,
        scenario: Scenario,
        plan: tuple[OracleWindow, ...],
        *,
        tick_s: float = 1.0,
    ) -> None:
        if not plan:
            raise ValueError("plan: needs at least one window")
        self.plan = plan
        self.interval_s = tick_s
        self.initial = plan[0].allocation
        # How far ahead of a window its workers are asked for: a start-up, so they
        # serve from the window's start (a bound on reacting sets it to 0).
        self.lead_s = scenario.worker_startup_s
        self._last = self.initial

    @property
    def schedule(self) -> tuple[object, ...]:
        """Every size it asks for and when (``base.replay`` reuses its runs): a plan
        of one allocation throughout is the constant one, whatever its windows."""
        sizes = {(w.allocation.prefill, w.allocation.decode) for w in self.plan}
        if len(sizes) == 1:
            ((prefill, decode),) = sizes
            return ("constant", prefill, decode)
        windows = tuple(
            (w.start_s, w.end_s, w.allocation.prefill, w.allocation.decode) for w in self.plan
        )
        return ("windows", self.lead_s, self.interval_s, windows)

    def wanted(self, now_s: float) -> Allocation:
        """Each pool at the largest allocation of the current window and of every
        window that must start its workers before the next tick to be served in time."""
        horizon_s = now_s + self.lead_s + self.interval_s
        windows = [w for w in self.plan if w.end_s > now_s and w.start_s < horizon_s] or [
            self.plan[-1]
        ]
        return Allocation(
            prefill=max(w.allocation.prefill for w in windows),
            decode=max(w.allocation.decode for w in windows),
        )

    def tick(self, view: ClusterView) -> Allocation | None:
        wanted = self.wanted(view.now_s)
        if wanted == self._last:
            return None
        self._last = wanted
        return wanted
