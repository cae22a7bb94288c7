"""`sara profile`: measure this machine's iteration-time profile with the real engine.

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


def cmd_profile(args: argparse.Namespace) -> int:
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
    p.add_argument("--model", required=True, metavar="DIR|tiny", help="checkpoint folder or 'tiny'")
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
    p.add_argument("--name", help="profile name (default MODEL@DEVICE)")
    p.set_defaults(func=cmd_profile)
