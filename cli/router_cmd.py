"""`sara router`: the OpenAI-compatible router of the data plane.

    sara router --listen 127.0.0.1:8000 --redis redis://127.0.0.1:6379 --model DIR

The router imports no torch: it reads the checkpoint's ``config.json`` and
``tokenizer.json`` only (``--model tiny`` is generated once into ``--model-cache``),
and the chat template (``workers.router_chat``: the model's own, else ChatML).
"""

from __future__ import annotations

import argparse
import json
import logging
import secrets
from pathlib import Path
from typing import Any

from cli import common
from cli.common import UsageError
from cli.runtime import add_deployment_args, resolve_model


def cmd_router(args: argparse.Namespace) -> int:
    from controller.http_server import serve_http
    from workers.router import RouterConfig, create_router_app
    from workers.router_chat import load_chat_template

    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(message)s")
    host, port = common.parse_listen("--listen", args.listen)
    model_dir = resolve_model(args.model, Path(args.model_cache))
    try:
        model_config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        context = int(model_config["max_position_embeddings"])
        vocab = int(model_config["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--model: cannot read {model_dir / 'config.json'}: {exc}") from exc
    tokenize, detokenize, tokenize_bare = _tokenizer(model_dir)
    try:
        template = load_chat_template(model_dir)
    except ValueError as exc:
        raise UsageError(f"--model: {exc}") from exc
    logging.getLogger(__name__).info("chat template: %s", template.source)
    try:
        config = RouterConfig(
            redis_url=args.redis,
            max_context_tokens=context,
            # What clients name the model: by default what --model was given (a
            # folder's last component), so `--model tiny` answers to "tiny", not to
            # the generated folder, and `--model /models/llama-3-8b` to "llama-3-8b".
            model_name=args.model_name or default_model_name(args.model),
            vocab_size=vocab,
            max_queued_requests=args.max_queued,
            request_timeout_s=args.request_timeout_s,
            key_prefix=args.key_prefix,
        )
    except ValueError as exc:
        raise UsageError(f"--{str(exc).split(':')[0].replace('_', '-')}: {exc}") from exc
    health = None
    watch = None
    if args.health_listen:
        from workers.router_health import HealthConfig, HealthProcess, LoopWatch

        health_host, health_port = common.parse_listen("--health-listen", args.health_listen)
        watch = LoopWatch()
        try:
            health = HealthProcess(
                HealthConfig(
                    host=health_host,
                    port=health_port,
                    stall_s=args.loop_stall_s,
                    redis_url=config.redis_url,
                    key_prefix=config.key_prefix,
                    redis_timeout_s=config.redis_timeout_s,
                ),
                watch,
            ).start()
        except (OSError, ValueError) as exc:
            raise UsageError(f"--health-listen: {exc}") from exc
    app = create_router_app(
        config,
        tokenize=tokenize,
        detokenize=detokenize,
        new_seed=lambda: secrets.randbits(63),
        chat_template=template,
        # A model's own template writes its special tokens (BOS) itself.
        tokenize_chat=tokenize_bare if template.adds_special_tokens else tokenize,
        loop_watch=watch,
    )
    try:
        serve_http(app, host=host, port=port, access_log=False)
    finally:
        if health is not None:
            health.stop()
    return 0


def default_model_name(model: str) -> str:
    """The served name of ``--model``: ``tiny`` as is, a folder by its last component."""
    return Path(model).name or model


def _tokenizer(model_dir: Path) -> tuple[Any, Any, Any]:
    """Text in and out through ``tokenizer.json`` (tokenise, detokenise, and tokenise
    without adding special tokens); without one, prompts must be token ids."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():

        def no_text(text: str) -> list[int]:
            raise ValueError("this model has no tokenizer.json: send the prompt as token ids")

        return no_text, lambda ids: "", no_text
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))

    def tokenize(text: str) -> list[int]:
        return list(tokenizer.encode(text).ids)

    def tokenize_bare(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    def detokenize(ids: list[int]) -> str:
        return str(tokenizer.decode(ids))

    return tokenize, detokenize, tokenize_bare


def register(sub: Any) -> None:
    p = sub.add_parser("router", help="the OpenAI-compatible router")
    add_deployment_args(p)
    p.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT")
    p.add_argument(
        "--model-name",
        "--served-model-name",
        help="the id /v1/models shows and requests must name (default: --model as given, "
        "a folder by its last component)",
    )
    p.add_argument(
        "--health-listen",
        metavar="HOST:PORT",
        help="also answer /healthz and /readyz here, from a process of their own (off the "
        "request-serving event loop: a probe that overload cannot delay)",
    )
    p.add_argument(
        "--loop-stall-s",
        type=float,
        default=10.0,
        help="the health listener's /healthz is 503 once the event loop has not run this long",
    )
    p.add_argument("--max-queued", type=int, default=1024, help="admission limit (429 beyond)")
    p.add_argument(
        "--request-timeout-s", type=float, default=300.0, help="arrival to last token, seconds"
    )
    p.set_defaults(func=cmd_router)
