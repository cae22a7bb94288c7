"""Chat completions and the parameters clients send, over a real redis-server.

The worker side is ``ProtocolWorker`` (letters: output token ``i`` is
``'a' + (last prompt byte + i) % 26``, see tests/workers/conftest.py) under a
byte-level tokenizer, so every expected text is computed here from the prompt.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

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
from tests.workers.test_router import registered  # noqa: F401 (a fixture)
from workers.protocol import FinishReason, Streams, TokenEvent
from workers.redis_util import RedisServer
from workers.router import RouterConfig, create_router_app

Json = dict[str, Any]
SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "Hello"}


def chatml(messages: list[Json]) -> str:
    """The documented default template, written out independently of the router."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def letters(prompt: list[int], n: int) -> str:
    return "".join(chr(letter(prompt, i)) for i in range(n))


def sse(url: str, path: str, body: Json) -> list[Any]:
    """The SSE payloads of a 200 stream (JSON objects, then the string ``[DONE]``)."""
    events: list[Any] = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=10) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def post(url: str, path: str, body: Json) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=10)


@pytest.fixture
def served(worker: ProtocolWorker, start_router: RouterFactory) -> ServerThread:
    return start_router()


# --------------------------------------------------------------------------- chat


def test_a_chat_completion_answers_the_rendered_conversation_as_an_assistant_message(
    served: ServerThread,
) -> None:
    messages = [SYSTEM, USER]
    resp = post(served.url, "/v1/chat/completions", {"messages": messages, "max_tokens": 6})
    assert resp.status_code == 200
    body = resp.json()
    prompt = byte_tokenize(chatml(messages))
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": letters(prompt, 6)}
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 6,
        "total_tokens": len(prompt) + 6,
    }


def test_a_streamed_chat_sends_the_role_first_then_content_deltas_then_done(
    served: ServerThread,
) -> None:
    messages = [USER, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Go"}]
    events = sse(served.url, "/v1/chat/completions", {"messages": messages, "max_tokens": 5})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert all("role" not in d for d in deltas[1:])
    prompt = byte_tokenize(chatml(messages))
    assert "".join(d["content"] for d in deltas) == letters(prompt, 5)
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons == [None] * 4 + ["length"]


def test_content_given_as_text_parts_is_joined_by_newlines(served: ServerThread) -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    body = post(
        served.url,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": parts}], "max_tokens": 1},
    ).json()
    prompt = chatml([{"role": "user", "content": "one\ntwo"}])
    assert body["usage"]["prompt_tokens"] == len(byte_tokenize(prompt))


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({}, "messages", "invalid_value"),
        ({"messages": []}, "messages", "invalid_value"),
        ({"messages": "hi"}, "messages", "invalid_value"),
        ({"messages": ["hi"]}, "messages[0]", "invalid_value"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_value"),
        ({"messages": [USER, {"role": "user"}]}, "messages[1].content", "invalid_value"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "invalid_value"),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "invalid_value"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].type",
            "unsupported",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
            "messages[0].content[0].text",
            "invalid_value",
        ),
        (
            {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]},
            "messages[0].role",
            "unsupported",
        ),
        ({"messages": [USER], "logprobs": True}, "logprobs", "unsupported"),
        ({"messages": [USER], "top_logprobs": 2}, "top_logprobs", "unsupported"),
        ({"messages": [USER], "tools": [{"type": "function"}]}, "tools", "unsupported"),
        ({"messages": [USER], "tool_choice": "required"}, "tool_choice", "unsupported"),
        (
            {"messages": [USER], "response_format": {"type": "json_object"}},
            "response_format",
            "unsupported",
        ),
        ({"messages": [USER], "temperature": "0.5"}, "temperature", "invalid_value"),
        ({"messages": [USER], "n": 0}, "n", "invalid_value"),
        ({"messages": [USER], "max_completion_tokens": 600}, "messages", "context_length_exceeded"),
    ],
)
def test_a_bad_chat_request_is_a_400_naming_the_field(
    served: ServerThread, body: Json, param: str, code: str
) -> None:
    resp = post(served.url, "/v1/chat/completions", body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (
        param,
        code,
        "invalid_request_error",
    )
    assert param.split("[")[0].split(".")[0] in error["message"]


def test_a_chat_naming_another_model_is_a_404(served: ServerThread) -> None:
    resp = post(served.url, "/v1/chat/completions", {"model": "gpt-4o", "messages": [USER]})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


# --------------------------------------------------------------------------- both endpoints

PATHS = [
    ("/v1/completions", {"prompt": "Hello"}, byte_tokenize("Hello")),
    ("/v1/chat/completions", {"messages": [USER]}, byte_tokenize(chatml([USER]))),
]


def text_of(choice: Json) -> str:
    if "message" in choice:
        return str(choice["message"]["content"])
    if "delta" in choice:
        return str(choice["delta"].get("content", ""))
    return str(choice["text"])


@pytest.mark.parametrize(("path", "base", "prompt"), PATHS)
def test_max_completion_tokens_bounds_the_answer(
    served: ServerThread, path: str, base: Json, prompt: list[int]
) -> None:
    body = post(served.url, path, {**base, "max_completion_tokens": 21}).json()
    assert body["usage"]["completion_tokens"] == 21
    assert text_of(body["choices"][0]) == letters(prompt, 21)


@pytest.mark.parametrize(("path", "base", "prompt"), PATHS)
def test_include_usage_adds_a_last_chunk_without_choices(
    served: ServerThread, path: str, base: Json, prompt: list[int]
) -> None:
    body = {**base, "max_tokens": 4, "stream_options": {"include_usage": True}}
    events = sse(served.url, path, body)
    assert events[-1] == "[DONE]"
    *content, last = events[:-1]
    assert all(c["usage"] is None for c in content)
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 4,
        "total_tokens": len(prompt) + 4,
    }
    assert "".join(text_of(c["choices"][0]) for c in content) == letters(prompt, 4)


