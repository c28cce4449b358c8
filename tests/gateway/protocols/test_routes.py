"""Every engine route through the whole pipeline, on real sockets: client -> gateway -> engine.

Counted and laned like chat (a prompt whose characters/4 is under the threshold but whose real
token count is over it goes to the heavy lane), forwarded to the same path, answered with the
engine's bytes; errors in the route's own shape; OpenAI-shaped 404 and 405 elsewhere.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import orjson
import pytest
from structlog.testing import capture_logs

from gateway.protocols.routes import ENGINE_ROUTES
from tests.conftest import JSON, lanes_config
from tests.gateway.request.test_pipeline import dense_json

DEMO_THRESHOLD = 32768  # configs/demo.yaml: the fast lane ends here


@pytest.fixture
async def gateway(engines: Any, gateway_at: Any) -> Any:
    config = lanes_config(
        [engines["fast"][1]],
        [engines["heavy"][1]],
        threshold=DEMO_THRESHOLD,
        routes={"forward_headers": ["x-tenant", "OpenAI-Organization"]},
    )
    async with gateway_at(config) as (url, _settings):
        yield url


def dense() -> str:
    """Dense JSON: characters/4 under the demo threshold, real tokens above it."""
    packed = dense_json(120_000)
    assert len(packed) / 4 < DEMO_THRESHOLD
    return packed


def small_and_dense(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    text = dense()
    if path == "/v1/responses":
        return (
            {"model": "qwen3.6", "input": "hello"},
            {
                "model": "qwen3.6",
                "instructions": "be brief",
                "input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}],
            },
        )
    if path == "/v1/messages":
        return (
            {"model": "qwen3.6", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
            {
                "model": "qwen3.6",
                "max_tokens": 8,
                "system": "be brief",
                "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
            },
        )
    return (
        {"model": "qwen3.6", "input": ["hello", "world"]},
        {"model": "qwen3.6", "input": ["short", text]},
    )


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages", "/v1/embeddings"])
async def test_a_dense_prompt_under_chars_over_4_goes_to_the_heavy_lane(
    gateway: str, engines: Any, path: str
) -> None:
    small, large = small_and_dense(path)
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as client:
        with capture_logs() as logs:
            light = await client.post(path, json=small)
            heavy = await client.post(path, json=large)
    assert light.status_code == 200 and heavy.status_code == 200, heavy.text
    assert light.headers["x-shapegate-lane"] == "fast"
    assert heavy.headers["x-shapegate-lane"] == "heavy"
    assert int(heavy.headers["x-shapegate-prompt-tokens"]) > DEMO_THRESHOLD
    # The engine got the original bytes on the same path.
    seen = [s for s in engines["heavy"][0].seen.values() if s.path == path]
    assert len(seen) == 1 and orjson.loads(seen[0].body) == large
    decisions = [e for e in logs if e["event"] == "route.decision"]
    assert [d["lane"] for d in decisions] == ["fast", "heavy"]
    assert decisions[1]["count_method"] in ("exact", "cache")  # counted, not bounded
    assert decisions[1]["route"] == path.rsplit("/", 1)[-1]


async def test_every_engine_route_runs_the_pipeline_to_its_own_upstream_path(
    gateway: str, engines: Any
) -> None:
    bodies: dict[str, Any] = {
        "chat": {"model": "qwen3.6", "messages": [{"role": "user", "content": "hi"}]},
        "completions": {"model": "qwen3.6", "prompt": "hi"},
        "responses": {"model": "qwen3.6", "input": "hi"},
        "messages": {
            "model": "qwen3.6",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
        },
        "embeddings": {"model": "qwen3.6", "input": "hi"},
        "pooling": {"model": "qwen3.6", "input": ["a", "b"]},
        "score": {"model": "qwen3.6", "text_1": "q", "text_2": ["a", "b"]},
        "rerank": {"model": "qwen3.6", "query": "q", "documents": ["a", {"text": "b"}]},
        "tokenize": {"model": "qwen3.6", "prompt": "hello"},
        "detokenize": {"model": "qwen3.6", "tokens": [1, 2, 3]},
    }
    async with httpx.AsyncClient(base_url=gateway, timeout=10) as client:
        for path, route in ENGINE_ROUTES.items():
            if route.multipart:
                continue
            with capture_logs() as logs:
                r = await client.post(path, json=bodies[route.kind])
            assert r.status_code == 200, (path, r.text)
            assert r.headers["x-shapegate-lane"] == "fast"
            finished = [e for e in logs if e["event"] == "route.finished"]
            assert finished and finished[0]["outcome"] == "ok"
    paths = sorted(s.path for s in engines["fast"][0].seen.values())
    assert paths == sorted(p for p, r in ENGINE_ROUTES.items() if not r.multipart)


async def test_multipart_audio_goes_to_the_policy_lane_and_is_bounded(
    engines: Any, gateway_at: Any
) -> None:
    config = lanes_config(
        [engines["fast"][1]], [engines["heavy"][1]], routes={"multipart_lane": "heavy"}
    )
    config["server"]["max_body_bytes"] = 64 * 1024
    async with gateway_at(config) as (url, _), httpx.AsyncClient(base_url=url) as client:
        files = {"file": ("a.wav", b"RIFF" + b"\0" * 4000, "audio/wav")}
        r = await client.post("/v1/audio/transcriptions", data={"model": "qwen3.6"}, files=files)
        assert r.status_code == 200, r.text
        assert r.headers["x-shapegate-lane"] == "heavy"
        assert r.headers["x-shapegate-prompt-tokens"] == "0"
        # Declared over the limit: refused before a byte of the body is read.
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/audio/transcriptions HTTP/1.1\r\nhost: x\r\n"
            b"content-type: multipart/form-data; boundary=b\r\ncontent-length: 10000000\r\n\r\n"
        )
        await writer.drain()
        refused = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert refused.startswith(b"HTTP/1.1 413 ")
        no_model = await client.post("/v1/audio/transcriptions", files=files)
        assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
    seen = list(engines["heavy"][0].seen.values())
    assert len(seen) == 1 and seen[0].path == "/v1/audio/transcriptions"
    assert seen[0].headers["content-type"].startswith("multipart/form-data")


async def test_unknown_routes_and_wrong_methods_answer_in_the_api_shape(gateway: str) -> None:
    async with httpx.AsyncClient(base_url=gateway) as client:
        missing = await client.post("/v1/nothing-here", json={})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == 404 and "detail" not in missing.json()
        wrong = await client.get("/v1/chat/completions")
        assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405
        anthropic_wrong = await client.get("/v1/messages")
        assert anthropic_wrong.status_code == 405
        assert anthropic_wrong.json()["type"] == "error"
        assert anthropic_wrong.json()["error"]["type"] == "invalid_request_error"


async def test_messages_route_answers_errors_in_anthropic_shape(gateway: str) -> None:
    async with httpx.AsyncClient(base_url=gateway) as client:
        unknown = await client.post(
            "/v1/messages",
            json={"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
        )
        bad = await client.post("/v1/messages", content=b"{not json", headers=JSON)
        openai_bad = await client.post("/v1/responses", content=b"{not json", headers=JSON)
    assert unknown.status_code == 404
    assert unknown.json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model `nope` does not exist."},
    }
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert openai_bad.status_code == 400 and openai_bad.json()["error"]["code"] == 400


async def test_models_retrieve_and_version(gateway: str) -> None:
    client = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused")
    model = await client.models.retrieve("Qwen/Qwen3.6-35B-A3B")
    assert model.id == "Qwen/Qwen3.6-35B-A3B" and model.owned_by == "shapegate"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("nope")
    await client.close()
    async with httpx.AsyncClient(base_url=gateway) as raw:
        version = await raw.get("/version")
    assert version.status_code == 200 and version.json()["version"]


async def test_policy_forward_headers_extend_the_allowlist(gateway: str, engines: Any) -> None:
    headers = {
        "x-tenant": "acme",
        "OpenAI-Organization": "org-1",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "x-secret": "never",
    }
    async with httpx.AsyncClient(base_url=gateway) as client:
        r = await client.post(
            "/v1/responses", json={"model": "qwen3.6", "input": "hi"}, headers=headers
        )
    assert r.status_code == 200
    (seen,) = engines["fast"][0].seen.values()
    assert seen.headers["x-tenant"] == "acme"
    assert seen.headers["openai-organization"] == "org-1"
    assert seen.headers["traceparent"].startswith("00-0af7")
    assert "x-secret" not in seen.headers


async def test_without_the_setting_only_the_builtin_headers_pass(
    engines: Any, gateway_at: Any
) -> None:
    config = lanes_config([engines["fast"][1]], [engines["heavy"][1]])
    async with gateway_at(config) as (url, _), httpx.AsyncClient(base_url=url) as client:
        r = await client.post(
            "/v1/embeddings",
            json={"model": "qwen3.6", "input": "hi"},
            headers={"x-tenant": "acme", "traceparent": "00-ab-cd-01"},
        )
    assert r.status_code == 200
    (seen,) = engines["fast"][0].seen.values()
    assert "x-tenant" not in seen.headers and seen.headers["traceparent"] == "00-ab-cd-01"


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_disconnect_mid_stream_frees_the_slot_and_closes_the_engine_request(
    gateway: str, engines: Any, path: str
) -> None:
    small, _ = small_and_dense(path)
    body = {**small, "stream": True, "fake": {"chunks": 50, "gap": 0.1}}
    engine = engines["fast"][0]
    async with httpx.AsyncClient(base_url=gateway, timeout=10) as client:
        with capture_logs() as logs:
            async with client.stream("POST", path, json=body) as response:
                assert response.status_code == 200
                async for _ in response.aiter_bytes():
                    break  # one chunk, then leave
            deadline = time.monotonic() + 5
            while engine.open_requests() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)
        state = (await client.get("/admin/state")).json()
    assert not engine.open_requests(), "the engine request was not closed"
    (seen,) = engine.seen.values()
    assert not seen.completed
    assert all(lane["slots_in_use"] == 0 for lane in state["lanes"])
    finished = [e for e in logs if e["event"] == "route.finished"]
    assert finished[0]["outcome"] == "client_disconnect"


@pytest.mark.parametrize(
    ("path", "tail"),
    [
        ("/v1/messages", b'event: error\ndata: {"type":"error","error":{"type":"api_error"'),
        ("/v1/responses", b'event: error\ndata: {"type":"error","code":"timeout"'),
        ("/v1/chat/completions", b'data: {"error":{"message"'),
    ],
)
async def test_a_stream_cut_by_a_watchdog_ends_in_the_routes_error_shape(
    engines: Any, gateway_at: Any, path: str, tail: bytes
) -> None:
    config = lanes_config([engines["fast"][1]], [engines["heavy"][1]])
    config["lanes"][0]["timeouts"] = {
        "connect_s": 1,
        "first_byte_s": 2,
        "idle_s": 0.3,
        "total_s": 5,
    }
    bodies = {
        "/v1/messages": {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        "/v1/responses": {"input": "hi"},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    }
    body = {
        "model": "qwen3.6",
        "stream": True,
        "fake": {"mode": "stall", "chunks": 2},
        **bodies[path],
    }
    async with (
        gateway_at(config) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        r = await client.post(path, json=body)
    assert r.status_code == 200
    last = r.content.rsplit(b"\n\n", 2)[-2] if path != "/v1/chat/completions" else r.content
    assert tail in last, r.content[-300:]
