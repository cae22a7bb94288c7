"""Run the `sara` CLI in-process and capture what it printed and its exit code."""

from __future__ import annotations

import pytest

from cli.__main__ import main


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `sara ARGV`, whether it returned or exited."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