@pytest.mark.parametrize(("path", "base", "prompt"), PATHS)
def test_a_stop_string_split_over_tokens_ends_the_text_before_it(
    served: ServerThread, path: str, base: Json, prompt: list[int]
) -> None:
    text = letters(prompt, 26)
    stop = text[5:7]  # completed by the 7th token
    plain = post(served.url, path, {**base, "max_tokens": 50, "stop": [stop, "never"]}).json()
    [choice] = plain["choices"]
    assert text_of(choice) == text[:5] and choice["finish_reason"] == "stop"
    assert plain["usage"]["completion_tokens"] == 7
    events = sse(served.url, path, {**base, "max_tokens": 50, "stop": stop})
    chunks = [e for e in events[:-1] if e["choices"]]
    streamed = [text_of(c["choices"][0]) for c in chunks]
    # Nothing of the stop string was ever sent, not even its first character.
    assert "".join(streamed) == text[:5]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_stop_string_withdraws_the_request_from_the_workers(
    redis_server: RedisServer, start_router: RouterFactory, streams: Streams
) -> None:
    slow = ProtocolWorker(redis_server.url, tpot_s=0.05, name="slow").start()
    try:
        served = start_router()
        prompt = byte_tokenize("Hello")
        body = post(
            served.url, "/v1/completions", {"prompt": "Hello", "max_tokens": 200, "stop": "j"}
        ).json()
        assert body["choices"][0]["text"] == letters(prompt, 200).split("j")[0]
        assert streams.cancelled([body["id"]])
    finally:
        slow.stop()


def test_n_choices_are_independent_requests_with_distinct_seeds(
    start_router: RouterFactory,
    streams: Streams,
    registered: None,  # noqa: F811
) -> None:
    """A hand-written worker answers each request with letters from its seed."""
    served = start_router()
    n, seed = 3, 40

    def answer() -> None:
        served_ids = 0
        deadline = time.monotonic() + 5
        while served_ids < 2 * n and time.monotonic() < deadline:
            for d in streams.read_prefill("seeded", count=8, block_ms=50):
                s = d.message.seed
                assert s is not None
                events = [TokenEvent(index=i, token=ord("a") + (s + i) % 26) for i in range(3)] + [
                    TokenEvent(index=3, token=ord("."), finish_reason=FinishReason.STOP)
                ]
                streams.publish_tokens([(d.message.request_id, e) for e in events])
                streams.ack(Pool.PREFILL, [d.entry_id])
                served_ids += 1

    thread = threading.Thread(target=answer)
    thread.start()
    body = post(served.url, "/v1/completions", {"prompt": "x", "n": n, "seed": seed}).json()
    events = sse(served.url, "/v1/completions", {"prompt": "x", "n": n, "seed": seed})
    thread.join()

    def expected(i: int) -> str:
        return "".join(chr(ord("a") + (seed + i + k) % 26) for k in range(3)) + "."

    assert [c["index"] for c in body["choices"]] == list(range(n))
    assert [c["text"] for c in body["choices"]] == [expected(i) for i in range(n)]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop"] * n
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 4 * n, "total_tokens": 13}
    streamed: dict[int, str] = {}
    finished: list[int] = []
    for event in events[:-1]:
        [choice] = event["choices"]
        streamed[choice["index"]] = streamed.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            finished.append(choice["index"])
    assert streamed == {i: expected(i) for i in range(n)}
    assert sorted(finished) == list(range(n))
    assert events[-2]["usage"]["completion_tokens"] == 4 * n


