"""The black-box fit recovers a known profile from the times it would produce, and the
profile it writes is one `sara solve` accepts. (The measurement against live servers,
emulated and torch, is bench/blackbox_profile.py: minutes, not a unit test.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from queueing.catalog import resolve_profile
from workers.blackbox_profiler import (
    BlackBoxError,
    BlackBoxGrid,
    ItlSample,
    TtftSample,
    fit_blackbox,
    profile_of,
)

TRUE = resolve_profile("llama-2-70b-tp4@a100-80g")
HTTP_S = 0.008  # what the path adds to every TTFT
PATH_S_PER_TOKEN = 20e-6  # the KV hand-off, per prompt token
PROMPTS = (16, 128, 256, 384, 512, 1024)
CHUNK = 512


def true_ttft(length: int) -> float:
    chunks = math.ceil(length / CHUNK)
    pairs = length * (length + 1) / 2
    return (
        HTTP_S
        + PATH_S_PER_TOKEN * length
        + chunks * TRUE.t0_s
        + TRUE.t_tok_s * length
        + TRUE.t_attn_s * pairs
    )


def true_itl(batch: int, kv_per_sequence: float) -> float:
    return TRUE.iteration_s(n_tokens=batch, n_kv_read=batch * kv_per_sequence)


def samples(noise: float = 0.0, seed: int = 0) -> tuple[list[TtftSample], list[ItlSample]]:
    rng = np.random.default_rng(seed)
    ttft = [
        TtftSample(prompt_tokens=n, ttft_s=true_ttft(n) * (1 + noise * rng.standard_normal()))
        for n in PROMPTS
    ]
    itl = [
        ItlSample(
            concurrency=b,
            context_tokens=c,
            kv_tokens_per_sequence=c + 12.0,
            itl_s=true_itl(b, c + 12.0) * (1 + noise * rng.standard_normal()),
        )
        for c in (32, 512, 2048)
        for b in (1, 4, 16, 32)
    ]
    return ttft, itl


def test_exact_times_give_back_the_profile_the_overhead_and_the_hand_off() -> None:
    fit = fit_blackbox(*samples(), chunk_tokens=CHUNK)
    assert fit.t0_s == pytest.approx(TRUE.t0_s, rel=1e-6)
    assert fit.t_tok_s == pytest.approx(TRUE.t_tok_s, rel=1e-6)
    assert fit.t_kv_s == pytest.approx(TRUE.t_kv_s, rel=1e-5)
    assert fit.t_attn_s == pytest.approx(TRUE.t_attn_s, rel=1e-4)
    assert fit.overhead_s == pytest.approx(HTTP_S, rel=1e-5)
    assert fit.path_s_per_token == pytest.approx(PATH_S_PER_TOKEN, rel=1e-5)
    assert fit.r2 == pytest.approx(1.0) and fit.max_relative_error < 1e-6
    assert fit.predicted_ttft_s(1024) == pytest.approx(true_ttft(1024), rel=1e-9)


def test_with_one_percent_noise_the_iteration_times_stay_within_ten_percent() -> None:
    for seed in range(5):
        fit = fit_blackbox(*samples(noise=0.01, seed=seed), chunk_tokens=CHUNK)
        for length in PROMPTS:
            pairs = length * (length + 1) / 2
            truth = TRUE.iteration_s(n_tokens=length, n_attn_pairs=pairs)
            assert fit.prefill_s(length) == pytest.approx(truth, rel=0.10), (seed, length)
        for batch in (1, 4, 16, 32):
            truth = true_itl(batch, 512.0)
            assert fit.decode_step_s(batch, 512.0) == pytest.approx(truth, rel=0.10)
        assert fit.r2 > 0.95


def test_too_few_shapes_are_refused_by_name() -> None:
    ttft, itl = samples()
    with pytest.raises(BlackBoxError, match="3 prompt lengths"):
        fit_blackbox(ttft[:2], itl)
    with pytest.raises(ValueError, match=r"^prompt_tokens: at least 3 lengths"):
        BlackBoxGrid(prompt_tokens=(16, 32))
    with pytest.raises(ValueError, match=r"^concurrency: must be integers >= 1"):
        BlackBoxGrid(concurrency=(0, 4))


def test_the_written_profile_is_one_sara_solve_accepts(tmp_path: object) -> None:
    fit = fit_blackbox(*samples(), chunk_tokens=CHUNK)
    profile = profile_of(
        fit,
        name="blackbox-test",
        model="llama-2-70b",
        kv_capacity_tokens=TRUE.kv_capacity_tokens,
        kv_bytes_per_token=TRUE.kv_bytes_per_token,
        startup_s=TRUE.startup_s,
        max_context_tokens=TRUE.max_context_tokens,
        url="http://127.0.0.1:8000",
    )
    path = tmp_path / "fit.json"  # type: ignore[operator]
    path.write_text(profile.to_json())
    answer = subprocess.run(
        [sys.executable, "-m", "cli", "solve", "--arrival-rate", "2", "--profile", str(path),
         "--lengths", "data/traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv", "--json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert answer.returncode == 0, answer.stderr
    assert json.loads(answer.stdout)["profile"] == "blackbox-test"


def test_without_memory_facts_the_command_says_which_flags_to_give() -> None:
    answer = subprocess.run(
        [sys.executable, "-m", "cli", "profile", "--openai-url", "http://127.0.0.1:9",
         "--model", "m", "--out", "/dev/null"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert answer.returncode == 2
    assert "--memory-from" in answer.stderr and "--kv-capacity-tokens" in answer.stderr
