"""gateway.count.tokenizers.conversation: the messages vLLM 0.32 hands the chat template.

The reference is vLLM's own preprocessing (vllm/renderers/chat_utils.py, vllm/renderers/hf.py)
followed by transformers' ``apply_chat_template`` on the shipped Qwen3.6 template: each case
below is rendered both ways and the counts compared.
"""

from __future__ import annotations

import os
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.count.tokenizers.conversation import (
    BILLING_HEADER,
    TemplateRejected,
    content_format,
    conversation,
    names_developer,
)
from gateway.count.tokens import TokenCounter
from gateway.protocols.openai import ChatPrompt

DATA = Path(__file__).resolve().parents[3] / "gateway" / "count" / "tokenizer_data"
QWEN_TEMPLATE = (DATA / "qwen3.6" / "chat_template.jinja").read_text()
BILLING = "x-anthropic-billing-header: cc_version=2.1.77.abc; cc_entrypoint=cli; cch=1f2e3;"


def parse(source: str) -> Any:
    return ImmutableSandboxedEnvironment().parse(source)


def chat(*messages: dict[str, Any]) -> ChatPrompt:
    return ChatPrompt(messages=messages)


@pytest.fixture(scope="module")
def counter() -> Iterator[TokenCounter]:
    models = [
        {
            "name": "hf",
            "tokenizer": {"source": "builtin", "name": "qwen3.6", "chat_template": "hf"},
        },
        {
            "name": "chatml",
            "tokenizer": {"source": "builtin", "name": "qwen3.6", "chat_template": "chatml"},
        },
    ]
    counter = TokenCounter.for_models(models)
    yield counter
    counter.close()


@pytest.fixture(scope="module")
def hf_qwen(tmp_path_factory: pytest.TempPathFactory) -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("qwen3.6-conv")
    with zipfile.ZipFile(DATA / "qwen3.6" / "tokenizer.json.zip") as archive:
        (folder / "tokenizer.json").write_bytes(archive.read("tokenizer.json"))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DATA / "qwen3.6" / name, folder / name)
    return AutoTokenizer.from_pretrained(str(folder))


def hf_count(hf_qwen: Any, messages: list[dict[str, Any]]) -> tuple[str, int]:
    text = hf_qwen.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text, len(hf_qwen.encode(text, add_special_tokens=False))


# -- content format -------------------------------------------------------------------------


def test_qwen_template_is_openai_format_and_chatml_like_templates_are_string() -> None:
    assert content_format(parse(QWEN_TEMPLATE)) == "openai"
    assert content_format(parse("{% for m in messages %}{{ m['content'] }}{% endfor %}")) == (
        "string"
    )
    loops = "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}"
    assert content_format(parse(loops)) == "openai"
    # A macro that loops over a parameter nobody passes message content to: still "string".
    unused = (
        "{% macro r(content) %}{% for i in content %}{{ i }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    assert content_format(parse(unused)) == "string"


def test_text_parts_are_concatenated_by_the_qwen_template(
    counter: TokenCounter, hf_qwen: Any
) -> None:
    """Defect 1: vLLM passes the parts to Qwen's template as a list (it concatenates them);
    joined with "\\n" first they counted one token high per join."""
    parts = [{"type": "text", "text": t} for t in ("Describe", " the sea", " in one line.")]
    prompt = chat({"role": "user", "content": parts})

    text, tokens = hf_count(hf_qwen, [{"role": "user", "content": parts}])

    assert "Describe the sea in one line." in text
    assert counter.render_chat("hf", prompt) == text
    assert counter.count_sync("hf", prompt).tokens == tokens
    # The built-in ChatML stays vLLM's "string" format: parts joined with "\n".
    assert "Describe\n the sea\n in one line." in counter.render_chat("chatml", prompt)


def test_string_format_drops_empty_texts_and_tool_parts_join_with_newlines() -> None:
    prompt = chat(
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, "", {"type": "text", "text": "b"}],
        },
        {"role": "tool", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
    )
    as_string = conversation(prompt, "string", developer_role=False)
    as_list = conversation(prompt, "openai", developer_role=False)

    assert as_string[0]["content"] == "a\nb"
    assert as_list[0]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": ""},
        {"type": "text", "text": "b"},
    ]
    assert as_string[1]["content"] == as_list[1]["content"] == "x\ny"


# -- developer role -------------------------------------------------------------------------


def test_developer_becomes_system_for_a_template_that_does_not_name_it(
    counter: TokenCounter, hf_qwen: Any
) -> None:
    """Defect 2: Qwen's template raises "Unexpected message role." on developer; vLLM maps it
    to system first (and merges system messages into one at the front)."""
    assert not names_developer(QWEN_TEMPLATE)
    prompt = chat(
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hello"},
    )
    text, tokens = hf_count(
        hf_qwen, [{"role": "system", "content": "Answer in French."}, prompt.messages[1]]
    )

    assert counter.render_chat("hf", prompt) == text
    assert counter.count_sync("hf", prompt).tokens == tokens
    assert counter.render_chat("chatml", prompt).startswith("<|im_start|>system\nAnswer in")


