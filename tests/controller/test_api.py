"""The REST API, end to end through FastAPI's TestClient over a real FileConfigStore."""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import schemathesis
from fastapi import FastAPI
from pydantic import BaseModel, ValidationError

from controller.api import ConfigDocument, create_app, load_api_token
from controller.config import ConfigError, ControllerConfig
from controller.profiles import ProfileSources
from controller.schema import config_fields_markdown
from controller.store import (
    ConfigStore,
    FileConfigStore,
    MemoryConfigStore,
    VersionedConfig,
)
from queueing.catalog import resolve_profile

with warnings.catch_warnings():
    # Starlette's TestClient says it will move from httpx to httpx2: nothing to act on here.
    warnings.filterwarnings("ignore", message=".*httpx2.*")
    from fastapi.testclient import TestClient

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Loop:
    """Stands in for the control loop's read-outs."""

    ready: bool = True
    not_ready_reason: str = "the latest tick failed: actuator: no such deployment"
    status: dict[str, Any] = field(default_factory=lambda: {"mode": "active", "tick": 7})
    asked_limits: list[int] = field(default_factory=list)

    def decisions(self, limit: int) -> Sequence[Mapping[str, Any]]:
        self.asked_limits.append(limit)
        return [{"tick": i, "reasons": ["hold"]} for i in range(min(limit, 3))]


def make_app(
    store: ConfigStore,
    loop: Loop | None = None,
    *,
    api_token: str | None = TOKEN,
    open_reads: bool = True,
    profiles: ProfileSources = ProfileSources(),  # noqa: B008 (frozen)
) -> FastAPI:
    loop = Loop() if loop is None else loop
    return create_app(
        store=store,
        status=lambda: loop.status,
        decisions=loop.decisions,
        ready=lambda: (loop.ready, "ready" if loop.ready else loop.not_ready_reason),
        metrics=lambda: b"# HELP x y\n# TYPE x gauge\nx 1.0\n",
        api_token=api_token,
        open_reads=open_reads,
        profiles=profiles,
    )


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "config.json"


@pytest.fixture
def loop() -> Loop:
    return Loop()


@pytest.fixture
def client(path: Path, loop: Loop) -> Iterator[TestClient]:
    with TestClient(make_app(FileConfigStore(path), loop)) as test_client:
        yield test_client


def snapshot(client: TestClient) -> tuple[dict[str, Any], str]:
    response = client.get("/v1/config")
    assert response.status_code == 200
    return response.json(), response.headers["etag"]


# -- reading and writing ----------------------------------------------------------------


def test_get_returns_the_document_with_its_version_as_a_quoted_etag(
    client: TestClient, path: Path
) -> None:
    response = client.get("/v1/config")
    assert response.status_code == 200
    assert response.json() == ControllerConfig().to_dict()
    assert response.headers["etag"] == f'"{FileConfigStore(path).load().version}"'


def test_put_replaces_the_document_and_fields_left_out_take_their_defaults(
    client: TestClient,
) -> None:
    client.patch("/v1/config", json={"headroom": 0.3}, headers=AUTH)
    new = {"mode": "advisory", "slo": {"ttft_p99_s": 1.2, "tpot_p99_s": 0.05}, "gpu_budget": 16}
    response = client.put("/v1/config", json=new, headers=AUTH)
    assert response.status_code == 200
    expected = {**ControllerConfig().to_dict(), **new}
    assert response.json() == expected
    assert snapshot(client) == (expected, response.headers["etag"])


def test_patch_merges_nested_fields_and_keeps_their_siblings(client: TestClient) -> None:
    response = client.patch(
        "/v1/config",
        content=json.dumps({"slo": {"ttft_p99_s": 0.8}, "prefill": {"max_replicas": 12}}),
        headers={**AUTH, **MERGE_PATCH},
    )
    assert response.status_code == 200
    document = response.json()
    assert document["slo"] == {"ttft_p99_s": 0.8, "tpot_p99_s": 0.1}
    assert document["prefill"] == {"min_replicas": 1, "max_replicas": 12}
    assert snapshot(client)[0] == document


