"""Every API route the gateway relays, through the official SDKs, against real vLLM: chat,
completions (a batched ``prompt`` list too), Responses and Messages, streamed and not. Each
answer has the API's own shape, carries the engine's usage, and says which lane served it."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from tests.real.engines import MODEL, Real


@pytest.fixture
def oai(real: Real) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=real.gateway.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
def claude(real: Real) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=real.gateway.url, api_key="unused", max_retries=0) as c:
        yield c


def test_chat_not_streamed(oai: openai.OpenAI) -> None:
    raw = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert raw.headers["x-shapegate-lane"] == "fast"
    answer = raw.parse()
    assert answer.object == "chat.completion"
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.usage is not None and answer.usage.completion_tokens >= 1
    assert int(raw.headers["x-shapegate-prompt-tokens"]) == answer.usage.prompt_tokens


def test_chat_streamed_with_usage(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    usages = [c.usage for c in chunks if c.usage is not None]
    assert usages and usages[-1].completion_tokens == 6
    assert chunks[-1].choices == []  # the usage chunk closes the stream


def test_completions_single_and_streamed(oai: openai.OpenAI) -> None:
    answer = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert answer.object == "text_completion" and len(answer.choices) == 1
    assert answer.usage is not None and answer.usage.prompt_tokens == 4
    pieces = list(oai.completions.create(model=MODEL, prompt="abc", max_tokens=4, stream=True))
    assert "".join(p.choices[0].text for p in pieces if p.choices)


def test_completions_batched_prompt_list(oai: openai.OpenAI) -> None:
    """vLLM serves a batch of prompts in one request: one choice per prompt, usage summed."""
    raw = oai.completions.with_raw_response.create(
        model=MODEL, prompt=["hello world", "a b c d"], max_tokens=2
    )
    answer = raw.parse()
    assert sorted(c.index for c in answer.choices) == [0, 1]
    assert answer.usage is not None and answer.usage.prompt_tokens == 2 + 4


def test_responses_not_streamed_and_streamed(oai: openai.OpenAI) -> None:
    answer = oai.responses.create(model=MODEL, input="hello", max_output_tokens=16)
    assert answer.object == "response" and answer.status in ("completed", "incomplete")
    assert answer.usage is not None and answer.usage.input_tokens > 0
    events = list(
        oai.responses.create(model=MODEL, input="hello", max_output_tokens=16, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created", kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    final = events[-1].response  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens > 0


def test_messages_not_streamed_and_streamed(claude: anthropic.Anthropic) -> None:
    raw = claude.messages.with_raw_response.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hello"}]
    )
    assert raw.headers["x-shapegate-lane"] == "fast"
    answer = raw.parse()
    assert answer.type == "message" and answer.role == "assistant"
    assert answer.usage.input_tokens > 0 and answer.usage.output_tokens >= 1
    with claude.messages.stream(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hello"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert isinstance(text, str)
    assert final.usage.output_tokens >= 1
