"""The router's text layer: stop strings over split text, and chat templates (the
model's own rendered as Hugging Face renders it, checked against transformers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.router_chat import (
    DEFAULT_CHAT_TEMPLATE,
    ChatError,
    load_chat_template,
    parse_messages,
)
from workers.router_stop import StopMatcher

# --------------------------------------------------------------------------- stop strings


def split_at(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=40),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=12),
)
def test_released_text_is_the_text_up_to_the_first_stop_however_it_is_split(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    found = [s for s in stops if s in text]
    # Generation stops where the first stop string completes.
    ends = [text.find(s) + len(s) for s in found]
    matcher = StopMatcher(stops)
    released, stopped = "", False
    seen = ""
    for piece in split_at(text, cuts):
        seen += piece
        out, stopped = matcher.feed(piece)
        released += out
        # Never ahead of what could still turn out to begin a stop string.
        assert seen.startswith(released)
        if stopped:
            break
    if not stopped:
        released += matcher.flush()
    if not found:
        assert (released, stopped) == (text, False)
    else:
        assert stopped
        # Cut at the leftmost stop string complete by then, however the text was split.
        visible = text[: min(ends)]
        assert released == text[: min(visible.find(s) for s in stops if s in visible)]


def test_a_stop_string_is_held_back_while_it_may_still_complete() -> None:
    matcher = StopMatcher(["</answer>"])
    assert matcher.feed("42 </ans") == ("42 ", False)
    assert matcher.feed("wer> more") == ("", True)


def test_an_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="stops"):
        StopMatcher(["a", ""])


# --------------------------------------------------------------------------- templates

# A Llama-3-style template: special tokens, trim_blocks, a loop control, raise_exception.
TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('the system message must come first') }}"
    "{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief. "},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": [{"type": "text", "text": "Count"}]},
]


def write_model(folder: Path, config: dict[str, object]) -> Path:
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_the_models_template_renders_as_transformers_renders_it(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    config = {"chat_template": TEMPLATE, "bos_token": {"content": "<|begin_of_text|>"}}
    template = load_chat_template(write_model(tmp_path / "m", config))
    assert template.adds_special_tokens
    ours = template.render(parse_messages(MESSAGES))
    reference_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.BPE()),
        bos_token="<|begin_of_text|>",
    )
    plain = [{**m, "content": "Count"} if isinstance(m["content"], list) else m for m in MESSAGES]
    theirs = reference_tok.apply_chat_template(
        plain, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs


def test_a_template_that_refuses_the_messages_is_a_chat_error(tmp_path: Path) -> None:
    template = load_chat_template(write_model(tmp_path / "m", {"chat_template": TEMPLATE}))
    messages = parse_messages([MESSAGES[1], MESSAGES[0]])
    with pytest.raises(ChatError, match="the system message must come first") as caught:
        template.render(messages)
    assert caught.value.param == "messages"


def test_named_templates_use_the_default_one_and_a_jinja_file_wins(tmp_path: Path) -> None:
    named = {
        "chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"},
        ]
    }
    folder = write_model(tmp_path / "m", named)
    assert load_chat_template(folder).render(parse_messages(MESSAGES)) == "D"
    (folder / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert load_chat_template(folder).render(parse_messages(MESSAGES)) == "J4"


def test_without_a_template_the_default_is_chatml(tmp_path: Path) -> None:
    assert load_chat_template(tmp_path) is DEFAULT_CHAT_TEMPLATE
    folder = write_model(tmp_path / "m", {"bos_token": "<s>"})
    template = load_chat_template(folder)
    assert not template.adds_special_tokens
    rendered = template.render(parse_messages(MESSAGES[1:3]))
    assert rendered == (
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_a_template_that_does_not_compile_is_refused_naming_the_file(tmp_path: Path) -> None:
    folder = write_model(tmp_path / "m", {"chat_template": "{% for m in messages %}"})
    with pytest.raises(ValueError, match=r"tokenizer_config\.json"):
        load_chat_template(folder)


def test_sara_routers_chat_tokenizer_adds_no_bos_to_a_template_that_writes_its_own(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch")
    from cli.router_cmd import _tokenizer
    from workers.checkpoint import tiny_config, train_tokenizer

    train_tokenizer(tiny_config()).save(str(tmp_path / "tokenizer.json"))
    tokenize, detokenize, tokenize_bare = _tokenizer(tmp_path)
    bos = 1  # the tiny tokenizer's <s>
    assert tokenize("Hello")[0] == bos and tokenize_bare("Hello")[0] != bos
    assert tokenize("Hello")[1:] == tokenize_bare("Hello")
    assert tokenize_bare("<s>Hello") == [bos, *tokenize_bare("Hello")]
    assert detokenize(tokenize_bare("Hello")) == "Hello"