def test_patch_with_null_puts_a_field_back_to_its_default(client: TestClient) -> None:
    client.patch("/v1/config", json={"gpu_budget": 8, "slo": {"tpot_p99_s": 0.2}}, headers=AUTH)
    response = client.patch("/v1/config", json={"gpu_budget": None, "slo": None}, headers=AUTH)
    assert response.status_code == 200
    assert response.json() == ControllerConfig().to_dict()


def test_patch_also_accepts_plain_json(client: TestClient) -> None:
    response = client.patch("/v1/config", json={"mode": "advisory"}, headers=AUTH)
    assert response.status_code == 200
    assert response.json()["mode"] == "advisory"


def test_the_etag_changes_with_the_content_and_only_with_it(client: TestClient) -> None:
    _, original = snapshot(client)
    changed = client.patch("/v1/config", json={"headroom": 0.2}, headers=AUTH).headers["etag"]
    same = client.patch("/v1/config", json={"headroom": 0.2}, headers=AUTH).headers["etag"]
    back = client.patch("/v1/config", json={"headroom": None}, headers=AUTH).headers["etag"]
    assert changed != original
    assert same == changed
    assert back == original


def test_the_config_survives_a_restart_on_the_same_file(client: TestClient, path: Path) -> None:
    client.put("/v1/config", json={"mode": "advisory", "gpu_budget": 10}, headers=AUTH)
    before = snapshot(client)
    with TestClient(make_app(FileConfigStore(path))) as restarted:
        assert snapshot(restarted) == before


# -- optimistic concurrency -------------------------------------------------------------


@pytest.mark.parametrize("method", ["PUT", "PATCH"])
def test_a_write_with_the_current_etag_in_if_match_succeeds(
    client: TestClient, method: str
) -> None:
    _, etag = snapshot(client)
    response = client.request(
        method, "/v1/config", json={"headroom": 0.25}, headers={**AUTH, "If-Match": etag}
    )
    assert response.status_code == 200
    assert response.json()["headroom"] == 0.25


@pytest.mark.parametrize("method", ["PUT", "PATCH"])
def test_a_write_with_a_stale_if_match_is_a_conflict_and_changes_nothing(
    client: TestClient, method: str
) -> None:
    _, stale = snapshot(client)
    client.patch("/v1/config", json={"headroom": 0.2}, headers=AUTH)  # someone else wins
    before = snapshot(client)
    response = client.request(
        method, "/v1/config", json={"headroom": 0.5}, headers={**AUTH, "If-Match": stale}
    )
    assert response.status_code == 409
    assert before[1].strip('"') in response.json()["detail"], "says which version is current"
    assert snapshot(client) == before


@pytest.mark.parametrize("if_match", ["*", 'W/"x", *', None])
def test_without_a_precondition_the_last_writer_wins(
    client: TestClient, if_match: str | None
) -> None:
    client.patch("/v1/config", json={"headroom": 0.2}, headers=AUTH)
    headers = AUTH if if_match is None else {**AUTH, "If-Match": if_match}
    response = client.put("/v1/config", json={"headroom": 0.4}, headers=headers)
    assert response.status_code == 200
    assert snapshot(client)[0]["headroom"] == 0.4


def test_if_match_may_list_several_tags_and_compares_strongly(client: TestClient) -> None:
    _, etag = snapshot(client)
    weak = client.patch(
        "/v1/config", json={"headroom": 0.2}, headers={**AUTH, "If-Match": f"W/{etag}"}
    )
    assert weak.status_code == 409
    listed = client.patch(
        "/v1/config", json={"headroom": 0.2}, headers={**AUTH, "If-Match": f'"other", {etag}'}
    )
    assert listed.status_code == 200


class RacingStore(MemoryConfigStore):
    """A store where another writer slips in just before the first replace."""

    def __init__(self) -> None:
        super().__init__()
        self.raced = False

    def replace(self, config: ControllerConfig, *, expected_version: str | None) -> VersionedConfig:
        if not self.raced:
            self.raced = True
            other = self.load().config.merged({"slo": {"tpot_p99_s": 0.07}})
            super().replace(other, expected_version=None)
        return super().replace(config, expected_version=expected_version)


