"""`sara worker`: a prefill or decode worker process of the data plane.

    sara worker prefill --redis redis://127.0.0.1:6379 --model DIR --metrics-listen :9400
    sara worker decode  --redis redis://127.0.0.1:6379 --model DIR --metrics-listen :9401

    sara worker prefill --engine emulated --profile llama-3-8b@h100-sxm --model DIR ...
    sara worker decode --engine emulated ... --metrics-flavor vllm


``--model tiny`` means the generated tiny model, written once into ``--model-cache``
(so every process of a deployment loads the same weights and tokenizer). With
``--engine emulated`` no model runs: ``workers.emulated`` times every step by
``--profile`` (``--model`` is read only for its ``config.json``: vocabulary and
context), and the worker waits the profile's startup time (``--startup-s``) before
it serves. A worker stops on SIGTERM after draining (finishes what it holds,
deregisters), exit 0.

``--metrics-flavor vllm|sglang`` adds, beside its ``sara_worker_*`` metrics, that
engine's metric families (``vllm,sglang``: both) fed by the same measurements
(``workers.engine_metrics``), labelled with ``--served-model-name`` (default: the
model folder's name), so that the controller's ``vllm`` and ``sglang`` flavours can be
run against SARA's own pools.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from cli import common
from cli.common import UsageError
from cli.runtime import add_deployment_args, resolve_model
from queueing.pools import Pool
from workers.protocol import RECLAIM_MIN_IDLE_MS

DEFAULT_KV_SCALE = 1.0 / 256  # workers.emulated.DEFAULT_KV_SCALE (the parser imports no torch)


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


TORCH_MISSING = (
    "torch is not installed: pip install -e '.[workers]' (both engines need it: the "
    "emulated one for the KV tensors it hands off)"
)


def require_torch() -> None:
    """``UsageError`` in one line when torch is missing (the workers' one heavy need)."""
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError as exc:
        raise UsageError(TORCH_MISSING) from exc


def cmd_worker(args: argparse.Namespace) -> int:
    profile = _emulated_profile(args) if args.engine == "emulated" else None
    require_torch()
    import torch

    from workers.engine import tune_cpu_allocator
    from workers.protocol import connect
    from workers.transfer import RedisKvTransport
    from workers.worker import WorkerSettings
    from workers.worker_http import WorkerHttpServer

    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {args.pool} %(message)s", stream=sys.stderr
    )
    pool = Pool(args.pool)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device: cuda requested but torch sees no CUDA device")
    if args.device == "cpu":
        # One thread per worker: workers share the machine's cores with each other.
        torch.set_num_threads(args.threads)
        tune_cpu_allocator()
    host, port = common.parse_listen("--metrics-listen", args.metrics_listen, any_port=True)
    worker_id = args.worker_id or f"{pool.value}-{socket.gethostname()}-{os.getpid()}"
    num_blocks = args.num_blocks
    if num_blocks is None:  # the emulated cache is the profile's: what the model assumes
        num_blocks = 1024 if profile is None else profile.kv_capacity_tokens // args.block_size
    try:
        settings = WorkerSettings(
            worker_id=worker_id,
            pool=pool,
            token_budget=args.token_budget,
            num_blocks=num_blocks,
            block_size=args.block_size,
            max_running=args.max_running,
            key_prefix=args.key_prefix,
            reclaim_min_idle_ms=args.reclaim_idle_ms,
        )
    except ValueError as exc:
        raise UsageError(f"--{str(exc).split(':')[0].replace('_', '-')}: {exc}") from exc
    model_dir = resolve_model(args.model, Path(args.model_cache))
    metrics = _worker_metrics(args, pool, model_dir)
    engine = (
        _torch_engine(args, model_dir, settings)
        if profile is None
        else _emulated_engine(args, model_dir, settings, profile, metrics)
    )
    client = connect(args.redis)
    transport: Any = RedisKvTransport(client, key_prefix=f"{settings.key_prefix}:kv")
    extra: dict[str, Any] = {}
    closers: list[Any] = []
    if args.kv_transport == "torch":
        # NCCL between GPUs, gloo on CPU; the decode worker pulls (workers/kv_pull.py).
        from workers.kv_pull import KvPullClient, KvPullServer
        from workers.protocol import KeySpace
        from workers.worker_metrics import TransferDirection

        keys = KeySpace(settings.key_prefix)
        if pool is Pool.PREFILL:

            def sent(nbytes: int, seconds: float) -> None:
                metrics.transferred(
                    transport=server.transport.value,
                    direction=TransferDirection.SEND,
                    nbytes=nbytes,
                    duration_s=seconds,
                )

            server = KvPullServer(
                connect(args.redis), worker_id=worker_id, keys=keys, device=args.device,
                host=args.advertise_host, on_transfer=sent,
            ).start()  # fmt: skip
            transport = server
            closers.append(server)
        else:
            pull = KvPullClient(
                connect(args.redis), worker_id=worker_id, keys=keys, device=args.device,
                host=args.advertise_host,
            )  # fmt: skip
            extra["pull"] = pull
            closers.append(pull)
    worker_cls: Any
    if pool is Pool.PREFILL:
        from workers.prefill_worker import PrefillWorker as worker_cls
    else:
        from workers.decode_worker import DecodeWorker as worker_cls
    stop = _stop_on_signals()
    holder: dict[str, Any] = {}
    http = WorkerHttpServer(
        host=host,
        port=port,
        metrics=metrics.exposition,
        readiness=lambda: holder["worker"].readiness(),
    )
    worker = worker_cls(
        settings,
        engine=engine,
        transport=transport,
        client=client,
        metrics=metrics,
        address=http.address,
        **extra,
    )
    holder["worker"] = worker
    http.start()
    try:
        startup_s = _startup_s(args, profile)
        if startup_s > 0:
            # The profile's start-up runs from the scale-up that launched the process to
            # its first served request, so the interpreter's start and the imports are
            # part of it: waiting the whole start-up after them made a 5-s start-up
            # last 10 s live where the simulator's lasted 5.
            spent_s = process_age_s()
            logging.info(
                "emulating the profile's startup: %.1f s (%.1f s of it starting the process)",
                startup_s,
                min(spent_s, startup_s),
            )
            if spent_s < startup_s and stop.wait(startup_s - spent_s):
                return 0  # stopped while starting: nothing held, nothing to drain
        return int(worker.run(stop))
    finally:
        http.stop()
        for closer in closers:
            closer.close()


