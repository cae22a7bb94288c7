"""Where a profile spec (a built-in name or a JSON file) becomes an ``IterationProfile``.

The one loader of the CLI (``--profile``) and the control loop (``config.profile``);
the operator resolves built-in names only (a cluster has no profile files).
"""

from __future__ import annotations

from pathlib import Path

from queueing.catalog import resolve_profile
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
