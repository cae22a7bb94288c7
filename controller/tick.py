"""One control tick and its record.

Pure: the tick's record is plain data that the loop, the REST API, the operator's
status and the logs all read, so none of them needs its own copy of its shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controller.policy import Decision


@dataclass(frozen=True, kw_only=True)
class TickRecord:
    """One tick as the REST API and the logs show it."""

    time_s: float
    config_version: str
    decision: Decision | None
    applied: bool
    error: str | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "time_s": self.time_s,
            "config_version": self.config_version,
            "applied": self.applied,
            "error": self.error,
            **(self.decision.as_dict() if self.decision else {}),
        }
