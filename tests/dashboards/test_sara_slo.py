"""The generated Grafana dashboard: committed copies, panels, queries and variables."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dashboards import sara_slo
from dashboards.sara_slo import OUTPUTS, dashboard_queries, render
from tests.dashboards.promql_names import defined_metric_names, metric_names, promtool_path
from workers.router_metrics import RouterMetrics

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    model: dict[str, Any] = json.loads(render())
    return model


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def variable(dashboard: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [v for v in dashboard["templating"]["list"] if v["name"] == name]
    return found


@pytest.mark.parametrize("path", OUTPUTS, ids=lambda p: str(p.relative_to(sara_slo.ROOT)))
def test_each_committed_copy_is_the_generated_json_byte_for_byte(path: Path) -> None:
    assert path.read_bytes() == render().encode(), (
        f"{path} is stale: run python -m dashboards.sara_slo --write-all"
    )


def test_the_json_is_deterministic_with_sorted_keys() -> None:
    text = render()
    assert text == render()
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"


def test_the_dashboard_has_a_fixed_uid_and_a_recent_schema(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "sara-slo"
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["id"] is None


def test_every_panel_has_a_unit_a_description_and_a_query(dashboard: dict[str, Any]) -> None:
    for panel in panels(dashboard):
        title = panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"], title
        assert len(panel["description"]) > 40, title
        assert panel["targets"], title
        assert all(t["expr"].strip() for t in panel["targets"]), title
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), title


def test_panel_ids_are_unique_and_numbered_in_reading_order(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert ids == list(range(1, len(ids) + 1))
    assert len({p["title"] for p in panels(dashboard)}) == len(panels(dashboard))


def test_panels_fit_the_grid_without_overlapping(dashboard: dict[str, Any]) -> None:
    taken: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        cells = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_every_panel_and_query_uses_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    for panel in panels(dashboard):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert all(t["datasource"] == DATASOURCE for t in panel["targets"]), panel["title"]
    assert variable(dashboard, "datasource")["type"] == "datasource"
    assert variable(dashboard, "datasource")["query"] == "prometheus"


@pytest.mark.parametrize("name", ["namespace", "autoscaler"])
def test_label_variables_default_to_all_which_also_matches_a_missing_label(
    dashboard: dict[str, Any], name: str
) -> None:
    var = variable(dashboard, name)
    assert var["type"] == "query"
    assert var["includeAll"] is True and var["allValue"] == ".*"
    assert var["current"]["value"] == "$__all"
    assert var["definition"].startswith("label_values(") and var["definition"].endswith(f"{name})")


def test_every_query_reads_only_metrics_that_the_code_defines() -> None:
    known = defined_metric_names()
    for title, expr in dashboard_queries():
        unknown = metric_names(expr) - known
        assert not unknown, f"{title}: {expr} reads undefined metrics {sorted(unknown)}"


def test_the_queries_cover_the_slis_the_controller_and_the_workers() -> None:
    used = set().union(*(metric_names(expr) for _, expr in dashboard_queries()))
    for name in (
        "sara_ttft_seconds_bucket",
        "sara_tpot_seconds_bucket",
        "sara_controller_desired_replicas",
        "sara_controller_current_replicas",
        "sara_controller_predicted_p99_seconds",
        "sara_controller_observed_p99_seconds",
        "sara_controller_model_error_ratio",
        "sara_controller_arrival_rate_rps",
        "sara_controller_decisions_total",
        "sara_worker_queue_depth",
        "sara_kv_transfer_seconds_bucket",
        "sara_kv_transfer_bytes_total",
    ):
        assert name in used, name


def test_dashboard_queries_list_every_target_with_the_variables_filled_in(
    dashboard: dict[str, Any],
) -> None:
    queries = dashboard_queries({"window": "5m"})
    targets = [(p["title"], t["expr"]) for p in panels(dashboard) for t in p["targets"]]
    assert [title for title, _ in queries] == [title for title, _ in targets]
    for title, expr in queries:
        assert "$" not in expr, f"{title}: {expr}"
    assert any('le="2.0"' in e and "[5m]" in e for _, e in queries)
    assert any('le="0.1"' in e for _, e in queries)
    assert any(e == "vector(2.0)" for _, e in queries)


def test_slo_values_are_normalised_to_the_bucket_label_or_refused() -> None:
    assert any('le="1.0"' in e for _, e in dashboard_queries({"ttft_slo": "1"}))
    with pytest.raises(ValueError, match="ttft_slo_s"):
        dashboard_queries({"ttft_slo": "1.9"})
    with pytest.raises(ValueError, match="unknown 'colour'"):
        dashboard_queries({"colour": "red"})


def test_slo_choices_are_bounds_the_router_exposes() -> None:
    exposed = RouterMetrics().exposition().decode()

    def bounds(metric: str) -> set[str]:
        return set(re.findall(rf'^{metric}_bucket\{{le="([^"]+)"\}}', exposed, re.MULTILINE))

    dash = json.loads(render())
    for name, metric, default in (
        ("ttft_slo", "sara_ttft_seconds", "2.0"),
        ("tpot_slo", "sara_tpot_seconds", "0.1"),
    ):
        var = variable(dash, name)
        choices = {o["value"] for o in var["options"]}
        assert choices <= bounds(metric), name
        assert var["current"]["value"] == default


def test_every_query_parses_as_promql(tmp_path: Path) -> None:
    # promtool checks the syntax of rule expressions: wrap each query in a recording rule.
    rules = [
        {"record": f"dashboard:query{i}", "expr": expr}
        for i, (_, expr) in enumerate(dashboard_queries())
    ]
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(
        [promtool_path(), "check", "rules", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_cli_writes_the_file_and_check_finds_the_copies_current(tmp_path: Path) -> None:
    out = tmp_path / "dash.json"
    assert sara_slo.main(["--out", str(out)]) == 0
    assert out.read_text() == render()
    assert sara_slo.main(["--check"]) == 0


def test_the_docs_explain_every_panel(dashboard: dict[str, Any]) -> None:
    docs = (sara_slo.ROOT / "docs" / "dashboard.md").read_text(encoding="utf-8")
    for panel in panels(dashboard):
        assert f"**{panel['title']}**" in docs, panel["title"]
