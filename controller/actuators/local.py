"""Worker processes on this machine: one command template per pool (``sara serve``).

Each worker is a child process in its own session (so its own process group): a
signal goes to the whole group, so a worker started through a shell wrapper stops
with its children. Scaling down stops the newest workers first, the way a drain
should: SIGTERM at once (the worker finishes what it holds and exits), SIGKILL only
if it is still running ``grace_period_s`` later. ``scale`` never waits for a worker to
exit; the deadlines are enforced by ``reap()``, which ``observe`` and ``scale`` call
and which a background thread calls every ``reap_interval_s`` (pass ``None`` to drive
it yourself). Reaping also collects the exit status, so no worker stays a zombie.

What must stay true: a worker's pid is signalled only while its exit status has not
been collected (after that the pid may belong to someone else), and both happen
under one lock.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import math
import os
import signal
import string
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from controller.actuator import ActuatorError
from controller.observation import PoolObservation
from queueing.pools import Pool

logger = logging.getLogger(__name__)

PLACEHOLDERS = ("index", "pool", "port")
_CLOSE_POLL_S = 0.05
_KILL_WAIT_S = 5.0  # how long close() waits for SIGKILLed workers to be collected


@dataclass(frozen=True, kw_only=True)
class WorkerSlot:
    """One live worker process as the actuator sees it.

    ``index`` is unique among the pool's live workers (draining ones included, so a
    new worker never reuses the port of one that is still shutting down); ``port``
    is the pool's base port plus ``index`` when ``ports`` names one for the pool.
    """

    pool: Pool
    index: int
    port: int | None
    pid: int
    draining: bool


Readiness = Callable[[WorkerSlot], bool]


def validate_template(name: str, argument: str, *, has_port: bool) -> frozenset[str]:
    """The placeholders ``argument`` uses; ``ValueError`` naming ``name`` if it cannot format.

    Allowed: ``{index}``, ``{pool}``, and ``{port}`` when ``has_port``; literal braces
    are doubled, as in ``str.format``.
    """
    try:
        parsed = list(string.Formatter().parse(argument))
    except ValueError as exc:
        raise ValueError(f"{name}: malformed template {argument!r}: {exc}") from None
    fields = {field for _, field, _, _ in parsed if field is not None}
    unknown = sorted(f"{{{field}}}" for field in fields if field not in PLACEHOLDERS)
    if unknown:
        raise ValueError(
            f"{name}: unknown placeholder(s) {', '.join(unknown)} in {argument!r}; "
            f"allowed: {{index}}, {{pool}}, {{port}}"
        )
    if "port" in fields and not has_port:
        raise ValueError(f"{name}: {argument!r} uses {{port}} but no base port is configured")
    try:  # nested or odd format specs only show up when formatting
        argument.format(index=0, pool="prefill", port=1)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"{name}: cannot format {argument!r}: {exc!r}") from None
    return frozenset(fields)


def _render(argument: str, slot: WorkerSlot) -> str:
    return argument.format(index=slot.index, pool=slot.pool.value, port=slot.port)


def http_readiness(url_template: str, *, timeout_s: float = 0.5) -> Readiness:
    """A readiness probe: GET the URL (placeholders as in the commands); 2xx means ready.

    Any other status, a refused connection or a timeout (``timeout_s``, seconds)
    means not ready. A ``{port}`` placeholder needs ``ports`` on the actuator.
    """
    uses_port = "port" in validate_template("url_template", url_template, has_port=True)
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s: must be a finite number > 0, got {timeout_s!r}")

    def probe(slot: WorkerSlot) -> bool:
        if slot.port is None and uses_port:
            raise ValueError(f"url_template: {url_template!r} needs a base port for {slot.pool}")
        url = _render(url_template, slot)
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                return 200 <= int(response.status) < 300
        except (OSError, http.client.HTTPException):  # URLError, HTTPError (non-2xx), timeouts
            return False

    return probe


@dataclass(eq=False, kw_only=True)
class _Worker:
    pool: Pool
    index: int
    port: int | None
    process: subprocess.Popen[bytes]
    kill_at_s: float | None = None  # set when draining: SIGKILL from then on
    killed: bool = False

    def slot(self) -> WorkerSlot:
        return WorkerSlot(
            pool=self.pool,
            index=self.index,
            port=self.port,
            pid=self.process.pid,
            draining=self.kill_at_s is not None,
        )


class LocalProcessActuator:
    """Scales pools of local worker processes.

    ``commands`` maps each pool to an argv template; each argument may contain
    ``{index}``, ``{pool}`` (``"prefill"``/``"decode"``) and, for a pool in ``ports``,
    ``{port}`` (base port + index). Workers also get ``SARA_POOL``,
    ``SARA_WORKER_INDEX`` (and ``SARA_WORKER_PORT``) in their environment, on top of
    this process's environment plus ``env``. With ``log_dir``, a worker's stdout and
    stderr are appended to ``log_dir/<pool>-<index>.log``; otherwise they are
    inherited. ``readiness`` (optional) is asked about each serving worker on
    ``observe``; without it a running worker counts as ready.

    Failure modes: a command that cannot be started raises ``ActuatorError`` naming
    it; a pool without a command raises ``ActuatorError``; bad templates and options
    raise ``ValueError`` here, at construction.
    """

    def __init__(
        self,
        commands: Mapping[Pool, Sequence[str]],
        *,
        grace_period_s: float = 30.0,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        log_dir: Path | None = None,
        ports: Mapping[Pool, int] | None = None,
        readiness: Readiness | None = None,
        reap_interval_s: float | None = 0.2,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not (isinstance(grace_period_s, int | float) and math.isfinite(grace_period_s)):
            raise ValueError(f"grace_period_s: must be a finite number, got {grace_period_s!r}")
        if grace_period_s < 0:
            raise ValueError(f"grace_period_s: must be >= 0, got {grace_period_s!r}")
        if reap_interval_s is not None and not (
            math.isfinite(reap_interval_s) and reap_interval_s > 0
        ):
            raise ValueError(f"reap_interval_s: must be > 0 or None, got {reap_interval_s!r}")
        self._ports: dict[Pool, int] = {}
        for pool, port in (ports or {}).items():
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f"ports[{pool.value}]: must be a TCP port, got {port!r}")
            self._ports[pool] = port
        self._commands: dict[Pool, tuple[str, ...]] = {}
        for pool, command in commands.items():
            if not isinstance(pool, Pool):
                raise ValueError(f"commands: keys must be Pool members, got {pool!r}")
            if isinstance(command, str) or not command:
                raise ValueError(f"commands[{pool.value}]: must be a non-empty argv list")
            for position, argument in enumerate(command):
                validate_template(
                    f"commands[{pool.value}][{position}]", argument, has_port=pool in self._ports
                )
            self._commands[pool] = tuple(command)
        self._grace_period_s = float(grace_period_s)
        self._env = dict(env or {})
        self._cwd = cwd
        self._log_dir = log_dir
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        self._readiness = readiness
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.RLock()
        self._workers: dict[Pool, list[_Worker]] = {pool: [] for pool in self._commands}
        self._closed = False
        self._stop_reaper = threading.Event()
        self._reaper: threading.Thread | None = None
        if reap_interval_s is not None:
            self._reaper = threading.Thread(
                target=self._reap_until_closed,
                args=(reap_interval_s,),
                name="sara-local-reaper",
                daemon=True,
            )
            self._reaper.start()

    # -- the Actuator protocol ------------------------------------------------------

    def observe(self, pool: Pool) -> PoolObservation:
        """Serving workers (running, not draining) and how many of them are ready."""
        with self._lock:
            self._check_usable(pool)
            self._reap_locked()
            serving = [w.slot() for w in self._workers[pool] if w.kill_at_s is None]
        # Probes may take up to their timeout each: never hold the lock across them.
        if self._readiness is None:
            ready = len(serving)
        else:
            ready = sum(1 for slot in serving if self._readiness(slot))
        return PoolObservation(current_replicas=len(serving), ready_replicas=ready)

    def scale(self, pool: Pool, replicas: int) -> None:
        """Start or drain workers until ``replicas`` are serving (never blocks on exits)."""
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ValueError(f"replicas: must be an integer >= 0, got {replicas!r}")
        with self._lock:
            self._check_usable(pool)
            self._reap_locked()
            serving = [w for w in self._workers[pool] if w.kill_at_s is None]
            for _ in range(replicas - len(serving)):
                self._start(pool)
            for worker in reversed(serving[replicas:]):  # newest first
                self._drain(worker)

    # -- lifecycle ------------------------------------------------------------------

    def workers(self, pool: Pool) -> list[WorkerSlot]:
        """The pool's live worker processes, draining ones included, oldest first."""
        with self._lock:
            return [w.slot() for w in self._workers.get(pool, [])]

    def reap(self) -> None:
        """Collect exited workers and SIGKILL draining ones past their grace period."""
        with self._lock:
            self._reap_locked()

    def close(self) -> None:
        """Stop every worker: SIGTERM, SIGKILL after the grace period; wait for all.

        Blocks for at most the grace period (plus a few seconds for SIGKILLed
        processes to be collected). Safe to call more than once.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for workers in self._workers.values():
                for worker in workers:
                    if worker.kill_at_s is None:
                        self._drain(worker)
            deadlines = [w.kill_at_s or 0.0 for ws in self._workers.values() for w in ws]
        self._stop_reaper.set()
        if self._reaper is not None and self._reaper is not threading.current_thread():
            self._reaper.join()
        give_up_at_s = max(deadlines, default=0.0) + _KILL_WAIT_S
        while True:
            with self._lock:
                self._reap_locked()
                left = [w.process.pid for ws in self._workers.values() for w in ws]
            if not left:
                return
            if self._clock() > give_up_at_s:
                logger.error("local actuator: worker pids %s did not exit after SIGKILL", left)
                return
            self._sleep(_CLOSE_POLL_S)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals (call with the lock held) ----------------------------------------

    def _check_usable(self, pool: Pool) -> None:
        if self._closed:
            raise ActuatorError("local actuator: closed")
        if pool not in self._commands:
            raise ActuatorError(f"local actuator: no command configured for pool {pool.value}")

    def _start(self, pool: Pool) -> None:
        workers = self._workers[pool]
        taken = {w.index for w in workers}
        index = next(i for i in range(len(workers) + 1) if i not in taken)
        base_port = self._ports.get(pool)
        port = None if base_port is None else base_port + index
        slot = WorkerSlot(pool=pool, index=index, port=port, pid=0, draining=False)
        argv = [_render(argument, slot) for argument in self._commands[pool]]
        env = {**os.environ, **self._env, "SARA_POOL": pool.value, "SARA_WORKER_INDEX": str(index)}
        if port is not None:
            env["SARA_WORKER_PORT"] = str(port)
        try:
            if self._log_dir is None:
                process = self._popen(argv, env, None)
            else:
                path = self._log_dir / f"{pool.value}-{index}.log"
                with path.open("ab") as log:  # the child keeps its own copy of the descriptor
                    process = self._popen(argv, env, log.fileno())
        except OSError as exc:
            raise ActuatorError(
                f"local actuator: cannot start {pool.value} worker {index} ({argv[0]}): {exc}"
            ) from exc
        workers.append(_Worker(pool=pool, index=index, port=port, process=process))
        logger.info("started %s worker %d (pid %d): %s", pool.value, index, process.pid, argv)

    def _popen(
        self, argv: list[str], env: dict[str, str], log: int | None
    ) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT if log is not None else None,
            env=env,
            cwd=self._cwd,
            start_new_session=True,  # own session and process group: signals reach its children
        )

    def _drain(self, worker: _Worker) -> None:
        worker.kill_at_s = self._clock() + self._grace_period_s
        self._signal(worker, signal.SIGTERM)
        logger.info(
            "draining %s worker %d (pid %d)", worker.pool.value, worker.index, worker.process.pid
        )

    def _signal(self, worker: _Worker, signum: signal.Signals) -> None:
        if worker.process.returncode is not None:  # collected: the pid is no longer ours
            return
        # ProcessLookupError: the group is gone; poll() will collect the leader.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.process.pid, signum)

    def _reap_locked(self) -> None:
        now_s = self._clock()
        for workers in self._workers.values():
            alive: list[_Worker] = []
            for worker in workers:
                code = worker.process.poll()
                if code is None and worker.kill_at_s is not None and now_s >= worker.kill_at_s:
                    if not worker.killed:
                        logger.warning(
                            "%s worker %d (pid %d) still running %.1f s after SIGTERM: SIGKILL",
                            worker.pool.value,
                            worker.index,
                            worker.process.pid,
                            self._grace_period_s,
                        )
                        self._signal(worker, signal.SIGKILL)
                        worker.killed = True
                    code = worker.process.poll()
                if code is None:
                    alive.append(worker)
                elif worker.kill_at_s is None:
                    logger.warning(
                        "%s worker %d (pid %d) exited unexpectedly with status %d",
                        worker.pool.value,
                        worker.index,
                        worker.process.pid,
                        code,
                    )
                else:
                    logger.info(
                        "%s worker %d (pid %d) stopped with status %d",
                        worker.pool.value,
                        worker.index,
                        worker.process.pid,
                        code,
                    )
            workers[:] = alive

    def _reap_until_closed(self, interval_s: float) -> None:
        while not self._stop_reaper.wait(interval_s):
            with self._lock:
                self._reap_locked()
