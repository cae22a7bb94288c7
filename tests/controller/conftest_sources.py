"""Test exporters for the observation sources: the router's and a worker's metrics.

They export exactly the metrics of DESIGN §4 that the sources read, with
``prometheus_client``, on a free loopback port. ``restart()`` replaces the registry
with a fresh one, as a restarted process would (its counters start again at 0).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

TTFT_BUCKETS_S = tuple(round(0.1 * i, 1) for i in range(1, 11))  # 0.1 .. 1.0
TPOT_BUCKETS_S = tuple(round(0.01 * i, 2) for i in range(1, 11))  # 0.01 .. 0.1
PROMPT_BUCKETS_TOKENS = tuple(128 * i for i in range(1, 9))  # 128 .. 1024
OUTPUT_BUCKETS_TOKENS = tuple(32 * i for i in range(1, 9))  # 32 .. 256
ITERATION_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2)


class _Exporter:
    """Serves ``self.registry`` at ``/metrics`` until ``stop()``; answers 503 while
    ``available`` is false (a process that is down for a while). ``before_scrape``, if
    set, runs before each answer (to bring driven traffic up to the moment of reading)."""

    def __init__(self) -> None:
        self.available = True
        self.before_scrape: Callable[[], None] | None = None
        self.registry = CollectorRegistry()
        self._build()
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                if not exporter.available:
                    self.send_error(503)
                    return
                if exporter.before_scrape is not None:
                    exporter.before_scrape()
                body = generate_latest(exporter.registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def _build(self) -> None:
        raise NotImplementedError

    def restart(self) -> None:
        """A new process on the same port: a fresh registry, every counter at 0."""
        self.registry = CollectorRegistry()
        self._build()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class RouterExporter(_Exporter):
    """The router's request counter and its latency and length histograms."""

    def _build(self) -> None:
        r = self.registry
        self.requests = Counter("sara_requests", "Requests received.", registry=r)
        self.ttft = Histogram(
            "sara_ttft_seconds", "Time to first token.", buckets=TTFT_BUCKETS_S, registry=r
        )
        self.tpot = Histogram(
            "sara_tpot_seconds", "Time per output token.", buckets=TPOT_BUCKETS_S, registry=r
        )
        self.prompt_tokens = Histogram(
            "sara_prompt_tokens", "Prompt length.", buckets=PROMPT_BUCKETS_TOKENS, registry=r
        )
        self.output_tokens = Histogram(
            "sara_output_tokens", "Output length.", buckets=OUTPUT_BUCKETS_TOKENS, registry=r
        )

    def record(self, *, ttft_s: float, tpot_s: float, prompt: int, output: int) -> None:
        """One request, counted on arrival and measured on completion."""
        self.requests.inc()
        self.ttft.observe(ttft_s)
        self.tpot.observe(tpot_s)
        self.prompt_tokens.observe(prompt)
        self.output_tokens.observe(output)


class WorkerExporter(_Exporter):
    """A worker's queue depth, KV usage and iteration time, labelled with its pool."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        super().__init__()

    def _build(self) -> None:
        r = self.registry
        self.queue_depth = Gauge(
            "sara_worker_queue_depth", "Requests waiting.", ["pool"], registry=r
        ).labels(pool=self.pool)
        self.kv_utilization = Gauge(
            "sara_worker_kv_utilization", "KV blocks in use.", ["pool"], registry=r
        ).labels(pool=self.pool)
        self.iteration = Histogram(
            "sara_worker_iteration_seconds",
            "Iteration time.",
            ["pool"],
            buckets=ITERATION_BUCKETS_S,
            registry=r,
        ).labels(pool=self.pool)


def closed_port() -> int:
    """A loopback port that nothing listens on (just released by the OS)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def silent_server() -> Iterator[int]:
    """A loopback port that accepts connections and never answers (a hung server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield int(sock.getsockname()[1])
