"""The live controller and the back-test run one configuration, the forecaster's
included: what ``sara serve`` / ``sara controller`` would store for a profile and
SLOs is what the ``sara`` and ``sara-forecast`` back-test policies tick with."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest

from cli.serve_cmd import _store
from controller.config import ControllerConfig
from controller.policy import ControllerState, PoolState
from controller.tick import forecast_config
from queueing.catalog import resolve_profile
from queueing.pools import PerPool
from queueing.solver import SloTargets
from sim.policies import Allocation, SaraPolicy, Scenario, forecasting

PROFILE = "llama-3-8b@h100-sxm"


def _served(tmp_path: Path) -> ControllerConfig:
    args = argparse.Namespace(config=None, profile=PROFILE, ttft_p99_s=1.0, tpot_p99_s=0.05)
    return _store(args, tmp_path).load().config


def _scenario() -> Scenario:
    return Scenario(
        profile=resolve_profile(PROFILE), slo=SloTargets(ttft_p99_s=1.0, tpot_p99_s=0.05)
    )


def test_the_backtest_runs_the_served_configuration(tmp_path: Path) -> None:
    served = _served(tmp_path)
    policy = SaraPolicy(_scenario(), Allocation(prefill=1, decode=1))
    assert policy.config.to_dict() == served.to_dict()
    # The controller command seeds the same defaults.
    assert served == replace(
        ControllerConfig(),
        profile=PROFILE,
        slo=replace(ControllerConfig().slo, ttft_p99_s=1.0, tpot_p99_s=0.05),
    )


def test_the_forecasting_backtest_is_the_served_configuration_with_the_forecaster_on(
    tmp_path: Path,
) -> None:
    served = _served(tmp_path)
    scenario = _scenario()
    config = forecasting(scenario, scenario.controller_config)
    # The served document with the forecaster on, nothing else changed (its horizon
    # is the measured lead time in both: controller.tick.forecast_config).
    assert config.to_dict() == served.merged({"forecast": {"enabled": True}}).to_dict()
    assert SaraPolicy(scenario, Allocation(prefill=1, decode=1), config=config).name == (
        "sara-forecast"
    )


def test_the_forecast_looks_one_measured_lead_time_ahead() -> None:
    config = ControllerConfig()
    state = ControllerState(
        pools=PerPool(prefill=PoolState(startup_s=40.0), decode=PoolState(startup_s=90.0))
    )
    assert forecast_config(config, state).horizon_s == pytest.approx(90.0 + config.interval_s)
    # Before any start-up is measured, the prior.
    fresh = forecast_config(config, ControllerState())
    assert fresh.horizon_s == config.lead_time.startup_prior_s + config.interval_s
    off = replace(config, lead_time=replace(config.lead_time, enabled=False))
    assert forecast_config(off, state).horizon_s == config.forecast.horizon_s
