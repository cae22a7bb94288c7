"""A private ``redis-server`` process: for tests, and for ``sara serve`` on one machine.

``RedisServer.start()`` picks a free loopback port (unless given one), runs
``redis-server`` there without persistence (``--save "" --appendonly no``), waits
until it answers ``PING`` and returns the handle; ``stop()`` ends it (SIGTERM, then
SIGKILL) and removes its working directory. ``kill()`` is ``kill -9`` (a crash, for
tests); ``restart()`` starts it again on the same port, empty.

With ``die_with_parent=True`` (Linux) the server gets ``PR_SET_PDEATHSIG`` = SIGKILL:
it dies with the thread that started it — for `sara serve`, the main thread or its
supervisor's, which live as long as the stack — so a parent killed with SIGKILL
leaves no ``redis-server`` holding its port.

Nothing here imports the redis client: readiness is a raw ``PING`` on a socket, so
the module can start a server before any client library is loaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

DEFAULT_BINARY = "redis-server"
LOOPBACK = "127.0.0.1"


_PR_SET_PDEATHSIG = 1  # prctl(2)


def parent_death_signal(signum: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks the kernel to send ``signum`` to the child when the
    thread that forked it ends; ``None`` where there is no ``prctl`` (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os._exit(1)

    return preexec


class RedisServerError(RuntimeError):
    """The server could not be started (binary missing, port taken, never ready)."""


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands out to outgoing connections (Linux's default if unknown)."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        low, high = (int(x) for x in text.split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port_block(count: int, host: str = LOOPBACK, *, seed: int | None = None) -> int:
    """The first of ``count`` consecutive TCP ports, all free on ``host`` a moment ago.

    Workers bind base + i as they start, seconds or minutes later. A block taken from
    the kernel's ephemeral range (where ``free_port`` draws) can meanwhile be taken by
    any outgoing connection — a load generator's hundreds of them — and the worker
    then dies on "address already in use"; so the block is sought below that range,
    starting at a random block so that concurrent runs rarely try the same one.
    """
    if count < 1:
        raise ValueError(f"count: expected at least 1 port, got {count!r}")
    low, _ = ephemeral_port_range()
    first, last = 10_000, low - count  # above the well-known and registered-by-habit ports
    if last < first:
        raise OSError(f"no room for {count} ports below the ephemeral range starting at {low}")
    blocks = range(first, last + 1, count)
    start = random.Random(seed).randrange(len(blocks))
    for k in range(len(blocks)):
        base = blocks[(start + k) % len(blocks)]
        if all(_bindable(host, port) for port in range(base, base + count)):
            return base
    raise OSError(f"no {count} consecutive free ports on {host} below {low}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def ping(host: str, port: int, *, timeout_s: float = 0.5) -> bool:
    """True if a Redis server on ``host:port`` answers ``PING`` with ``+PONG``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A ``redis-server`` child process on loopback. Use ``start()``, not the constructor."""

    def __init__(
        self, *, port: int, host: str, binary: str, workdir: Path, die_with_parent: bool = False
    ) -> None:
        self.port = port
        self.host = host
        self.binary = binary
        self.workdir = workdir
        self.die_with_parent = die_with_parent
        self._process: subprocess.Popen[bytes] | None = None
        self._last_status: int | None = None

    @classmethod
    def start(
        cls,
        port: int | None = None,
        *,
        host: str = LOOPBACK,
        binary: str = DEFAULT_BINARY,
        ready_timeout_s: float = 10.0,
        attempts: int = 3,
        die_with_parent: bool = False,
    ) -> RedisServer:
        """Start a server and wait until it answers; raises ``RedisServerError``.

        With ``port=None`` a free port is chosen, and another one tried (up to
        ``attempts`` times) if it was taken in the meantime.
        """
        path = shutil.which(binary)
        if path is None:
            raise RedisServerError(
                f"{binary}: not found on PATH (install the Debian package redis-server)"
            )
        workdir = Path(tempfile.mkdtemp(prefix="sara-redis-"))
        last_error: RedisServerError | None = None
        for _ in range(max(1, attempts) if port is None else 1):
            server = cls(
                port=port or free_port(host),
                host=host,
                binary=path,
                workdir=workdir,
                die_with_parent=die_with_parent,
            )
            try:
                server._spawn(ready_timeout_s)
                return server
            except RedisServerError as exc:
                last_error = exc
        shutil.rmtree(workdir, ignore_errors=True)
        assert last_error is not None
        raise last_error

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def exit_status(self) -> int | None:
        """The status it exited with, while it is not running (``None``: running, or
        stopped through ``stop``/``kill``)."""
        if self._process is not None:
            return self._process.poll()
        return self._last_status

    @property
    def log_path(self) -> Path:
        return self.workdir / f"redis-{self.port}.log"

    def _spawn(self, ready_timeout_s: float) -> None:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--logfile", str(self.log_path),
            "--daemonize", "no",
        ]  # fmt: skip
        # Its own session: a Ctrl-C meant for the parent must not kill Redis before
        # the parent has drained its workers; stop() ends it explicitly.
        self._process = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=parent_death_signal() if self.die_with_parent else None,
        )
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._process = None
                raise RedisServerError(
                    f"redis-server on port {self.port} exited at start: {self._log_tail()}"
                )
            if ping(self.host, self.port):
                return
            time.sleep(0.01)
        self._terminate(timeout_s=2.0)
        raise RedisServerError(
            f"redis-server on port {self.port} not ready after {ready_timeout_s} s: "
            f"{self._log_tail()}"
        )

    def _log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-3:]) or "(empty log)"

    def _terminate(self, *, timeout_s: float) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            self._last_status = None if process is None else process.returncode
            return
        # SHUTDOWN NOSAVE exits at once; SIGTERM waits for the next server tick (100 ms).
        with (
            contextlib.suppress(OSError),
            socket.create_connection((self.host, self.port), timeout=0.5) as sock,
        ):
            sock.sendall(b"SHUTDOWN NOSAVE\r\n")
            sock.recv(64)  # the connection closes as the server exits
        for stop in (process.terminate, process.kill):
            try:
                process.wait(timeout=timeout_s)
                return
            except subprocess.TimeoutExpired:
                stop()
        process.wait()

    def kill(self) -> None:
        """``kill -9`` the server (a crash). ``restart()`` brings it back on the same port."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()

    def restart(self, *, ready_timeout_s: float = 10.0) -> None:
        """Start the server again on the same port (empty: nothing is persisted)."""
        self._terminate(timeout_s=5.0)
        self._spawn(ready_timeout_s)

    def stop(self, *, timeout_s: float = 5.0) -> None:
        """End the server (SIGTERM, SIGKILL after ``timeout_s``) and remove its directory."""
        self._terminate(timeout_s=timeout_s)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __del__(self) -> None:
        # A last resort against a leaked child; stop() is the way to end it.
        with contextlib.suppress(Exception):
            if self._process is not None and self._process.poll() is None:
                self._process.kill()
