"""Scaling policies to back-test in the simulator, by name.

- ``sara``: the production ``controller.policy.decide`` (``sim.policies.sara``);
- ``sara-forecast``: the same with its rate forecaster enabled (``forecast`` in the
  controller's configuration), looking one worker startup ahead;
- ``static-peak`` / ``static-mean``: the solver's fixed allocation for the busiest
  minute / the mean rate (``sim.policies.static``);
- ``threshold``: Kubernetes HPA v2 semantics on utilisation metrics
  (``sim.policies.threshold``);
- ``throughput`` / ``throughput-trend``: a Dynamo-style SLA planner with the
  constant / trend load predictor (``sim.policies.throughput``);
- ``oracle``: clairvoyant, the cheapest plan a replay of the whole run confirms
  meets the SLO target
  (``sim.policies.oracle``).
"""

from __future__ import annotations

from collections.abc import Callable

from sim.policies.base import (
    Allocation,
    BacktestPolicy,
    ClusterView,
    Scenario,
    solver_allocation,
    warm_start,
    window_allocation,
)
from sim.policies.oracle import OraclePlan, OraclePolicy, OracleWindow, plan_oracle
from sim.policies.sara import SaraPolicy, forecasting
from sim.policies.static import StaticPolicy, static_mean, static_peak
from sim.policies.threshold import HpaBehaviour, ThresholdPolicy, ThresholdTargets
from sim.policies.throughput import Predictor, ThroughputPolicy
from sim.trace import Trace

__all__ = [
    "POLICY_NAMES",
    "Allocation",
    "BacktestPolicy",
    "ClusterView",
    "HpaBehaviour",
    "OraclePlan",
    "OraclePolicy",
    "OracleWindow",
    "Predictor",
    "SaraPolicy",
    "Scenario",
    "StaticPolicy",
    "ThresholdPolicy",
    "ThresholdTargets",
    "ThroughputPolicy",
    "forecasting",
    "make_policy",
    "plan_oracle",
    "solver_allocation",
    "static_mean",
    "static_peak",
    "warm_start",
    "window_allocation",
]

POLICY_NAMES = (
    "sara",
    "sara-forecast",
    "static-peak",
    "static-mean",
    "threshold",
    "throughput",
    "throughput-trend",
    "oracle",
)


def make_policy(
    name: str,
    trace: Trace,
    scenario: Scenario,
    *,
    initial: Allocation | None = None,
    progress: Callable[[float], None] | None = None,
) -> BacktestPolicy:
    """The policy called ``name`` for this trace and scenario.

    ``initial`` is where the autoscaling policies start (default: ``warm_start``);
    the static policies and the oracle plan their own. ``progress`` reports the
    oracle's planning (fraction done). Raises ``ValueError`` naming the known
    policies for an unknown name.
    """
    if name not in POLICY_NAMES:
        raise ValueError(f"policy: unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    if name == "static-peak":
        return static_peak(trace, scenario)
    if name == "static-mean":
        return static_mean(trace, scenario)
    if name == "oracle":
        return OraclePolicy(scenario, plan_oracle(trace, scenario, progress=progress).windows)
    start = initial or warm_start(trace, scenario)
    if name == "sara":
        return SaraPolicy(scenario, start)
    if name == "sara-forecast":
        return SaraPolicy(scenario, start, config=forecasting(scenario, scenario.controller_config))
    if name == "threshold":
        return ThresholdPolicy(scenario, start)
    predictor = Predictor.CONSTANT if name == "throughput" else Predictor.TREND
    return ThroughputPolicy(scenario, start, predictor=predictor)
