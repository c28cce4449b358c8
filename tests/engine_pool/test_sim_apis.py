"""The simulated engine serves the rest of vLLM's API in vLLM's shapes: Responses and Anthropic
Messages (bodies and typed SSE events), embeddings, pooling, score, rerank, detokenize, audio.
The pooling and audio routes exist only for a model that serves those tasks: these tests run an
engine whose model serves every task (tests/support/sim_profiles.py)."""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest

from engine_pool.sim.server import SimServer, run_sim
from engine_pool.sim.wire import output_text
from gateway.protocols.routes import ENGINE_ROUTES
from gateway.tools.sim_support import RegistryCounter
from tests.support.sim_profiles import every_task


@pytest.fixture
async def sim(engine_counter: RegistryCounter) -> AsyncIterator[SimServer]:
    async with run_sim(every_task(), time_scale=0.01, counter=engine_counter) as server:
        yield server


@pytest.fixture
async def client(sim: SimServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as c:
        yield c


def events(raw: bytes) -> list[tuple[str, dict[str, object]]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        head, data = block.split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: ")
        out.append((head[7:], orjson.loads(data[6:])))
    return out


async def test_responses_stream_is_typed_events_with_sequence_numbers(
    client: httpx.AsyncClient,
) -> None:
    r = await client.post(
        "/v1/responses",
        json={"model": "qwen3.6", "input": "hi", "max_output_tokens": 3, "stream": True},
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    got = events(r.content)
    assert [kind for kind, _ in got] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in got] == list(range(11))
    assert all(data["type"] == kind for kind, data in got)
    assert b"[DONE]" not in r.content
    completed = got[-1][1]["response"]
    assert isinstance(completed, dict) and completed["status"] == "incomplete"
    assert completed["usage"]["output_tokens"] == 3


async def test_messages_stream_and_body(client: httpx.AsyncClient) -> None:
    body = {"model": "qwen3.6", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    r = await client.post("/v1/messages", json={**body, "stream": True})
    kinds = [kind for kind, _ in events(r.content)]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    plain = (await client.post("/v1/messages", json=body)).json()
    assert plain["type"] == "message" and plain["content"] == [
        {"type": "text", "text": output_text(0, 2)}
    ]
    assert plain["stop_reason"] == "max_tokens" and plain["usage"]["output_tokens"] == 2
    missing = await client.post("/v1/messages", json={**body, "model": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


async def test_unknown_previous_response_is_404_like_vllm(client: httpx.AsyncClient) -> None:
    first = (await client.post("/v1/responses", json={"model": "qwen3.6", "input": "a"})).json()
    ok = await client.post(
        "/v1/responses",
        json={"model": "qwen3.6", "input": "b", "previous_response_id": first["id"]},
    )
    gone = await client.post(
        "/v1/responses", json={"model": "qwen3.6", "input": "b", "previous_response_id": "resp_x"}
    )
    assert ok.status_code == 200
    assert gone.status_code == 404 and "resp_x" in gone.json()["error"]["message"]


async def test_pooling_routes(client: httpx.AsyncClient, sim: SimServer) -> None:
    floats = (
        await client.post("/v1/embeddings", json={"model": "qwen3.6", "input": ["a", "b"]})
    ).json()
    packed = (
        await client.post(
            "/v1/embeddings", json={"model": "qwen3.6", "input": "a", "encoding_format": "base64"}
        )
    ).json()
    vector = floats["data"][0]["embedding"]
    raw = base64.b64decode(packed["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(vector)}f", raw)) == pytest.approx(vector)
    assert floats["usage"]["prompt_tokens"] == sim.requests()[0].prompt_tokens > 0
    pooled = (await client.post("/pooling", json={"model": "qwen3.6", "input": "a"})).json()
    assert pooled["data"][0]["object"] == "pooling"
    scored = (
        await client.post(
            "/v1/score", json={"model": "qwen3.6", "text_1": "q", "text_2": ["a", "b"]}
        )
    ).json()
    assert [d["index"] for d in scored["data"]] == [0, 1]
    ranked = (
        await client.post(
            "/v1/rerank",
            json={"model": "qwen3.6", "query": "q", "documents": ["a", "b", "c"], "top_n": 2},
        )
    ).json()
    scores = [r["relevance_score"] for r in ranked["results"]]
    assert len(scores) == 2 and scores == sorted(scores, reverse=True)
    assert all(r.route in ("embeddings", "pooling", "score", "rerank") for r in sim.requests())


async def test_tokenize_detokenize_round_trip(client: httpx.AsyncClient) -> None:
    text = "hello 東京 <|im_start|>"
    tokens = (await client.post("/tokenize", json={"model": "qwen3.6", "prompt": text})).json()
    back = await client.post("/detokenize", json={"model": "qwen3.6", "tokens": tokens["tokens"]})
    assert back.json() == {"prompt": text}
    bad = await client.post("/detokenize", json={"model": "qwen3.6", "tokens": [10**9]})
    assert bad.status_code == 400


async def test_audio_transcription_and_version(client: httpx.AsyncClient, sim: SimServer) -> None:
    r = await client.post(
        "/v1/audio/transcriptions",
        data={"model": "qwen3.6"},
        files={"file": ("a.wav", b"RIFF0000", "audio/wav")},
    )
    assert r.status_code == 200 and r.json() == {"text": output_text(0, 16).strip()}
    assert sim.requests()[0].prompt_tokens == 1500
    assert (await client.get("/version")).json()["version"].endswith("+sim")


async def test_the_sim_serves_every_path_the_gateway_forwards(client: httpx.AsyncClient) -> None:
    """The sim keeps its own route table (engine_pool never imports gateway); a path the gateway
    forwards and the sim lacks would answer 404 here instead of vLLM's 400 for a bad body."""
    for path, route in ENGINE_ROUTES.items():
        r = await client.post(path, json={})
        assert r.status_code == 400, (path, r.status_code, r.text)
        if route.errors == "anthropic":
            assert r.json()["type"] == "error", path
        else:
            assert r.json()["error"]["code"] == 400, path
