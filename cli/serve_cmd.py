"""`sara serve`: the whole stack on this machine.

    sara serve [--listen 127.0.0.1:8000] [--model DIR|tiny] [--redis URL]
               [--api-listen 127.0.0.1:8080] [--config FILE] [--profile FILE|NAME]

Starts, in this order: a private ``redis-server`` on a free loopback port (unless
``--redis`` names one), the router (a child process), and the controller in this
process: the control loop with the local actuator, which starts the prefill and
decode workers (child processes, one torch thread each, metrics on consecutive
ports from ``--prefill-port``/``--decode-port``), and the controller's REST API.
The controller observes by scraping the router's ``/metrics`` (no Prometheus
needed). On SIGINT/SIGTERM everything stops in reverse order: the workers drain
(SIGTERM, then SIGKILL after the grace period), the router stops, Redis stops.

It supervises what it starts (``cli.supervision``): a private Redis or the router
that exits is logged and started again with a backoff (the workers and the router
reconnect by themselves), a worker that exits is replaced by the controller's next
tick, and a child that cannot be brought back stops the whole stack with exit
status 1 — never a half-dead stack that answers 503 for ever. Its children die
with it, whenever it dies: SIGTERM at any phase of start-up or shut-down runs the
same clean-up, and after a SIGKILL the children end by themselves (a parent watch
in each Python child, a parent-death signal on Redis).

A note on latency: every hop is a loopback TCP connection; redis-py and uvicorn
disable Nagle's algorithm (TCP_NODELAY) on their sockets, so small messages such
as one token are not held back waiting for an ACK.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cli import common
from cli.common import UsageError
from cli.runtime import DEFAULT_MODEL_CACHE, python_cli, resolve_model, run_with_api
from cli.supervision import (
    PARENT_PID_ENV,
    ChildStartError,
    ManagedProcess,
    RedisChild,
    Supervisor,
)
from cli.worker_cmd import DEFAULT_KV_SCALE, require_torch
from controller.closing import close_if_closable
from controller.config import ConfigError, ControllerConfig
from controller.loop import ControlLoop
from controller.metrics import ControllerMetrics
from controller.store import FileConfigStore
from queueing.pools import Pool

logger = logging.getLogger("sara.serve")

CONFIG_FILE = "config.json"
STARTUP_TIMEOUT_S = 60.0


def worker_command(
    pool: Pool, *, redis_url: str, model_dir: Path, args: Any, profile: str | None = None
) -> list[str]:
    """The local actuator's argv template of one pool's worker (``{port}``, ``{index}``);
    with ``--engine emulated``, ``profile`` times the workers' steps."""
    engine: list[str] = []
    if args.engine == "emulated":
        assert profile is not None
        engine = ["--engine", "emulated", "--profile", profile, "--kv-scale", str(args.kv_scale)]
        if args.startup_s is not None:
            engine += ["--startup-s", str(args.startup_s)]
    return python_cli(
        "worker",
        pool.value,
        "--redis",
        redis_url,
        "--model",
        str(model_dir),
        "--metrics-listen",
        "127.0.0.1:{port}",
        "--worker-id",
        f"{pool.value}-{{index}}-{int(time.time())}",
        "--token-budget",
        str(args.token_budget),
        "--max-running",
        str(args.max_running),
        "--kv-transport",
        args.kv_transport,
        *engine,
        *([] if args.num_blocks is None else ["--num-blocks", str(args.num_blocks)]),
    )


@contextlib.contextmanager
def _redis(url: str | None, children: list[Any]) -> Iterator[str]:
    if url is not None:
        yield url
        return
    from workers.redis_util import RedisServer, RedisServerError

    try:
        server = RedisServer.start(die_with_parent=True)
    except RedisServerError as exc:
        raise UsageError(f"--redis: no URL given and {exc}") from exc
    children.append(RedisChild(server))
    try:
        logger.info("redis on %s", server.url)
        yield server.url
    finally:
        server.stop()


