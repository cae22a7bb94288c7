"""An emulated worker's start-up counts from its process's start, as the profile's does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_the_process_age_counts_from_the_process_start_not_from_the_call() -> None:
    # A child that sleeps a known time before it asks: its age is at least that sleep
    # (plus its interpreter's start), and nowhere near a machine's uptime.
    code = (
        "import time\n"
        "time.sleep(1.5)\n"
        "from cli.worker_cmd import process_age_s\n"
        "print(process_age_s())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    age_s = float(done.stdout.strip())
    assert 1.5 <= age_s < 60.0, age_s
