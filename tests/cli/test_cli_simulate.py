"""`sara simulate --policy/--compare`: the JSON shape, the table, the report, errors,
and the fixed-pool mode left as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.cli_runner import run_cli as run

ROOT = Path(__file__).resolve().parents[2]
CONV = str(ROOT / "data/traces/AzureLLMInferenceTrace_conv.csv")
# Five minutes of the conversation trace at twice its rate, on the 70B profile with a
# one-minute startup: a few seconds per policy.
WORKLOAD = [
    "simulate",
    "--trace",
    CONV,
    "--slice-end",
    "300",
    "--rate-scale",
    "2",
    "--profile",
    "llama-2-70b-tp4@h100-sxm",
    "--startup-s",
    "60",
]
FIELDS = (
    "requests",
    "completed",
    "slo_attainment",
    "ttft_p99_s",
    "tpot_p99_s",
    "gpu_hours",
    "scale_events",
    "scale_events_per_hour",
    "lost_requests",
    "rejected_requests",
    "series",
)


def test_compare_with_json_prints_every_policy_with_the_documented_fields(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(
        capsys, *WORKLOAD, "--compare", "sara,static-peak,threshold,throughput", "--json"
    )
    assert code == 0, err
    data = json.loads(out)
    assert list(data["policies"]) == ["sara", "static-peak", "threshold", "throughput"]
    for name, result in data["policies"].items():
        for key in FIELDS:
            assert key in result, (name, key)
        assert result["lost_requests"] == 0
        # Prompts beyond the model's 4k context are refused at arrival, by every policy.
        assert result["requests"] == data["requests"]
        assert result["completed"] + result["rejected_requests"] == result["requests"]
        assert set(result["scale_events"]) == {"prefill", "decode"}
        series = result["series"]
        assert len(series["start_s"]) == len(series["prefill_replicas"]) == 5
    assert data["startup_s"] == 60.0
    assert data["profile"] == "llama-2-70b-tp4@h100-sxm"
    # Progress went to stderr, one line per finished policy when not on a terminal.
    assert "[4/4] throughput: simulating done" in err


def test_one_policy_uses_the_same_shape(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, *WORKLOAD, "--policy", "static-mean", "--json", "--no-progress")
    assert code == 0
    data = json.loads(out)
    assert list(data["policies"]) == ["static-mean"]
    assert data["policies"]["static-mean"]["scale_events"] == {"prefill": 0, "decode": 0}


def test_policy_and_compare_together_run_each_name_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(
        capsys,
        *WORKLOAD,
        "--policy",
        "static-mean",
        "--compare",
        "static-mean,static-peak",
        "--json",
        "--no-progress",
    )
    assert code == 0
    assert list(json.loads(out)["policies"]) == ["static-mean", "static-peak"]


def test_without_json_a_table_is_printed_and_the_report_is_written(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    report = tmp_path / "report"
    code, out, err = run(
        capsys, *WORKLOAD, "--compare", "static-peak,static-mean", "--report", str(report)
    )
    assert code == 0, err
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("policy"))
    assert "x static-peak" in lines[header]
    assert lines[header + 2].startswith("static-peak")
    assert lines[header + 3].startswith("static-mean")
    assert (report / "index.html").exists()
    for name in ("load.png", "replicas.png", "latency.png", "gpu_hours.png"):
        assert (report / name).read_bytes()[:4] == b"\x89PNG"
    assert "report written to" in err


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--policy", "hpa"], "--policy: unknown policy 'hpa'"),
        (["--compare", "sara,nope"], "--compare: unknown policy 'nope'"),
        (["--policy", "sara", "--startup-s", "-1"], "--startup-s"),
        (["--policy", "sara", "--window-s", "0"], "--window-s"),
        (["--policy", "sara", "--prefill-workers", "2"], "--prefill-workers"),
        (["--report", "/tmp/x"], "--report: needs --policy or --compare"),
    ],
)
def test_bad_arguments_exit_2_with_a_message_that_names_them(
    capsys: pytest.CaptureFixture[str], extra: list[str], needle: str
) -> None:
    code, _, err = run(capsys, *WORKLOAD, *extra)
    assert code == 2
    assert needle in err


def test_dynamic_policies_can_start_from_given_pool_sizes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(
        capsys,
        *WORKLOAD,
        "--policy",
        "threshold",
        "--prefill-workers",
        "3",
        "--decode-workers",
        "2",
        "--json",
        "--no-progress",
    )
    assert code == 0
    assert json.loads(out)["policies"]["threshold"]["initial"] == {"prefill": 3, "decode": 2}


def test_the_fixed_pool_mode_still_works_without_a_policy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(
        capsys, *WORKLOAD, "--prefill-workers", "2", "--decode-workers", "1", "--json"
    )
    assert code == 0
    data = json.loads(out)
    assert data["prefill_workers"] == 2
    assert data["requests"] == data["completed"] + data["rejected_requests"]
    assert "policies" not in data
