"""`sara profile`: measure an iteration-time profile, with the real engine here or
from outside over any OpenAI-compatible server (``--openai-url``,
``workers.blackbox_profiler``).

Loads a checkpoint folder (or generates the tiny random model), times the engine's
forward pass over a grid of batch shapes, fits DESIGN §3.1's four coefficients and
writes the profile JSON that `sara solve --profile FILE` reads. torch is imported
only inside the command, so `import cli.__main__` stays light.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from cli.common import UsageError

EXIT_FIT_FAILED = 1


def _int_list(flag: str) -> Any:
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                f"{flag}: expected comma-separated integers, got {text!r}"
            ) from exc
        if not values or any(v < 0 for v in values):
            raise argparse.ArgumentTypeError(f"{flag}: expected integers >= 0, got {text!r}")
        return values

    return parse


def cmd_blackbox(args: argparse.Namespace) -> int:
    """`sara profile --openai-url URL --model NAME`: fit the profile from outside."""
    from dataclasses import replace

    import openai

    from controller.profiles import load_profile
    from queueing.profile import ProfileError
    from workers.blackbox_profiler import (
        BlackBoxError,
        BlackBoxGrid,
        BlackBoxProfiler,
        format_blackbox_report,
        profile_of,
    )

    try:
        grid = BlackBoxGrid(
            prompt_tokens=args.prompt_grid,
            concurrency=args.concurrency_grid,
            context_tokens=args.itl_context_grid,
            output_tokens=args.output_tokens,
            repeats=args.repeats_http,
            chunk_tokens=args.chunk_tokens,
        )
    except ValueError as exc:
        raise UsageError(f"--prompt-grid/--concurrency-grid/--itl-context-grid: {exc}") from exc
    if args.memory_from is None and (
        args.kv_capacity_tokens is None or args.kv_bytes_per_token is None
    ):
        raise UsageError(
            "--memory-from: a black box does not say how large its KV cache is: give "
            "--memory-from PROFILE (a built-in or a file for the same model and GPU) or "
            "--kv-capacity-tokens and --kv-bytes-per-token"
        )
    memory = None
    if args.memory_from is not None:
        try:
            memory = load_profile(args.memory_from)
        except (OSError, ProfileError) as exc:
            raise UsageError(f"--memory-from: {exc}") from exc
    client = openai.OpenAI(
        base_url=args.openai_url.rstrip("/")
        + ("" if args.openai_url.rstrip("/").endswith("/v1") else "/v1"),
        api_key=args.api_key or "unused",
        timeout=args.request_timeout_s,
        max_retries=0,
    )
    profiler = BlackBoxProfiler(
        client,
        model=args.model,
        grid=grid,
        seed=args.seed,
        token_low=args.token_low,
        token_high=args.token_high,
        ignore_eos=not args.no_ignore_eos,
        progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
    )
    print(
        f"profiling {args.model} at {args.openai_url} from outside: "
        f"{len(grid.prompt_tokens)} prompt lengths, "
        f"{len(grid.concurrency) * len(grid.context_tokens)} decode shapes x {grid.repeats}",
        file=sys.stderr,
        flush=True,
    )
    try:
        round_trip = profiler.http_round_trip_s()
        fit = profiler.run()
    except openai.OpenAIError as exc:
        raise UsageError(f"--openai-url: {type(exc).__name__}: {exc}") from exc
    except BlackBoxError as exc:
        print(f"sara: {exc}", file=sys.stderr)
        return EXIT_FIT_FAILED
    try:
        profile = profile_of(
            fit,
            name=args.name or f"{args.model}@blackbox",
            model=args.model,
            hardware=memory.hardware if memory is not None else "unknown (black box)",
            tensor_parallel=memory.tensor_parallel if memory is not None else 1,
            kv_capacity_tokens=args.kv_capacity_tokens or memory.kv_capacity_tokens,  # type: ignore[union-attr]
            kv_bytes_per_token=args.kv_bytes_per_token or memory.kv_bytes_per_token,  # type: ignore[union-attr]
            startup_s=args.startup_s
            if args.startup_s is not None
            else (memory.startup_s if memory else 60.0),
            max_context_tokens=memory.max_context_tokens if memory is not None else None,
            url=args.openai_url,
        )
    except ValueError as exc:
        print(f"sara: the fit is not a valid profile: {exc}", file=sys.stderr)
        return EXIT_FIT_FAILED
    if args.name:
        profile = replace(profile, name=args.name)
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(profile.to_json(), encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--out: cannot write {out}: {exc.strerror}") from exc
    print(format_blackbox_report(fit, http_round_trip_s=round_trip))
    print(f"wrote {out}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    if args.openai_url is not None:
        return cmd_blackbox(args)
    import torch

    from workers.checkpoint import CheckpointError, write_tiny_checkpoint
    from workers.engine import tune_cpu_allocator
    from workers.profiler import ProfileFitError, ProfileGrid, format_report, profile_model

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device: cuda requested but torch sees no CUDA device")
    if args.repeats < 1:
        raise UsageError(f"--repeats: must be >= 1, got {args.repeats}")
    if args.warmup < 0:
        raise UsageError(f"--warmup: must be >= 0, got {args.warmup}")
    if args.refine < 0:
        raise UsageError(f"--refine: must be >= 0, got {args.refine}")
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads: must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    elif args.device == "cpu":
        # Workers run one torch thread each; a second thread also makes timings on a
        # shared machine far noisier (a descheduled OpenMP thread stalls every op).
        torch.set_num_threads(1)
    tune_cpu_allocator()
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    try:
        grid = ProfileGrid(
            prefill_tokens=args.budget_grid,
            decode_batch=args.batch_grid,
            context_tokens=args.context_grid,
        )
        grid.shapes()
    except ValueError as exc:
        raise UsageError(f"--budget-grid/--batch-grid/--context-grid: {exc}") from exc

    def progress(done: int, total: int) -> None:
        print(f"  round {done}/{total}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="sara-tiny-") as tmp:
        if args.model == "tiny":
            model_dir = write_tiny_checkpoint(Path(tmp) / "tiny", seed=args.seed, tokenizer=False)
            model_name = "tiny"
        else:
            model_dir = Path(args.model)
            if not model_dir.is_dir():
                raise UsageError(f"--model: {args.model} is not a folder (or 'tiny')")
            model_name = model_dir.resolve().name
        print(
            f"profiling {model_name} on {args.device}: {len(grid.shapes())} batch shapes x "
            f"({args.warmup} warm-up + {args.repeats}) passes",
            file=sys.stderr,
            flush=True,
        )
        try:
            run = profile_model(
                model_dir,
                model_name=model_name,
                device=args.device,
                dtype=dtype,
                grid=grid,
                repeats=args.repeats,
                warmup=args.warmup,
                block_size=args.block_size,
                kv_cache_tokens=args.kv_cache_tokens,
                seed=args.seed,
                refine_rounds=args.refine,
                progress=progress,
            )
        except CheckpointError as exc:
            raise UsageError(f"--model: {exc}") from exc
        except ProfileFitError as exc:
            print(f"sara: {exc}", file=sys.stderr)
            return EXIT_FIT_FAILED
        except ValueError as exc:
            raise UsageError(str(exc)) from exc

    profile = run.profile
    if args.name:
        from dataclasses import replace

        profile = replace(profile, name=args.name)
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(profile.to_json(), encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--out: cannot write {out}: {exc.strerror}") from exc
    print(format_report(run))
    print(f"wrote {out}")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "profile", help="measure and fit this machine's iteration-time profile (needs torch)"
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="DIR|tiny|NAME",
        help="checkpoint folder or 'tiny'; with --openai-url, the served model's name",
    )
    p.add_argument(
        "--openai-url",
        metavar="URL",
        help="measure this OpenAI-compatible server from outside (vLLM, SGLang, sara serve) "
        "instead of running the engine here",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="weights and KV dtype (default: float32 on cpu, the config's on cuda)",
    )
    p.add_argument("--out", required=True, metavar="FILE", help="profile JSON to write")
    p.add_argument(
        "--budget-grid",
        type=_int_list("--budget-grid"),
        default=(0, 64, 256, 512),
        metavar="N,N,...",
        help="prefill-chunk tokens per iteration (default 0,64,256,512)",
    )
    p.add_argument(
        "--batch-grid",
        type=_int_list("--batch-grid"),
        default=(0, 4, 16, 64),
        metavar="B,B,...",
        help="decoding sequences per iteration (default 0,4,16,64)",
    )
    p.add_argument(
        "--context-grid",
        type=_int_list("--context-grid"),
        default=(256, 1024),
        metavar="C,C,...",
        help="decode contexts and prefill prefixes in tokens (default 256,1024)",
    )
    p.add_argument("--repeats", type=int, default=11, help="timed passes per shape (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed passes per shape first")
    p.add_argument(
        "--refine",
        type=int,
        default=2,
        metavar="ROUNDS",
        help="times the worst-fitting shapes are measured again (default 2; 0: never)",
    )
    p.add_argument("--threads", type=int, help="torch threads (default 1 on cpu)")
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        metavar="N",
        help="KV cache size (default: 512 MiB on cpu, 90%% of free memory on cuda)",
    )
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the grid order (and tiny model)")
    p.add_argument("--name", help="profile name (default MODEL@DEVICE, MODEL@blackbox)")
    b = p.add_argument_group("black box (--openai-url)")
    b.add_argument(
        "--prompt-grid",
        type=_int_list("--prompt-grid"),
        default=(16, 128, 256, 384, 512),
        metavar="L,L,...",
        help="prompt lengths of the TTFT probes (default 16,128,256,384,512)",
    )
    b.add_argument(
        "--concurrency-grid",
        type=_int_list("--concurrency-grid"),
        default=(1, 4, 16, 32),
        metavar="B,B,...",
        help="concurrent streams of the ITL probes (default 1,4,16,32)",
    )
    b.add_argument(
        "--itl-context-grid",
        type=_int_list("--itl-context-grid"),
        default=(32, 512),
        metavar="C,C,...",
        help="prompt lengths of the ITL probes (default 32,512)",
    )
    b.add_argument(
        "--output-tokens",
        type=int,
        default=16,
        help="gaps per ITL stream while all decode (the streams get more tokens to cover "
        "the prefills of the others)",
    )
    b.add_argument(
        "--repeats-http",
        type=int,
        default=5,
        help="repeats per probe (TTFT: the fastest; ITL: the median gap)",
    )
    b.add_argument(
        "--chunk-tokens", type=int, help="the engine's prefill chunk (default: one pass per prompt)"
    )
    b.add_argument(
        "--memory-from",
        metavar="PROFILE",
        help="KV capacity, bytes per token, "
        "startup and context from this profile (same model and GPU)",
    )
    b.add_argument("--kv-capacity-tokens", type=int, help="KV tokens one instance holds")
    b.add_argument("--kv-bytes-per-token", type=int, help="KV bytes per token")
    b.add_argument("--startup-s", type=float, help="seconds from start to first served request")
    b.add_argument("--api-key", help="bearer token of the server (default none)")
    b.add_argument("--request-timeout-s", type=float, default=120.0)
    b.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (vLLM's extension) for a server that refuses it",
    )
    b.add_argument("--token-low", type=int, default=100, help="smallest prompt token id")
    b.add_argument("--token-high", type=int, default=400, help="largest prompt token id + 1")
    p.set_defaults(func=cmd_profile)
