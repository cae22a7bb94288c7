"""Stall-free batching: what a long prompt does to the decodes already running.

Eight requests are decoding on the tiny model when a prompt of 8x the token budget
arrives. Under chunked prefill (Sarathi-Serve) every step still gives each decode its
token and spends the rest of the budget on the prompt; under prefill-first the whole
prompt runs in one step and the decodes wait for it. The bench prints, for both
policies and measured in the same run, the worst time-between-tokens (TBT) of the
running decodes from the prompt's arrival until the prompt has its first token and
each decode its next one, beside the reference: one budget-sized iteration (the
median step of the chunked runs that carried exactly ``budget`` tokens).
Target: chunked worst TBT <= 1.5x that iteration.

Trials alternate the two policies; each policy's figure is the median over trials of
the per-trial worst TBT (the largest single value is printed too), because on a
shared machine one trial can catch an unrelated pause.

    .venv/bin/python bench/stall_free.py [--budget 64] [--decodes 8] [--trials 9]"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from workers.checkpoint import load_model, write_tiny_checkpoint
from workers.engine import Engine, tune_cpu_allocator
from workers.model import LlamaForCausalLM
from workers.sampling import SamplingParams
from workers.scheduler import SchedulingPolicy

TARGET_RATIO = 1.5
WARM_STEPS = 4


@dataclass(frozen=True, kw_only=True)
class Trial:
    worst_tbt_s: float
    budget_steps_s: tuple[float, ...]  # steps that carried exactly `budget` tokens
    prompt_ttft_s: float


def run_trial(
    model: LlamaForCausalLM,
    policy: SchedulingPolicy,
    *,
    budget: int,
    decodes: int,
    prompt_tokens: int,
    seed: int,
    clock: Callable[[], float] = time.perf_counter,
) -> Trial:
    engine = Engine(model, token_budget=budget, num_blocks=512, block_size=16, policy=policy)
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    running = [
        engine.add_request(torch.randint(3, 512, (32,), generator=gen).tolist(), params)
        for _ in range(decodes)
    ]
    last_token_s: dict[int, float] = {}
    # Let every decode start, then a few plain decode steps.
    while len(last_token_s) < decodes:
        for seq_id, _ in engine.step():
            last_token_s[seq_id] = clock()
    for _ in range(WARM_STEPS):
        for seq_id, _ in engine.step():
            last_token_s[seq_id] = clock()

    arrival_s = clock()
    long_id = engine.add_request(
        torch.randint(3, 512, (prompt_tokens,), generator=gen).tolist(),
        SamplingParams(max_tokens=4, ignore_eos=True),
    )
    worst = 0.0
    budget_steps: list[float] = []
    first_token_s: float | None = None
    # Until the prompt has its first token and every decode its next one after that.
    while first_token_s is None or any(last_token_s[i] <= first_token_s for i in running):
        start = clock()
        out = engine.step()
        now = clock()
        plan = engine.last_plan
        if plan is not None and plan.num_batched_tokens == budget:
            budget_steps.append(now - start)
        for seq_id, _ in out:
            if seq_id == long_id:
                first_token_s = now
            elif seq_id in running:
                worst = max(worst, now - last_token_s[seq_id])
                last_token_s[seq_id] = now
    assert first_token_s is not None
    return Trial(
        worst_tbt_s=worst,
        budget_steps_s=tuple(budget_steps),
        prompt_ttft_s=first_token_s - arrival_s,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=64, help="token budget per step")
    parser.add_argument("--decodes", type=int, default=8, help="requests decoding already")
    parser.add_argument("--prompt-factor", type=int, default=8, help="prompt = factor x budget")
    parser.add_argument("--trials", type=int, default=9)
    args = parser.parse_args()
    if args.prompt_factor < 8:
        parser.error("--prompt-factor: the bench is defined for prompts of at least 8x the budget")

    torch.set_num_threads(1)  # as a worker process runs
    tune_cpu_allocator()
    prompt_tokens = args.prompt_factor * args.budget
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(write_tiny_checkpoint(Path(tmp), seed=0, tokenizer=False))

    policies = (SchedulingPolicy.CHUNKED_PREFILL, SchedulingPolicy.PREFILL_FIRST)
    trials: dict[SchedulingPolicy, list[Trial]] = {p: [] for p in policies}
    gc.collect()
    gc.disable()
    try:
        # A warm-up trial, not counted.
        run_trial(
            model,
            policies[0],
            budget=args.budget,
            decodes=args.decodes,
            prompt_tokens=prompt_tokens,
            seed=0,
        )
        for t in range(args.trials):
            for policy in policies if t % 2 == 0 else policies[::-1]:
                trials[policy].append(
                    run_trial(
                        model,
                        policy,
                        budget=args.budget,
                        decodes=args.decodes,
                        prompt_tokens=prompt_tokens,
                        seed=t + 1,
                    )
                )
    finally:
        gc.enable()

    budget_steps = [s for trial in trials[policies[0]] for s in trial.budget_steps_s]
    iteration_s = statistics.median(budget_steps)
    print(
        f"stall-free batching, tiny model on cpu (1 thread): budget {args.budget} tokens, "
        f"{args.decodes} decodes running, a {prompt_tokens}-token prompt "
        f"({args.prompt_factor}x the budget) arrives; {args.trials} trials per policy"
    )
    print(f"one budget-sized iteration (median of {len(budget_steps)}): {iteration_s * 1e3:.2f} ms")
    print(
        f"{'policy':<16} {'worst TBT ms':>13} {'max of trials':>14} "
        f"{'/ iteration':>12} {'prompt TTFT ms':>15}"
    )
    worst: dict[SchedulingPolicy, float] = {}
    for policy in policies:
        per_trial = [trial.worst_tbt_s for trial in trials[policy]]
        worst[policy] = statistics.median(per_trial)
        ttft = statistics.median(trial.prompt_ttft_s for trial in trials[policy])
        print(
            f"{policy.value:<16} {worst[policy] * 1e3:>13.2f} {max(per_trial) * 1e3:>14.2f} "
            f"{worst[policy] / iteration_s:>11.2f}x {ttft * 1e3:>15.2f}"
        )
    ratio = worst[policies[0]] / iteration_s
    ok = ratio <= TARGET_RATIO
    print(
        f"chunked worst TBT / budget-sized iteration = {ratio:.2f} "
        f"(target <= {TARGET_RATIO}): {'PASS' if ok else 'FAIL'}"
    )
    print(
        f"prefill-first worst TBT / chunked worst TBT = "
        f"{worst[policies[1]] / worst[policies[0]]:.2f}x"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
