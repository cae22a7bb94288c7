"""Chat messages and the chat template that turns them into one prompt.

``parse_messages`` validates ``messages`` of ``/v1/chat/completions`` (OpenAI's
shape: a non-empty list of ``{"role", "content"}``, the content a string or a list
of ``{"type": "text", "text"}`` parts) and raises ``ChatError`` naming the field
(``messages[2].content[0].type``).

The template: the model's own when it ships one (``chat_template.jinja`` in the
folder, else the ``chat_template`` of ``tokenizer_config.json``), rendered the way
Hugging Face's ``apply_chat_template`` renders it (a sandboxed Jinja environment
with ``trim_blocks``/``lstrip_blocks`` and loop controls, ``raise_exception``,
``tojson``, the tokenizer config's special tokens, ``add_generation_prompt``
true); such templates write their own special tokens, so their text is tokenised
without adding any. Without one, ``DEFAULT_CHAT_TEMPLATE``: ChatML,

    <|im_start|>{role}\\n{content}<|im_end|>\\n ... <|im_start|>assistant\\n

tokenised like a text prompt (the tokenizer adds its BOS, if it has one).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class Role(enum.Enum):
    SYSTEM = "system"
    DEVELOPER = "developer"
    USER = "user"
    ASSISTANT = "assistant"


class ChatError(ValueError):
    """A message that is not valid; ``param`` names the field."""

    def __init__(self, message: str, *, param: str, unsupported: bool = False) -> None:
        super().__init__(message)
        self.param = param
        self.unsupported = unsupported


@dataclass(frozen=True, kw_only=True)
class ChatMessage:
    role: Role
    content: str
    name: str | None = None

    def as_template_value(self) -> dict[str, str]:
        value = {"role": self.role.value, "content": self.content}
        if self.name is not None:
            value["name"] = self.name
        return value


def _content(raw: Any, param: str) -> str:
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list) or not raw:
        raise ChatError(
            f"{param}: expected a string or a non-empty list of text parts", param=param
        )
    texts = []
    for j, part in enumerate(raw):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise ChatError(f"{where}: expected an object {{type, text}}", param=where)
        kind = part.get("type")
        if kind != "text":
            raise ChatError(
                f"{where}.type: only 'text' parts are supported, got {kind!r}",
                param=f"{where}.type",
                unsupported=isinstance(kind, str),
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatError(f"{where}.text: expected a string", param=f"{where}.text")
        texts.append(text)
    # Parts of one message are joined by newlines, as vLLM joins them.
    return "\n".join(texts)


def parse_messages(raw: Any) -> tuple[ChatMessage, ...]:
    """The validated messages; ``ChatError`` naming the first bad field."""
    if not isinstance(raw, list) or not raw:
        raise ChatError("messages: expected a non-empty list of messages", param="messages")
    roles = [r.value for r in Role]
    out = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ChatError(f"{where}: expected an object {{role, content}}", param=where)
        role = message.get("role")
        if role in ("tool", "function"):
            raise ChatError(
                f"{where}.role: {role!r} messages need tool calling, which this server does "
                "not support",
                param=f"{where}.role",
                unsupported=True,
            )
        if role not in roles:
            raise ChatError(
                f"{where}.role: expected one of {roles}, got {role!r}", param=f"{where}.role"
            )
        if message.get("tool_calls"):
            raise ChatError(
                f"{where}.tool_calls: tool calling is not supported by this server",
                param=f"{where}.tool_calls",
                unsupported=True,
            )
        if "content" not in message:
            raise ChatError(f"{where}.content: required", param=f"{where}.content")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise ChatError(f"{where}.name: expected a string", param=f"{where}.name")
        out.append(
            ChatMessage(
                role=Role(role),
                content=_content(message["content"], f"{where}.content"),
                name=name,
            )
        )
    return tuple(out)


class ChatTemplate:
    """Renders messages into the prompt text (``render``); ``ChatError`` (param
    ``messages``) when the template itself refuses them (``raise_exception``).

    ``adds_special_tokens``: the rendered text already holds the special tokens (a
    model's own template), so it must be tokenised without adding a BOS again."""

    def __init__(
        self,
        render: Callable[[Sequence[ChatMessage]], str],
        *,
        adds_special_tokens: bool,
        source: str,
    ) -> None:
        self._render = render
        self.adds_special_tokens = adds_special_tokens
        self.source = source  # where it came from, for the logs

    def render(self, messages: Sequence[ChatMessage]) -> str:
        return self._render(messages)


def _chatml(messages: Sequence[ChatMessage]) -> str:
    turns = [f"<|im_start|>{m.role.value}\n{m.content}<|im_end|>\n" for m in messages]
    return "".join(turns) + "<|im_start|>assistant\n"


DEFAULT_CHAT_TEMPLATE = ChatTemplate(_chatml, adds_special_tokens=False, source="ChatML default")


class _TemplateRefused(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRefused(message)


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string, or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def jinja_chat_template(source: str, special_tokens: Mapping[str, str]) -> ChatTemplate:
    """A Jinja chat template; ``ValueError`` if it does not compile (or jinja2 is absent)."""
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # comes with the workers' extra (torch)
        raise ValueError("the model has a Jinja chat template: install jinja2") from exc

    def tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        template = env.from_string(source)
    except TemplateError as exc:
        raise ValueError(f"the chat template does not compile: {exc}") from exc

    def render(messages: Sequence[ChatMessage]) -> str:
        try:
            return template.render(
                messages=[m.as_template_value() for m in messages],
                add_generation_prompt=True,
                tools=None,
                documents=None,
                **special_tokens,
            )
        except _TemplateRefused as exc:
            raise ChatError(
                f"messages: the model's chat template: {exc}", param="messages"
            ) from exc
        except TemplateError as exc:
            raise ChatError(
                f"messages: the model's chat template failed on them: {exc}", param="messages"
            ) from exc

    return ChatTemplate(render, adds_special_tokens=True, source="the model's chat template")


def load_chat_template(model_dir: Path) -> ChatTemplate:
    """The model folder's chat template, or ``DEFAULT_CHAT_TEMPLATE`` if it has none;
    ``ValueError`` naming the file if one is there and unusable."""
    config_path = model_dir / TOKENIZER_CONFIG_FILE
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            loaded = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{config_path}: cannot be read: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ValueError(f"{config_path}: expected a JSON object")
        config = loaded
    source: Any = None
    where = config_path
    jinja_file = model_dir / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        source, where = jinja_file.read_text(encoding="utf-8"), jinja_file
    else:
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the one called "default"
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
    if source is None:
        return DEFAULT_CHAT_TEMPLATE
    if not isinstance(source, str):
        raise ValueError(f"{where}: chat_template: expected a string")
    special = {
        key: text
        for key, value in config.items()
        if key.endswith("_token") and (text := _token_text(value)) is not None
    }
    try:
        return jinja_chat_template(source, special)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
