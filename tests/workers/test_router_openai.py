"""The official ``openai`` client against `sara serve`: models, completions and chat
completions, streaming and not.

Two real stacks (Redis, the router, a prefill and a decode worker, the controller):
the emulated engine (no tokenizer: token-id prompts, and chat refused with a clear
400), and the torch tiny model with its own tokenizer (text both ways, chat through
the ChatML default). Greedy decoding makes a streamed answer comparable with the
plain one: the same tokens, so the same text.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from controller.config import ControllerConfig
from workers.redis_util import free_port

PROFILE = "llama-3-8b@h100-sxm"
START_TIMEOUT_S = 120.0


@dataclass
class Stack:
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)


def launch(work: Path, *args: str) -> Stack:
    work.mkdir(parents=True, exist_ok=True)
    router_port, api_port = free_port(), free_port()
    config = work / "config.json"
    config.write_text(json.dumps(ControllerConfig(profile=PROFILE).to_dict()))
    log = work / "serve.log"
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "cli", "serve", "--config", str(config)),
            *("--state-dir", str(work / "state"), "--model-cache", str(work / "models")),
            *("--listen", f"127.0.0.1:{router_port}", "--api-listen", f"127.0.0.1:{api_port}"),
            *("--prefill-port", str(free_port()), "--decode-port", str(free_port())),
            *("--grace-period-s", "1", "--request-timeout-s", "60", *args),
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if k != "SARA_PARENT_PID"},
    )
    return Stack(process=process, url=f"http://127.0.0.1:{router_port}", log=log)


def wait_ready(stack: Stack) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert stack.process.poll() is None, "exited:\n" + stack.log.read_text()[-3000:]
        try:
            if httpx.get(f"{stack.url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "not ready:\n" + stack.log.read_text()[-3000:]
        time.sleep(0.2)


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Stack]]:
    """Both stacks, started together (their start-ups overlap)."""
    started = {
        "emulated": launch(
            tmp_path_factory.mktemp("emulated"),
            *("--engine", "emulated", "--startup-s", "0", "--served-model-name", "llama-8b"),
        )
    }
    if importlib.util.find_spec("torch") is not None:
        started["tiny"] = launch(
            tmp_path_factory.mktemp("tiny"), "--model", "tiny", "--profile", PROFILE
        )
    try:
        for stack in started.values():
            wait_ready(stack)
        yield started
    finally:
        for stack in started.values():
            if stack.process.poll() is None:
                stack.process.send_signal(signal.SIGTERM)
        for stack in started.values():
            try:
                stack.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                stack.process.kill()
                stack.process.wait()


@pytest.fixture
def emulated(stacks: dict[str, Stack]) -> Stack:
    return stacks["emulated"]


@pytest.fixture
def tiny(stacks: dict[str, Stack]) -> Stack:
    if "tiny" not in stacks:
        pytest.skip("torch is not installed: no tiny model")
    return stacks["tiny"]


def test_the_emulated_stack_answers_the_openai_client(emulated: Stack) -> None:
    client = emulated.client()
    assert [m.id for m in client.models.list().data] == ["llama-8b"]
    plain = client.completions.create(model="llama-8b", prompt=[5, 6, 7], max_tokens=5)
    assert plain.object == "text_completion"
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage is not None and plain.usage.completion_tokens == 5
    assert plain.created >= int(time.time()) - 60
    chunks = list(
        client.completions.create(
            model="llama-8b",
            prompt=[5, 6, 7],
            max_tokens=4,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *content, last = chunks
    assert sorted(c.choices[0].index for c in content) == [0] * 4 + [1] * 4
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 8)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="llama-8b", messages=[{"role": "user", "content": "hi"}]
        )
    assert "tokenizer.json" in str(refused.value)


def test_the_tiny_model_answers_completions_and_chats_streaming_or_not(tiny: Stack) -> None:
    client = tiny.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    plain = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=8, temperature=0, seed=1
    )
    streamed = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    assert plain.usage is not None and plain.usage.completion_tokens == 8

    messages = [{"role": "system", "content": "Count."}, {"role": "user", "content": "1 2 3"}]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=12, temperature=0
    )
    assert chat.object == "chat.completion"
    [choice] = chat.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    text = choice.message.content or ""
    assert chat.usage is not None and chat.usage.completion_tokens == 12
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_completion_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12

    # A stop string taken from the greedy answer cuts it there.
    stop = text.strip()[2:4]
    assert len(stop) == 2, text
    cut = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("model", "name"),
    [("tiny", "tiny"), ("/models/llama-3-8b", "llama-3-8b"), ("ckpt/", "ckpt"), ("a/b/c", "c")],
)
def test_the_served_name_defaults_to_what_model_was_given(model: str, name: str) -> None:
    from cli.router_cmd import default_model_name

    assert default_model_name(model) == name
