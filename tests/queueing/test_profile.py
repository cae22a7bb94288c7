"""The iteration-time profile: its JSON document, its validation, its arithmetic."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queueing.catalog import DEFAULT_PROFILE_NAME, builtin_profiles, resolve_profile
from queueing.profile import IterationProfile, ProfileError, attention_pairs


def _document() -> dict[str, Any]:
    return dict(json.loads(resolve_profile(DEFAULT_PROFILE_NAME).to_json()))


@pytest.mark.parametrize("name", list(builtin_profiles()))
def test_every_builtin_profile_survives_a_json_round_trip(name: str) -> None:
    profile = resolve_profile(name)
    assert IterationProfile.from_json(profile.to_json()) == profile


def test_the_document_holds_every_field_with_its_unit_in_the_name() -> None:
    assert set(_document()) == {
        "name",
        "model",
        "hardware",
        "tensor_parallel",
        "t0_s",
        "t_tok_s",
        "t_kv_s",
        "t_attn_s",
        "kv_capacity_tokens",
        "kv_bytes_per_token",
        "startup_s",
        "source",
        "max_context_tokens",
    }


def _without(field: str) -> dict[str, Any]:
    document = _document()
    del document[field]
    return document


def _with(**changes: Any) -> dict[str, Any]:
    return {**_document(), **changes}


@pytest.mark.parametrize(
    ("document", "field"),
    [
        (_without("t0_s"), "t0_s"),
        (_without("source"), "source"),
        (_with(t0_ms=8.0), "t0_ms"),
        (_with(t0_s=-0.001), "t0_s"),
        (_with(t_kv_s=float("inf")), "t_kv_s"),
        (_with(startup_s="30"), "startup_s"),
        (_with(kv_capacity_tokens=1000.5), "kv_capacity_tokens"),
        (_with(kv_capacity_tokens=1000.0), "kv_capacity_tokens"),
        (_with(kv_capacity_tokens=0), "kv_capacity_tokens"),
        (_with(tensor_parallel=True), "tensor_parallel"),
        (_with(kv_bytes_per_token="131072"), "kv_bytes_per_token"),
        (_with(name=""), "name"),
        (_with(t0_s=0.0, t_tok_s=0.0), "t0_s"),
    ],
)
def test_a_bad_document_is_rejected_naming_the_field(document: dict[str, Any], field: str) -> None:
    with pytest.raises(ProfileError, match=rf"^{field}:"):
        IterationProfile.from_json(json.dumps(document))


@pytest.mark.parametrize("text", ["{", "[1, 2]", '"profile"', "null"])
def test_text_that_is_not_a_json_object_is_rejected(text: str) -> None:
    with pytest.raises(ProfileError, match=r"^profile:"):
        IterationProfile.from_json(text)


def test_an_iteration_costs_the_floor_plus_each_term() -> None:
    profile = IterationProfile.from_dict(_with(t0_s=0.01, t_tok_s=1e-4, t_kv_s=1e-7, t_attn_s=1e-9))
    assert profile.iteration_s(n_tokens=0) == pytest.approx(0.01)
    assert profile.iteration_s(n_tokens=100, n_kv_read=1000, n_attn_pairs=5050) == pytest.approx(
        0.01 + 100 * 1e-4 + 1000 * 1e-7 + 5050 * 1e-9
    )


def test_a_single_token_attends_to_its_prefix_and_itself() -> None:
    assert attention_pairs(1, 0) == 1
    assert attention_pairs(1, 99) == 100
    assert attention_pairs(4, 0) == 1 + 2 + 3 + 4


@given(
    prompt_tokens=st.integers(1, 5000),
    chunk_tokens=st.integers(1, 5000),
)
def test_a_prompt_has_the_same_attention_pairs_however_it_is_chunked(
    prompt_tokens: int, chunk_tokens: int
) -> None:
    pairs = sum(
        attention_pairs(min(chunk_tokens, prompt_tokens - start), start)
        for start in range(0, prompt_tokens, chunk_tokens)
    )
    assert pairs == prompt_tokens * (prompt_tokens + 1) // 2


def test_the_catalogue_is_built_once_and_a_callers_copy_cannot_change_it() -> None:
    first = builtin_profiles()
    name = next(iter(first))
    first.clear()  # the caller's dict is its own
    assert resolve_profile(name) is resolve_profile(name)  # one build, the same profile
    assert name in builtin_profiles()
    with pytest.raises(ProfileError, match="unknown profile"):
        resolve_profile("no-such-model@no-such-gpu")
