"""Where a profile spec (a built-in name or a JSON file) becomes an ``IterationProfile``.

The one loader of the CLI (``--profile``) and the control loop (``config.profile``);
the operator resolves built-in names only (a cluster has no profile files).

``load_profile`` trusts its caller (a flag on the command line reads what it names).
A profile that arrives over the REST API does not come from someone who may read the
controller's files, so ``ProfileSources`` admits only a built-in name or a JSON file
under one of its directories, and only one that parses as a profile: ``/etc/passwd``
is refused before it is opened, ``nope`` before it is stored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from queueing.catalog import builtin_profiles, resolve_profile
from queueing.profile import IterationProfile, ProfileError


def load_profile(spec: str) -> IterationProfile:
    """The built-in profile called ``spec``, or the profile JSON file at path ``spec``.

    A spec ending in ``.json``, or naming an existing file, is a path. Raises
    ``OSError`` when the file cannot be read and ``ProfileError`` for an unknown name
    or an invalid document (the message names the file and the field).
    """
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        text = path.read_text(encoding="utf-8")
        try:
            return IterationProfile.from_json(text)
        except ProfileError as exc:
            raise ProfileError(f"{spec}: {exc}") from exc
    return resolve_profile(spec)


@dataclass(frozen=True, kw_only=True)
class ProfileSources:
    """The profiles a config may name: the built-ins, and JSON files under ``directories``.

    ``load`` raises ``ProfileError`` whose message starts with ``profile:`` (the field),
    so the REST API answers 422 naming it and keeps the config as it was.
    """

    directories: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        for directory in self.directories:
            if not isinstance(directory, Path):
                raise ValueError(f"directories: expected Path objects, got {directory!r}")

    def load(self, spec: str) -> IterationProfile:
        if spec in builtin_profiles():
            return resolve_profile(spec)
        path = Path(spec)
        if path.suffix != ".json" and os.sep not in spec:
            known = ", ".join(builtin_profiles())
            raise ProfileError(
                f"profile: {spec!r} is neither a built-in profile ({known}) nor a profile JSON file"
            )
        real = Path(os.path.realpath(path))  # symlinks and .. resolved: no way out
        allowed = [Path(os.path.realpath(d)) for d in self.directories]
        if not any(real.is_relative_to(d) for d in allowed):
            where = ", ".join(str(d) for d in allowed) or "none configured"
            raise ProfileError(
                f"profile: {spec} is not under an allowed profile directory ({where})"
            )
        if real.suffix != ".json":
            raise ProfileError(f"profile: {spec} is not a profile JSON file (*.json)")
        try:
            text = real.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ProfileError(f"profile: cannot read {spec}: {exc}") from exc
        try:
            return IterationProfile.from_json(text)
        except ProfileError as exc:
            raise ProfileError(f"profile: {spec}: {exc}") from exc

    def with_file_of(self, spec: str) -> ProfileSources:
        """These sources, plus the directory of ``spec`` when it is a file (the profile
        the controller was started with: its directory is the operator's)."""
        path = Path(spec)
        if spec in builtin_profiles() or not path.is_file():
            return self
        return ProfileSources(directories=(*self.directories, path.resolve().parent))