def test_a_patch_racing_another_writer_is_merged_onto_that_write_not_over_it() -> None:
    store = RacingStore()
    with TestClient(make_app(store)) as racing:
        response = racing.patch("/v1/config", json={"slo": {"ttft_p99_s": 1.1}}, headers=AUTH)
    assert response.status_code == 200
    assert store.load().config.to_dict()["slo"] == {"ttft_p99_s": 1.1, "tpot_p99_s": 0.07}


def test_a_patch_with_if_match_racing_another_writer_is_a_conflict() -> None:
    store = RacingStore()
    with TestClient(make_app(store)) as racing:
        etag = racing.get("/v1/config").headers["etag"]
        response = racing.patch(
            "/v1/config", json={"headroom": 0.3}, headers={**AUTH, "If-Match": etag}
        )
    assert response.status_code == 409
    assert store.load().config.headroom == ControllerConfig().headroom


# -- validation: 422 names the field, and nothing changes -------------------------------

INVALID: list[tuple[str, str, Any, list[str | int], str]] = [
    # (case, method, body, loc, message prefix)
    ("negative SLO", "PUT", {"slo": {"ttft_p99_s": -1}}, ["body", "slo", "ttft_p99_s"], "slo."),
    ("zero SLO by patch", "PATCH", {"slo": {"tpot_p99_s": 0}}, ["body", "slo", "tpot_p99_s"], ""),
    (
        "min above max",
        "PUT",
        {"prefill": {"min_replicas": 8, "max_replicas": 4}},
        ["body", "prefill", "min_replicas"],
        "",
    ),
    (
        "min above max by patch",
        "PATCH",
        {"decode": {"min_replicas": 65}},
        ["body", "decode", "min_replicas"],
        "",
    ),
    ("unknown field", "PUT", {"slo_seconds": 2}, ["body", "slo_seconds"], ""),
    ("unknown nested field", "PATCH", {"slo": {"p99": 2}}, ["body", "slo", "p99"], ""),
    ("string for a number", "PUT", {"headroom": "0.2"}, ["body", "headroom"], ""),
    ("boolean for a number", "PATCH", {"window_s": True}, ["body", "window_s"], ""),
    ("fraction for an integer", "PUT", {"gpu_budget": 8.5}, ["body", "gpu_budget"], ""),
    ("float for an integer", "PATCH", {"gpu_budget": 8.0}, ["body", "gpu_budget"], ""),
    (
        "number for a boolean",
        "PATCH",
        {"calibration": {"enabled": 1}},
        ["body", "calibration", "enabled"],
        "",
    ),
    ("object for a number", "PUT", {"interval_s": {"value": 3}}, ["body", "interval_s"], ""),
    ("unknown mode", "PATCH", {"mode": "aggressive"}, ["body", "mode"], ""),
    ("empty profile", "PUT", {"profile": ""}, ["body", "profile"], ""),
    ("unknown profile", "PATCH", {"profile": "nope"}, ["body", "profile"], ""),
    (
        "a file outside the profile directories",
        "PATCH",
        {"profile": "/etc/passwd"},
        ["body", "profile"],
        "",
    ),
    ("a JSON file outside them", "PUT", {"profile": "/etc/sara/p.json"}, ["body", "profile"], ""),
    ("an absurd GPU budget", "PATCH", {"gpu_budget": 10**30}, ["body", "gpu_budget"], ""),
    ("a float GPU budget", "PATCH", {"gpu_budget": 1e30}, ["body", "gpu_budget"], ""),
    ("a week-long tick", "PATCH", {"interval_s": 7 * 86400.0}, ["body", "interval_s"], ""),
    (
        "replicas past any cluster",
        "PATCH",
        {"decode": {"max_replicas": 10**9}},
        ["body", "decode", "max_replicas"],
        "",
    ),
    ("budget below the minimums", "PUT", {"gpu_budget": 1}, ["body", "gpu_budget"], ""),
    (
        "budget below raised minimums",
        "PATCH",
        {"gpu_budget": 5, "prefill": {"min_replicas": 3}, "decode": {"min_replicas": 3}},
        ["body", "gpu_budget"],
        "",
    ),
    ("stale before the window", "PATCH", {"stale_after_s": 10}, ["body", "stale_after_s"], ""),
    ("headroom out of range", "PUT", {"headroom": 12}, ["body", "headroom"], ""),
    ("dead band of one", "PATCH", {"dead_band": 1.0}, ["body", "dead_band"], ""),
    (
        "negative forecast horizon",
        "PUT",
        {"forecast": {"horizon_s": -1.0}},
        ["body", "forecast", "horizon_s"],
        "",
    ),
    (
        "fewer than three forecast bins",
        "PATCH",
        {"forecast": {"bin_s": 200.0}},
        ["body", "forecast", "trend_window_s"],
        "",
    ),
    ("integer beyond any float", "PUT", {"kv_link_gbps": 10**400}, ["body", "kv_link_gbps"], ""),
    ("not an object", "PUT", [1, 2], ["body"], ""),
    ("a bare number as a patch", "PATCH", 3, ["body"], ""),
]


