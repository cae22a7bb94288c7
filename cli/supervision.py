"""What keeps `sara serve` whole: children that die with it, and children that come back.

Two faults leave a half-dead stack that answers 503 for ever: a child that dies (a
``kill -9`` of Redis, an out-of-memory kill of the router) and is never started
again, and a parent that dies (SIGKILL, or SIGTERM while it is still starting)
leaving its children running with their ports taken. So:

- Every Python child of `sara serve` (router, workers) finds the parent's pid in
  ``$SARA_PARENT_PID`` and runs ``watch_parent``: a daemon thread that exits the
  process once its parent is gone (the child was re-parented). A thread, not a
  parent-death signal: ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the
  child ends, and the local actuator starts workers from the control loop's thread.
- ``redis-server`` cannot run our thread; it gets ``PR_SET_PDEATHSIG`` (SIGKILL), and
  is only ever (re)started from threads that live as long as the stack
  (``workers.redis_util``, ``die_with_parent=True``).
- ``Supervisor`` polls the children it was given; one that exited is logged and
  started again after a backoff (0.5 s doubling to 8 s, reset once it has run a
  minute); after ``max_restarts`` failed starts in a row it gives up, and
  ``on_give_up`` stops the whole stack, which then exits non-zero.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from workers.redis_util import RedisServer

logger = logging.getLogger("sara.supervision")

PARENT_PID_ENV = "SARA_PARENT_PID"
EXIT_PARENT_GONE = 70
WATCH_INTERVAL_S = 0.5


def watch_parent(
    parent_pid: int,
    *,
    interval_s: float = WATCH_INTERVAL_S,
    on_orphaned: Callable[[], None] | None = None,
) -> threading.Thread:
    """A daemon thread that ends this process once ``parent_pid`` is no longer its parent.

    ``on_orphaned`` defaults to ``os._exit(EXIT_PARENT_GONE)``: nothing is left to serve
    (the router and Redis went with the parent), and a clean drain could wait minutes.
    """

    def orphaned() -> None:
        print(
            f"sara: parent process {parent_pid} is gone; exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_PARENT_GONE)

    action = orphaned if on_orphaned is None else on_orphaned

    def run() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        action()

    thread = threading.Thread(target=run, name="sara-parent-watch", daemon=True)
    thread.start()
    return thread


def watch_parent_from_env(environ: dict[str, str] | None = None) -> threading.Thread | None:
    """``watch_parent`` for the pid in ``$SARA_PARENT_PID``, when it is set (a child of
    `sara serve`); ``None`` otherwise. A parent already gone ends the process at once."""
    value = (os.environ if environ is None else environ).get(PARENT_PID_ENV)
    if not value:
        return None
    try:
        parent_pid = int(value)
    except ValueError:
        logger.warning("%s=%r is not a pid: not watching the parent", PARENT_PID_ENV, value)
        return None
    return watch_parent(parent_pid)


class Child(Protocol):
    """A process the supervisor keeps running."""

    name: str

    @property
    def running(self) -> bool: ...

    def exit_status(self) -> int | None: ...

    def restart(self) -> None:
        """Start it again; raises on a failed start (the supervisor retries)."""


@dataclass
class _Watched:
    child: Child
    backoff_s: float
    started_at: float
    failures: int = 0
    due_at: float | None = None  # when the next restart is due (it is down)


@dataclass
class Supervisor:
    """Restarts the children it watches; gives up after ``max_restarts`` failed starts.

    ``clock`` and ``sleep`` are injectable for tests. ``gave_up`` holds the reason once
    it has given up (the stack's exit status is then non-zero).
    """

    children: list[Child]
    on_give_up: Callable[[str], None]
    poll_s: float = 0.25
    first_backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    healthy_after_s: float = 60.0
    max_restarts: int = 8
    clock: Callable[[], float] = time.monotonic
    gave_up: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        now = self.clock()
        self._watched = [_Watched(c, self.first_backoff_s, now) for c in self.children]

    def start(self) -> Supervisor:
        self._thread = threading.Thread(target=self._run, name="sara-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.check() is not None:
                return

    def check(self) -> str | None:
        """One round: restart what is due; the give-up reason, if it came to that."""
        now = self.clock()
        for w in self._watched:
            if w.child.running:
                if w.due_at is None and now - w.started_at >= self.healthy_after_s:
                    w.failures, w.backoff_s = 0, self.first_backoff_s
                continue
            if w.due_at is None:
                logger.warning(
                    "%s exited unexpectedly (status %s); restarting in %.1f s",
                    w.child.name,
                    w.child.exit_status(),
                    w.backoff_s,
                )
                w.due_at = now + w.backoff_s
                continue
            if now < w.due_at:
                continue
            try:
                w.child.restart()
            except Exception as exc:  # a failed start: back off and try again
                w.failures += 1
                logger.warning("%s: restart %d failed: %s", w.child.name, w.failures, exc)
                if w.failures >= self.max_restarts:
                    return self._give_up(
                        f"{w.child.name} could not be restarted ({w.failures} attempts): {exc}"
                    )
                w.backoff_s = min(2 * w.backoff_s, self.max_backoff_s)
                w.due_at = now + w.backoff_s
                continue
            logger.info("%s restarted", w.child.name)
            w.failures += 1
            w.backoff_s = min(2 * w.backoff_s, self.max_backoff_s)
            w.started_at, w.due_at = now, None
            if w.failures > self.max_restarts:
                return self._give_up(
                    f"{w.child.name} keeps exiting ({w.failures} restarts within "
                    f"{self.healthy_after_s:g} s of each other)"
                )
        return None

    def _give_up(self, reason: str) -> str:
        self.gave_up = reason
        logger.error("giving up: %s; stopping the stack", reason)
        self.on_give_up(reason)
        return reason


class ManagedProcess:
    """A child process started from ``argv``, its output appended to ``log``; healthy when
    ``health_url`` answers 200. For the router of `sara serve`."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        *,
        log: os.PathLike[str] | str,
        health_url: str,
        startup_timeout_s: float,
    ) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self.health_url = health_url
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exit_status(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def start(self) -> None:
        """Start it and wait until it is healthy; ``ChildStartError`` otherwise."""
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ChildStartError(
                    f"{self.name} exited with status {self.process.returncode} at start"
                )
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.health_url, timeout=1.0) as reply,
            ):
                if reply.status == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise ChildStartError(
            f"{self.name} did not answer {self.health_url} within {self.startup_timeout_s:.0f} s"
        )

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self, *, timeout_s: float = 10.0) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class ChildStartError(RuntimeError):
    """A supervised child did not start (it exited, or never became healthy)."""


class RedisChild:
    """A private ``RedisServer`` as a supervised child (restarted empty, same port)."""

    name = "redis-server"

    def __init__(self, server: RedisServer) -> None:
        self.server = server

    @property
    def running(self) -> bool:
        return self.server.running

    def exit_status(self) -> int | None:
        return self.server.exit_status()

    def restart(self) -> None:
        self.server.restart()
