"""The local-process actuator starts, drains and kills real worker processes.

The workers are small Python scripts: one traps SIGTERM, leaves a marker file and
exits (a worker that drains); one ignores SIGTERM (a worker that hangs), which must
be SIGKILLed after the grace period. Every test ends with no worker process left,
zombies included (checked through /proc).
"""

from __future__ import annotations

import functools
import http.server
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from controller.actuator import Actuator, ActuatorError
from controller.actuators.local import (
    LocalProcessActuator,
    WorkerSlot,
    http_readiness,
    validate_template,
)
from controller.observation import PoolObservation
from queueing.pools import Pool

# No braces in the scripts: every argument of a command is a template.
DRAINS = """
import os, signal, sys, time
out = sys.argv[1]
def on_term(signum, frame):
    open(out + '.drained', 'w').close()
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print('worker', os.environ['SARA_POOL'], os.environ['SARA_WORKER_INDEX'], flush=True)
open(out + '.started', 'w').close()
while True:
    time.sleep(0.02)
"""

HANGS = """
import signal, sys, time
out = sys.argv[1]
signal.signal(signal.SIGTERM, lambda signum, frame: open(out + '.ignored', 'w').close())
open(out + '.started', 'w').close()
while True:
    time.sleep(0.02)
"""


def command(script: str, tmp_path: Path) -> list[str]:
    return [sys.executable, "-c", script, str(tmp_path / "{pool}-{index}")]


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def gone(pid: int) -> bool:
    """Neither running nor a zombie: its exit status was collected."""
    return not Path(f"/proc/{pid}").exists()


def started(tmp_path: Path, name: str) -> bool:
    return (tmp_path / f"{name}.started").exists()


@pytest.fixture
def make() -> Iterator[Callable[..., LocalProcessActuator]]:
    """Builds actuators; closes them afterwards and checks no process outlived them."""
    built: list[LocalProcessActuator] = []
    pids: set[int] = set()

    def build(commands: Mapping[Pool, Sequence[str]], **options: Any) -> LocalProcessActuator:
        actuator = LocalProcessActuator(commands, **options)
        built.append(actuator)
        return actuator

    yield build
    for actuator in built:
        for pool in Pool:
            pids.update(slot.pid for slot in actuator.workers(pool))
        actuator.close()
    for pid in pids:
        wait_for(functools.partial(gone, pid), timeout_s=5.0)


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ("--rank={rank}", "{rank}"),
        ("{}", "{}"),
        ("{0}", "{0}"),
        ("{index.real}", "{index.real}"),
        ("--port={port}", "no base port"),
        ("--index={index", "malformed"),
        ("{index:{width}}", "cannot format"),
    ],
)
def test_a_template_that_cannot_be_filled_in_is_rejected_at_construction(
    argument: str, message: str
) -> None:
    with pytest.raises(ValueError, match="commands\\[prefill\\]\\[1\\]") as caught:
        LocalProcessActuator({Pool.PREFILL: ["worker", argument]}, reap_interval_s=None)
    assert message in str(caught.value)


def test_the_known_placeholders_and_doubled_braces_are_accepted() -> None:
    fields = validate_template("x", "--w={index} --p={pool} --port={port} {{}}", has_port=True)
    assert fields == {"index", "pool", "port"}


@pytest.mark.parametrize("bad", [[], "python worker.py"])
def test_a_command_must_be_a_non_empty_argv_list(bad: object) -> None:
    with pytest.raises(ValueError, match="commands\\[decode\\]"):
        LocalProcessActuator({Pool.DECODE: bad}, reap_interval_s=None)  # type: ignore[dict-item]


def test_scaling_up_starts_workers_with_their_index_and_pool_filled_in(
    tmp_path: Path, make: Callable[..., LocalProcessActuator]
) -> None:
    actuator = make({Pool.PREFILL: command(DRAINS, tmp_path)}, log_dir=tmp_path / "logs")
    as_protocol: Actuator = actuator  # statically: it is an Actuator
    as_protocol.scale(Pool.PREFILL, 3)
    wait_for(lambda: all(started(tmp_path, f"prefill-{i}") for i in range(3)))
    assert actuator.observe(Pool.PREFILL) == PoolObservation(current_replicas=3, ready_replicas=3)
    assert [slot.index for slot in actuator.workers(Pool.PREFILL)] == [0, 1, 2]
    log = tmp_path / "logs" / "prefill-2.log"
    wait_for(lambda: log.exists() and "worker prefill 2" in log.read_text())