@pytest.mark.parametrize(
    ("case", "method", "body", "loc", "prefix"), INVALID, ids=[c[0] for c in INVALID]
)
def test_an_invalid_document_is_a_422_naming_the_field_and_changes_nothing(
    client: TestClient, case: str, method: str, body: Any, loc: list[str | int], prefix: str
) -> None:
    before = snapshot(client)
    response = client.request(method, "/v1/config", json=body, headers=AUTH)
    assert response.status_code == 422, response.text
    (problem,) = response.json()["detail"]
    assert problem["loc"] == loc
    dotted = ".".join(str(part) for part in loc[1:]) or "body"
    assert problem["msg"].startswith(f"{dotted}: "), problem["msg"]
    assert problem["type"]
    assert snapshot(client) == before


NOT_JSON: list[tuple[str, bytes, int]] = [
    ("malformed JSON", b'{"headroom": 0.2', 422),
    ("a NaN literal", b'{"headroom": NaN}', 422),
    ("an Infinity literal", b'{"slo": {"ttft_p99_s": Infinity}}', 422),
    ("a -Infinity literal", b'{"scale_up_cooldown_s": -Infinity}', 422),
    ("an overflowing exponent", b'{"interval_s": 1e999}', 422),
    ("an integer too long to parse", b'{"gpu_budget": ' + b"9" * 5000 + b"}", 400),
    ("nesting deeper than the parser", b"[" * 100_000, 400),
    ("bytes that are not UTF-8", b'{"profile": "\xff\xfe"}', 400),
]


@pytest.mark.parametrize(("case", "body", "status"), NOT_JSON, ids=[c[0] for c in NOT_JSON])
@pytest.mark.parametrize("method", ["PUT", "PATCH"])
def test_a_body_that_is_not_finite_json_is_a_4xx_and_changes_nothing(
    client: TestClient, method: str, case: str, body: bytes, status: int
) -> None:
    before = snapshot(client)
    response = client.request(
        method, "/v1/config", content=body, headers={**AUTH, "Content-Type": "application/json"}
    )
    assert response.status_code == status, response.text
    assert snapshot(client) == before


def test_malformed_json_is_reported_against_the_body(client: TestClient) -> None:
    response = client.put(
        "/v1/config",
        content=b'{"headroom": }',
        headers={**AUTH, "Content-Type": "application/json"},
    )
    (problem,) = response.json()["detail"]
    assert problem["msg"].startswith("body: not valid JSON at character 13")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_that_is_not_declared_json_is_a_415_and_changes_nothing(
    client: TestClient, content_type: str | None
) -> None:
    before = snapshot(client)
    headers = AUTH if content_type is None else {**AUTH, "Content-Type": content_type}
    response = client.put("/v1/config", content=b'{"headroom": 0.3}', headers=headers)
    assert response.status_code == 415
    assert response.json()["detail"].startswith("Content-Type: expected application/json")
    assert snapshot(client) == before


