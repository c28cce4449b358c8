"""The free bound is sound: never below the exact count, for any text, template or vocabulary.

The claim: a byte-level BPE emits at most one token per byte of the text it encodes, and a
special token is one token for many bytes, so UTF-8 bytes of everything the template renders
bound the count. The catch the property test found: Qwen normalises to NFC first, and NFC can
triple a text's bytes (U+1D160 is 4 bytes, its NFC form 12), so the bound measures the NFC form.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.count.tokens import TokenCounter
from gateway.errors import BadRequest
from gateway.protocols.openai import ChatPrompt, CompletionPrompt

NEVER = 2**62  # exact_above so high that the bound is always the answer

SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "<|vision_start|>",
    "<|image_pad|>",
    "<|fim_prefix|>",
    "<|endofprompt|>",
    "<|im_",
    "|>",
    "<|",
]
# Characters whose NFC form is longer in UTF-8 than they are.
EXPANDING = [
    "\U0001d160",
    "\U0001d15f",
    "\ufb2c",
    "\u0344",
    "\u0f73",
    "\u0958",
    "\u2126",
    "e\u0301",
    "\u1e9b\u0323",
]


@pytest.fixture(scope="module")
def counters() -> Iterator[TokenCounter]:
    def tok(name: str, template: str) -> dict[str, Any]:
        return {"source": "builtin", "name": name, "chat_template": template}

    counter = TokenCounter.for_models(
        [
            {"name": "qwen-chatml", "tokenizer": tok("qwen3.6", "chatml")},
            {"name": "qwen-hf", "tokenizer": tok("qwen3.6", "hf")},
            {"name": "cl100k", "tokenizer": tok("cl100k_base", "chatml")},
        ]
    )
    yield counter
    counter.close()


MODELS = ("qwen-chatml", "qwen-hf", "cl100k")

unicode_text = st.text(st.characters(codec="utf-8"), max_size=200)
code_text = st.text(
    st.sampled_from(list("abcdefxyz_0123456789 \t\n(){}[]:;=+-*/<>'\"#.,|\\")), max_size=300
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | unicode_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(unicode_text, inner, max_size=4),
    max_leaves=12,
)
json_text = json_values.map(lambda v: json.dumps(v, ensure_ascii=False))
tricky = st.lists(st.sampled_from(SPECIALS + EXPANDING) | unicode_text, max_size=12).map("".join)
# Runs of NFC-expanding characters: little else in the text to hide a bound that is too low.
expanding = st.lists(st.sampled_from(EXPANDING), min_size=1, max_size=80).map("".join)
any_text = st.one_of(unicode_text, code_text, json_text, tricky, expanding)

content = st.one_of(
    any_text,
    st.none(),
    st.lists(
        st.one_of(
            any_text.map(lambda t: {"type": "text", "text": t}),
            st.just({"type": "image_url", "image_url": {"url": "http://x/y.png"}}),
        ),
        max_size=3,
    ),
)
tool_call = st.builds(
    lambda name, args: {
        "id": "c",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    },
    st.text(st.characters(codec="ascii", categories=["L"]), min_size=1, max_size=10),
    st.dictionaries(
        st.text(st.characters(codec="ascii", categories=["L"]), min_size=1, max_size=8),
        json_values,
        max_size=3,
    ),
)
tool = json_values.map(lambda v: {"type": "function", "function": {"name": "f", "parameters": v}})


@st.composite
def conversations(draw: st.DrawFn) -> ChatPrompt:
    """System?, then user/assistant(/tool) turns with a user query in it: what chat APIs get."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(content)})
    messages.append({"role": "user", "content": draw(any_text), "name": draw(any_text)})
    for _ in range(draw(st.integers(0, 3))):
        calls = draw(st.lists(tool_call, max_size=2))
        reply: dict[str, Any] = {"role": "assistant", "content": draw(content)}
        if calls:
            reply["tool_calls"] = calls
        messages.append(reply)
        if calls:
            messages.append({"role": "tool", "tool_call_id": "c", "content": draw(any_text)})
        messages.append({"role": "user", "content": draw(content)})
    return ChatPrompt(tuple(messages), tuple(draw(st.lists(tool, max_size=2))))


def assert_bound_holds(
    counter: TokenCounter,
    model: str,
    prompt: ChatPrompt | CompletionPrompt,
) -> None:
    try:
        bound = counter.count_sync(model, prompt, exact_above=NEVER)
    except BadRequest:
        return  # the model's own template refused these messages (as the engine would)
    exact = counter.count_sync(model, prompt)
    assert bound.method == "bound"
    assert bound.tokens >= exact.tokens, (model, prompt)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=conversations(), model=st.sampled_from(MODELS))
def test_bound_covers_every_chat_prompt(
    counters: TokenCounter, prompt: ChatPrompt, model: str
) -> None:
    assert_bound_holds(counters, model, prompt)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(any_text, min_size=1, max_size=3), model=st.sampled_from(MODELS))
def test_bound_covers_every_completion_prompt(
    counters: TokenCounter, texts: list[str], model: str
) -> None:
    assert_bound_holds(counters, model, CompletionPrompt(texts=tuple(texts)))


@pytest.mark.parametrize("char", EXPANDING)
def test_bound_measures_the_nfc_form(counters: TokenCounter, char: str) -> None:
    prompt = CompletionPrompt(texts=(char * 64,))
    assert_bound_holds(counters, "qwen-chatml", prompt)


def test_raw_bytes_would_not_bound_an_nfc_expanding_text(counters: TokenCounter) -> None:
    """Why the bound measures the NFC form: here the count exceeds the raw UTF-8 bytes."""
    text = "\U0001d160" * 50  # 200 bytes; NFC gives 3 code points of 4 bytes each
    exact = counters.count_sync("qwen-chatml", CompletionPrompt(texts=(text,)))
    assert exact.tokens > len(text.encode())
    assert exact.prompt_bytes == len(text.encode())
