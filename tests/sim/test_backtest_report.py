"""The back-test report: valid PNG plots, an HTML page that shows them and the table,
and the text/Markdown tables."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from queueing.catalog import resolve_profile
from queueing.solver import KvLink, SloTargets
from sim.backtest import BacktestResult, compare
from sim.policies import Scenario
from sim.report import PLOTS, format_table, summary_rows, write_report
from sim.trace_io import load_trace
from sim.workload import scale_rate, time_slice

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SCENARIO = Scenario(
    profile=resolve_profile("llama-2-70b-tp4@h100-sxm"),
    slo=SloTargets(ttft_p99_s=2.0, tpot_p99_s=0.1),
    link=KvLink(bytes_per_s=50e9),
    startup_s=60.0,
)


@pytest.fixture(scope="module")
def results() -> dict[str, BacktestResult]:
    piece = time_slice(
        load_trace(ROOT / "data/traces/AzureLLMInferenceTrace_conv.csv"), start_s=0, end_s=300
    )
    trace = scale_rate(piece, 3.0, np.random.default_rng(4))
    return compare(trace, ["sara", "static-peak", "threshold"], SCENARIO)


class Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.cells: list[str] = []
        self.title = ""
        self._in: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.images.append(dict(attrs)["src"] or "")
        self._in = tag

    def handle_endtag(self, tag: str) -> None:
        self._in = None

    def handle_data(self, data: str) -> None:
        if self._in == "td":
            self.cells.append(data)
        if self._in == "title":
            self.title += data


def test_the_report_writes_valid_pngs_and_a_page_that_shows_them(
    results: dict[str, BacktestResult], tmp_path: Path
) -> None:
    index = write_report(
        tmp_path / "report",
        results,
        title="Back-test: test",
        description={"workload": "conv", "requests": 123},
        ttft_slo_s=2.0,
        tpot_slo_s=0.1,
    )
    assert index == tmp_path / "report" / "index.html"
    for name in PLOTS:
        data = (tmp_path / "report" / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        # The IHDR chunk: a real image of a readable size.
        width = int.from_bytes(data[16:20], "big")
        height = int.from_bytes(data[20:24], "big")
        assert width >= 800 and height >= 300, (name, width, height)
    page = Page()
    page.feed(index.read_text(encoding="utf-8"))
    assert sorted(page.images) == sorted(PLOTS)
    assert page.title == "Back-test: test"
    for name in results:
        assert name in page.cells


def test_the_text_table_has_a_row_per_policy_and_the_markdown_one_is_a_table(
    results: dict[str, BacktestResult],
) -> None:
    rows = summary_rows(results, reference="static-peak")
    text = format_table(rows, reference="static-peak")
    lines = text.splitlines()
    assert len(lines) == 2 + len(results)
    assert lines[0].startswith("policy") and "x static-peak" in lines[0]
    peak_row = next(r for r in rows if r.policy == "static-peak")
    assert peak_row.relative_gpu_hours == pytest.approx(1.0)
    markdown = format_table(rows, markdown=True).splitlines()
    assert markdown[1].startswith("|---")
    assert all(line.startswith("| ") for line in markdown[2:])


def test_a_report_needs_results(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="results"):
        write_report(tmp_path, {}, title="t", description={}, ttft_slo_s=1.0, tpot_slo_s=0.1)
