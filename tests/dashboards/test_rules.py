"""The generated Prometheus rules: the committed file, promtool, and the unit tests' coverage."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dashboards import rules
from dashboards.rules import OUTPUT, RuleConfig, render, rule_groups, rule_queries
from tests.dashboards.promql_names import defined_metric_names, metric_names, promtool_path

TESTS = OUTPUT.with_name("prometheus-rules.test.yaml")


def all_rules() -> list[dict[str, Any]]:
    return [rule for group in rule_groups()["groups"] for rule in group["rules"]]


def alerts() -> list[dict[str, Any]]:
    return [rule for rule in all_rules() if "alert" in rule]


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool_path(), *args], capture_output=True, text=True, cwd=cwd)


def test_the_committed_rule_file_is_the_generated_one() -> None:
    assert OUTPUT.read_text(encoding="utf-8") == render(), (
        f"{OUTPUT} is stale: run python -m dashboards.rules --write-all"
    )


def test_the_rule_file_reads_back_as_the_generated_groups() -> None:
    assert yaml.safe_load(OUTPUT.read_text(encoding="utf-8")) == rule_groups()


def test_promtool_accepts_the_rule_file() -> None:
    done = promtool("check", "rules", str(OUTPUT))
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_unit_tests_pass() -> None:
    done = promtool("test", "rules", TESTS.name, cwd=TESTS.parent)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    cases = [
        case
        for test in yaml.safe_load(TESTS.read_text(encoding="utf-8"))["tests"]
        for case in test.get("alert_rule_test", [])
    ]
    for alert in alerts():
        mine = [c for c in cases if c["alertname"] == alert["alert"]]
        assert any(c.get("exp_alerts") for c in mine), f"{alert['alert']}: no firing case"
        assert any(not c.get("exp_alerts") for c in mine), f"{alert['alert']}: no quiet case"


def test_every_alert_has_a_severity_a_summary_and_a_description() -> None:
    for alert in alerts():
        assert alert["labels"]["severity"] in {"critical", "warning"}, alert["alert"]
        assert alert["annotations"]["summary"], alert["alert"]
        assert len(alert["annotations"]["description"]) > 100, alert["alert"]


def test_each_sli_pages_fast_and_tickets_slow_on_two_window_pairs() -> None:
    by_name = {a["alert"]: a for a in alerts()}
    for sli in ("TTFT", "TPOT"):
        fast = by_name[f"Sara{sli}ErrorBudgetBurnFast"]
        slow = by_name[f"Sara{sli}ErrorBudgetBurnSlow"]
        assert fast["labels"]["severity"] == "critical"
        assert slow["labels"]["severity"] == "warning"
        for window in ("1h", "5m", "6h", "30m"):
            assert f"ratio_rate{window} > " in fast["expr"]
        for window in ("1d", "2h", "3d", "6h"):
            assert f"ratio_rate{window} > " in slow["expr"]


def test_rule_queries_read_only_defined_metrics_or_recorded_series() -> None:
    recorded = {rule["record"] for rule in all_rules() if "record" in rule}
    known = defined_metric_names() | recorded
    names = [name for name, _ in rule_queries()]
    assert len(names) == len(set(names)) == len(all_rules())
    for name, expr in rule_queries():
        unknown = metric_names(expr) - known
        assert not unknown, f"{name}: reads undefined metrics {sorted(unknown)}"


def test_every_attainment_window_of_an_alert_is_recorded() -> None:
    recorded = {rule["record"] for rule in all_rules() if "record" in rule}
    for alert in alerts():
        for name in metric_names(alert["expr"]):
            if name.startswith("sara:"):
                assert name in recorded, f"{alert['alert']} reads {name}, not recorded"


def test_attainment_counts_the_bucket_whose_bound_is_the_slo() -> None:
    exprs = dict(rule_queries(RuleConfig(ttft_slo_s=1.0, tpot_slo_s=0.05)))
    assert 'sara_ttft_seconds_bucket{le="1.0"}' in exprs["sara:ttft_slo_attainment:ratio_rate5m"]
    assert 'sara_tpot_seconds_bucket{le="0.05"}' in exprs["sara:tpot_slo_attainment:ratio_rate1h"]


def test_a_non_default_config_still_passes_promtool(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    config = RuleConfig(ttft_slo_s=0.5, objective=0.995, scale_up_stuck_for="15m")
    assert rules.main(["--out", str(path), "--ttft-slo", "0.5", "--objective", "0.995",
                       "--scale-up-stuck-for", "15m"]) == 0  # fmt: skip
    assert path.read_text() == render(config)
    assert "> 14.4 * 0.005" in path.read_text()
    done = promtool("check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"ttft_slo_s": 1.9}, "ttft_slo_s"),
        ({"tpot_slo_s": 0.115}, "tpot_slo_s"),  # between bucket bounds
        ({"objective": 1.0}, "objective"),
        ({"objective": 0.0}, "objective"),
        ({"scale_up_stuck_for": "10 minutes"}, "scale_up_stuck_for"),
        ({"controller_missing_for": "0m"}, "controller_missing_for"),
    ],
)
def test_a_bad_parameter_is_refused_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RuleConfig(**kwargs)


def test_check_reports_the_committed_file_current() -> None:
    assert rules.main(["--check"]) == 0


def test_the_docs_explain_every_alert() -> None:
    docs = (rules.ROOT / "docs" / "dashboard.md").read_text(encoding="utf-8")
    for alert in alerts():
        assert f"`{alert['alert']}`" in docs, alert["alert"]
