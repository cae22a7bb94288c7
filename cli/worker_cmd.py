"""`sara worker`: a prefill or decode worker process of the data plane.

    sara worker prefill --redis redis://127.0.0.1:6379 --model DIR --metrics-listen :9400
    sara worker decode  --redis redis://127.0.0.1:6379 --model DIR --metrics-listen :9401

``--model tiny`` means the generated tiny model, written once into ``--model-cache``
(so every process of a deployment loads the same weights and tokenizer). A worker
stops on SIGTERM after draining (finishes what it holds, deregisters), exit 0.
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


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def cmd_worker(args: argparse.Namespace) -> int:
    import torch

    from workers.checkpoint import CheckpointError, load_model
    from workers.engine import Engine, tune_cpu_allocator
    from workers.protocol import connect
    from workers.transfer import RedisKvTransport
    from workers.worker import WorkerSettings
    from workers.worker_http import WorkerHttpServer
    from workers.worker_metrics import WorkerMetrics

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
    try:
        settings = WorkerSettings(
            worker_id=worker_id,
            pool=pool,
            token_budget=args.token_budget,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            max_running=args.max_running,
            key_prefix=args.key_prefix,
            reclaim_min_idle_ms=args.reclaim_idle_ms,
        )
    except ValueError as exc:
        raise UsageError(f"--{str(exc).split(':')[0].replace('_', '-')}: {exc}") from exc
    model_dir = resolve_model(args.model, Path(args.model_cache))
    try:
        model = load_model(model_dir, device=args.device)
    except CheckpointError as exc:
        raise UsageError(f"--model: {exc}") from exc
    engine = Engine(
        model,
        token_budget=settings.token_budget,
        num_blocks=settings.num_blocks,
        block_size=settings.block_size,
        max_running=settings.max_running,
        keep_finished_kv=True,
    )
    client = connect(args.redis)
    transport: Any = RedisKvTransport(client, key_prefix=f"{settings.key_prefix}:kv")
    metrics = WorkerMetrics(pool)
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
        return int(worker.run(stop))
    finally:
        http.stop()
        for closer in closers:
            closer.close()


def register(sub: Any) -> None:
    p = sub.add_parser("worker", help="a prefill or decode worker process")
    p.add_argument("pool", choices=[pool.value for pool in Pool])
    add_deployment_args(p)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=1, help="cpu: torch threads (default 1)")
    p.add_argument("--metrics-listen", default="127.0.0.1:0", metavar="HOST:PORT")
    p.add_argument("--worker-id", help="unique id (default POOL-HOST-PID)")
    p.add_argument("--token-budget", type=int, default=512, help="tokens per engine step")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV-cache blocks")
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
        help="take over another worker's entry idle this long (it died)",
    )
    p.set_defaults(func=cmd_worker)