def served_model_name(args: argparse.Namespace, model_dir: Path) -> str:
    """What clients name the model: ``--served-model-name``, else what ``--model`` was
    given (``tiny``, not the generated folder's name; a folder by its last component);
    with ``--engine emulated`` (no ``--model``) the emulated model folder's name."""
    from cli.router_cmd import default_model_name

    if args.served_model_name:
        return str(args.served_model_name)
    return model_dir.name if args.engine == "emulated" else default_model_name(args.model)


@contextlib.contextmanager
def _router(
    args: argparse.Namespace, redis_url: str, model_dir: Path, log: Path, children: list[Any]
) -> Iterator[str]:
    host, port = common.parse_listen("--listen", args.listen)
    url = f"http://{host}:{port}"
    router = ManagedProcess(
        "the router",
        python_cli(
            "router",
            "--listen",
            f"{host}:{port}",
            "--redis",
            redis_url,
            "--model",
            str(model_dir),
            "--request-timeout-s",
            str(args.request_timeout_s),
            "--model-name",
            served_model_name(args, model_dir),
        ),
        log=log,
        health_url=f"{url}/healthz",
        startup_timeout_s=STARTUP_TIMEOUT_S,
    )
    try:
        try:
            router.start()
        except ChildStartError as exc:
            raise UsageError(str(exc)) from exc
        children.append(router)
        logger.info("router on %s", url)
        yield url
    finally:
        router.stop()


@contextlib.contextmanager
def _supervised(children: list[Any]) -> Iterator[Supervisor]:
    """Restart ``children`` (filled in as they start) until the block ends; giving up
    stops the stack (SIGTERM to this process: the API server returns, clean-up runs)."""
    supervisor = Supervisor(
        children=children, on_give_up=lambda reason: os.kill(os.getpid(), signal.SIGTERM)
    )
    supervisor.start()
    try:
        yield supervisor
    finally:
        supervisor.stop()


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    # Until the API server takes SIGTERM over (and after it gives it back), SIGTERM
    # unwinds like Ctrl-C: every started child is stopped by the finally blocks.
    raise SystemExit(128 + signum)


def _store(args: argparse.Namespace, state_dir: Path) -> FileConfigStore:
    """The config: ``--config`` (or the defaults) with the command line's overrides."""
    try:
        base = (
            json.loads(Path(args.config).read_text(encoding="utf-8"))
            if args.config
            else ControllerConfig().to_dict()
        )
        if args.profile:
            base["profile"] = args.profile
        if args.ttft_p99_s is not None:
            base["slo"]["ttft_p99_s"] = args.ttft_p99_s
        if args.tpot_p99_s is not None:
            base["slo"]["tpot_p99_s"] = args.tpot_p99_s
        config = ControllerConfig.from_dict(base)
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"--config: {exc}") from exc
    except ConfigError as exc:
        raise UsageError(f"--config: {exc}") from exc
    state_dir.mkdir(parents=True, exist_ok=True)
    store = FileConfigStore(state_dir / CONFIG_FILE)
    store.replace(config, expected_version=None)  # this run's config wins over a stale one
    return store


