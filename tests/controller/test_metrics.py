"""The controller's metrics, read back through prometheus_client's own text parser."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from controller.metrics import SOLVE_SECONDS_BUCKETS, ControllerMetrics

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(metrics: ControllerMetrics) -> tuple[dict[str, str], Samples]:
    """(family name -> type, (sample name, labels) -> value) of the exposition."""
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(metrics.exposition().decode("utf-8")):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return types, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def tick(**overrides: Any) -> dict[str, Any]:
    arguments: dict[str, Any] = {
        "desired": {"prefill": 6, "decode": 9},
        "current": {"prefill": 4, "decode": 9},
        "predicted_p99_s": {"prefill": 1.7, "decode": 0.082},
        "observed_p99_s": {"prefill": 2.4, "decode": 0.09},
        "raw_rate_rps": 41.5,
        "smoothed_rate_rps": 37.25,
        "reasons": {"prefill": "scale_up", "decode": "dead_band"},
        "solve_s": 0.00042,
        "model_error": {"prefill": 1.41, "decode": 1.1},
    }
    arguments.update(overrides)
    return arguments


POOL_GAUGES = [
    "sara_controller_desired_replicas",
    "sara_controller_current_replicas",
    "sara_controller_predicted_p99_seconds",
    "sara_controller_observed_p99_seconds",
    "sara_controller_model_error_ratio",
]


def test_every_metric_is_exposed_with_its_type() -> None:
    types, _ = scrape(ControllerMetrics())
    assert {name: types[name] for name in POOL_GAUGES} == dict.fromkeys(POOL_GAUGES, "gauge")
    assert types["sara_controller_arrival_rate_rps"] == "gauge"
    assert types["sara_controller_decisions"] == "counter"  # exposed as ..._total
    assert types["sara_controller_solve_seconds"] == "histogram"


def test_before_the_first_tick_every_pool_and_rate_series_exists_and_reads_nan() -> None:
    _, samples = scrape(ControllerMetrics())
    for name in POOL_GAUGES:
        for pool in ("prefill", "decode"):
            assert math.isnan(value(samples, name, pool=pool)), (name, pool)
    for kind in ("raw", "smoothed"):
        assert math.isnan(value(samples, "sara_controller_arrival_rate_rps", kind=kind))


def test_a_tick_sets_every_gauge_to_its_value() -> None:
    metrics = ControllerMetrics()
    metrics.record_tick(**tick())
    _, samples = scrape(metrics)
    expected = {
        ("sara_controller_desired_replicas", "prefill"): 6,
        ("sara_controller_desired_replicas", "decode"): 9,
        ("sara_controller_current_replicas", "prefill"): 4,
        ("sara_controller_current_replicas", "decode"): 9,
        ("sara_controller_predicted_p99_seconds", "prefill"): 1.7,
        ("sara_controller_predicted_p99_seconds", "decode"): 0.082,
        ("sara_controller_observed_p99_seconds", "prefill"): 2.4,
        ("sara_controller_observed_p99_seconds", "decode"): 0.09,
        ("sara_controller_model_error_ratio", "prefill"): 1.41,
        ("sara_controller_model_error_ratio", "decode"): 1.1,
    }
    for (name, pool), number in expected.items():
        assert value(samples, name, pool=pool) == pytest.approx(number), (name, pool)
    assert value(samples, "sara_controller_arrival_rate_rps", kind="raw") == 41.5
    assert value(samples, "sara_controller_arrival_rate_rps", kind="smoothed") == 37.25


def test_decisions_count_one_per_pool_per_tick_by_reason() -> None:
    metrics = ControllerMetrics()
    metrics.record_tick(**tick())
    metrics.record_tick(**tick())
    metrics.record_tick(**tick(reasons={"prefill": "cooldown", "decode": "dead_band"}))
    _, samples = scrape(metrics)
    counts = {
        (labels["pool"], labels["reason"]): number
        for (name, label_set), number in samples.items()
        if name == "sara_controller_decisions_total"
        for labels in [dict(label_set)]
    }
    assert counts == {
        ("prefill", "scale_up"): 2,
        ("prefill", "cooldown"): 1,
        ("decode", "dead_band"): 3,
    }


def test_the_solve_histogram_has_dense_buckets_from_100_us_to_100_ms() -> None:
    assert SOLVE_SECONDS_BUCKETS[0] == 1e-4
    assert SOLVE_SECONDS_BUCKETS[-1] == 0.1
    assert list(SOLVE_SECONDS_BUCKETS) == sorted(set(SOLVE_SECONDS_BUCKETS))
    ratios = [b / a for a, b in itertools.pairwise(SOLVE_SECONDS_BUCKETS)]
    assert max(ratios) <= 2.0, "no gap wider than a factor of two"


def test_each_solve_lands_in_its_bucket_and_a_tick_without_a_solve_adds_none() -> None:
    metrics = ControllerMetrics()
    solves = (0.00012, 0.00042, 0.0031, 0.25)
    for solve_s in solves:
        metrics.record_tick(**tick(solve_s=solve_s))
    metrics.record_tick(**tick(solve_s=None))
    _, samples = scrape(metrics)

    def bucket(le: str) -> float:
        return value(samples, "sara_controller_solve_seconds_bucket", le=le)

    assert bucket("0.0001") == 0
    assert bucket("0.00015") == 1
    assert bucket("0.0005") == 2
    assert bucket("0.005") == 3
    assert bucket("0.1") == 3
    assert bucket("+Inf") == 4
    assert value(samples, "sara_controller_solve_seconds_count") == 4
    assert value(samples, "sara_controller_solve_seconds_sum") == pytest.approx(sum(solves))


def test_what_a_tick_did_not_know_reads_nan_rather_than_an_older_value() -> None:
    metrics = ControllerMetrics()
    metrics.record_tick(**tick())
    metrics.record_tick(
        **tick(
            current={"prefill": 5},  # decode missing from the mapping
            predicted_p99_s={"prefill": None, "decode": 0.08},
            observed_p99_s={},
            raw_rate_rps=None,
            model_error={"prefill": None, "decode": None},
        )
    )
    _, samples = scrape(metrics)
    assert value(samples, "sara_controller_current_replicas", pool="prefill") == 5
    assert math.isnan(value(samples, "sara_controller_current_replicas", pool="decode"))
    assert math.isnan(value(samples, "sara_controller_predicted_p99_seconds", pool="prefill"))
    assert value(samples, "sara_controller_predicted_p99_seconds", pool="decode") == 0.08
    for pool in ("prefill", "decode"):
        assert math.isnan(value(samples, "sara_controller_observed_p99_seconds", pool=pool))
        assert math.isnan(value(samples, "sara_controller_model_error_ratio", pool=pool))
    assert math.isnan(value(samples, "sara_controller_arrival_rate_rps", kind="raw"))
    assert value(samples, "sara_controller_arrival_rate_rps", kind="smoothed") == 37.25


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        ({"desired": {"prefil": 3}}, "desired: unknown pool 'prefil'"),
        ({"model_error": {"router": 1.0}}, "model_error: unknown pool 'router'"),
        ({"reasons": {"decode": ""}}, "reasons.decode"),
        ({"solve_s": -0.001}, "solve_s"),
        ({"solve_s": math.nan}, "solve_s"),
    ],
)
def test_a_bad_tick_is_refused_naming_the_argument_and_publishes_nothing(
    overrides: dict[str, Any], names: str
) -> None:
    metrics = ControllerMetrics()
    metrics.record_tick(**tick())
    before = metrics.exposition()
    with pytest.raises(ValueError, match=names):
        metrics.record_tick(**tick(**{"desired": {"prefill": 1, "decode": 1}, **overrides}))
    assert metrics.exposition() == before


def test_two_controllers_in_one_process_do_not_share_series() -> None:
    first, second = ControllerMetrics(), ControllerMetrics()
    first.record_tick(**tick())
    _, samples = scrape(second)
    assert math.isnan(value(samples, "sara_controller_desired_replicas", pool="prefill"))
    assert not any(name == "sara_controller_decisions_total" for name, _ in samples)