def test_scaling_down_drains_the_newest_workers_with_sigterm_and_reaps_them(
    tmp_path: Path, make: Callable[..., LocalProcessActuator]
) -> None:
    actuator = make({Pool.DECODE: command(DRAINS, tmp_path)}, grace_period_s=10.0)
    actuator.scale(Pool.DECODE, 3)
    wait_for(lambda: all(started(tmp_path, f"decode-{i}") for i in range(3)))
    pids = [slot.pid for slot in actuator.workers(Pool.DECODE)]

    actuator.scale(Pool.DECODE, 1)
    assert actuator.observe(Pool.DECODE).current_replicas == 1  # draining ones no longer count
    wait_for(lambda: gone(pids[1]) and gone(pids[2]))
    assert (tmp_path / "decode-1.drained").exists()
    assert (tmp_path / "decode-2.drained").exists()
    assert not (tmp_path / "decode-0.drained").exists()
    assert not gone(pids[0])
    assert [slot.pid for slot in actuator.workers(Pool.DECODE)] == [pids[0]]


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace_period(
    tmp_path: Path, make: Callable[..., LocalProcessActuator]
) -> None:
    grace_s = 0.5
    actuator = make({Pool.PREFILL: command(HANGS, tmp_path)}, grace_period_s=grace_s)
    actuator.scale(Pool.PREFILL, 1)
    wait_for(lambda: started(tmp_path, "prefill-0"))
    (slot,) = actuator.workers(Pool.PREFILL)

    began = time.monotonic()
    actuator.scale(Pool.PREFILL, 0)
    assert time.monotonic() - began < grace_s  # the caller does not wait for the drain
    wait_for(lambda: (tmp_path / "prefill-0.ignored").exists())
    assert not gone(slot.pid)
    wait_for(lambda: gone(slot.pid))  # nobody calls reap(): the background reaper does
    assert time.monotonic() - began >= grace_s
    assert actuator.workers(Pool.PREFILL) == []


def test_without_the_reaper_thread_reap_kills_exactly_at_the_deadline_of_the_injected_clock(
    tmp_path: Path, make: Callable[..., LocalProcessActuator]
) -> None:
    now_s = [100.0]
    actuator = make(
        {Pool.PREFILL: command(HANGS, tmp_path)},
        grace_period_s=30.0,
        reap_interval_s=None,
        clock=lambda: now_s[0],
    )
    actuator.scale(Pool.PREFILL, 1)
    wait_for(lambda: started(tmp_path, "prefill-0"))
    (slot,) = actuator.workers(Pool.PREFILL)
    actuator.scale(Pool.PREFILL, 0)
    wait_for(lambda: (tmp_path / "prefill-0.ignored").exists())

    now_s[0] = 129.9
    actuator.reap()
    time.sleep(0.1)
    assert not gone(slot.pid)
    assert actuator.workers(Pool.PREFILL)[0].draining

    now_s[0] = 130.0

    def reaped() -> bool:
        actuator.reap()
        return gone(slot.pid)

    wait_for(reaped)
    assert actuator.workers(Pool.PREFILL) == []


def test_a_new_worker_never_takes_the_index_of_one_still_draining(
    tmp_path: Path, make: Callable[..., LocalProcessActuator]
) -> None:
    actuator = make({Pool.DECODE: command(HANGS, tmp_path)}, grace_period_s=1.5)
    actuator.scale(Pool.DECODE, 2)
    wait_for(lambda: started(tmp_path, "decode-1"))
    actuator.scale(Pool.DECODE, 1)  # index 1 drains (and hangs)
    actuator.scale(Pool.DECODE, 2)
    slots = actuator.workers(Pool.DECODE)
    assert [(s.index, s.draining) for s in slots] == [(0, False), (1, True), (2, False)]
    assert actuator.observe(Pool.DECODE) == PoolObservation(current_replicas=2, ready_replicas=2)