def _config_sets_profile(config_file: str | None) -> bool:
    if config_file is None:
        return False
    try:
        document = json.loads(Path(config_file).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return True  # _store reports the error
    return not isinstance(document, dict) or "profile" in document


def _machine_key() -> str:
    """What the iteration times of a CPU worker depend on besides the model."""
    import hashlib
    import platform

    import torch

    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    text = f"{cpu}|{os.cpu_count()}|torch {torch.__version__}|1 thread"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _measured_profile(model_dir: Path, cache_dir: Path) -> Path:
    """The iteration-time profile of ``model_dir`` on this machine's CPU, measured once
    (about 30 s, the workers' one torch thread) and cached by model and machine: the
    controller plans with the engine it runs, not with a GPU's roofline."""
    path = cache_dir / f"{model_dir.name}-cpu-{_machine_key()}.json"
    if path.is_file():
        logger.info("profile of %s on this CPU: %s (cached)", model_dir.name, path)
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    logger.info("measuring the iteration-time profile of %s on this CPU (about 30 s)", model_dir)
    # The live demo's quick grid: the shapes one worker of this stack runs.
    grid = ["--budget-grid", "0,64,256", "--batch-grid", "0,8,32", "--context-grid", "256,1024"]
    done = subprocess.run(
        python_cli(
            *("profile", "--model", str(model_dir), "--device", "cpu", "--out", str(tmp)),
            *("--repeats", "5", "--refine", "1", *grid),
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise UsageError(f"--profile: not given, and measuring one failed: {tail}")
    os.replace(tmp, path)  # whole or not at all, for the next start
    logger.info("profile of %s on this CPU: %s", model_dir.name, path)
    return path


def _emulated_model(profile_spec: str, state_dir: Path) -> Path:
    """A weightless model folder for ``--engine emulated``: the ``config.json`` the
    router and the workers read (vocabulary, context), named after the profile."""
    from controller.profiles import load_profile
    from queueing.profile import ProfileError
    from workers.emulated import model_card

    try:
        profile = load_profile(profile_spec)
    except (OSError, ProfileError) as exc:
        raise UsageError(f"--profile: {exc}") from exc
    folder = (state_dir / f"emulated-{profile.name.replace('@', '-')}").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model_card(profile), indent=1) + "\n")
    return folder


def cmd_serve(args: argparse.Namespace) -> int:
    from controller.actuators.local import LocalProcessActuator, http_readiness
    from controller.api import load_api_token
    from controller.sources.scrape import ScrapeSource

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape otherwise
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # the children watch this process
    state_dir = Path(args.state_dir)
    if args.engine == "torch" and not args.profile and not _config_sets_profile(args.config):
        # No profile named: plan with this engine's own, not a GPU's it does not run on.
        require_torch()
        measured = resolve_model(args.model, Path(args.model_cache)).resolve()
        args.profile = str(_measured_profile(measured, Path(args.model_cache) / "profiles"))
    store = _store(args, state_dir)
    config = store.load().config
    api_host, api_port = common.parse_listen("--api-listen", args.api_listen)
    try:
        token = load_api_token(file=args.api_token_file)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--api-token-file: {exc}") from exc
    if args.engine == "emulated":
        model_dir = _emulated_model(config.profile, state_dir)
    else:
        require_torch()
        model_dir = resolve_model(args.model, Path(args.model_cache)).resolve()
    log_dir = state_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    children: list[Any] = []
    # The supervisor is entered last, so it stops first: what the clean-up stops
    # must not be restarted.
    with (
        _redis(args.redis, children) as redis_url,
        _router(args, redis_url, model_dir, log_dir / "router.log", children) as router_url,
        _supervised(children) as supervisor,
    ):
        actuator = LocalProcessActuator(
            {
                pool: worker_command(
                    pool,
                    redis_url=redis_url,
                    model_dir=model_dir,
                    args=args,
                    profile=config.profile,
                )
                for pool in Pool
            },
            ports={Pool.PREFILL: args.prefill_port, Pool.DECODE: args.decode_port},
            readiness=http_readiness("http://127.0.0.1:{port}/readyz"),
            log_dir=log_dir,
            grace_period_s=args.grace_period_s,
        )
        try:
            for pool, limits in ((Pool.PREFILL, config.prefill), (Pool.DECODE, config.decode)):
                actuator.scale(pool, max(limits.min_replicas, args.initial_replicas))
            source: Any = ScrapeSource(
                [f"{router_url}/metrics"],
                window_s=config.window_s,
                burst_window_s=config.burst_window_s,
                scv_span_s=config.lead_time.pool_s,
                clock=time.time,
            )
            if args.prometheus:  # a Prometheus that scrapes the router keeps the history
                from controller.sources.prometheus import PrometheusSource

                source = PrometheusSource(
                    args.prometheus,
                    window_s=config.window_s,
                    burst_window_s=config.burst_window_s,
                    scv_step_s=min(5.0, config.burst_window_s),
                    scv_span_s=config.lead_time.pool_s,
                )
            metrics = ControllerMetrics()
            loop = ControlLoop(
                store=store,
                source=source,
                actuator=actuator,
                metrics=metrics,
                state_dir=state_dir,
            )
            print(
                f"sara serve: router {router_url}  controller http://{api_host}:{api_port}  "
                f"redis {redis_url}  logs {log_dir}",
                file=sys.stderr,
                flush=True,
            )
            run_with_api(loop, token=token, host=api_host, port=api_port)
        finally:
            close_if_closable(actuator)
    if supervisor.gave_up is not None:
        print(f"sara serve: stopped: {supervisor.gave_up}", file=sys.stderr, flush=True)
        return 1
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="the whole stack on this machine")
    p.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT", help="router")
    p.add_argument("--api-listen", default="127.0.0.1:8080", metavar="HOST:PORT", help="REST API")
    p.add_argument("--redis", metavar="URL", help="use this Redis (default: start a private one)")
    p.add_argument("--model", default="tiny", metavar="DIR|tiny")
    p.add_argument("--model-cache", default=str(DEFAULT_MODEL_CACHE), metavar="DIR")
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model id of the API (default: --model as given; emulated: the profile's)",
    )
    p.add_argument("--state-dir", default=".sara/serve", metavar="DIR")
    p.add_argument("--config", metavar="FILE", help="controller config JSON (GET /v1/config)")
    p.add_argument(
        "--profile",
        metavar="FILE|NAME",
        help="iteration-time profile (default: the config's; without one in the config, "
        "--engine torch measures the model's on this CPU once and caches it)",
    )
    p.add_argument(
        "--prometheus",
        metavar="URL",
        help="observe through this Prometheus, which scrapes the router (default: scrape it)",
    )
    p.add_argument("--ttft-p99-s", type=float, help="TTFT SLO (overrides the config)")
    p.add_argument("--tpot-p99-s", type=float, help="TPOT SLO (overrides the config)")
    p.add_argument("--initial-replicas", type=int, default=1, help="workers per pool at start")
    p.add_argument("--prefill-port", type=int, default=9400, help="first prefill metrics port")
    p.add_argument("--decode-port", type=int, default=9500, help="first decode metrics port")
    p.add_argument("--token-budget", type=int, default=512, help="workers: tokens per step")
    p.add_argument(
        "--num-blocks", type=int, help="workers: KV blocks (default 1024; emulated: the profile's)"
    )
    p.add_argument("--max-running", type=int, default=64, help="workers: sequences per batch")
    p.add_argument(
        "--kv-transport",
        choices=("redis", "torch"),
        default="redis",
        help="workers: KV through Redis or a torch.distributed link (gloo on CPU)",
    )
    p.add_argument(
        "--engine",
        choices=("torch", "emulated"),
        default="torch",
        help="workers: run --model, or emulate an accelerator timed by the config's profile",
    )
    p.add_argument(
        "--kv-scale",
        type=float,
        default=DEFAULT_KV_SCALE,
        help="emulated: KV bytes handed off per profile byte",
    )
    p.add_argument(
        "--startup-s", type=float, help="emulated: worker startup (default: the profile's)"
    )
    p.add_argument("--grace-period-s", type=float, default=60.0, help="drain time before SIGKILL")
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="router timeout")
    p.add_argument("--api-token-file", help="bearer token for mutations (else $SARA_API_TOKEN)")
    p.set_defaults(func=cmd_serve)
