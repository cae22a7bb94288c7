"""The supervisor of `sara serve`, with a fake clock and fake children; and the parent
watch, with real processes."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field

from cli.supervision import Supervisor


@dataclass
class FakeChild:
    name: str = "fake"
    running: bool = True
    fail_starts: int = 0  # the next restarts that raise
    restarts: int = 0
    events: list[str] = field(default_factory=list)

    def exit_status(self) -> int | None:
        return None if self.running else 137

    def restart(self) -> None:
        if self.fail_starts:
            self.fail_starts -= 1
            raise RuntimeError("port taken")
        self.restarts += 1
        self.running = True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def supervisor(child: FakeChild, clock: Clock, gave_up: list[str], **kwargs: object) -> Supervisor:
    return Supervisor(
        children=[child],
        on_give_up=gave_up.append,
        clock=clock,
        **kwargs,  # type: ignore[arg-type]
    )


def test_a_child_that_dies_is_restarted_after_its_backoff_and_the_backoff_doubles() -> None:
    child, clock, gave_up = FakeChild(), Clock(), []
    sup = supervisor(child, clock, gave_up, first_backoff_s=0.5)
    child.running = False
    assert sup.check() is None and child.restarts == 0  # noticed, not yet due
    clock.now = 0.4
    sup.check()
    assert child.restarts == 0
    clock.now = 0.5
    sup.check()
    assert child.restarts == 1 and child.running
    child.running = False  # dies again at once: the next wait is twice as long
    sup.check()
    clock.now = 1.4
    sup.check()
    assert child.restarts == 1
    clock.now = 1.5
    sup.check()
    assert child.restarts == 2 and gave_up == []


def test_a_child_that_cannot_be_started_stops_the_stack() -> None:
    child, clock, gave_up = FakeChild(fail_starts=100), Clock(), []
    sup = supervisor(child, clock, gave_up, max_restarts=3, first_backoff_s=1.0)
    child.running = False
    for _ in range(100):
        clock.now += 10.0
        if sup.check() is not None:
            break
    assert len(gave_up) == 1 and "could not be restarted (3 attempts)" in gave_up[0]
    assert sup.gave_up == gave_up[0]


def test_a_child_that_ran_a_healthy_minute_starts_over_with_the_first_backoff() -> None:
    child, clock, gave_up = FakeChild(), Clock(), []
    sup = supervisor(child, clock, gave_up, max_restarts=2, first_backoff_s=1.0)
    for _ in range(10):  # dies after every healthy minute: never given up on
        child.running = False
        sup.check()
        clock.now += 1.0
        sup.check()
        assert child.running
        clock.now += 61.0
        sup.check()
    assert gave_up == [] and child.restarts == 10


def test_a_child_whose_parent_dies_exits_by_itself() -> None:
    # A parent that starts a watching child and is then killed: the child must go.
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', "
            "'import os, time\\nfrom cli.supervision import watch_parent\\n"
            "watch_parent(os.getppid(), interval_s=0.05)\\ntime.sleep(60)'])\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
    )
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    time.sleep(0.5)  # the child is up and watching
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child_pid}/stat") as stat:
                if stat.read().split(")")[-1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"child {child_pid} outlived its parent by 10 s")
