"""``oracle``: a clairvoyant planner, the cost floor to compare against.

It cuts the trace into windows (300 s by default) and, knowing every request of
every window in advance, finds for each the smallest pools that the simulator
confirms meet both SLOs in it: the P99 TTFT and the P99 TPOT of the requests
arriving in the window, simulated on fixed pools with the previous ``warmup_s``
seconds of requests replayed first (so a window inherits its predecessor's
backlog) and not counted.

The search is cheap because the pools are nearly separable: TTFT depends only on
the prefill pool, and TPOT on the decode pool (the prefill pool only shifts when
requests reach it). One simulation therefore tests a prefill count and a decode
count at once; each pool gallops from the solver's zero-headroom answer for the
window (usually right, or off by one) and then bisects, so a window typically
costs two or three short simulations. Each pool is capped at the scenario's
``max_replicas``; a window that even that cannot serve is marked ``met=False``.

During the run it provisions ahead of the startup delay: a pool grows early
enough that its new workers serve from the start of the window that needs them,
and shrinks (its removed workers drain) when that window ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sim.cluster import Cluster
from sim.policies.base import Allocation, ClusterView, Scenario, window_allocation
from sim.trace import Trace

DEFAULT_WINDOW_S = 300.0
DEFAULT_WARMUP_S = 60.0


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
    ttft = results.ttft_s[counted]
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


def plan_oracle(
    trace: Trace,
    scenario: Scenario,
    *,
    window_s: float = DEFAULT_WINDOW_S,
    warmup_s: float = DEFAULT_WARMUP_S,
    progress: Callable[[float], None] | None = None,
) -> tuple[OracleWindow, ...]:
    """Every window's plan, from time 0 to the last arrival."""
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
        self._startup_s = scenario.worker_startup_s
        self._last = self.initial

    def wanted(self, now_s: float) -> Allocation:
        """Each pool at the largest allocation of the current window and of every
        window that must start its workers before the next tick to be served in time."""
        horizon_s = now_s + self._startup_s + self.interval_s
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
