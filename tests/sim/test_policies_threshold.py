"""The threshold policy follows the Kubernetes HPA's documented semantics.

Every expectation here is worked out by hand from the HPA documentation: the
replica calculator (ratio, tolerance, not-yet-ready pods), the stabilisation
windows and the default scaling policies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from queueing.catalog import resolve_profile
from queueing.solver import SloTargets
from sim.cluster import ClusterSnapshot, PoolSnapshot
from sim.policies import Allocation, Scenario, ThresholdPolicy, ThresholdTargets
from sim.policies.threshold import HpaBehaviour, HpaScaler, metric_proposal

PROFILE = resolve_profile("llama-2-70b-tp4@h100-sxm")
SCENARIO = Scenario(profile=PROFILE, slo=SloTargets(ttft_p99_s=2.0, tpot_p99_s=0.1))


@pytest.mark.parametrize(
    ("ready", "unready", "average", "target", "expected", "why"),
    [
        (4, 0, 0.75, 0.7, 4, "ratio 1.07 is within the 10 % tolerance"),
        (4, 0, 0.63, 0.7, 4, "ratio 0.90 is within the tolerance too"),
        (4, 0, 0.9, 0.6, 6, "ratio 1.5: ceil(1.5 x 4) = 6"),
        (10, 0, 0.35, 0.7, 5, "ratio 0.5: ceil(0.5 x 10) = 5"),
        (3, 0, 0.8, 0.7, 4, "ratio 1.143 > 1.1: ceil(3.43) = 4"),
        (4, 4, 1.0, 0.7, 8, "starting pods at 0 %: 4 / (0.7 x 8) = 0.71 < 1, so no change"),
        (4, 1, 1.0, 0.5, 8, "starting pod at 0 %: ratio 4 / (0.5 x 5) = 1.6, ceil(1.6 x 5) = 8"),
        (4, 2, 0.2, 0.7, 2, "scale-down sets starting pods aside: ceil(0.286 x 4) = 2"),
    ],
)
def test_the_replica_calculator_matches_the_hand_computed_answer(
    ready: int, unready: int, average: float, target: float, expected: int, why: str
) -> None:
    got = metric_proposal(
        ready=ready, unready=unready, average=average, target=target, tolerance=0.1
    )
    assert got == expected, why


def test_no_ready_pod_means_no_proposal() -> None:
    assert metric_proposal(ready=0, unready=3, average=0.0, target=0.7, tolerance=0.1) is None


def test_scale_up_is_limited_to_the_larger_of_doubling_and_four_pods_per_period() -> None:
    hpa = HpaScaler(HpaBehaviour())
    # 3 -> at most max(2 x 3, 3 + 4) = 7; a sync period later 7 -> max(14, 11) = 14.
    assert hpa.step(now_s=0.0, current=3, proposal=40) == 7
    assert hpa.step(now_s=15.0, current=7, proposal=40) == 14
    assert hpa.step(now_s=30.0, current=14, proposal=40) == 28
    assert hpa.step(now_s=45.0, current=28, proposal=40) == 40


def test_the_scale_up_limit_counts_from_the_size_at_the_start_of_the_period() -> None:
    # Syncing every 5 s with a 15-s period: the 4 pods added at t=0 use the period's
    # allowance until t=15 (exclusive), so t=5 and t=10 cannot add more.
    hpa = HpaScaler(HpaBehaviour(sync_period_s=5.0))
    assert hpa.step(now_s=0.0, current=3, proposal=40) == 7
    assert hpa.step(now_s=5.0, current=7, proposal=40) == 7
    assert hpa.step(now_s=10.0, current=7, proposal=40) == 7
    assert hpa.step(now_s=15.0, current=7, proposal=40) == 14


def test_scale_down_waits_for_the_stabilisation_window_and_takes_its_highest_proposal() -> None:
    hpa = HpaScaler(HpaBehaviour())
    current = hpa.step(now_s=0.0, current=10, proposal=10)
    proposals = {15.0 * k: 6 for k in range(1, 40)}
    proposals[150.0] = 8
    seen = {}
    for t, p in sorted(proposals.items()):
        current = hpa.step(now_s=t, current=current, proposal=p)
        seen[t] = current
    # The 10 proposed at t=0 holds until it leaves the 300-s window (t > 300 - 0).
    assert seen[285.0] == 10
    # At t=300 the highest proposal in (0, 300] is the 8 of t=150.
    assert seen[300.0] == 8
    # At t=450 the 8 has left the window too: down to 6.
    assert seen[435.0] == 8
    assert seen[450.0] == 6


def test_scale_down_may_drop_all_the_way_in_one_step_but_not_below_the_minimum() -> None:
    hpa = HpaScaler(HpaBehaviour(down_stabilisation_s=0.0, min_replicas=2))
    assert hpa.step(now_s=0.0, current=12, proposal=1) == 2


def test_the_maximum_replicas_cap_the_result() -> None:
    hpa = HpaScaler(HpaBehaviour(max_replicas=5))
    assert hpa.step(now_s=0.0, current=3, proposal=40) == 5


# -- the policy on a crafted load -------------------------------------------------------


@dataclass
class CraftedCluster:
    """A stand-in for the simulator: pools follow the policy at once (no startup) and
    the load is scripted: ``busy(t)`` prefill workers busy (capped at the pool) and
    ``queued(t)`` prompts waiting; the decode pool is held exactly at its target."""

    allocation: Allocation
    busy: dict[float, int]
    queued: dict[float, int] = field(default_factory=dict)
    now_s: float = 0.0

    def snapshot(self, *, window_s: float = 30.0) -> ClusterSnapshot:
        n, m = self.allocation.prefill, self.allocation.decode
        reserved = 1000  # prompt + output tokens of every completion
        per_worker = min(SCENARIO.token_budget, PROFILE.kv_capacity_tokens // reserved)
        running = round(0.7 * per_worker * m)  # decode exactly at its target
        t = self.now_s
        empty_f = np.zeros(0, dtype=np.float64)
        return ClusterSnapshot(
            time_s=t,
            window_s=window_s,
            prefill=PoolSnapshot(
                starting=0,
                serving=n,
                draining=0,
                busy=min(n, self.busy.get(t, 0)),
                queue_length=self.queued.get(t, 0),
                running=min(n, self.busy.get(t, 0)),
            ),
            decode=PoolSnapshot(
                starting=0, serving=m, draining=0, busy=m, queue_length=0, running=running
            ),
            arrived=0,
            completed=1,
            window_arrivals=0,
            window_arrival_rate_rps=0.0,
            window_prompt_tokens=np.zeros(0, dtype=np.int64),
            window_output_tokens=np.array([200], dtype=np.int64),
            window_completed_prompt_tokens=np.array([reserved - 200], dtype=np.int64),
            window_arrival_s=empty_f,
            window_ttft_s=empty_f,
            window_tpot_s=empty_f,
        )


def drive(policy: ThresholdPolicy, cluster: CraftedCluster, until_s: float) -> dict[float, int]:
    """Tick the policy every interval; the prefill pool size after each tick."""
    sizes = {}
    k = 1
    while (t := k * policy.interval_s) <= until_s:
        cluster.now_s = t
        wanted = policy.tick(cluster)  # type: ignore[arg-type]
        if wanted is not None:
            cluster.allocation = wanted
        sizes[t] = cluster.allocation.prefill
        k += 1
    return sizes


def one_sample_targets(**kwargs: object) -> ThresholdTargets:
    # One sample per sync and no averaging, so each sync sees exactly the scripted load.
    return ThresholdTargets(sample_s=15.0, average_s=15.0, **kwargs)  # type: ignore[arg-type]


def test_on_a_crafted_load_the_policy_holds_within_tolerance_scales_up_and_stabilises() -> None:
    start = Allocation(prefill=4, decode=2)
    policy = ThresholdPolicy(SCENARIO, start, targets=one_sample_targets())
    busy = {15.0: 3, 30.0: 4, 45.0: 6}  # 0.75 (tolerance), then 1.0, 1.0
    busy.update({15.0 * k: 2 for k in range(4, 30)})  # 2 busy: utilisation falls
    sizes = drive(policy, CraftedCluster(allocation=start, busy=busy), 420.0)
    assert sizes[15.0] == 4  # 3/4 = 0.75: ratio 1.07, within tolerance
    assert sizes[30.0] == 6  # 4/4: ratio 1.43, ceil(5.71) = 6
    assert sizes[45.0] == 9  # 6/6: ratio 1.43, ceil(8.57) = 9
    # 2/9 busy proposes ceil(0.317 x 9) = 3 from t=60, but the 9 proposed at t=45
    # holds the pool until it leaves the 300-s window at t=345.
    assert sizes[330.0] == 9
    assert sizes[345.0] == 3


def test_on_a_crafted_backlog_the_queue_aware_metric_hits_the_scale_up_limit() -> None:
    start = Allocation(prefill=2, decode=2)
    policy = ThresholdPolicy(SCENARIO, start, targets=one_sample_targets(count_queued=True))
    busy = {15.0 * k: 64 for k in range(1, 5)}
    queued = {15.0 * k: 20 for k in range(1, 5)}
    sizes = drive(policy, CraftedCluster(allocation=start, busy=busy, queued=queued), 45.0)
    # (2 + 20) / 2 = 11 per worker, ratio 15.7: proposes 32, limited to max(4, 2 + 4) = 6.
    assert sizes[15.0] == 6
    # (6 + 20) / 6 = 4.33, ratio 6.19: proposes 38, limited to max(12, 10) = 12.
    assert sizes[30.0] == 12
    # (12 + 20) / 12 = 2.67, ratio 3.81: proposes 46, limited to max(24, 16) = 24.
    assert sizes[45.0] == 24


def test_the_sync_period_must_be_a_whole_number_of_samples() -> None:
    with pytest.raises(ValueError, match="sync_period_s"):
        ThresholdPolicy(
            SCENARIO, Allocation(prefill=1, decode=1), targets=ThresholdTargets(sample_s=4.0)
        )
