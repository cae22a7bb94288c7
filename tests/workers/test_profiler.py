"""`sara profile` fits DESIGN §3.1's coefficients and writes a profile `sara solve` accepts."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("torch")

import numpy as np

from cli.__main__ import main
from queueing.profile import IterationProfile, attention_pairs
from workers.paged_attention import SeqSlice
from workers.profiler import (
    BatchShape,
    Measurement,
    ProfileFitError,
    ProfileGrid,
    fit_profile,
    measure,
    remeasure_outliers,
)

ROOT = Path(__file__).resolve().parents[2]
AZURE_CONV = ROOT / "data" / "traces" / "AzureLLMInferenceTrace_conv.csv"
TRUE = {"t0_s": 2e-3, "t_tok_s": 3e-5, "t_kv_s": 5e-7, "t_attn_s": 8e-8}


def synthetic(shapes: list[BatchShape], coef: dict[str, float]) -> list[Measurement]:
    out = []
    for s in shapes:
        t = (
            coef["t0_s"]
            + coef["t_tok_s"] * s.n_tokens
            + coef["t_kv_s"] * s.n_kv_read
            + coef["t_attn_s"] * s.n_attn_pairs
        )
        out.append(Measurement(shape=s, median_s=t, samples_s=(t,)))
    return out


def test_the_grid_prices_each_shape_as_the_scheduler_does() -> None:
    shapes = ProfileGrid(
        prefill_tokens=(0, 32), decode_batch=(0, 4), context_tokens=(64, 256)
    ).shapes()
    assert all(s.n_tokens >= 1 for s in shapes)
    chunk = next(s for s in shapes if s.prefill_tokens == 32 and s.prefix_tokens == 256)
    assert chunk.n_attn_pairs == attention_pairs(32, 256) == 32 * 256 + 32 * 33 // 2
    decodes = next(s for s in shapes if s.decode_batch == 4 and s.decode_context == 64)
    assert decodes.n_kv_read == 4 * 64
    # Every prefill size with prefixes {0, 64, 256}, crossed with {no decode, 4 x 64, 4 x 256},
    # plus the decode-only shapes.
    assert len(shapes) == 1 * 3 * 3 + 2


def test_the_fit_recovers_exact_coefficients() -> None:
    fit = fit_profile(synthetic(ProfileGrid().shapes(), TRUE))
    for name, value in TRUE.items():
        assert getattr(fit, name) == pytest.approx(value, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.max_rel_error < 1e-6


def test_the_fit_never_returns_a_negative_coefficient() -> None:
    # Times that *fall* with the KV read: least squares would want t_kv < 0.
    coef = TRUE | {"t_kv_s": -1e-8}
    shapes = [s for s in ProfileGrid().shapes() if s.n_kv_read < 40_000]
    fit = fit_profile(synthetic(shapes, coef))
    assert min(fit.t0_s, fit.t_tok_s, fit.t_kv_s, fit.t_attn_s) >= 0
    assert fit.t_kv_s == 0


def test_too_few_measurements_cannot_be_fitted() -> None:
    shapes = ProfileGrid().shapes()[:3]
    with pytest.raises(ProfileFitError, match="cannot fit 4 coefficients"):
        fit_profile(synthetic(shapes, TRUE))


class FakeRunner:
    """Stands in for ``ModelRunner``: each forward advances a fake clock by the true
    linear time of its batch, times ``slow`` for the first ``slow_calls`` passes of one
    shape (a burst from another process on a shared machine)."""

    def __init__(self, slow_shape: BatchShape, slow_calls: int, slow: float = 3.0) -> None:
        self.kv = SimpleNamespace(num_blocks=4096, block_size=16)
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=512))
        self.now = 0.0
        self.slow_shape, self.slow_calls, self.slow = slow_shape, slow_calls, slow

    def clock(self) -> float:
        return self.now

    def synchronize(self) -> None:
        pass

    def execute(self, slices: list[SeqSlice]) -> None:
        chunks = [s for s in slices if len(s.token_ids) > 1]
        decodes = [s for s in slices if len(s.token_ids) == 1]
        shape = BatchShape(
            prefill_tokens=len(chunks[0].token_ids) if chunks else 0,
            prefix_tokens=chunks[0].start_pos if chunks else 0,
            decode_batch=len(decodes),
            decode_context=decodes[0].end_pos if decodes else 0,
        )
        t = synthetic([shape], TRUE)[0].median_s
        if shape == self.slow_shape and self.slow_calls > 0:
            self.slow_calls -= 1
            t *= self.slow
        self.now += t


def test_a_shape_hit_by_a_burst_is_re_measured_and_the_fit_recovers() -> None:
    shapes = ProfileGrid(
        prefill_tokens=(0, 64, 256), decode_batch=(0, 4, 16), context_tokens=(64, 256)
    ).shapes()
    victim = shapes[len(shapes) // 2]
    # Slow for the warm-up pass and 8 of the 11 timed ones: even the median is hit.
    runner: Any = FakeRunner(victim, slow_calls=1 + 8)
    rng = np.random.default_rng(0)
    measured = measure(runner, shapes, repeats=11, warmup=1, rng=rng, clock=runner.clock)
    noisy = fit_profile(measured)
    assert noisy.worst_shape == victim and noisy.max_rel_error > 0.5
    again, count = remeasure_outliers(
        runner, measured, noisy, repeats=11, rng=rng, clock=runner.clock
    )
    assert count == 1
    fit = fit_profile(again)
    assert fit.max_rel_error < 1e-6
    assert fit.t_tok_s == pytest.approx(TRUE["t_tok_s"], rel=1e-6)


SMALL_GRID = [
    "--budget-grid", "0,16,64",
    "--batch-grid", "0,4",
    "--context-grid", "32,128",
    "--repeats", "3",
    "--kv-cache-tokens", "16384",
]  # fmt: skip


def test_sara_profile_writes_a_profile_that_sara_solve_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tiny.json"
    args = ["profile", "--model", "tiny", "--device", "cpu", "--out", str(out), *SMALL_GRID]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "R^2 = " in printed and "largest relative error" in printed
    profile = IterationProfile.from_json(out.read_text())
    assert profile.kv_capacity_tokens == 16384
    assert profile.kv_bytes_per_token == 2 * 4 * 2 * 32 * 4  # K+V x layers x kv heads x dim x fp32
    assert profile.t0_s + profile.t_tok_s > 0
    assert profile.startup_s > 0
    assert "sara profile" in profile.source and "R^2" in profile.source

    # The cache (16,384 tokens) holds the longest Azure conversation (14,089 tokens); the
    # SLOs are a CPU's (the prefill of 14k tokens on the tiny CPU model takes seconds).
    args = ["solve", "--profile", str(out), "--arrival-rate", "1", "--json"]
    args += ["--ttft-p99", "60", "--tpot-p99", "1"]
    assert main([*args, "--lengths", str(AZURE_CONV)]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["feasible"] is True
    assert answer["prefill_workers"] >= 1 and answer["decode_workers"] >= 1


def test_sara_profile_reports_a_bad_model_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "p.json")])
    assert exit_info.value.code == 2
    assert "--model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "--model", "tiny", "--out", "p.json", "--budget-grid", "a,b"])
    assert exit_info.value.code == 2