def test_created_is_the_time_of_the_request_not_of_the_router(
    redis_server: RedisServer, worker: ProtocolWorker
) -> None:
    now = [1_800_000_000.0]
    config = RouterConfig(
        redis_url=redis_server.url,
        max_context_tokens=512,
        vocab_size=256,
        model_name="tiny",
        key_prefix=KEYS.prefix,
        poll_block_ms=100,
    )
    app = create_router_app(
        config, tokenize=byte_tokenize, detokenize=byte_detokenize, wall_clock=lambda: now[0]
    )
    server = ServerThread(app).start()
    try:
        now[0] += 3600.5
        plain = post(server.url, "/v1/completions", {"prompt": "a", "max_tokens": 2}).json()
        chat = sse(server.url, "/v1/chat/completions", {"messages": [USER], "max_tokens": 2})
        models = httpx.get(f"{server.url}/v1/models", timeout=5).json()
    finally:
        server.stop()
    assert plain["created"] == 1_800_003_600
    assert {c["created"] for c in chat[:-1]} == {1_800_003_600}
    assert models["data"][0]["created"] == 1_800_000_000


def test_n_choices_that_do_not_all_fit_the_queue_are_a_429_and_none_stays_queued(
    start_router: RouterFactory,
    streams: Streams,
    registered: None,  # noqa: F811
) -> None:
    """No worker takes anything: two choices fit the queue, the third does not."""
    served = start_router(max_queued_requests=2)
    resp = post(served.url, "/v1/completions", {"prompt": "x", "n": 3})
    assert resp.status_code == 429 and resp.json()["error"]["code"] == "queue_full"
    depth = streams.queue_depth(Pool.PREFILL)
    assert (depth.waiting, depth.in_service) == (0, 0)
    text = httpx.get(f"{served.url}/metrics", timeout=5).text
    assert 'sara_request_outcomes_total{outcome="rejected"} 1.0' in text
    assert 'sara_request_outcomes_total{outcome="cancelled"} 2.0' in text


def test_a_client_that_leaves_a_stream_of_n_choices_cancels_every_one(
    redis_server: RedisServer, start_router: RouterFactory, streams: Streams
) -> None:
    slow = ProtocolWorker(redis_server.url, tpot_s=0.05, name="slow").start()
    try:
        served = start_router()
        body = {"prompt": "a", "max_tokens": 200, "n": 2, "stream": True}
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=10) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
        response_id = json.loads(first[6:])["id"]
        choices = [f"{response_id}.{i}" for i in range(2)]
        deadline = time.monotonic() + 5
        while streams.cancelled(choices) != set(choices):
            assert time.monotonic() < deadline, streams.cancelled(choices)
            time.sleep(0.05)
        deadline = time.monotonic() + 5
        while (text := httpx.get(f"{served.url}/metrics", timeout=5).text) and (
            "sara_router_inflight_requests 0.0" not in text
        ):
            assert time.monotonic() < deadline, "requests still in flight"
            time.sleep(0.05)
        assert 'sara_request_outcomes_total{outcome="cancelled"} 2.0' in text
    finally:
        slow.stop()


def test_a_chat_the_models_template_refuses_is_a_400_with_its_message(
    redis_server: RedisServer, worker: ProtocolWorker
) -> None:
    pytest.importorskip("jinja2")
    from workers.router_chat import jinja_chat_template

    template = jinja_chat_template(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('users speak first') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        {},
    )
    config = RouterConfig(
        redis_url=redis_server.url,
        max_context_tokens=512,
        vocab_size=256,
        key_prefix=KEYS.prefix,
        poll_block_ms=100,
    )
    app = create_router_app(
        config, tokenize=byte_tokenize, detokenize=byte_detokenize, chat_template=template
    )
    server = ServerThread(app).start()
    try:
        refused = post(server.url, "/v1/chat/completions", {"messages": [SYSTEM, USER]})
        served = post(server.url, "/v1/chat/completions", {"messages": [USER], "max_tokens": 2})
    finally:
        server.stop()
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "messages" and "users speak first" in error["message"]
    assert served.status_code == 200
    assert served.json()["usage"]["prompt_tokens"] == len(byte_tokenize("Hello"))