def test_an_unsupported_method_is_a_405_listing_every_method_of_the_resource(
    client: TestClient,
) -> None:
    response = client.request("DELETE", "/v1/config", headers=AUTH)
    assert response.status_code == 405
    assert set(response.headers["allow"].split(", ")) == {"GET", "PUT", "PATCH"}


def test_merge_patch_media_type_is_for_patch_only(client: TestClient) -> None:
    response = client.put("/v1/config", content=b"{}", headers={**AUTH, **MERGE_PATCH})
    assert response.status_code == 415


# -- auth ---------------------------------------------------------------------------------

AUTH_CASES: list[tuple[str, dict[str, str], int]] = [
    ("no Authorization header", {}, 401),
    ("a scheme other than Bearer", {"Authorization": f"Basic {TOKEN}"}, 401),
    ("Bearer without a token", {"Authorization": "Bearer "}, 401),
    ("a wrong token", {"Authorization": "Bearer not-the-token"}, 403),
    ("the token with a suffix", {"Authorization": f"Bearer {TOKEN}x"}, 403),
    ("a token with non-ASCII", {"Authorization": "Bearer t\u00f6ken"}, 403),
]


@pytest.mark.parametrize(("case", "headers", "status"), AUTH_CASES, ids=[c[0] for c in AUTH_CASES])
@pytest.mark.parametrize("method", ["PUT", "PATCH"])
def test_a_mutation_without_the_right_token_is_refused_and_changes_nothing(
    client: TestClient, method: str, case: str, headers: dict[str, str], status: int
) -> None:
    before = snapshot(client)
    encoded = {
        key: value.encode("utf-8") for key, value in headers.items()
    }  # raw bytes on the wire
    response = client.request(method, "/v1/config", json={"headroom": 0.5}, headers=encoded)
    assert response.status_code == status
    if status == 401:
        assert response.headers["www-authenticate"].startswith("Bearer")
    assert response.json()["detail"].startswith("Authorization: ")
    assert snapshot(client) == before


def test_the_bearer_scheme_name_is_case_insensitive(client: TestClient) -> None:
    response = client.patch(
        "/v1/config", json={"headroom": 0.5}, headers={"Authorization": f"bearer {TOKEN}"}
    )
    assert response.status_code == 200


