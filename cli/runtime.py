"""What the commands that run the stack share: the model folder, the data-plane
flags, the control loop with its REST API, and this interpreter's `sara`.

Used by `sara controller`, `sara serve`, `sara worker` and `sara router`; heavy
libraries (torch, uvicorn) are imported only inside the functions that need them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cli.common import UsageError

if TYPE_CHECKING:
    from controller.loop import ControlLoop

DEFAULT_MODEL_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sara"
TINY_SEED = 0


def python_cli(*args: str) -> list[str]:
    """Run a `sara` subcommand with this interpreter (works without the entry point)."""
    return [sys.executable, "-m", "cli", *args]


def resolve_model(spec: str, cache_dir: Path) -> Path:
    """The checkpoint folder for ``--model``: a folder, or ``tiny`` (generated once)."""
    if spec != "tiny":
        folder = Path(spec)
        if not (folder / "config.json").is_file():
            raise UsageError(f"--model: {spec} is not a checkpoint folder (no config.json)")
        return folder
    folder = cache_dir / f"tiny-seed{TINY_SEED}"
    if (folder / "config.json").is_file():
        return folder
    from workers.checkpoint import write_tiny_checkpoint

    cache_dir.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed: processes starting together never see half a checkpoint.
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=cache_dir))
    try:
        write_tiny_checkpoint(tmp / "tiny", seed=TINY_SEED)
        try:
            os.rename(tmp / "tiny", folder)
        except OSError:
            if not (folder / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def add_deployment_args(p: argparse.ArgumentParser) -> None:
    """The flags every data-plane process of one deployment shares (worker, router)."""
    p.add_argument("--redis", default="redis://127.0.0.1:6379", metavar="URL")
    p.add_argument("--model", default="tiny", metavar="DIR|tiny", help="checkpoint folder")
    p.add_argument(
        "--model-cache",
        default=str(DEFAULT_MODEL_CACHE),
        metavar="DIR",
        help="where --model tiny is generated (default ~/.cache/sara)",
    )
    p.add_argument("--key-prefix", default="sara", help="Redis key prefix of the deployment")


def run_with_api(loop: ControlLoop, *, token: str | None, host: str, port: int) -> None:
    """The control loop in a thread, its REST API in this one, until SIGTERM/SIGINT."""
    from controller.api import create_app
    from controller.http_server import serve_http
    from controller.profiles import ProfileSources

    # A profile written over the API: a built-in, or a file where sara keeps the
    # profiles it measured, or beside the one the controller was started with.
    profiles = ProfileSources(directories=(DEFAULT_MODEL_CACHE / "profiles",)).with_file_of(
        loop.store.load().config.profile
    )
    app = create_app(
        store=loop.store,
        status=loop.status,
        decisions=loop.decisions,
        ready=loop.readiness,
        metrics=loop.metrics.exposition,
        api_token=token,
        profiles=profiles,
    )
    stop = threading.Event()
    worker = threading.Thread(target=loop.run, args=(stop,), name="sara-control-loop", daemon=True)
    worker.start()
    scrape = getattr(loop.source, "scrape", None)
    if callable(scrape):
        # The scrape source needs snapshots between ticks (about one a second) for the
        # burst window and the inter-arrival SCV; Prometheus keeps its own history.
        threading.Thread(
            target=_scrape_every, args=(scrape, stop, 1.0), name="sara-scrape", daemon=True
        ).start()
    try:
        serve_http(app, host=host, port=port)
    finally:
        stop.set()
        worker.join(timeout=10)


def _scrape_every(scrape: Any, stop: threading.Event, period_s: float) -> None:
    while not stop.wait(period_s):
        scrape()
