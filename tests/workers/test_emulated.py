"""The emulated engine: the profile's time per step, deterministic continuations, real KV bytes.

Times are checked on a fake clock against the iteration-time formula worked out by
hand for the batch (DESIGN §3.1); continuations against one emulated engine
generating alone; the worker loop against a real Redis, as the torch engine's is.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("torch")

from queueing.pools import Pool
from tests.profiles import TEST_8B as TEST_PROFILE
from tests.without_torch import BLOCK_TORCH
from workers.decode_worker import DecodeWorker
from workers.emulated import (
    DEFAULT_KV_SCALE,
    EmulatedEngine,
    EmulatedModel,
    emulated_token,
    kv_width,
)
from workers.paged_attention import KvShapeError
from workers.prefill_worker import PrefillWorker
from workers.protocol import FinishReason, KeySpace, PrefillRequest, Streams, connect
from workers.redis_util import RedisServer
from workers.sampling import SamplingParams
from workers.transfer import KvPayload, RedisKvTransport
from workers.worker import Worker, WorkerSettings
from workers.worker_metrics import WorkerMetrics

MODEL = EmulatedModel(vocab_size=1000, max_position_embeddings=4096, eos_token_ids=(2,))
PREFIX = "em"
KEYS = KeySpace(PREFIX)


class FakeClock:
    """Monotonic time that moves only when slept on (or by ``work_s`` per reading)."""

    def __init__(self, work_s: float = 0.0) -> None:
        self.now_s = 0.0
        self.work_s = work_s

    def __call__(self) -> float:
        self.now_s += self.work_s
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.now_s += seconds


def engine(clock: FakeClock | None = None, **kwargs: Any) -> EmulatedEngine:
    timing: dict[str, Any] = {}
    if clock is not None:
        timing = {"clock": clock, "sleep": clock.sleep}
    return EmulatedEngine(
        TEST_PROFILE,
        model=MODEL,
        **{"token_budget": 256, "num_blocks": 256, **timing, **kwargs},
    )


def test_a_prompt_step_lasts_t0_plus_its_tokens_plus_its_causal_attention_pairs() -> None:
    clock = FakeClock()
    e = engine(clock)
    e.add_request(list(range(10, 110)), SamplingParams(max_tokens=1))
    e.step()
    p = TEST_PROFILE
    # 100 prompt tokens in one chunk: 100 * 101 / 2 causal pairs, no decode reads.
    assert clock.now_s == pytest.approx(p.t0_s + 100 * p.t_tok_s + 5050 * p.t_attn_s, rel=1e-12)


def test_a_decode_step_lasts_t0_plus_one_token_each_plus_the_contexts_it_reads() -> None:
    clock = FakeClock()
    e = engine(clock)
    e.add_request(list(range(10, 40)), SamplingParams(max_tokens=5))  # 30-token prompt
    e.add_request(list(range(10, 60)), SamplingParams(max_tokens=5))  # 50-token prompt
    e.step()  # both prompts, first tokens
    before = clock.now_s
    e.step()  # two decodes, each reading its prompt + first token
    p = TEST_PROFILE
    assert clock.now_s - before == pytest.approx(p.t0_s + 2 * p.t_tok_s + (31 + 51) * p.t_kv_s)


def test_the_steps_own_work_is_absorbed_and_a_late_step_adds_no_sleep() -> None:
    p = TEST_PROFILE
    step_s = p.t0_s + 8 * p.t_tok_s + 36 * p.t_attn_s
    busy = FakeClock(work_s=step_s / 50)  # a few readings of the clock: well under the step
    e = engine(busy)
    e.add_request(list(range(8)), SamplingParams(max_tokens=1))
    e.step()
    # The step ends when due (started at the first reading), not due + its work: at
    # most the one reading that sees it is due comes after.
    due_s = busy.work_s + step_s
    assert due_s <= busy.now_s <= due_s + busy.work_s * 1.000001
    slow = FakeClock(work_s=step_s)  # descheduled: the work alone outlasts the step
    e = engine(slow)
    e.add_request(list(range(8)), SamplingParams(max_tokens=1))
    slept: list[float] = []
    e._sleep = slept.append
    e.step()
    assert slept == []


def test_back_to_back_steps_keep_the_profiles_cadence_whatever_the_worker_does_between() -> None:
    clock = FakeClock()
    seen: list[tuple[float, float]] = []
    e = engine(clock, on_step=lambda s, o: seen.append((s, o)))
    e.add_request(list(range(10, 40)), SamplingParams(max_tokens=4))
    e.step()
    first_due = clock.now_s
    clock.sleep(0.002)  # the worker publishes and reads between the steps
    e.step()
    # The second step started when the first was due: its 2 ms of work overlapped.
    assert clock.now_s == pytest.approx(first_due + seen[1][0])
    assert seen[1][1] == pytest.approx(0.002)
    clock.sleep(1.0)  # idle longer than a step: nothing to overlap, the step starts now
    start = clock.now_s
    e.step()
    assert clock.now_s == pytest.approx(start + seen[2][0]) and seen[2][1] == 0.0


def test_a_request_arriving_soon_after_the_engine_went_idle_gets_a_whole_step() -> None:
    clock = FakeClock()
    seen: list[tuple[float, float]] = []
    e = engine(clock, on_step=lambda s, o: seen.append((s, o)))
    e.add_request(list(range(10, 40)), SamplingParams(max_tokens=1))
    e.step()  # the prompt's step, which finishes the request: nothing left to run
    clock.sleep(0.002)  # idle, far less than a step, then the next request arrives
    e.add_request(list(range(50, 90)), SamplingParams(max_tokens=1))
    start = clock.now_s
    e.step()
    # Nothing was under way to overlap with: the whole step's time, from now.
    assert seen[1][1] == 0.0
    assert clock.now_s == pytest.approx(start + seen[1][0])


def test_the_same_request_gets_the_same_tokens_whatever_shares_its_batch() -> None:
    asks = [
        (list(range(3, 40)), SamplingParams(max_tokens=12)),
        (list(range(100, 105)), SamplingParams(max_tokens=9, temperature=0.8, seed=7)),
        (list(range(200, 290)), SamplingParams(max_tokens=6, temperature=1.0, seed=123)),
    ]
    together = engine().generate([a for a, _ in asks], [sp for _, sp in asks])
    alone = [engine().generate([a], [sp])[0] for a, sp in asks]
    assert together == alone
    assert [len(t) for t in together] == [12, 9, 6]  # no EOS: every request runs to max_tokens
    assert all(2 not in t for t in together)


def test_tokens_depend_on_the_seed_when_sampled_and_on_the_prompt_when_greedy() -> None:
    prompt = list(range(50, 80))
    seeded = [engine().generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=s))[0]
              for s in (1, 1, 2)]  # fmt: skip
    assert seeded[0] == seeded[1] != seeded[2]
    greedy = [engine().generate([p], SamplingParams(max_tokens=8))[0] for p in (prompt, prompt[1:])]
    assert greedy[0] != greedy[1]
    assert all(emulated_token(9, i, vocab_size=3, eos=frozenset({0, 1})) == 2 for i in range(20)), (
        "EOS ids are never generated"
    )


def test_a_request_prefilled_on_one_engine_continues_on_another_exactly() -> None:
    prompt, params = list(range(20, 83)), SamplingParams(max_tokens=10, temperature=0.7, seed=42)
    want = engine().generate([prompt], [params])[0]
    prefill = engine(keep_finished_kv=True)
    seq = prefill.add_request(prompt, replace(params, max_tokens=1))
    first = [t for _, t in prefill.step()]
    snapshot = prefill.export_kv(seq)
    decode = engine(keep_finished_kv=True)
    decode.import_kv(7, snapshot, snapshot.num_tokens, prompt_token_ids=prompt,
                     output_token_ids=first, params=params)  # fmt: skip
    rest: list[int] = []
    while decode.has_unfinished:
        rest += [t for _, t in decode.step()]
    assert first + rest == want


def test_the_hand_off_carries_kv_scale_times_the_profiles_kv_bytes_per_token() -> None:
    scale = 1 / 64
    e = engine(keep_finished_kv=True, kv_scale=scale)
    seq = e.add_request(list(range(200)), SamplingParams(max_tokens=1))
    e.step()
    payload = KvPayload.from_kv("r", key=e.export_kv(seq).key, value=e.export_kv(seq).value)
    per_token = TEST_PROFILE.kv_bytes_per_token * scale
    # The width is rounded to whole float16 elements: within half an element pair per token.
    assert abs(payload.nbytes / 200 - per_token) <= 2
    assert kv_width(TEST_PROFILE, DEFAULT_KV_SCALE) >= 1
    other = engine(keep_finished_kv=True, kv_scale=scale / 2)
    with pytest.raises(KvShapeError, match="key"):
        other.import_kv(0, e.export_kv(seq), 200, prompt_token_ids=list(range(200)),
                        output_token_ids=[5], params=SamplingParams(max_tokens=4))  # fmt: skip


@pytest.mark.parametrize("scale", [0.0, -1.0, 2.0, float("nan")])
def test_a_kv_scale_outside_zero_to_one_is_refused_by_name(scale: float) -> None:
    with pytest.raises(ValueError, match="kv_scale"):
        engine(kv_scale=scale)


def test_an_emulated_model_without_room_to_generate_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        EmulatedModel(vocab_size=1, max_position_embeddings=10)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        EmulatedModel.from_config({"vocab_size": 10})


# -- the worker loop against a real Redis ---------------------------------------------------


@pytest.fixture
def redis_url() -> Iterator[str]:
    server = RedisServer.start()
    try:
        yield server.url
    finally:
        server.stop()


def make_worker(pool: Pool, worker_id: str, url: str, profile_s: list[float]) -> Worker:
    settings = WorkerSettings(
        worker_id=worker_id, pool=pool, token_budget=256, num_blocks=256, key_prefix=PREFIX,
        idle_block_ms=20, keepalive_interval_s=0.1, reclaim_interval_s=0.1,
        reclaim_min_idle_ms=400,
    )  # fmt: skip
    client = connect(url)
    cls: Any = PrefillWorker if pool is Pool.PREFILL else DecodeWorker
    return cls(
        settings,
        engine=engine(keep_finished_kv=True, on_step=lambda s, o: profile_s.append(s - o)),
        transport=RedisKvTransport(client, key_prefix=f"{PREFIX}:kv"),
        client=client,
        metrics=WorkerMetrics(pool),
    )


def run(workers: list[Worker], stop: threading.Event) -> list[threading.Thread]:
    threads = [threading.Thread(target=w.run, args=(stop,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    return threads


def collect(streams: Streams, request_id: str, timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    last, tokens = "0-0", []
    while time.monotonic() < deadline:
        last, events = streams.read_tokens(request_id, last, block_ms=100)
        for event in events:
            assert event.error is None, event.error
            if event.index == len(tokens):
                tokens.append(event.token)
                if event.finished:
                    assert event.finish_reason is FinishReason.LENGTH
                    return tokens
    raise AssertionError(f"{request_id}: unfinished after {timeout_s} s: {tokens}")


def enqueue(streams: Streams, asks: list[tuple[list[int], SamplingParams]]) -> list[str]:
    now = time.time()
    for i, (prompt, sp) in enumerate(asks):
        streams.enqueue_prefill(
            PrefillRequest(
                request_id=f"em-{i}", prompt_token_ids=tuple(prompt), max_tokens=sp.max_tokens,
                temperature=sp.temperature, seed=sp.seed, arrival_s=now, deadline_s=now + 60,
            )
        )  # fmt: skip
    return [f"em-{i}" for i in range(len(asks))]


ASKS = [
    (list(range(3, 400)), SamplingParams(max_tokens=20)),  # two chunks of the budget
    (list(range(100, 130)), SamplingParams(max_tokens=15, temperature=0.9, seed=5)),
    (list(range(7, 60)), SamplingParams(max_tokens=1)),  # ends at the prefill worker
    (list(range(500, 540)), SamplingParams(max_tokens=30, temperature=1.0, seed=11)),
]


def test_emulated_workers_over_redis_continue_exactly_and_no_step_ends_before_its_time(
    redis_url: str,
) -> None:
    want = engine().generate([a for a, _ in ASKS], [sp for _, sp in ASKS])
    client = connect(redis_url)
    streams = Streams(client, KEYS)
    streams.ensure_groups()
    profile_s: dict[Pool, list[float]] = {pool: [] for pool in Pool}
    workers = [make_worker(pool, f"{pool.value}-0", redis_url, profile_s[pool]) for pool in Pool]
    stop = threading.Event()
    threads = run(workers, stop)
    try:
        ids = enqueue(streams, ASKS)
        assert [collect(streams, rid) for rid in ids] == want
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    for w in workers:
        labels = {"pool": w.settings.pool.value}
        count = w.metrics.registry.get_sample_value("sara_worker_iteration_seconds_count", labels)
        measured_s = w.metrics.registry.get_sample_value(
            "sara_worker_iteration_seconds_sum", labels
        )
        assert measured_s is not None
        assert count == len(profile_s[w.settings.pool]) > 0
        # Sleep-until-due never ends a step early: measured >= the profile's time less
        # the worker's work between steps that the step overlapped.
        assert measured_s >= sum(profile_s[w.settings.pool]) - 1e-9


def test_a_decode_worker_lost_mid_request_is_repaired_with_the_exact_continuation(
    redis_url: str,
) -> None:
    asks = ASKS[1:2] + ASKS[3:]
    want = engine().generate([a for a, _ in asks], [sp for _, sp in asks])
    client = connect(redis_url)
    streams = Streams(client, KEYS)
    streams.ensure_groups()
    stop = threading.Event()
    threads = run([make_worker(Pool.PREFILL, "p0", redis_url, [])], stop)
    doomed = make_worker(Pool.DECODE, "d-doomed", redis_url, [])
    ids = enqueue(streams, asks)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # drive it until both requests have tokens out
        doomed.maintain()
        doomed.iterate()
        if all(len(streams.published_tokens(r)) >= 4 for r in ids):
            break
    assert doomed.queue_depth() == 2
    threads += run([make_worker(Pool.DECODE, "d-new", redis_url, [])], stop)  # kill -9: no ack
    try:
        assert [collect(streams, rid) for rid in ids] == want
    finally:
        stop.set()
        for t in threads:
            t.join(10)


def test_sara_worker_emulated_needs_a_profile_and_says_so_in_one_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cli", "worker", "prefill", "--engine", "emulated"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "--profile" in out.stderr


def test_the_parsers_kv_scale_default_is_the_engines() -> None:
    from cli.worker_cmd import DEFAULT_KV_SCALE as parser_default

    assert parser_default == DEFAULT_KV_SCALE


@pytest.mark.parametrize("verb", [["worker", "prefill"], ["serve", "--state-dir", "STATE"]])
def test_without_torch_sara_worker_and_serve_say_what_to_install_in_one_line(
    verb: list[str], tmp_path: Any
) -> None:
    blocked = BLOCK_TORCH + "from cli.__main__ import main; main(sys.argv[1:])"
    argv = [str(tmp_path) if a == "STATE" else a for a in verb]
    out = subprocess.run(
        [sys.executable, "-c", blocked, *argv], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "pip install" in out.stderr