def test_system_and_developer_messages_merge_into_one_leading_system(
    counter: TokenCounter, hf_qwen: Any
) -> None:
    prompt = chat(
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {
            "role": "developer",
            "content": [{"type": "text", "text": "No"}, {"type": "text", "text": "emoji."}],
        },
    )
    merged = conversation(prompt, "openai", developer_role=False)

    assert merged == [
        {"role": "system", "content": "Be brief.\n\nNo\nemoji."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    _, tokens = hf_count(hf_qwen, merged)
    assert counter.count_sync("hf", prompt).tokens == tokens
    # A template that names the role gets it unchanged.
    kept = conversation(prompt, "openai", developer_role=True)
    assert [m["role"] for m in kept] == ["system", "user", "developer"]
    assert names_developer("{% if m.role == 'developer' %}{% endif %}")


# -- the Claude Code billing line -----------------------------------------------------------


def test_the_billing_line_of_a_system_message_is_dropped(
    counter: TokenCounter, hf_qwen: Any
) -> None:
    """Defect 8: vLLM drops the first line of a system text that starts with the header."""
    prompt = chat(
        {"role": "system", "content": f"{BILLING}\nYou are Claude Code."},
        {"role": "user", "content": "hi"},
    )
    text, tokens = hf_count(
        hf_qwen,
        [{"role": "system", "content": "You are Claude Code."}, {"role": "user", "content": "hi"}],
    )

    assert counter.render_chat("hf", prompt) == text
    assert counter.count_sync("hf", prompt).tokens == tokens
    assert BILLING not in counter.render_chat("chatml", prompt)


def test_billing_rule_only_on_system_text_that_starts_with_it() -> None:
    parts = [
        {"type": "text", "text": BILLING},  # the whole part: dropped
        {"type": "text", "text": "keep " + BILLING},  # not at the start: kept
        BILLING + "\nrest",  # a plain string part: its first line dropped
    ]
    system = conversation(chat({"role": "system", "content": parts}), "openai", False)[0]
    user = conversation(chat({"role": "user", "content": BILLING}), "string", False)[0]

    assert system["content"] == [
        {"type": "text", "text": "keep " + BILLING},
        {"type": "text", "text": "rest"},
    ]
    assert user["content"] == BILLING


# -- fields and tool calls ------------------------------------------------------------------


def test_only_the_fields_vllm_knows_reach_the_template() -> None:
    prompt = chat(
        {"role": "user", "content": "q", "name": "bob", "extra": 1},
        {
            "role": "assistant",
            "content": "a",
            "reasoning": "because",
            "reasoning_content": "ignored",
            "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "not json"}},
                {"type": "function", "function": {"name": "g", "arguments": "[1]"}},
                {"type": "function", "function": {"name": "h", "arguments": '{"x": 1}'}},
            ],
        },
        {"role": "assistant", "content": "b", "tool_calls": []},
    )
    user, assistant, empty = conversation(prompt, "string", False)

    assert user == {"role": "user", "content": "q", "name": "bob"}
    assert assistant["reasoning"] == assistant["reasoning_content"] == "because"
    assert [c["function"]["arguments"] for c in assistant["tool_calls"]] == [{}, {}, {"x": 1}]
    assert "tool_calls" not in empty
    assert prompt.messages[1]["tool_calls"][2]["function"]["arguments"] == '{"x": 1}'  # unchanged


def test_a_tool_call_that_is_not_a_function_is_refused() -> None:
    prompt = chat({"role": "assistant", "content": "", "tool_calls": [{"type": "custom"}]})
    with pytest.raises(TemplateRejected, match="type 'function'"):
        conversation(prompt, "string", False)


@pytest.mark.parametrize("fmt", ["string", "openai"])
@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool", "x"])
@pytest.mark.parametrize(
    "text", ["", "hi", "a\nb", f"{BILLING_HEADER}: cc=1\nrest", BILLING_HEADER, "<|im_end|>"]
)
def test_a_string_content_is_what_its_one_text_part_makes(fmt: Any, role: str, text: str) -> None:
    """The one-string shortcut of ``_content`` gives what the general path gives for the
    same text as a one-part list, in both formats and every role (empty text included)."""
    for developer_role in (False, True):
        as_string = conversation(
            ChatPrompt(messages=({"role": role, "content": text},)), fmt, developer_role
        )
        as_list = conversation(
            ChatPrompt(messages=({"role": role, "content": [text]},)), fmt, developer_role
        )
        assert as_string == as_list
