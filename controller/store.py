"""Where the controller's config lives, and its version for optimistic concurrency.

The REST API and the control loop share one store: the API replaces the document,
the loop loads it at every tick. A version is a content hash, so it needs no
counter to persist, an unchanged config keeps its version across restarts, and a
client's ``If-Match`` stays valid for as long as the content it read is current.

Two stores live here: ``FileConfigStore`` (a JSON file, written atomically) and
``MemoryConfigStore`` (tests, advisory runs). The Kubernetes store, which keeps the
document in the ``SLOAutoscaler`` spec, implements the same ``ConfigStore`` protocol.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from controller.config import ConfigError, ControllerConfig

VERSION_HEX_DIGITS = 16  # 64 bits of sha256: collisions are not a practical concern


@dataclass(frozen=True, kw_only=True)
class VersionedConfig:
    """A config and the version that names its content."""

    config: ControllerConfig
    version: str


class VersionConflictError(RuntimeError):
    """A write expected a version that is no longer current (HTTP 409 at the edge)."""

    def __init__(self, *, expected_version: str, current_version: str) -> None:
        super().__init__(
            f"version: expected {expected_version!r} but the current version is "
            f"{current_version!r}; read the config again and retry"
        )
        self.expected_version = expected_version
        self.current_version = current_version


class ConfigStore(Protocol):
    def load(self) -> VersionedConfig:
        """The current config and its version."""
        ...

    def replace(self, config: ControllerConfig, *, expected_version: str | None) -> VersionedConfig:
        """Make ``config`` current and return it with its version.

        With ``expected_version`` the write happens only if that is still the
        current version (else ``VersionConflictError`` and nothing changes); with
        ``None`` the last writer wins.
        """
        ...


def config_version(config: ControllerConfig) -> str:
    """The first 16 hex digits of the sha256 of the config's canonical JSON.

    Canonical in the spirit of RFC 8785: sorted keys, no whitespace, and integral
    numbers written without a fraction, so ``30`` and ``30.0`` (which the config
    treats as equal) give the same version.
    """
    canonical = json.dumps(
        _canonical_numbers(config.to_dict()),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:VERSION_HEX_DIGITS]


def _canonical_numbers(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _canonical_numbers(item) for key, item in value.items()}
    # Only floats that an int represents exactly; larger ones keep their float form.
    if isinstance(value, float) and value.is_integer() and abs(value) < 2.0**53:
        return int(value)
    return value


class _LockedStore:
    """The version check and the swap, under one lock; subclasses persist."""

    def __init__(self, config: ControllerConfig) -> None:
        self._lock = threading.Lock()
        self._current = VersionedConfig(config=config, version=config_version(config))

    def load(self) -> VersionedConfig:
        with self._lock:
            return self._current

    def replace(self, config: ControllerConfig, *, expected_version: str | None) -> VersionedConfig:
        with self._lock:
            current = self._current
            if expected_version is not None and expected_version != current.version:
                raise VersionConflictError(
                    expected_version=expected_version, current_version=current.version
                )
            new = VersionedConfig(config=config, version=config_version(config))
            if new.version != current.version:
                # Persist first: if it fails, the old config stays current in memory too.
                self._persist(config)
                self._current = new
            return self._current

    def _persist(self, config: ControllerConfig) -> None:
        raise NotImplementedError


class MemoryConfigStore(_LockedStore):
    """A store that forgets on exit; starts from ``config`` (the defaults if None)."""

    def __init__(self, config: ControllerConfig | None = None) -> None:
        super().__init__(ControllerConfig() if config is None else config)

    def _persist(self, config: ControllerConfig) -> None:
        pass  # memory only: swapping ``_current`` is the whole write


class FileConfigStore(_LockedStore):
    """The config as one JSON document in ``path`` (the same document GET /v1/config shows).

    At start the file is read and validated whole; an absent file is created with
    the defaults, and an unreadable, corrupt or invalid one raises ``ConfigError``
    naming the file. It is never replaced silently: a bad hand edit must be fixed,
    not lost. The file is read only at start; edit it by hand only while stopped.

    A write goes to a temporary file in the same directory, is fsynced, and is
    renamed over ``path`` with ``os.replace`` (atomic on POSIX), so a crash at any
    point leaves either the old or the new document, never a mix.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if self.path.exists():
            config = _read(self.path)
        else:
            config = ControllerConfig()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _write_atomically(self.path, config)
        super().__init__(config)

    def _persist(self, config: ControllerConfig) -> None:
        _write_atomically(self.path, config)


def _read(path: Path) -> ControllerConfig:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from exc
    except (ValueError, RecursionError) as exc:  # e.g. an integer past Python's digit limit
        raise ConfigError(f"{path}: not a usable JSON document: {exc}") from exc
    try:
        return ControllerConfig.from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    except OverflowError as exc:  # an integer too large for a float-valued field
        raise ConfigError(f"{path}: a number is out of range: {exc}") from exc


def _write_atomically(path: Path, config: ControllerConfig) -> None:
    text = json.dumps(config.to_dict(), indent=2, allow_nan=False) + "\n"
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as tmp:
            tmp.write(text)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk too.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # platforms without directory fds (Windows): the rename is all we can do
    try:
        # Some filesystems refuse fsync on a directory; the data file itself is synced.
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


__all__ = [
    "ConfigStore",
    "FileConfigStore",
    "MemoryConfigStore",
    "VersionConflictError",
    "VersionedConfig",
    "config_version",
]
