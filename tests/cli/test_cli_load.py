"""`sara load` and the load generator, replayed against the router on a real
redis-server, with ``ProtocolWorker`` (tests/workers/conftest.py) playing the worker
side of the data plane (a token loop instead of a model). Loopback only."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cli.__main__ import main
from cli.loadgen import (
    PlanOptions,
    RequestResult,
    ResultStatus,
    build_plan,
    completions_url,
    summarize,
)
from sim.trace import Trace
from tests.workers.conftest import (
    KEYS,
    ProtocolWorker,
    ServerThread,
    byte_detokenize,
    byte_tokenize,
)
from workers.redis_util import RedisServer, free_port
from workers.router import RouterConfig, create_router_app


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer.start()
    yield server
    server.stop()


Start = Callable[..., ServerThread]


@pytest.fixture
def start_router(redis_server: RedisServer) -> Iterator[Start]:
    servers: list[ServerThread] = []

    def start(**overrides: Any) -> ServerThread:
        config = RouterConfig(
            **{
                "redis_url": redis_server.url,
                "max_context_tokens": 512,
                "vocab_size": 256,
                "model_name": "tiny",
                "key_prefix": KEYS.prefix,
                "poll_block_ms": 100,
                **overrides,
            }
        )
        servers.append(
            ServerThread(
                create_router_app(config, tokenize=byte_tokenize, detokenize=byte_detokenize)
            ).start()
        )
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def worker(redis_server: RedisServer) -> Iterator[ProtocolWorker]:
    w = ProtocolWorker(redis_server.url, tpot_s=0.002).start()
    yield w
    w.stop()


def write_trace(path: Path, rows: list[tuple[float, int, int]]) -> str:
    lines = ["timestamp_s,prompt_tokens,output_tokens"]
    lines += [f"{t},{p},{o}" for t, p, o in rows]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["load", *args, "--json"]) == 0
    return dict(json.loads(capsys.readouterr().out))


# --------------------------------------------------------------------------- end to end


def test_a_trace_replays_open_loop_and_reports_percentiles_and_attainment(
    worker: ProtocolWorker,
    start_router: Start,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    router = start_router()
    rows = [(i * 0.05, 20 + i, 5 + i % 4) for i in range(24)]  # 20 req/s for 1.15 s
    trace = write_trace(tmp_path / "t.csv", rows)
    # SLOs far above a 2-ms-per-token worker's latencies: every request meets them,
    # however loaded the machine running the test is.
    out = run_json(
        capsys, "--url", router.url, "--trace", trace, "--time-scale", "0.5",
        "--ttft-slo", "5", "--tpot-slo", "1",
    )
    assert (out["requests"], out["completed"], out["failed"]) == (24, 24, 0)
    assert out["model"] == "tiny"
    assert out["offered_rate_rps"] == pytest.approx(40, rel=0.01)  # 0.5x the time: 2x rate
    for name in ("ttft_s", "tpot_s", "latency_s"):
        p = out[name]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"] < 2.0
    assert out["slo_attainment"] == 1.0
    assert out["max_send_lag_s"] >= 0  # on-schedule sending is checked below, under load
    assert out["output_tokens_per_s"] > 0


def test_sends_stay_on_schedule_while_answers_queue_up(
    redis_server: RedisServer,
    start_router: Start,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    slow = ProtocolWorker(redis_server.url, prefill_s=0.15, name="slow").start()
    try:
        router = start_router()
        trace = write_trace(tmp_path / "t.csv", [(i * 0.02, 8, 2) for i in range(6)])
        out = run_json(capsys, "--url", router.url, "--trace", trace, "--ttft-slo", "0.3")
    finally:
        slow.stop()
    assert out["completed"] == 6
    # Open loop: nobody waited for an answer before sending. A closed-loop sender would
    # be >= 0.6 s late for the last request (five 0.15 s prefills ahead of it); the
    # bound leaves room for a loaded CI machine.
    assert out["max_send_lag_s"] < 0.3
    # One prefill worker at 0.15 s each: the last waits for five before it.
    assert out["ttft_s"]["p99"] > 0.6
    assert 0 < out["ttft_attainment"] < 1


def test_refusals_and_rejections_are_counted_by_kind_and_miss_the_slo(
    start_router: Start, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    router = start_router(request_timeout_s=0.3)  # and no worker at all
    trace = write_trace(tmp_path / "t.csv", [(0.0, 8, 2), (0.01, 8, 2), (0.02, 600, 2)])
    out = run_json(capsys, "--url", router.url, "--trace", trace)
    assert (out["requests"], out["completed"], out["failed"]) == (3, 0, 3)
    # The too-long prompt is a 400; with no live worker the router refuses at once
    # (503 no_workers) rather than letting the request time out.
    assert out["failures"] == {"http_400": 1, "http_503": 2}
    assert out["slo_attainment"] == 0.0
    assert out["ttft_s"] is None


def test_fit_context_shortens_prompts_to_the_models_context(
    worker: ProtocolWorker,
    start_router: Start,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    router = start_router()
    trace = write_trace(tmp_path / "t.csv", [(0.0, 2000, 3), (0.01, 100, 3)])
    out = run_json(capsys, "--url", router.url, "--trace", trace, "--fit-context")
    assert out["completed"] == 2


def test_the_text_report_is_a_table(
    worker: ProtocolWorker,
    start_router: Start,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    router = start_router()
    trace = write_trace(tmp_path / "t.csv", [(0.0, 8, 3), (0.01, 8, 3)])
    assert main(["load", "--url", router.url, "--trace", trace]) == 0
    text = capsys.readouterr().out
    for label in ("requests sent", "TTFT (ms)", "TPOT (ms)", "P99", "SLO attainment (both)"):
        assert label in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--url", "127.0.0.1:8000"], "--url"),
        (["--url", "http://127.0.0.1:{free}"], "cannot read"),
        (["--url", "http://127.0.0.1:{free}", "--rate-scale", "0"], "--rate-scale"),
        (["--url", "http://127.0.0.1:{free}", "--max-requests", "0"], "--max-requests"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "t.csv", [(0.0, 8, 3)])
    args = [a.replace("{free}", str(free_port())) for a in args]
    with pytest.raises(SystemExit) as exc:
        main(["load", *args, "--trace", trace])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_an_unreadable_trace_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["load", "--url", "http://127.0.0.1:1", "--trace", str(tmp_path / "none.csv")])
    assert exc.value.code == 2
    assert "--trace" in capsys.readouterr().err


# --------------------------------------------------------------------------- the plan


def trace(n: int = 100, gap_s: float = 0.1) -> Trace:
    return Trace(
        arrival_s=(np.arange(n) * gap_s).astype(np.float64),
        prompt_tokens=np.arange(1, n + 1) * 10,
        output_tokens=np.full(n, 50),
        source="test",
    )


def test_time_scale_multiplies_arrival_times() -> None:
    plan = build_plan(trace(), PlanOptions(time_scale=0.5), np.random.default_rng(0))
    assert [r.send_at_s for r in plan[:3]] == pytest.approx([0.0, 0.05, 0.1])


def test_rate_scale_multiplies_the_count_on_the_same_time_axis() -> None:
    base = trace(1000)
    plan = build_plan(base, PlanOptions(rate_scale=3.0), np.random.default_rng(0))
    assert len(plan) == 3000
    assert plan[-1].send_at_s <= base.arrival_s[-1]
    thinned = build_plan(base, PlanOptions(rate_scale=0.5), np.random.default_rng(0))
    assert 400 < len(thinned) < 600  # binomial(1000, 0.5): within 6 sigma


def test_duration_and_max_requests_bound_the_plan() -> None:
    rng = np.random.default_rng(0)
    assert len(build_plan(trace(), PlanOptions(duration_s=1.0), rng)) == 10
    assert len(build_plan(trace(), PlanOptions(max_requests=7), rng)) == 7


def test_lengths_are_scaled_clipped_and_fitted_into_the_context() -> None:
    rng = np.random.default_rng(0)
    plan = build_plan(
        trace(),
        PlanOptions(length_scale=0.5, max_prompt_tokens=100, max_output_tokens=20, vocab_size=50),
        rng,
    )
    assert [len(r.prompt_token_ids) for r in plan[:3]] == [5, 10, 15]
    assert max(len(r.prompt_token_ids) for r in plan) == 100
    assert {r.max_tokens for r in plan} == {20}
    assert all(0 <= t < 50 for r in plan for t in r.prompt_token_ids)
    fitted = build_plan(trace(), PlanOptions(context_tokens=60), rng)
    assert all(len(r.prompt_token_ids) + r.max_tokens <= 60 for r in fitted)
    assert all(len(r.prompt_token_ids) >= 1 for r in fitted)
    tiny = build_plan(trace(), PlanOptions(context_tokens=20), rng)
    assert {(len(r.prompt_token_ids), r.max_tokens) for r in tiny} == {(1, 19)}


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"time_scale": 0}, "time_scale"),
        ({"rate_scale": float("inf")}, "rate_scale"),
        ({"duration_s": -1}, "duration_s"),
        ({"max_requests": 0}, "max_requests"),
        ({"context_tokens": 1}, "context_tokens"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_invalid_plan_options_are_refused_naming_the_field(
    overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        PlanOptions(**overrides)


def test_completions_url_accepts_the_base_or_the_endpoint() -> None:
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/completions"):
        assert completions_url(url) == "http://h:1/v1/completions"


def result(
    ttft: float | None, tpot: float | None, status: ResultStatus = ResultStatus.OK, i: int = 0
) -> RequestResult:
    return RequestResult(
        index=i,
        scheduled_s=float(i),
        send_lag_s=0.0,
        prompt_tokens=1,
        max_tokens=2,
        status=status,
        output_tokens=2,
        ttft_s=ttft,
        tpot_s=tpot,
        latency_s=None if ttft is None else ttft + (tpot or 0),
    )


def test_attainment_counts_failures_as_misses_and_percentiles_cover_successes() -> None:
    results = [result(0.1 * (i + 1), 0.01, i=i) for i in range(10)]  # TTFT 0.1 .. 1.0
    results += [
        result(None, None, ResultStatus.TIMEOUT, i=10),
        result(0.2, 0.5, i=11),
    ]  # TPOT over its SLO
    report = summarize(results, ttft_slo_s=0.55, tpot_slo_s=0.1)
    assert (report.requests, report.completed, report.failed) == (12, 11, 1)
    assert report.failures == {"timeout": 1}
    assert report.ttft_attainment == pytest.approx(6 / 12)  # 0.1..0.5 and the 0.2
    assert report.tpot_attainment == pytest.approx(10 / 12)
    assert report.slo_attainment == pytest.approx(5 / 12)
    ttft = report.ttft_s
    assert ttft is not None
    assert ttft.p50 == pytest.approx(
        float(np.percentile([*(0.1 * (i + 1) for i in range(10)), 0.2], 50))
    )
