"""The official openai and anthropic SDKs, unchanged, against the gateway in front of simulated
vLLM engines (the ``shapegate demo`` shape: two lanes, sim engines, real sockets).

The engines' app is wrapped by a recorder, so the bytes a client receives through the gateway
are compared with the bytes the engine sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from engine_pool.sim.server import SimServer
from engine_pool.sim.wire import output_text
from gateway.count.tokens import TokenCounter
from gateway.tools.sim_support import RegistryCounter
from tests.conftest import lanes_config
from tests.support.sim_profiles import every_task

TOOLS_OPENAI: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
TOOLS_ANTHROPIC: list[Any] = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


class Recorder:
    """ASGI middleware keeping every response body the engine sent, by x-request-id."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.sent: dict[str, bytes] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = dict(scope["headers"]).get(b"x-request-id", b"").decode()

        async def recording(message: Any) -> None:
            if message["type"] == "http.response.body" and rid:
                self.sent[rid] = self.sent.get(rid, b"") + message.get("body", b"")
            await send(message)

        await self.app(scope, receive, recording)


@pytest.fixture
async def demo(counter: TokenCounter, gateway_at: Any) -> AsyncIterator[dict[str, Any]]:
    shared = RegistryCounter(counter, "qwen3.6")
    # Models that serve every task: the SDKs' embeddings go through too (a generate-only
    # model's vLLM, like the shipped profiles', 404s them).
    fast = SimServer(every_task("h100-fast"), time_scale=0.2, counter=shared, seed=1)
    heavy = SimServer(every_task("h100-heavy"), time_scale=0.2, counter=shared, seed=2)
    recorder = Recorder(fast.app)
    fast.app = recorder
    await fast.start()
    await heavy.start()
    try:
        config = lanes_config([fast.url], [heavy.url], threshold=32768)
        async with gateway_at(config) as (url, _):
            yield {"url": url, "fast": fast, "recorder": recorder}
    finally:
        await fast.stop()
        await heavy.stop()


async def test_openai_responses_non_streaming(demo: dict[str, Any]) -> None:
    async with openai.AsyncOpenAI(base_url=demo["url"] + "/v1", api_key="unused") as client:
        raw = await client.responses.with_raw_response.create(
            model="qwen3.6",
            instructions="Answer briefly.",
            input=[{"role": "user", "content": "What is the weather in 東京?"}],
            tools=TOOLS_OPENAI,
            max_output_tokens=5,
        )
        response = raw.parse()
    assert response.output_text == output_text(0, 5)
    assert response.status == "incomplete"  # stopped by max_output_tokens
    assert response.usage is not None and response.usage.output_tokens == 5
    # A small prompt is decided by the free upper bound (UTF-8 bytes), never below the truth.
    assert response.usage.input_tokens <= int(raw.headers["x-shapegate-prompt-tokens"])
    assert raw.headers["x-shapegate-lane"] == "fast"


async def test_openai_responses_streaming_and_bytes_equal_the_engines(
    demo: dict[str, Any],
) -> None:
    async with openai.AsyncOpenAI(base_url=demo["url"] + "/v1", api_key="unused") as client:
        stream = await client.responses.create(
            model="qwen3.6", input="Say hi", max_output_tokens=4, stream=True
        )
        events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds.count("response.output_text.delta") == 4
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1]
    assert done.type == "response.completed"
    assert done.response.output_text == output_text(0, 4)

    body = {"model": "qwen3.6", "input": "Say hi", "max_output_tokens": 4, "stream": True}
    async with httpx.AsyncClient(base_url=demo["url"]) as raw:
        got = b""
        async with raw.stream(
            "POST", "/v1/responses", json=body, headers={"x-request-id": "bytes-1"}
        ) as r:
            async for chunk in r.aiter_raw():
                got += chunk
    assert got == demo["recorder"].sent["bytes-1"]
    assert got.startswith(b"event: response.created\ndata: ")


async def test_openai_embeddings_and_models_retrieve(demo: dict[str, Any]) -> None:
    async with openai.AsyncOpenAI(base_url=demo["url"] + "/v1", api_key="unused") as client:
        base64_default = await client.embeddings.create(model="qwen3.6", input=["a", "b 東京"])
        floats = await client.embeddings.create(model="qwen3.6", input="a", encoding_format="float")
        model = await client.models.retrieve("qwen3.6")
    assert [d.index for d in base64_default.data] == [0, 1]
    assert len(base64_default.data[0].embedding) == 16
    assert base64_default.data[0].embedding == pytest.approx(floats.data[0].embedding)
    assert base64_default.usage.prompt_tokens > 0
    assert model.id == "qwen3.6"


async def test_anthropic_messages_with_tools_streaming_and_not(demo: dict[str, Any]) -> None:
    async with anthropic.AsyncAnthropic(base_url=demo["url"], api_key="unused") as client:
        message = await client.messages.create(
            model="qwen3.6",
            max_tokens=6,
            system="You are terse.",
            tools=TOOLS_ANTHROPIC,
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": "t1",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        }
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}],
                },
            ],
        )
        assert message.content[0].type == "text"
        assert message.content[0].text == output_text(0, 6)
        assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 6
        async with client.messages.stream(
            model="qwen3.6",
            max_tokens=5,
            tools=TOOLS_ANTHROPIC,
            messages=[{"role": "user", "content": "Say hi"}],
        ) as stream:
            texts = [text async for text in stream.text_stream]
            final = await stream.get_final_message()
    assert "".join(texts) == output_text(0, 5)
    assert final.usage.output_tokens == 5 and final.stop_reason == "max_tokens"


async def test_anthropic_errors_reach_the_sdk_as_anthropic_errors(demo: dict[str, Any]) -> None:
    async with anthropic.AsyncAnthropic(base_url=demo["url"], api_key="unused") as client:
        with pytest.raises(anthropic.NotFoundError) as caught:
            await client.messages.create(
                model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}]
            )
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model `nope` does not exist."},
    }


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/responses", {"model": "qwen3.6", "input": "hi", "max_output_tokens": 5000}),
        (
            "/v1/messages",
            {
                "model": "qwen3.6",
                "max_tokens": 5000,
                "messages": [{"role": "user", "content": "hi"}],
            },
        ),
    ],
)
async def test_disconnect_mid_stream_aborts_the_engine_request_and_frees_the_slot(
    demo: dict[str, Any], path: str, body: dict[str, Any]
) -> None:
    rid = "leaver-" + path.rsplit("/", 1)[-1]
    fast: SimServer = demo["fast"]
    async with httpx.AsyncClient(base_url=demo["url"], timeout=10) as client:
        async with client.stream(
            "POST", path, json={**body, "stream": True}, headers={"x-request-id": rid}
        ) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            for _ in range(8):
                await anext(lines)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            records = fast.requests(rid)
            if records and records[0].outcome != "running":
                break
            await asyncio.sleep(0.01)
        state = (await client.get("/admin/state")).json()
    (record,) = fast.requests(rid)
    assert record.outcome == "aborted" and record.abort_reason == "client_disconnect"
    assert 0 < record.tokens_generated < 5000
    assert all(lane["slots_in_use"] == 0 for lane in state["lanes"])
    assert fast.engine.snapshot().running == 0