def test_auth_is_checked_before_the_body_is_even_parsed(client: TestClient) -> None:
    response = client.put(
        "/v1/config", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 401


def test_without_a_configured_token_mutations_are_refused_saying_why(path: Path) -> None:
    with TestClient(make_app(FileConfigStore(path), api_token=None)) as no_token:
        before = snapshot(no_token)
        for method in ("PUT", "PATCH"):
            response = no_token.request(method, "/v1/config", json={"headroom": 0.5}, headers=AUTH)
            assert response.status_code == 403
            assert "no API token is configured" in response.json()["detail"]
        assert snapshot(no_token) == before


@pytest.mark.parametrize("read", ["/v1/config", "/v1/status", "/v1/decisions", "/metrics"])
def test_closed_reads_need_the_token(path: Path, read: str) -> None:
    with TestClient(make_app(FileConfigStore(path), open_reads=False)) as closed:
        assert closed.get(read).status_code == 401
        assert closed.get(read, headers={"Authorization": "Bearer wrong"}).status_code == 403
        assert closed.get(read, headers=AUTH).status_code == 200


@pytest.mark.parametrize("open_path", ["/healthz", "/readyz", "/openapi.json"])
def test_probes_and_the_schema_stay_open_when_reads_are_closed(path: Path, open_path: str) -> None:
    with TestClient(make_app(FileConfigStore(path), open_reads=False)) as closed:
        assert closed.get(open_path).status_code == 200


def test_closed_reads_without_a_token_is_a_configuration_error(path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^api_token: "):
        make_app(FileConfigStore(path), api_token=None, open_reads=False)


@pytest.mark.parametrize("token", ["", "two words", "t\u00f6ken"])
def test_an_unusable_token_is_refused_at_start(path: Path, token: str) -> None:
    with pytest.raises(ConfigError, match=r"^api_token: "):
        make_app(FileConfigStore(path), api_token=token)


# -- loading the token ----------------------------------------------------------------------


def test_the_token_comes_from_the_environment_without_surrounding_whitespace() -> None:
    assert load_api_token({"SARA_API_TOKEN": "  abc123\n"}) == "abc123"


def test_the_token_file_is_read_and_stripped_and_wins_over_the_environment(
    tmp_path: Path,
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    assert load_api_token({"SARA_API_TOKEN": "from-env"}, file=str(token_file)) == "from-file"


def test_no_token_anywhere_is_none() -> None:
    assert load_api_token({}) is None


def test_an_empty_token_is_an_error_naming_where_it_came_from(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^SARA_API_TOKEN: the API token is empty"):
        load_api_token({"SARA_API_TOKEN": " \n"})
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(empty))}: the API token is empty"):
        load_api_token({}, file=str(empty))


def test_a_missing_token_file_is_an_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "absent"
    with pytest.raises(ConfigError, match=f"^{re.escape(str(missing))}: cannot read"):
        load_api_token({}, file=str(missing))


# -- the loop's read-outs and the probes --------------------------------------------------


def test_status_is_what_the_loop_reports_with_non_finite_numbers_as_null(
    client: TestClient, loop: Loop
) -> None:
    loop.status = {"mode": "active", "predicted_p99_s": {"prefill": math.nan, "decode": 0.07}}
    response = client.get("/v1/status")
    assert response.status_code == 200
    assert response.json() == {
        "mode": "active",
        "predicted_p99_s": {"prefill": None, "decode": 0.07},
    }


def test_decisions_pass_the_limit_and_default_to_fifty(client: TestClient, loop: Loop) -> None:
    assert client.get("/v1/decisions?limit=2").json() == [
        {"tick": 0, "reasons": ["hold"]},
        {"tick": 1, "reasons": ["hold"]},
    ]
    client.get("/v1/decisions")
    client.get("/v1/decisions?limit=1000")
    assert loop.asked_limits == [2, 50, 1000]


@pytest.mark.parametrize("limit", ["0", "1001", "-3", "ten", "2.5", "9" * 400])
def test_a_limit_outside_one_to_a_thousand_is_a_422_naming_it(
    client: TestClient, loop: Loop, limit: str
) -> None:
    response = client.get(f"/v1/decisions?limit={limit}")
    assert response.status_code == 422
    assert response.json()["detail"][0]["msg"].startswith("limit: ")
    assert loop.asked_limits == []


def test_healthz_says_ok(client: TestClient) -> None:
    response = client.get("/healthz")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


def test_readyz_follows_the_loop_and_says_why_it_is_not_ready(
    client: TestClient, loop: Loop
) -> None:
    assert client.get("/readyz").status_code == 200
    loop.ready = False
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json() == {"detail": f"not ready: {loop.not_ready_reason}"}


def test_a_profile_file_under_an_allowed_directory_is_taken_only_if_it_parses(
    tmp_path: Path, path: Path
) -> None:
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    good = profiles / "measured.json"
    good.write_text(resolve_profile("llama-3-8b@a100-80g").to_json(), encoding="utf-8")
    (profiles / "broken.json").write_text("{not json", encoding="utf-8")
    (tmp_path / "outside.json").write_text(good.read_text(), encoding="utf-8")
    app = make_app(FileConfigStore(path), profiles=ProfileSources(directories=(profiles,)))
    with TestClient(app) as client:
        ok = client.patch("/v1/config", json={"profile": str(good)}, headers=AUTH)
        assert ok.status_code == 200 and ok.json()["profile"] == str(good)
        before = snapshot(client)
        for spec in (
            str(profiles / "broken.json"),
            str(profiles / ".." / "outside.json"),  # resolved before it is checked
            str(profiles / "absent.json"),
        ):
            response = client.patch("/v1/config", json={"profile": spec}, headers=AUTH)
            assert response.status_code == 422, (spec, response.text)
            (problem,) = response.json()["detail"]
            assert problem["loc"] == ["body", "profile"]
            assert problem["msg"].startswith("profile: ")
            assert snapshot(client) == before


def test_metrics_are_served_as_prometheus_text(client: TestClient) -> None:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    assert response.content == b"# HELP x y\n# TYPE x gauge\nx 1.0\n"


# -- the schema and its docs ----------------------------------------------------------------


def test_the_rest_models_default_to_exactly_the_controller_defaults() -> None:
    assert ConfigDocument().to_config() == ControllerConfig()


def _leaf_bounds() -> Iterator[tuple[str, float]]:
    """(dotted numeric field, a bound the schema states for it)."""

    def walk(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, float]]:
        for name, info in model.model_fields.items():
            if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
                yield from walk(info.annotation, f"{prefix}{name}.")
                continue
            for item in info.metadata:
                for attribute in ("gt", "ge", "lt", "le"):
                    if getattr(item, attribute, None) is not None:
                        yield f"{prefix}{name}", float(getattr(item, attribute))

    return walk(ConfigDocument, "")


def _nested(dotted: str, value: Any) -> dict[str, Any]:
    head, _, rest = dotted.partition(".")
    return {head: _nested(rest, value) if rest else value}


@pytest.mark.parametrize(("dotted", "bound"), list(_leaf_bounds()))
def test_the_schema_ranges_are_the_config_ranges(dotted: str, bound: float) -> None:
    integer = dotted.endswith(("_replicas", "gpu_budget"))
    near = (
        [int(bound) - 1, int(bound), int(bound) + 1]
        if integer
        else [math.nextafter(bound, -math.inf), bound, math.nextafter(bound, math.inf)]
    )
    for value in near:
        document = _nested(dotted, value)
        try:
            ControllerConfig.from_dict(document)
            config_accepts = True
        except ConfigError as exc:
            config_accepts = False
            crossed = not str(exc).startswith(f"{dotted}: must")  # a rule spanning fields
        try:
            ConfigDocument.model_validate(document)
            schema_accepts = True
        except ValidationError:
            schema_accepts = False
        if config_accepts:
            assert schema_accepts, f"the schema refuses {dotted}={value!r}, the config takes it"
        elif not crossed:
            assert not schema_accepts, f"the schema takes {dotted}={value!r}, the config refuses"


def test_the_openapi_schema_describes_every_config_field_with_its_default(
    client: TestClient,
) -> None:
    schemas = client.get("/openapi.json").json()["components"]["schemas"]

    def check(schema_name: str, defaults: Mapping[str, Any], where: str) -> None:
        properties = schemas[schema_name]["properties"]
        assert set(properties) == set(defaults), where
        for name, default in defaults.items():
            prop = properties[name]
            assert prop.get("description"), f"{where}{name} has no description"
            if isinstance(default, dict):  # a nested object: its own schema
                ref = prop.get("$ref") or prop["allOf"][0]["$ref"]
                check(ref.rsplit("/", 1)[1], default, f"{where}{name}.")
            else:
                # FastAPI drops null values from the OpenAPI document, default: null too.
                assert prop.get("default") == default, f"{where}{name}"

    check("ConfigDocument", ControllerConfig().to_dict(), "")


def test_docs_api_md_carries_the_generated_config_table() -> None:
    assert config_fields_markdown() in (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert config_fields_markdown() in (ROOT / "README.md").read_text(encoding="utf-8")


# -- fuzzing from the app's own OpenAPI -----------------------------------------------------


def _fuzzed_app() -> FastAPI:
    return make_app(MemoryConfigStore())


SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", _fuzzed_app())


@SCHEMA.parametrize()
@hypothesis.settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=list(hypothesis.HealthCheck),
    derandomize=True,  # the same requests every run: a failure here is reproducible
)
def test_every_generated_request_gets_a_documented_non_5xx_answer(
    case: schemathesis.Case[Any],
) -> None:
    # Schema-valid documents can still break a cross-field rule (min <= max, the GPU
    # budget), which JSON Schema cannot express; their 422 is the design, not a bug.
    response = case.call_and_validate(
        headers=AUTH, excluded_checks=[schemathesis.checks.positive_data_acceptance]
    )
    assert response.status_code < 500, response.text
