"""A worker's HTTP endpoint: ``/metrics``, ``/healthz`` and ``/readyz``.

Served from a daemon thread by the standard library's threading HTTP server, so a
long engine step never delays a Prometheus scrape or a probe. ``/healthz`` is 200
while the process runs (Kubernetes' liveness); ``/readyz`` is 200 while the worker
takes new work and 503 while it starts, drains or cannot reach Redis (readiness).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST


class WorkerHttpServer:
    """Start with ``start()``; ``address`` is ``host:port`` once bound (port 0 picks one)."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        metrics: Callable[[], bytes],
        readiness: Callable[[], tuple[bool, dict[str, object]]],
    ) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, outer._metrics(), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._json(200, {"status": "ok"})
                elif path == "/readyz":
                    ready, body = outer._readiness()
                    self._json(200 if ready else 503, body)
                else:
                    self._json(404, {"error": f"no such path: {path}"})

            def _json(self, status: int, body: dict[str, object]) -> None:
                self._send(status, json.dumps(body).encode(), "application/json")

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return  # probes every second would flood the worker's log

        self._metrics = metrics
        self._readiness = readiness
        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="sara-worker-http", daemon=True
        )

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host!s}:{port}"

    def start(self) -> WorkerHttpServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
