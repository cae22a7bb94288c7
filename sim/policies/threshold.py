"""``threshold``: the Kubernetes Horizontal Pod Autoscaler (autoscaling/v2), one per pool.

Written from the HPA's documented behaviour (docs/backtesting.md lists the
sources), not from its code:

- every sync period (15 s) each metric proposes ``ceil(ratio * ready pods)`` with
  ``ratio = average value per ready pod / target``, unless the ratio is within the
  tolerance (10 %) of 1, which keeps the current count;
- pods that are not ready yet (starting workers) count as using 0 % of the target
  when the proposal is a scale-up (damping it while they boot) and are left out of
  a scale-down; a scale-up that this turns into no change, or into a scale-down,
  keeps the current count;
- stabilisation: the count goes up to the lowest proposal of the up window (0 s: at
  once) and down only to the highest proposal of the down window (300 s);
- rate limits (default behaviour): up by at most max(100 %, 4 pods) per 15 s,
  down by at most 100 % per 15 s, counted from the size at the start of the period;
- min/max replicas clamp the result.

The metrics, per pool (a choice this module makes; the HPA only needs numbers),
each sampled from the cluster every 5 s (the scrape interval) and averaged over the
last 60 s (an ``avg_over_time(...[1m])`` adapter rule):

- prefill: the busy fraction of the workers (the share in an iteration), the
  GPU-utilisation analogue; target 0.7;
- decode: the utilisation of the decode slots, sequences in decode over the
  serving workers' capacity, which is the smaller of the maximum batch and the KV
  capacity over the mean reserved tokens (prompt + output) of the last minute's
  completions; target 0.7.

Both saturate near 1 when a pool is overloaded (a queue forms that the metric does
not see), so one sync can grow a pool by at most 1 / 0.7 = 1.43x, and while new
pods start (counted at 0 %) the HPA waits for them: the classic HPA behaviour on a
utilisation metric. ``ThresholdTargets(count_queued=True)`` adds the queued
requests to the load instead (a queue-depth metric, which does not saturate but
makes the HPA's proportional rule overshoot on a backlog). The snapshot does not
separate draining workers' load from serving ones', so both average over the
serving and draining workers together.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from sim.cluster import ClusterSnapshot
from sim.policies.base import Allocation, ClusterView, Scenario

_EPS = 1e-9  # keeps ratios that are exact on paper exact after float rounding


@dataclass(frozen=True, kw_only=True)
class HpaBehaviour:
    """The HPA's knobs, with the Kubernetes defaults (scale-up: no stabilisation,
    max of 100 % and 4 pods per 15 s; scale-down: 300 s stabilisation, 100 % per
    15 s; 15 s sync period; 10 % tolerance)."""

    sync_period_s: float = 15.0
    tolerance: float = 0.1
    up_stabilisation_s: float = 0.0
    down_stabilisation_s: float = 300.0
    up_percent: float = 100.0
    up_pods: int = 4
    up_period_s: float = 15.0
    down_percent: float = 100.0
    down_period_s: float = 15.0
    min_replicas: int = 1
    max_replicas: int = 64

    def __post_init__(self) -> None:
        for name in ("sync_period_s", "up_period_s", "down_period_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance: must be in [0, 1), got {self.tolerance!r}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"min_replicas: must be in [1, max_replicas={self.max_replicas}], "
                f"got {self.min_replicas!r}"
            )


def metric_proposal(
    *, ready: int, unready: int, average: float, target: float, tolerance: float
) -> int | None:
    """One metric's replica proposal (the HPA replica calculator).

    ``average`` is the metric's mean over the ready pods, ``target`` its target
    value per pod (> 0). The current count is ``ready + unready``. None when no pod
    is ready (no metric to act on).
    """
    if target <= 0:
        raise ValueError(f"target: must be > 0, got {target!r}")
    current = ready + unready
    if ready == 0:
        return None
    ratio = average / target
    if unready == 0 or ratio <= 1.0:
        # Not-yet-ready pods are set aside for a scale-down.
        if abs(ratio - 1.0) <= tolerance + _EPS:
            return current
        return math.ceil(ratio * ready - _EPS)
    # A scale-up with pods still starting: count them at 0 % of the target.
    damped = average * ready / (target * current)
    if damped <= 1.0 or abs(damped - 1.0) <= tolerance + _EPS:
        return current
    return max(current, math.ceil(damped * current - _EPS))


@dataclass
class HpaScaler:
    """The HPA's state for one scale target: past proposals and scale events."""

    behaviour: HpaBehaviour
    proposals: deque[tuple[float, int]] = field(default_factory=deque)
    events: deque[tuple[float, int]] = field(default_factory=deque)  # (time, change)

    def step(self, *, now_s: float, current: int, proposal: int | None) -> int:
        """The replica count for this sync; ``proposal`` is the largest metric proposal
        (None: no metric, keep ``current``)."""
        b = self.behaviour
        if proposal is None:
            return current
        self.proposals.append((now_s, proposal))
        horizon_s = max(b.up_stabilisation_s, b.down_stabilisation_s)
        while self.proposals and self.proposals[0][0] <= now_s - horizon_s - b.sync_period_s:
            self.proposals.popleft()
        up = min([p for t, p in self.proposals if t > now_s - b.up_stabilisation_s] + [proposal])
        down = max(
            [p for t, p in self.proposals if t > now_s - b.down_stabilisation_s] + [proposal]
        )
        desired = current
        if desired < up:
            desired = up
        if desired > down:
            desired = down
        if desired > current:
            desired = min(desired, self._up_limit(now_s, current))
        elif desired < current:
            desired = max(desired, self._down_limit(now_s, current))
        desired = min(max(desired, b.min_replicas), b.max_replicas)
        if desired != current:
            self.events.append((now_s, desired - current))
        while self.events and self.events[0][0] <= now_s - max(b.up_period_s, b.down_period_s):
            self.events.popleft()
        return desired

    def _period_start(self, now_s: float, current: int, period_s: float) -> int:
        changed = sum(d for t, d in self.events if t > now_s - period_s)
        return current - changed

    def _up_limit(self, now_s: float, current: int) -> int:
        b = self.behaviour
        start = self._period_start(now_s, current, b.up_period_s)
        by_percent = math.ceil(start * (1.0 + b.up_percent / 100.0) - _EPS)
        return max(by_percent, start + b.up_pods)

    def _down_limit(self, now_s: float, current: int) -> int:
        b = self.behaviour
        start = self._period_start(now_s, current, b.down_period_s)
        return math.floor(start * (1.0 - b.down_percent / 100.0) + _EPS)


