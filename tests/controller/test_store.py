"""The config stores: versions, conflicts, atomic writes, restarts, bad files."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from controller.config import ConfigError, ControllerConfig, Mode, SloConfig
from controller.store import (
    ConfigStore,
    FileConfigStore,
    MemoryConfigStore,
    VersionConflictError,
    config_version,
)

TIGHTER = ControllerConfig(slo=SloConfig(ttft_p99_s=1.0, tpot_p99_s=0.05))
ADVISORY = ControllerConfig(mode=Mode.ADVISORY)


@pytest.fixture(params=["file", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ConfigStore:
    if request.param == "file":
        return FileConfigStore(tmp_path / "config.json")
    return MemoryConfigStore()


# -- the protocol, for every store --------------------------------------------------------


def test_a_new_store_holds_the_defaults(store: ConfigStore) -> None:
    current = store.load()
    assert current.config == ControllerConfig()
    assert current.version == config_version(ControllerConfig())


def test_replace_makes_the_config_current_under_a_new_version(store: ConfigStore) -> None:
    before = store.load()
    after = store.replace(TIGHTER, expected_version=None)
    assert after.config == TIGHTER
    assert after.version != before.version
    assert store.load() == after


def test_a_write_expecting_the_current_version_succeeds(store: ConfigStore) -> None:
    current = store.load()
    assert store.replace(TIGHTER, expected_version=current.version).config == TIGHTER


def test_a_write_expecting_a_stale_version_is_a_conflict_and_changes_nothing(
    store: ConfigStore,
) -> None:
    stale = store.load().version
    winner = store.replace(TIGHTER, expected_version=stale)
    with pytest.raises(VersionConflictError) as raised:
        store.replace(ADVISORY, expected_version=stale)
    assert raised.value.expected_version == stale
    assert raised.value.current_version == winner.version
    assert store.load() == winner


def test_without_an_expected_version_the_last_writer_wins(store: ConfigStore) -> None:
    store.replace(TIGHTER, expected_version=None)
    assert store.replace(ADVISORY, expected_version=None).config == ADVISORY


def test_of_racing_writers_expecting_one_version_exactly_one_wins(store: ConfigStore) -> None:
    start = store.load().version
    outcomes: list[str] = []
    barrier = threading.Barrier(8)

    def write(budget: int) -> None:
        barrier.wait()
        try:
            store.replace(ControllerConfig(gpu_budget=budget), expected_version=start)
            outcomes.append("won")
        except VersionConflictError:
            outcomes.append("conflict")

    threads = [threading.Thread(target=write, args=(10 + i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["conflict"] * 7 + ["won"]


# -- versions -------------------------------------------------------------------------------


def test_the_version_is_sixteen_hex_digits_of_the_content() -> None:
    version = config_version(TIGHTER)
    assert len(version) == 16
    int(version, 16)
    assert config_version(ControllerConfig(slo=SloConfig(ttft_p99_s=1.0, tpot_p99_s=0.05))) == (
        version
    )


def test_an_integral_float_and_the_integer_give_the_same_version() -> None:
    assert config_version(ControllerConfig(interval_s=30)) == config_version(
        ControllerConfig(interval_s=30.0)
    )


def test_rewriting_the_same_content_keeps_the_version(store: ConfigStore) -> None:
    first = store.replace(TIGHTER, expected_version=None)
    again = store.replace(TIGHTER, expected_version=first.version)
    assert again.version == first.version


# -- the file -------------------------------------------------------------------------------


def test_an_absent_file_is_created_with_the_default_document(tmp_path: Path) -> None:
    path = tmp_path / "state" / "config.json"
    FileConfigStore(path)
    assert json.loads(path.read_text()) == ControllerConfig().to_dict()


def test_the_file_holds_the_same_document_the_api_shows(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    FileConfigStore(path).replace(TIGHTER, expected_version=None)
    assert json.loads(path.read_text()) == TIGHTER.to_dict()


def test_a_restarted_store_loads_the_same_config_and_version(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    written = FileConfigStore(path).replace(TIGHTER, expected_version=None)
    assert FileConfigStore(path).load() == written


def test_a_hand_written_partial_document_fills_in_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"mode": "advisory"}')
    assert FileConfigStore(path).load().config == ADVISORY


def _fail(*args: object, **kwargs: object) -> None:
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("step", ["os.replace", "os.fsync"])
def test_a_crash_during_a_write_leaves_the_old_document_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    path = tmp_path / "config.json"
    store = FileConfigStore(path)
    before_text = path.read_text()
    before = store.load()
    monkeypatch.setattr(os, step.removeprefix("os."), _fail)

    with pytest.raises(OSError, match="No space left"):
        store.replace(TIGHTER, expected_version=None)

    monkeypatch.undo()
    assert path.read_text() == before_text
    assert store.load() == before, "memory must not run ahead of the disk"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"], "no temp file left"
    assert FileConfigStore(path).load() == before


def test_a_write_after_a_failed_one_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileConfigStore(tmp_path / "config.json")
    with monkeypatch.context() as patched:
        patched.setattr(os, "replace", _fail)
        with pytest.raises(OSError):
            store.replace(TIGHTER, expected_version=None)
    assert store.replace(TIGHTER, expected_version=None).config == TIGHTER


BAD_FILES: list[tuple[str, str, str]] = [
    ("truncated JSON", '{"mode": "act', "not valid JSON"),
    ("an empty file", "", "not valid JSON"),
    ("a JSON array", "[]", "config: expected a JSON object"),
    ("an invalid value", '{"slo": {"ttft_p99_s": -1}}', "slo.ttft_p99_s"),
    ("an unknown field", '{"slo_ms": 5}', "slo_ms: unknown field"),
    ("a NaN", '{"headroom": NaN}', "headroom"),
    ("min above max", '{"decode": {"min_replicas": 9, "max_replicas": 2}}', "decode.min_replicas"),
    ("an integer too large for a float", '{"interval_s": 1' + "0" * 400 + "}", "out of range"),
    ("an integer too long to parse", '{"gpu_budget": ' + "9" * 5000 + "}", "not a usable JSON"),
]


@pytest.mark.parametrize(("case", "text", "says"), BAD_FILES, ids=[c for c, _, _ in BAD_FILES])
def test_a_bad_file_at_start_is_an_error_naming_the_file_and_is_kept(
    tmp_path: Path, case: str, text: str, says: str
) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        FileConfigStore(path)
    message = str(raised.value)
    assert message.startswith(f"{path}: "), message
    assert says in message
    assert path.read_text() == text, "a bad file is never silently replaced"


def test_an_unreadable_path_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.mkdir()
    with pytest.raises(ConfigError, match=f"^{path}: cannot read"):
        FileConfigStore(path)


# -- memory ---------------------------------------------------------------------------------


def test_a_memory_store_starts_from_the_config_it_is_given() -> None:
    assert MemoryConfigStore(TIGHTER).load().config == TIGHTER
