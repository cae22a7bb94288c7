"""Serve an ASGI app with uvicorn until SIGTERM or SIGINT, then *return*.

``uvicorn.run`` shuts down gracefully on a signal but then raises the signal again
with its default action, so a SIGTERM ends the process before the caller's
``finally`` blocks run: the worker processes a controller started, the router and
Redis of ``sara serve`` would be left behind. ``serve_http`` keeps uvicorn's graceful
shutdown and returns normally instead, so the caller cleans up.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Generator
from typing import Any

import uvicorn

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _ReturningServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve_http(app: Any, *, host: str, port: int, **config: Any) -> None:
    """Run ``app`` on ``host:port`` until SIGTERM/SIGINT; returns after a graceful stop."""
    options = {"log_level": "warning", **config}
    _ReturningServer(uvicorn.Config(app, host=host, port=port, **options)).run()
