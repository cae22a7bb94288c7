"""The demo's simulated replay ticks where the live controller ticked.

The live controller logs each tick's wall-clock time; the replay reads the offset of
its first tick after the load's start and puts the simulated ticks at the same
offsets into the segment.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cli.live_demo import EMULATED_PROFILE
from cli.live_emulated import demo_config, live_tick_phase_s, simulate
from queueing.budget import token_budget
from queueing.catalog import resolve_profile
from sim.trace import Trace


def tick_line(time_s: float) -> str:
    return f'2026-12-01 17:00:37,711 {json.dumps({"event": "tick", "time_s": time_s})}\n'


def test_the_phase_is_the_first_tick_after_the_load_started(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    log.write_text(
        "starting\n" + tick_line(1000.2) + "not json {\n" + tick_line(1004.2) + tick_line(1008.2)
    )
    assert live_tick_phase_s(log, 1003.0, 4.0) == pytest.approx(1.2)
    assert live_tick_phase_s(log, 1000.2, 4.0) == pytest.approx(0.0)
    assert live_tick_phase_s(log, 2000.0, 4.0) == 0.0  # no tick after the start: none to match


@pytest.mark.parametrize("phase_s", [0.0, 1.0, 2.5])
def test_the_simulated_ticks_fall_at_the_live_offsets(phase_s: float) -> None:
    rng = np.random.default_rng(3)
    n = 120
    piece = Trace(
        arrival_s=np.sort(rng.uniform(0.0, 60.0, n)),
        prompt_tokens=rng.integers(100, 800, n),
        output_tokens=rng.integers(20, 200, n),
        source="uniform",
    )
    config = demo_config(EMULATED_PROFILE, 2.0, 0.1, startup_s=5.0)
    budget = token_budget(resolve_profile(EMULATED_PROFILE), tpot_slo_s=0.1)
    run = simulate(
        [piece], [0.0], 60.0, config=config, startup_s=5.0, token_budget=budget,
        tick_phase_s=phase_s,
    )  # fmt: skip
    times = np.array([t for t, _, _ in run.sizes])
    assert times.min() >= 0.0
    assert np.allclose(np.mod(times - phase_s, 4.0), 0.0, atol=1e-9)
    assert run.phases[0].requests == n and run.phases[0].completed == n