def test_a_worker_that_dies_is_collected_and_no_longer_counted(
    tmp_path: Path, make: Callable[..., LocalProcessActuator]
) -> None:
    actuator = make({Pool.PREFILL: [sys.executable, "-c", "raise SystemExit(3)"]})
    actuator.scale(Pool.PREFILL, 2)
    (first, second) = actuator.workers(Pool.PREFILL)
    wait_for(lambda: actuator.observe(Pool.PREFILL).current_replicas == 0)
    assert gone(first.pid) and gone(second.pid)


def test_close_stops_every_worker_is_idempotent_and_ends_the_actuator(
    tmp_path: Path, make: Callable[..., LocalProcessActuator]
) -> None:
    commands = {Pool.PREFILL: command(DRAINS, tmp_path), Pool.DECODE: command(HANGS, tmp_path)}
    with make(commands, grace_period_s=0.5) as actuator:
        actuator.scale(Pool.PREFILL, 2)
        actuator.scale(Pool.DECODE, 2)
        wait_for(
            lambda: all(
                started(tmp_path, f"{p}-{i}") for p in ("prefill", "decode") for i in range(2)
            )
        )
        pids = [s.pid for pool in Pool for s in actuator.workers(pool)]
    assert all(gone(pid) for pid in pids)  # close() waited: SIGTERM, then SIGKILL at 0.5 s
    assert (tmp_path / "prefill-0.drained").exists()
    actuator.close()
    with pytest.raises(ActuatorError, match="closed"):
        actuator.scale(Pool.PREFILL, 1)


def test_a_command_that_cannot_start_is_a_permanent_error_naming_it(
    tmp_path: Path, make: Callable[..., LocalProcessActuator]
) -> None:
    missing = str(tmp_path / "no-such-worker")
    actuator = make({Pool.PREFILL: [missing, "--index={index}"]})
    with pytest.raises(ActuatorError, match="no-such-worker"):
        actuator.scale(Pool.PREFILL, 1)
    assert actuator.observe(Pool.PREFILL).current_replicas == 0


def test_a_pool_without_a_command_is_a_permanent_error(
    tmp_path: Path, make: Callable[..., LocalProcessActuator]
) -> None:
    actuator = make({Pool.PREFILL: command(DRAINS, tmp_path)})
    with pytest.raises(ActuatorError, match="decode"):
        actuator.scale(Pool.DECODE, 1)
    with pytest.raises(ValueError, match="replicas"):
        actuator.scale(Pool.PREFILL, -1)


def test_ready_replicas_are_the_serving_workers_the_probe_calls_ready(
    tmp_path: Path, make: Callable[..., LocalProcessActuator]
) -> None:
    asked: list[WorkerSlot] = []

    def probe(slot: WorkerSlot) -> bool:
        asked.append(slot)
        return slot.index == 0

    actuator = make(
        {Pool.DECODE: command(DRAINS, tmp_path)}, ports={Pool.DECODE: 9100}, readiness=probe
    )
    actuator.scale(Pool.DECODE, 2)
    assert actuator.observe(Pool.DECODE) == PoolObservation(current_replicas=2, ready_replicas=1)
    assert [(s.index, s.port) for s in asked] == [(0, 9100), (1, 9101)]


class _Readyz(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/readyz/prefill/0" else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_the_http_probe_calls_a_worker_ready_only_on_a_2xx_answer() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Readyz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        probe = http_readiness("http://127.0.0.1:{port}/readyz/{pool}/{index}", timeout_s=2.0)

        def slot(index: int, port: int | None) -> WorkerSlot:
            return WorkerSlot(pool=Pool.PREFILL, index=index, port=port, pid=1, draining=False)

        assert probe(slot(0, port)) is True
        assert probe(slot(1, port)) is False  # 503
        with pytest.raises(ValueError, match="base port"):
            probe(slot(0, None))
    finally:
        server.shutdown()
        server.server_close()
    assert probe(slot(0, port)) is False  # refused


def test_the_http_probe_rejects_an_unknown_placeholder() -> None:
    with pytest.raises(ValueError, match="\\{host\\}"):
        http_readiness("http://{host}:{port}/readyz")
