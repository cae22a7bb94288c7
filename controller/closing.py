"""Closing what may hold connections or processes, whatever its type."""

from __future__ import annotations


def close_if_closable(resource: object) -> None:
    """``resource.close()`` when it has one; nothing otherwise.

    Actuators and observation sources are protocols without ``close``; the ones that
    hold a client, a thread or child processes add it. Errors from ``close`` propagate.
    """
    close = getattr(resource, "close", None)
    if callable(close):
        close()