def _worker_metrics(args: argparse.Namespace, pool: Pool, model_dir: Path) -> Any:
    """The worker's metrics in ``--metrics-flavor`` (the engine's labels need the
    served model's name and context, from its ``config.json``)."""
    import json

    from controller.config import MetricsFlavor
    from workers.engine_metrics import EngineIdentity
    from workers.worker_metrics import WorkerMetrics

    flavors = tuple(MetricsFlavor(f) for f in args.metrics_flavor)
    if set(flavors) == {MetricsFlavor.SARA}:
        return WorkerMetrics(pool)
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        context = config["max_position_embeddings"]
    except (OSError, ValueError, KeyError) as exc:
        raise UsageError(f"--model: no max_position_embeddings in its config.json: {exc}") from exc
    name = args.served_model_name or model_dir.name
    try:
        identity = EngineIdentity(model_name=name, max_model_len=context, pool=pool)
    except ValueError as exc:
        option = "served-model-name" if str(exc).startswith("model_name") else "model"
        raise UsageError(f"--{option}: {exc}") from exc
    return WorkerMetrics(pool, flavors=flavors, identity=identity)


def _flavors(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    wrong = [name for name in names if name not in ("sara", "vllm", "sglang")]
    if not names or wrong:
        raise argparse.ArgumentTypeError(
            f"expected sara, vllm or sglang (comma-separated), got {text!r}"
        )
    return names


def _torch_engine(args: argparse.Namespace, model_dir: Path, settings: Any) -> Any:
    from workers.checkpoint import CheckpointError, load_model
    from workers.engine import Engine

    try:
        model = load_model(model_dir, device=args.device)
    except CheckpointError as exc:
        raise UsageError(f"--model: {exc}") from exc
    return Engine(
        model,
        token_budget=settings.token_budget,
        num_blocks=settings.num_blocks,
        block_size=settings.block_size,
        max_running=settings.max_running,
        keep_finished_kv=True,
    )


def _emulated_profile(args: argparse.Namespace) -> Any:
    from controller.profiles import load_profile
    from queueing.profile import ProfileError

    if not args.profile:
        raise UsageError("--profile: --engine emulated needs an iteration-time profile")
    try:
        return load_profile(args.profile)
    except (OSError, ProfileError) as exc:
        raise UsageError(f"--profile: {exc}") from exc


def _emulated_engine(
    args: argparse.Namespace, model_dir: Path, settings: Any, profile: Any, metrics: Any
) -> Any:
    import json

    from prometheus_client import Counter

    from workers.emulated import EmulatedEngine, EmulatedModel

    profile_s = Counter(
        "sara_worker_emulated_profile_seconds",
        "Emulated engine: the profile's time of the steps run (iteration seconds over it "
        "is the emulation's timing accuracy).",
        ["pool"],
        registry=metrics.registry,
    ).labels(settings.pool.value)
    overlap_s = Counter(
        "sara_worker_emulated_overlap_seconds",
        "Emulated engine: the worker's work between back-to-back steps that the emulated "
        "accelerator overlapped (iteration + overlap seconds = the steps' cadence).",
        ["pool"],
        registry=metrics.registry,
    ).labels(settings.pool.value)

    def stepped(step_s: float, overlapped_s: float) -> None:
        profile_s.inc(step_s)
        overlap_s.inc(overlapped_s)

    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        model = EmulatedModel.from_config(config)
        return EmulatedEngine(
            profile,
            model=model,
            token_budget=settings.token_budget,
            num_blocks=settings.num_blocks,
            block_size=settings.block_size,
            max_running=settings.max_running,
            keep_finished_kv=True,
            kv_scale=args.kv_scale,
            on_step=stepped,
        )
    except (OSError, ValueError) as exc:
        field = "kv-scale" if str(exc).startswith("kv_scale") else "model"
        raise UsageError(f"--{field}: {exc}") from exc


def process_age_s() -> float:
    """Seconds since this process started (Linux: ``/proc/self/stat``'s start time
    against the uptime); 0 where the system does not say."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            # Fields after the command's closing parenthesis start at field 3; the
            # start time (clock ticks after boot) is field 22.
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as uptime:
            uptime_s = float(uptime.read().split()[0])
        return max(0.0, uptime_s - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def _startup_s(args: argparse.Namespace, profile: Any) -> float:
    """Seconds an emulated worker waits before serving: ``--startup-s``, else the profile's."""
    if profile is None:
        return 0.0
    value = profile.startup_s if args.startup_s is None else args.startup_s
    if not value >= 0:
        raise UsageError(f"--startup-s: expected seconds >= 0, got {value}")
    return float(value)


def register(sub: Any) -> None:
    p = sub.add_parser("worker", help="a prefill or decode worker process")
    p.add_argument("pool", choices=[pool.value for pool in Pool])
    add_deployment_args(p)
    p.add_argument(
        "--engine",
        choices=("torch", "emulated"),
        default="torch",
        help="torch: run --model; emulated: time every step by --profile (no model)",
    )
    p.add_argument("--profile", metavar="NAME|FILE", help="emulated: the iteration-time profile")
    p.add_argument(
        "--kv-scale",
        type=float,
        default=DEFAULT_KV_SCALE,
        help=f"emulated: KV bytes handed off per profile byte (default {DEFAULT_KV_SCALE:g})",
    )
    p.add_argument(
        "--startup-s", type=float, help="emulated: seconds before serving (default: the profile's)"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=1, help="cpu: torch threads (default 1)")
    p.add_argument("--metrics-listen", default="127.0.0.1:0", metavar="HOST:PORT")
    p.add_argument(
        "--metrics-flavor",
        type=_flavors,
        default=("sara",),
        metavar="sara|vllm|sglang[,...]",
        help="also export these engines' metrics from the same measurements (default: sara "
        "only; several, comma-separated, to compare the controller's flavours on one stack)",
    )
    p.add_argument(
        "--served-model-name",
        help="vllm/sglang flavours: the model_name label (default: the model folder's name)",
    )
    p.add_argument("--worker-id", help="unique id (default POOL-HOST-PID)")
    p.add_argument("--token-budget", type=int, default=512, help="tokens per engine step")
    p.add_argument(
        "--num-blocks",
        type=int,
        help="KV-cache blocks (default 1024; emulated: the profile's kv_capacity_tokens)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-running", type=int, default=64, help="sequences per batch")
    p.add_argument(
        "--kv-transport",
        choices=("redis", "torch"),
        default="redis",
        help="KV to decode: through Redis, or a torch.distributed link (NCCL/gloo)",
    )
    p.add_argument(
        "--advertise-host",
        default="127.0.0.1",
        help="torch transport: this worker's address as its peers reach it (pod IP)",
    )
    p.add_argument(
        "--reclaim-idle-ms",
        type=int,
        default=RECLAIM_MIN_IDLE_MS,
        help="take over the entries of a worker gone from the registry once idle this long",
    )
    p.set_defaults(func=cmd_worker)
