"""The router over a real redis-server, served by uvicorn on loopback.

The worker side is ``ProtocolWorker`` (tests/workers/conftest.py): a small loop that
consumes the prefill stream through its consumer group, publishes tokens and hands
off to the decode stream exactly as the real prefill and decode workers do, with a
fixed token rule (letters) instead of a model. Some tests play the worker side by
hand with ``Streams`` to produce re-runs, gaps and stalls.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import math
import re
import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from queueing.pools import Pool
from tests.workers.conftest import (
    KEYS,
    ProtocolWorker,
    RouterFactory,
    ServerThread,
    byte_detokenize,
    byte_tokenize,
    letter,
)
from workers.protocol import FinishReason, PrefillRequest, Streams, TokenEvent, connect
from workers.redis_util import RedisServer
from workers.registry import Heartbeat, Registry, WorkerInfo
from workers.router import IncrementalDetokenizer, RouterConfig

Json = dict[str, Any]


def expected_letters(prompt: list[int], n: int) -> str:
    return "".join(chr(letter(prompt, i)) for i in range(n))


def stream_events(url: str, body: Json, *, timeout_s: float = 10.0) -> tuple[int, list[Any]]:
    """Status and the SSE payloads (JSON objects, and the string ``[DONE]``)."""
    events: list[Any] = []
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=timeout_s
    ) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp.status_code, [resp.json()]
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return resp.status_code, events


def post(url: str, body: Json, *, timeout_s: float = 10.0) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics as ``name{labels}`` → value."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def error_of(resp: httpx.Response) -> Json:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


@pytest.fixture
def served(worker: ProtocolWorker, start_router: RouterFactory) -> ServerThread:
    return start_router()


@pytest.fixture
def registered(redis_server: RedisServer) -> Iterator[None]:
    """A live worker of each pool in the registry, for tests that play the worker side
    by hand (the router refuses requests no live worker could serve)."""
    client = connect(redis_server.url, timeout_s=2.0)
    beats = [
        Heartbeat(
            Registry(client, KEYS, ttl_s=2.0),
            partial(
                WorkerInfo, pool=pool, worker_id=f"by-hand-{pool.value}", ready=True, capacity=8
            ),
            interval_s=0.2,
        ).start()
        for pool in Pool
    ]
    yield
    for beat in beats:
        beat.stop()


# --------------------------------------------------------------------------- happy paths


def test_a_streamed_completion_arrives_token_by_token_in_order_and_ends_with_done(
    served: ServerThread,
) -> None:
    status, events = stream_events(served.url, {"prompt": "Hello", "max_tokens": 6})
    assert status == 200
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 6  # one chunk per token
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected_letters(
        byte_tokenize("Hello"), 6
    )
    assert bytes(ids).decode() == expected_letters(byte_tokenize("Hello"), 6)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]
    assert chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert chunks[0]["object"] == "text_completion" and chunks[0]["model"] == "tiny"


def test_a_plain_completion_of_token_ids_returns_the_text_and_usage(
    served: ServerThread,
) -> None:
    prompt = [10, 20, 30, 40]
    resp = post(
        served.url,
        {"prompt": prompt, "max_tokens": 7, "model": "tiny", "temperature": 0, "seed": 3},
    )
    assert resp.status_code == 200
    body = resp.json()
    [choice] = body["choices"]
    assert choice["text"] == expected_letters(prompt, 7)
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}


def test_one_token_is_enough(served: ServerThread) -> None:
    body = post(served.url, {"prompt": "a", "max_tokens": 1}).json()
    assert body["usage"]["completion_tokens"] == 1
    assert body["choices"][0]["finish_reason"] == "length"


def test_thirty_concurrent_streams_all_complete_in_order(served: ServerThread) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> str:
        text = ""
        async with client.stream(
            "POST",
            f"{served.url}/v1/completions",
            json={
                "prompt": [i + 1],
                "max_tokens": 20,
                "stream": True,
            },
        ) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def all_of_them() -> list[str]:
        async with httpx.AsyncClient(timeout=20) as client:
            return await asyncio.gather(*(one(client, i) for i in range(30)))

    texts = asyncio.run(all_of_them())
    assert texts == [expected_letters([i + 1], 20) for i in range(30)]


def test_models_healthz_and_readyz(served: ServerThread) -> None:
    models = httpx.get(f"{served.url}/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("tiny", 512)]
    assert httpx.get(f"{served.url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{served.url}/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "workers": {"prefill": 1, "decode": 1}}


def test_readyz_needs_a_live_prefill_and_a_live_decode_worker(
    start_router: RouterFactory,
) -> None:
    served = start_router()
    resp = httpx.get(f"{served.url}/readyz")
    assert resp.status_code == 503
    body = resp.json()
    assert body["status"] == "not ready"
    assert body["workers"] == {"prefill": 0, "decode": 0}
    assert "no ready prefill or decode worker" in body["reason"]


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"prompt": "x" * 500, "max_tokens": 13}, "prompt", "context_length_exceeded"),
        ({"prompt": [1] * 512, "max_tokens": 1}, "prompt", "context_length_exceeded"),
        ({"prompt": "", "max_tokens": 1}, "prompt", "invalid_value"),
        ({"prompt": [1, 256]}, "prompt", "invalid_value"),
        ({"prompt": [1, "a"]}, "prompt", "invalid_value"),
        ({"prompt": ["a", "b"]}, "prompt", "unsupported"),
        ({}, "prompt", "invalid_value"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"prompt": "a", "temperature": 2.5}, "temperature", "invalid_value"),
        ({"prompt": "a", "top_p": 0}, "top_p", "invalid_value"),
        ({"prompt": "a", "seed": -1}, "seed", "invalid_value"),
        ({"prompt": "a", "n": 0}, "n", "invalid_value"),
        ({"prompt": "a", "n": 129}, "n", "invalid_value"),
        ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        ({"prompt": "a", "stop": ""}, "stop", "invalid_value"),
        ({"prompt": "a", "stop": [1]}, "stop", "invalid_value"),
        ({"prompt": "a", "max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
        (
            {"prompt": "a", "max_tokens": 3, "max_completion_tokens": 4},
            "max_completion_tokens",
            "invalid_value",
        ),
        (
            {"prompt": "a", "stream_options": {"include_usage": True}},
            "stream_options",
            "invalid_value",
        ),
        ({"prompt": "a", "logprobs": 1}, "logprobs", "unsupported"),
        ({"prompt": "a", "echo": True}, "echo", "unsupported"),
        ({"prompt": "a", "best_of": 2}, "best_of", "unsupported"),
    ],
)
def test_a_bad_request_is_a_400_with_an_openai_error_body(
    served: ServerThread, body: Json, param: str, code: str
) -> None:
    resp = post(served.url, body)
    assert resp.status_code == 400
    error = error_of(resp)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert param in error["message"] or code == "context_length_exceeded"


def test_the_context_error_says_how_many_tokens_were_asked_for(served: ServerThread) -> None:
    error = error_of(post(served.url, {"prompt": "x" * 500, "max_tokens": 13}))
    assert "512" in error["message"] and "513" in error["message"]


def test_another_model_is_a_404(served: ServerThread) -> None:
    resp = post(served.url, {"prompt": "a", "model": "gpt-4"})
    assert resp.status_code == 404
    assert error_of(resp)["code"] == "model_not_found"


def test_a_full_queue_is_a_429_with_retry_after(
    redis_server: RedisServer, start_router: RouterFactory, streams: Streams, registered: None
) -> None:
    served = start_router(max_queued_requests=2, retry_after_s=3)
    for i in range(2):  # nobody serves the queue
        streams.enqueue_prefill(
            PrefillRequest(
                request_id=f"q{i}",
                prompt_token_ids=(1,),
                max_tokens=1,
                arrival_s=0.0,
                deadline_s=1e10,
            )
        )
    resp = post(served.url, {"prompt": "a"})
    assert resp.status_code == 429
    assert resp.headers["retry-after"] == "3"
    error = error_of(resp)
    assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
    m = metrics(served.url)
    assert m["sara_requests_total"] == 1  # offered load, though rejected
    assert m['sara_request_outcomes_total{outcome="rejected"}'] == 1
    assert m['sara_router_stream_requests{pool="prefill",state="waiting"}'] == 2


def test_redis_down_is_a_503_at_once_and_service_resumes_when_it_returns(
    redis_server: RedisServer, worker: ProtocolWorker, start_router: RouterFactory
) -> None:
    served = start_router()
    assert post(served.url, {"prompt": "a", "max_tokens": 2}).status_code == 200
    redis_server.kill()
    resp = post(served.url, {"prompt": "a", "max_tokens": 2})
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "1"
    error = error_of(resp)
    assert error["code"] == "redis_unavailable"
    assert redis_server.url in error["message"]
    # "At once": the answer is the failed connect itself (redis-py's "Error <errno>
    # connecting to ..."), not the router's own Redis timeout (redis_timeout_s, a bare
    # TimeoutError) running out on a retry loop or a connect that hangs.
    assert re.search(r"Error \d+ connecting to ", error["message"])
    assert "Timeout" not in error["message"]
    assert httpx.get(f"{served.url}/readyz").status_code == 503
    assert httpx.get(f"{served.url}/healthz").status_code == 200
    m = metrics(served.url)  # still served, the Redis-backed gauges unknown
    assert math.isnan(m['sara_router_live_workers{pool="prefill"}'])

    redis_server.restart()  # same port, empty
    deadline = time.monotonic() + 10
    while True:
        resp = post(served.url, {"prompt": "a", "max_tokens": 2})
        if resp.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert resp.status_code == 200
    assert resp.json()["usage"]["completion_tokens"] == 2


def test_redis_lost_mid_stream_ends_the_stream_with_an_error_event_then_done(
    redis_server: RedisServer, start_router: RouterFactory
) -> None:
    slow = ProtocolWorker(redis_server.url, tpot_s=0.05, name="slow").start()
    try:
        served = start_router()
        events: list[Any] = []
        with httpx.stream(
            "POST",
            f"{served.url}/v1/completions",
            json={"prompt": "a", "max_tokens": 200, "stream": True},
            timeout=10,
        ) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
                if len(events) == 2:
                    redis_server.kill()
    finally:
        slow.stop()
    assert "choices" in events[1]
    assert events[-2]["error"]["code"] == "redis_unavailable"
    assert events[-1] == "[DONE]"


def test_a_request_that_times_out_is_a_504_and_leaves_nothing_queued(
    start_router: RouterFactory, streams: Streams, registered: None
) -> None:
    served = start_router(request_timeout_s=0.4)
    # No worker: the router answers 504 (the client's own 10 s timeout would fail the
    # post otherwise), and not before its configured timeout (a lower bound, less 10 ms
    # for the event loop's timer resolution).
    started = time.monotonic()
    resp = post(served.url, {"prompt": "a"})
    assert time.monotonic() - started >= 0.4 - 0.01
    assert resp.status_code == 504
    error = error_of(resp)
    assert (error["type"], error["code"]) == ("timeout", "request_timeout")
    assert "0.4 s" in error["message"]
    # Its entry is withdrawn by the router's cleanup, which may still be running when
    # the 504 arrives: wait for it (the deadline only keeps a failure from hanging).
    deadline = time.monotonic() + 10
    while streams.queue_depth(Pool.PREFILL).total and time.monotonic() < deadline:
        time.sleep(0.01)
    assert streams.queue_depth(Pool.PREFILL).total == 0, "timed out waiting for the withdrawal"
    m = metrics(served.url)
    assert m['sara_request_outcomes_total{outcome="timeout"}'] == 1
    assert m["sara_ttft_seconds_count"] == 1  # observed at the timeout, a lower bound
    assert m['sara_ttft_seconds_bucket{le="0.3"}'] == 0


def test_a_streamed_request_that_times_out_ends_with_an_error_event_then_done(
    start_router: RouterFactory, streams: Streams, registered: None
) -> None:
    served = start_router(request_timeout_s=0.6)

    def first_token_only() -> None:  # a decode pool that never answers
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            for d in streams.read_prefill("stuck", block_ms=50):
                streams.publish_token(d.message.request_id, TokenEvent(index=0, token=104))
                return

    thread = threading.Thread(target=first_token_only)
    thread.start()
    status, events = stream_events(served.url, {"prompt": "a", "max_tokens": 5})
    thread.join()
    assert status == 200
    assert events[0]["choices"][0]["text"] == "h"
    assert events[1]["error"]["code"] == "request_timeout"
    assert "1 tokens received" in events[1]["error"]["message"]
    assert events[2:] == ["[DONE]"]


def test_a_worker_error_is_a_500_and_a_stream_error_event(
    redis_server: RedisServer, start_router: RouterFactory
) -> None:
    w = ProtocolWorker(redis_server.url, fail_token=7, name="failing").start()
    try:
        served = start_router()
        resp = post(served.url, {"prompt": [7, 1]})
        assert resp.status_code == 500
        error = error_of(resp)
        assert (error["type"], error["code"]) == ("server_error", "worker_error")
        assert "simulated failure" in error["message"]
        status, events = stream_events(served.url, {"prompt": [7, 1]})
        assert status == 200
        assert events[0]["error"]["code"] == "worker_error"
        assert events[1:] == ["[DONE]"]
        assert metrics(served.url)['sara_request_outcomes_total{outcome="error"}'] == 2
    finally:
        w.stop()


def play_worker(streams: Streams, script: list[TokenEvent]) -> threading.Thread:
    """Answer the next request with exactly these events (a hand-written worker)."""

    def run() -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            for d in streams.read_prefill("scripted", block_ms=50):
                streams.publish_tokens([(d.message.request_id, e) for e in script])
                streams.ack(Pool.PREFILL, [d.entry_id])
                return

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_tokens_republished_by_a_rerun_are_delivered_once(
    start_router: RouterFactory, streams: Streams, registered: None
) -> None:
    served = start_router()
    t = [TokenEvent(index=i, token=97 + i) for i in range(3)]
    rerun = [
        t[0],
        t[1],
        t[0],
        t[1],
        t[2],
        TokenEvent(index=3, token=100, finish_reason=FinishReason.STOP),
    ]
    thread = play_worker(streams, rerun)
    body = post(served.url, {"prompt": "a", "max_tokens": 10}).json()
    thread.join()
    assert body["choices"][0]["text"] == "abcd"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 4


def test_a_gap_in_the_token_stream_is_a_protocol_error(
    start_router: RouterFactory, streams: Streams, registered: None
) -> None:
    served = start_router()
    thread = play_worker(streams, [TokenEvent(index=0, token=97), TokenEvent(index=2, token=98)])
    resp = post(served.url, {"prompt": "a", "max_tokens": 10})
    thread.join()
    assert resp.status_code == 500
    assert error_of(resp)["code"] == "protocol_error"


def test_a_worker_that_overruns_max_tokens_is_cut_off(
    start_router: RouterFactory, streams: Streams, registered: None
) -> None:
    served = start_router()
    thread = play_worker(streams, [TokenEvent(index=i, token=97) for i in range(5)])
    body = post(served.url, {"prompt": "a", "max_tokens": 2}).json()
    thread.join()
    assert body["usage"]["completion_tokens"] == 2
    assert body["choices"][0]["finish_reason"] == "length"


def test_a_client_that_goes_away_cancels_its_request(
    redis_server: RedisServer, start_router: RouterFactory, streams: Streams
) -> None:
    slow = ProtocolWorker(redis_server.url, tpot_s=0.05, name="slow").start()
    try:
        served = start_router()
        with httpx.stream(
            "POST",
            f"{served.url}/v1/completions",
            json={"prompt": "a", "max_tokens": 200, "stream": True},
            timeout=10,
        ) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
        request_id = json.loads(first[6:])["id"]
        deadline = time.monotonic() + 5
        while not streams.cancelled([request_id]):
            assert time.monotonic() < deadline, "the request was not cancelled"
            time.sleep(0.05)
        m = metrics(served.url)
        assert m['sara_request_outcomes_total{outcome="cancelled"}'] == 1
        assert m["sara_router_inflight_requests"] == 0
    finally:
        slow.stop()


# --------------------------------------------------------------------------- metrics


def test_the_metrics_count_requests_lengths_ttft_and_tpot(served: ServerThread) -> None:
    prompts = [[1] * 5, [2] * 40, [3] * 300]
    for prompt in prompts:
        assert post(served.url, {"prompt": prompt, "max_tokens": 10}).status_code == 200
    post(served.url, {"prompt": "a", "n": 0})  # invalid: not an arrival
    m = metrics(served.url)
    assert m["sara_requests_total"] == 3
    assert m['sara_request_outcomes_total{outcome="ok"}'] == 3
    assert m['sara_request_outcomes_total{outcome="invalid"}'] == 1
    assert m["sara_prompt_tokens_count"] == 3
    assert m["sara_prompt_tokens_sum"] == 345
    assert m['sara_prompt_tokens_bucket{le="48.0"}'] == 2
    assert m["sara_output_tokens_sum"] == 30
    assert m["sara_ttft_seconds_count"] == 3
    assert m["sara_tpot_seconds_count"] == 3
    assert 0 < m["sara_ttft_seconds_sum"] < 3 * 2.0
    assert m['sara_router_live_workers{pool="decode"}'] == 1


def test_the_latency_buckets_reach_far_past_any_slo_and_bound_the_p99s_interpolation() -> None:
    from workers.router_metrics import TOKEN_BUCKETS, TPOT_BUCKETS_S, TTFT_BUCKETS_S

    assert TTFT_BUCKETS_S[-1] >= 60 and TPOT_BUCKETS_S[-1] >= 2 and TOKEN_BUCKETS[-1] >= 32768
    for buckets in (TTFT_BUCKETS_S, TPOT_BUCKETS_S):
        dense = [b for b in buckets if 0.01 <= b <= 1.0]
        # Linear interpolation in a bucket is off by at most its width: a sixth.
        assert max(hi / lo for lo, hi in itertools.pairwise(dense)) <= 7 / 6 + 1e-9


# --------------------------------------------------------------------------- pieces


def test_incremental_detokenizing_never_splits_a_character() -> None:
    text = "héllo ✓ 日本"
    detok = IncrementalDetokenizer(byte_detokenize)
    deltas = [detok.add(t) for t in byte_tokenize(text)] + [detok.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


@given(st.text(max_size=60))
@settings(max_examples=200, deadline=None)
def test_incremental_deltas_add_up_to_the_text(text: str) -> None:
    detok = IncrementalDetokenizer(byte_detokenize)
    deltas = [detok.add(t) for t in byte_tokenize(text)]
    assert "".join(deltas) + detok.flush() == text


def test_an_incomplete_character_at_the_end_is_flushed_as_is() -> None:
    detok = IncrementalDetokenizer(byte_detokenize)
    assert [detok.add(t) for t in [104, 0xE2, 0x9C]] == ["h", "", ""]
    assert detok.flush() == "\ufffd"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"redis_url": "localhost:6379"}, "redis_url"),
        ({"max_context_tokens": 1}, "max_context_tokens"),
        ({"max_queued_requests": 0}, "max_queued_requests"),
        ({"max_queued_requests": 10**6}, "max_queued_requests"),
        ({"request_timeout_s": 0}, "request_timeout_s"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"key_prefix": "a b"}, "prefix"),
    ],
)
def test_an_invalid_router_config_is_refused_naming_the_field(overrides: Json, field: str) -> None:
    settings: Json = {"redis_url": "redis://127.0.0.1:1/0", "max_context_tokens": 64, **overrides}
    with pytest.raises(ValueError, match=field):
        RouterConfig(**settings)


# --------------------------------------------------------------------------- faults at the edge


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a", "temperature": "0.5"}, "temperature"),
        ({"prompt": "a", "stream": "yes"}, "stream"),
        ({"prompt": "a", "ignore_eos": 1}, "ignore_eos"),
        ({"prompt": "a", "top_p": "1"}, "top_p"),
        ({"prompt": "a", "model": 3}, "model"),
        ({"prompt": [""]}, "prompt"),
    ],
)
def test_fields_of_the_wrong_type_are_not_coerced(
    served: ServerThread, body: Json, param: str
) -> None:
    resp = post(served.url, body)
    assert resp.status_code == 400
    assert error_of(resp)["param"] == param


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "a",',  # malformed JSON
        b'{"prompt": "\xff\xfe"}',  # not UTF-8
        b"[" * 10_000 + b"]" * 10_000,  # nested past the JSON parser's recursion limit
    ],
)
def test_a_body_that_cannot_be_parsed_is_a_400_with_an_openai_error_body(
    served: ServerThread, raw: bytes
) -> None:
    resp = httpx.post(
        f"{served.url}/v1/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert resp.status_code == 400
    error = error_of(resp)
    assert (error["code"], error["param"]) == ("invalid_json", None)


def test_an_unknown_path_is_a_404_with_an_openai_error_body(served: ServerThread) -> None:
    resp = httpx.get(f"{served.url}/v1/nothing", timeout=5)
    assert resp.status_code == 404
    assert error_of(resp)["code"] == "not_found"


def test_a_body_over_the_size_limit_is_refused_before_it_is_read(
    served: ServerThread,
) -> None:
    limit = RouterConfig(redis_url="redis://x:1", max_context_tokens=512).max_body_bytes
    # The limit leaves room for a whole context of token ids written as JSON.
    assert len(json.dumps({"prompt": [2**32 - 1] * 512, "max_tokens": 1})) < limit
    resp = post(served.url, {"prompt": "x" * (limit + 1)})
    assert resp.status_code == 413
    assert error_of(resp)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(limit // 1000 + 1):
            yield b"x" * 1000
        yield b'"}'

    resp = httpx.post(f"{served.url}/v1/completions", content=chunks(), timeout=10)
    assert resp.status_code == 413
    assert error_of(resp)["code"] == "request_too_large"


@pytest.mark.parametrize("connection", ["keep-alive", "close", "expect-100-continue"])
def test_a_huge_body_is_a_413_however_the_client_holds_its_connection(
    served: ServerThread, connection: str
) -> None:
    """Past the socket buffers: a server that closed with the body unread would reset
    the client while it still sends, and the client would never read the 413."""
    body = json.dumps({"prompt": "x" * (10 * 1024 * 1024)}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
    if connection == "close":
        headers["Connection"] = "close"
    if connection == "expect-100-continue":
        headers["Expect"] = "100-continue"
        conn.putrequest("POST", "/v1/completions")
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders()  # and waits for 100 Continue, which never comes: the 413 does
    else:
        conn.request("POST", "/v1/completions", body=body, headers=headers)
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    conn.close()
    assert resp.status == 413 and payload["error"]["code"] == "request_too_large"


def test_with_no_live_worker_a_request_is_a_503_no_workers_and_not_demand(
    start_router: RouterFactory,
) -> None:
    served = start_router(retry_after_s=2)
    started = time.monotonic()
    resp = post(served.url, {"prompt": "a"})
    assert time.monotonic() - started < 2.0  # at once, not at the request timeout (10 s)
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "2"
    error = error_of(resp)
    assert error["code"] == "no_workers"
    assert "prefill or decode" in error["message"]
    m = metrics(served.url)
    assert m["sara_requests_total"] == 0  # not demand: no worker would have served it
    assert m['sara_requests_refused_total{reason="no_workers"}'] == 1


def test_a_stream_whose_decode_pool_empties_ends_with_no_workers_within_the_grace(
    redis_server: RedisServer, start_router: RouterFactory, streams: Streams
) -> None:
    served = start_router(no_worker_grace_s=0.5, liveness_refresh_s=0.1)
    client = connect(redis_server.url, timeout_s=2.0)
    registry = Registry(client, KEYS, ttl_s=2.0)
    for pool in Pool:
        registry.heartbeat(
            WorkerInfo(pool=pool, worker_id=f"w-{pool.value}", ready=True, capacity=1)
        )

    def prefill_then_the_decode_pool_dies() -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            for d in streams.read_prefill("w-prefill", block_ms=50):
                streams.publish_token(d.message.request_id, TokenEvent(index=0, token=104))
                registry.deregister(Pool.DECODE, "w-decode")  # as a drained or expired one
                return

    thread = threading.Thread(target=prefill_then_the_decode_pool_dies)
    thread.start()
    started = time.monotonic()
    status, events = stream_events(served.url, {"prompt": "a", "max_tokens": 5})
    elapsed = time.monotonic() - started
    thread.join()
    assert status == 200
    assert events[0]["choices"][0]["text"] == "h"
    assert events[1]["error"]["code"] == "no_workers"
    assert "decode" in events[1]["error"]["message"]
    assert events[2:] == ["[DONE]"]
    assert 0.5 <= elapsed < 5.0  # after the grace, long before the 10 s request timeout


def test_past_max_inflight_requests_a_request_is_a_429_before_the_redis_pool_runs_dry(
    start_router: RouterFactory, registered: None
) -> None:
    served = start_router(max_inflight_requests=2, max_redis_connections=18, request_timeout_s=2.0)

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=10) as client:
            return [
                r.status_code
                for r in await asyncio.gather(
                    *(
                        client.post(f"{served.url}/v1/completions", json={"prompt": "a"})
                        for _ in range(12)
                    )
                )
            ]

    # Nobody serves the queue: the first two wait for their 2 s timeout, the rest
    # are refused at once with 429 (never 503: Redis is healthy).
    statuses: list[int] = []
    thread = threading.Thread(target=lambda: statuses.extend(asyncio.run(burst())))
    thread.start()
    deadline = time.monotonic() + 5
    while metrics(served.url)['sara_request_outcomes_total{outcome="rejected"}'] < 10:
        assert time.monotonic() < deadline, metrics(served.url)
        time.sleep(0.05)
    m = metrics(served.url)
    assert m["sara_router_inflight_requests"] == 2
    assert m["sara_requests_total"] == 12  # admitted or refused for capacity: demand
    thread.join()
    assert sorted(statuses) == [429] * 10 + [504] * 2


def test_redis_down_refusals_are_counted_apart_from_demand(
    redis_server: RedisServer, worker: ProtocolWorker, start_router: RouterFactory
) -> None:
    served = start_router()
    assert post(served.url, {"prompt": "a", "max_tokens": 2}).status_code == 200
    redis_server.kill()
    for _ in range(3):
        assert post(served.url, {"prompt": "a", "max_tokens": 2}).status_code == 503
    m = metrics(served.url)
    assert m["sara_requests_total"] == 1
    assert m['sara_requests_refused_total{reason="unavailable"}'] == 3
