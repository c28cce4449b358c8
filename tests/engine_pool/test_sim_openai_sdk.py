"""The official openai SDK talks to the simulated engine directly, as it would to vLLM."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from engine_pool.sim.server import SimServer

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something short."}]


@pytest.fixture
async def client(sim: SimServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="unused") as c:
        yield c


async def test_chat_non_streaming(client: openai.AsyncOpenAI, sim: SimServer) -> None:
    reply = await client.chat.completions.create(model="qwen3.6", messages=MESSAGES, max_tokens=6)
    assert reply.object == "chat.completion"
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == " lorem ipsum dolor sit amet consectetur"
    assert reply.usage is not None and reply.usage.completion_tokens == 6
    assert reply.usage.prompt_tokens == sim.requests()[0].prompt_tokens > 5


async def test_chat_streaming_with_usage(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="qwen3.6",
        messages=MESSAGES,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Request-Id": "sdk-stream"},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " lorem ipsum dolor sit amet"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5
    assert {c.id for c in chunks} == {"chatcmpl-sdk-stream"}


async def test_completions_both_ways(client: openai.AsyncOpenAI) -> None:
    full = await client.completions.create(model="qwen3.6", prompt="The river", max_tokens=3)
    assert full.choices[0].text == " lorem ipsum dolor"
    assert full.usage is not None and full.usage.completion_tokens == 3
    stream = await client.completions.create(
        model="qwen3.6", prompt="The river", max_tokens=3, stream=True
    )
    texts = [c.choices[0].text async for c in stream]
    assert texts == [" lorem", " ipsum", " dolor"]


async def test_errors_map_to_the_sdks_exceptions(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert "does not exist" in missing.value.message
    with pytest.raises(openai.BadRequestError) as too_much:
        await client.chat.completions.create(model="qwen3.6", messages=MESSAGES, max_tokens=40_000)
    assert too_much.value.param == "max_tokens"
    assert "cannot be greater than max_model_len=32768" in too_much.value.message
    with pytest.raises(openai.BadRequestError) as too_long:
        await client.completions.create(model="qwen3.6", prompt="The" + " cat" * 33_000)
    assert too_long.value.param == "input_tokens"
    assert "maximum context length is 32768 tokens" in too_long.value.message


async def test_models_list(client: openai.AsyncOpenAI) -> None:
    models = [m.id async for m in client.models.list()]
    assert models == ["qwen3.6", "Qwen/Qwen3.6-35B-A3B"]


async def test_output_is_a_function_of_the_context(client: openai.AsyncOpenAI) -> None:
    """The same request answers the same text; a continuation of its first k tokens (chat: the
    assistant message continued; completions: prompt plus text) answers the rest of it."""
    whole = await client.chat.completions.create(model="qwen3.6", messages=MESSAGES, max_tokens=13)
    text = whole.choices[0].message.content or ""
    again = await client.chat.completions.create(model="qwen3.6", messages=MESSAGES, max_tokens=13)
    assert again.choices[0].message.content == text
    words = text.split(" ")[1:]
    head = "".join(f" {w}" for w in words[:5])
    rest = await client.chat.completions.create(
        model="qwen3.6",
        messages=[*MESSAGES, {"role": "assistant", "content": head}],
        max_tokens=8,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert head + (rest.choices[0].message.content or "") == text
    seeded = await client.chat.completions.create(
        model="qwen3.6", messages=MESSAGES, max_tokens=3, seed=3
    )
    assert seeded.choices[0].message.content == " sit amet consectetur"
    full = await client.completions.create(model="qwen3.6", prompt="The river", max_tokens=20)
    cut = full.choices[0].text[: len(" lorem ipsum dolor")]
    tail = await client.completions.create(model="qwen3.6", prompt="The river" + cut, max_tokens=17)
    assert cut + tail.choices[0].text == full.choices[0].text
