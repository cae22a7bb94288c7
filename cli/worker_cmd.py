"""`sara worker` and `sara router`: the data-plane processes.

    sara worker prefill --redis redis://127.0.0.1:6379 --model DIR --metrics-listen :9400
    sara worker decode  --redis redis://127.0.0.1:6379 --model DIR --metrics-listen :9401
    sara router --listen 127.0.0.1:8000 --redis redis://127.0.0.1:6379 --model DIR

``--model tiny`` means the generated tiny model, written once into ``--model-cache``
(so every process of a deployment loads the same weights and tokenizer). A worker
stops on SIGTERM after draining (finishes what it holds, deregisters), exit 0.
The router imports no torch: it reads the checkpoint's ``config.json`` and
``tokenizer.json`` only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from controller import cli
from queueing.pools import Pool
from workers.protocol import RECLAIM_MIN_IDLE_MS

DEFAULT_MODEL_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sara"
TINY_SEED = 0


def resolve_model(spec: str, cache_dir: Path) -> Path:
    """The checkpoint folder for ``--model``: a folder, or ``tiny`` (generated once)."""
    if spec != "tiny":
        folder = Path(spec)
        if not (folder / "config.json").is_file():
            raise cli.UsageError(f"--model: {spec} is not a checkpoint folder (no config.json)")
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
        raise cli.UsageError("--device: cuda requested but torch sees no CUDA device")
    if args.device == "cpu":
        # One thread per worker: workers share the machine's cores with each other.
        torch.set_num_threads(args.threads)
        tune_cpu_allocator()
    host, port = cli.parse_listen("--metrics-listen", args.metrics_listen, any_port=True)
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
        raise cli.UsageError(f"--{str(exc).split(':')[0].replace('_', '-')}: {exc}") from exc
    model_dir = resolve_model(args.model, Path(args.model_cache))
    try:
        model = load_model(model_dir, device=args.device)
    except CheckpointError as exc:
        raise cli.UsageError(f"--model: {exc}") from exc
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


def cmd_router(args: argparse.Namespace) -> int:
    from controller.http_server import serve_http
    from workers.router import RouterConfig, create_router_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(message)s")
    host, port = cli.parse_listen("--listen", args.listen)
    model_dir = resolve_model(args.model, Path(args.model_cache))
    try:
        model_config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        context = int(model_config["max_position_embeddings"])
        vocab = int(model_config["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise cli.UsageError(f"--model: cannot read {model_dir / 'config.json'}: {exc}") from exc
    tokenize, detokenize = _tokenizer(model_dir)
    try:
        config = RouterConfig(
            redis_url=args.redis,
            max_context_tokens=context,
            model_name=args.model_name or model_dir.resolve().name,
            vocab_size=vocab,
            max_queued_requests=args.max_queued,
            request_timeout_s=args.request_timeout_s,
            key_prefix=args.key_prefix,
        )
    except ValueError as exc:
        raise cli.UsageError(f"--{str(exc).split(':')[0].replace('_', '-')}: {exc}") from exc
    app = create_router_app(
        config, tokenize=tokenize, detokenize=detokenize, new_seed=lambda: secrets.randbits(63)
    )
    serve_http(app, host=host, port=port, access_log=False)
    return 0


def _tokenizer(model_dir: Path) -> tuple[Any, Any]:
    """Text in and out through ``tokenizer.json``; without one, prompts must be token ids."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():

        def no_text(text: str) -> list[int]:
            raise ValueError("this model has no tokenizer.json: send the prompt as token ids")

        return no_text, lambda ids: ""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))

    def tokenize(text: str) -> list[int]:
        return list(tokenizer.encode(text).ids)

    def detokenize(ids: list[int]) -> str:
        return str(tokenizer.decode(ids))

    return tokenize, detokenize


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis", default="redis://127.0.0.1:6379", metavar="URL")
    p.add_argument("--model", default="tiny", metavar="DIR|tiny", help="checkpoint folder")
    p.add_argument(
        "--model-cache",
        default=str(DEFAULT_MODEL_CACHE),
        metavar="DIR",
        help="where --model tiny is generated (default ~/.cache/sara)",
    )
    p.add_argument("--key-prefix", default="sara", help="Redis key prefix of the deployment")


def register(sub: Any) -> None:
    p = sub.add_parser("worker", help="a prefill or decode worker process")
    p.add_argument("pool", choices=[pool.value for pool in Pool])
    _common(p)
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

    p = sub.add_parser("router", help="the OpenAI-compatible router")
    _common(p)
    p.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT")
    p.add_argument("--model-name", help="the id /v1/models shows (default: the folder's name)")
    p.add_argument("--max-queued", type=int, default=1024, help="admission limit (429 beyond)")
    p.add_argument(
        "--request-timeout-s", type=float, default=300.0, help="arrival to last token, seconds"
    )
    p.set_defaults(func=cmd_router)