@dataclass(frozen=True, kw_only=True)
class ThresholdTargets:
    """Per-pod metric targets (fractions of a worker's capacity) and how the metrics
    are collected: sampled every ``sample_s``, averaged over ``average_s``."""

    prefill: float = 0.7
    decode: float = 0.7
    sample_s: float = 5.0  # the scrape interval
    average_s: float = 60.0  # avg_over_time window of the adapter rule
    length_window_s: float = 60.0  # completions the mean reserved KV is taken over
    count_queued: bool = False  # add queued requests to the load (a queue-depth metric)


class ThresholdPolicy:
    """Two HPAs (prefill, decode) on load metrics sampled from the cluster."""

    name = "threshold"

    def __init__(
        self,
        scenario: Scenario,
        initial: Allocation,
        *,
        behaviour: HpaBehaviour | None = None,
        targets: ThresholdTargets | None = None,
    ) -> None:
        self.behaviour = behaviour or HpaBehaviour(max_replicas=scenario.max_replicas)
        self.targets = targets or ThresholdTargets()
        per_sync = self.behaviour.sync_period_s / self.targets.sample_s
        if abs(per_sync - round(per_sync)) > 1e-9 or round(per_sync) < 1:
            raise ValueError(
                f"sync_period_s: {self.behaviour.sync_period_s} must be a multiple of the "
                f"sample interval {self.targets.sample_s}"
            )
        self._per_sync = round(per_sync)
        self.initial = initial
        self.interval_s = self.targets.sample_s
        self._max_batch = scenario.token_budget
        self._kv_capacity = scenario.profile.kv_capacity_tokens
        # The HPAs were running before the trace began, at the starting allocation:
        # without that history a fresh HPA would scale an empty cluster down at once.
        self._prefill = HpaScaler(self.behaviour)
        self._prefill.proposals.append((0.0, initial.prefill))
        self._decode = HpaScaler(self.behaviour)
        self._decode.proposals.append((0.0, initial.decode))
        self._samples: deque[tuple[float, float | None, float | None]] = deque()
        self._reserved_tokens: float | None = None
        self._ticks = 0

    def tick(self, view: ClusterView) -> Allocation | None:
        now = view.now_s
        snap = view.snapshot(window_s=self.targets.length_window_s)
        self._samples.append((now, *self._sample(snap)))
        while self._samples and self._samples[0][0] <= now - self.targets.average_s:
            self._samples.popleft()
        self._ticks += 1
        if self._ticks % self._per_sync:
            return None
        p, d = snap.prefill, snap.decode
        prefill_now = p.starting + p.serving
        decode_now = d.starting + d.serving
        prefill = self._prefill.step(
            now_s=now,
            current=prefill_now,
            proposal=self._proposal(
                ready=p.serving,
                unready=p.starting,
                value=_mean(s[1] for s in self._samples),
                target=self.targets.prefill,
            ),
        )
        decode = self._decode.step(
            now_s=now,
            current=decode_now,
            proposal=self._proposal(
                ready=d.serving,
                unready=d.starting,
                value=_mean(s[2] for s in self._samples),
                target=self.targets.decode,
            ),
        )
        if prefill == prefill_now and decode == decode_now:
            return None
        return Allocation(prefill=prefill, decode=decode)

    def _proposal(
        self, *, ready: int, unready: int, value: float | None, target: float
    ) -> int | None:
        if value is None:
            return None
        return metric_proposal(
            ready=ready,
            unready=unready,
            average=value,
            target=target,
            tolerance=self.behaviour.tolerance,
        )

    def _sample(self, snap: ClusterSnapshot) -> tuple[float | None, float | None]:
        """(prefill, decode) load per worker now; None for a pool with no worker to ask."""
        p, d = snap.prefill, snap.decode
        prefill: float | None = None
        active = p.serving + p.draining
        if active > 0:
            queued = p.queue_length if self.targets.count_queued else 0
            prefill = (min(p.busy, active) + queued) / active
        if len(snap.window_output_tokens):
            reserved = snap.window_completed_prompt_tokens + snap.window_output_tokens
            self._reserved_tokens = float(np.mean(reserved))
        decode: float | None = None
        active = d.serving + d.draining
        if active > 0:
            capacity = float(self._max_batch)
            if self._reserved_tokens:
                capacity = min(capacity, self._kv_capacity / self._reserved_tokens)
            queued = d.queue_length if self.targets.count_queued else 0
            decode = (d.running + queued) / (active * capacity)
        return prefill, decode


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None
