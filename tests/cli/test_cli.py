"""The `sara` command line: solve, simulate, profiles; exit codes and messages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from queueing.catalog import resolve_profile
from tests.cli.cli_runner import run_cli as run

ROOT = Path(__file__).resolve().parents[2]
CONV = str(ROOT / "data/traces/AzureLLMInferenceTrace_conv.csv")
ARXIV = str(ROOT / "data/traces/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv")


def test_solve_on_a_trace_prints_the_documented_json_keys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(
        capsys, "solve", "--trace", CONV, "--ttft-p99", "1", "--tpot-p99", "0.05", "--json"
    )
    assert code == 0
    data = json.loads(out)
    for key in (
        "prefill_workers",
        "decode_workers",
        "ttft_p99_s",
        "tpot_p99_s",
        "token_budget",
        "feasible",
    ):
        assert key in data
    assert data["feasible"] is True
    assert data["ttft_p99_s"] <= 1 / 1.1 + 1e-9
    assert data["tpot_p99_s"] <= 0.05 / 1.1 + 1e-9


def test_solve_needs_more_workers_for_ten_times_the_rate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["solve", "--lengths", ARXIV, "--tpot-p99", "0.05", "--json"]
    _, low, _ = run(capsys, *args, "--arrival-rate", "10")
    _, high, _ = run(capsys, *args, "--arrival-rate", "100")
    low_d, high_d = json.loads(low), json.loads(high)
    assert high_d["prefill_workers"] > low_d["prefill_workers"]
    assert high_d["decode_workers"] >= low_d["decode_workers"]


def test_what_if_mode_evaluates_a_given_allocation(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "solve",
        "--lengths",
        ARXIV,
        "--arrival-rate",
        "100",
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--json",
    )
    data = json.loads(out)
    assert code == 0
    assert data["mode"] == "evaluate"
    assert data["ttft_p99_s"] is None  # one worker cannot keep up: no prediction
    assert data["feasible"] is False


def test_an_infeasible_slo_exits_1_with_a_one_line_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run(capsys, "solve", "--trace", CONV, "--ttft-p99", "0.01")
    assert code == 1
    assert "ttft_p99_s" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["solve", "--trace", "/nonexistent.csv"], "--trace"),
        (["solve", "--arrival-rate", "5"], "--arrival-rate"),
        (["solve", "--trace", CONV, "--profile", "no-such-gpu"], "--profile"),
        (["solve", "--trace", CONV, "--ttft-p99", "-1"], "--ttft-p99"),
        (["solve", "--trace", CONV, "--prefill-workers", "2"], "--prefill-workers"),
        (["simulate", "--trace", CONV, "--rate-scale", "0"], "--rate-scale"),
    ],
)
def test_bad_arguments_exit_2_with_a_message_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert needle in err
    assert "Traceback" not in err


def test_a_profile_file_written_from_a_builtin_is_accepted(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "p.json"
    path.write_text(resolve_profile("llama-3-8b@h100-sxm").to_json())
    code, out, _ = run(capsys, "solve", "--trace", CONV, "--profile", str(path), "--json")
    assert code == 0
    assert json.loads(out)["profile"] == "llama-3-8b@h100-sxm"


def test_a_broken_profile_file_is_rejected_naming_the_field(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    data = json.loads(resolve_profile("llama-3-8b@h100-sxm").to_json())
    data["t0_s"] = -1
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    code, _, err = run(capsys, "solve", "--trace", CONV, "--profile", str(path))
    assert code == 2
    assert "t0_s" in err


def test_simulate_a_fixed_allocation_accounts_for_every_request(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(
        capsys,
        "simulate",
        "--trace",
        CONV,
        "--slice-end",
        "300",
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--json",
    )
    data = json.loads(out)
    assert code == 0
    assert data["requests"] == data["completed"] > 1000
    for key in ("ttft_p99_s", "tpot_p99_s", "slo_attainment"):
        assert key in data
    assert 0.0 <= data["slo_attainment"] <= 1.0


def test_profiles_lists_every_builtin(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "profiles")
    assert code == 0
    assert "llama-2-70b-tp4@h100-sxm" in out
    assert "(default)" in out


def test_the_console_script_entry_point_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cli", "profiles", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "llama-3-8b@h100-sxm" in json.loads(done.stdout)
