"""Client keys, what reaches the engine, and no prompt text anywhere it should not be."""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from gateway.errors import Unauthorized
from gateway.request.auth import ClientAuth
from gateway.settings import AuthSettings
from tests.conftest import JSON, lanes_config
from tests.support.fake_engine import FakeEngine
from tests.support.servers import serve_asgi

CANARY = "zq-canary-7f3a91"


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "qwen3.6", "messages": [{"role": "user", "content": content}], **extra}


def test_keys_are_hashed_and_checked() -> None:
    auth = ClientAuth.from_settings(
        AuthSettings(api_key_sha256=(hashlib.sha256(b"k-one").hexdigest(),), api_keys_env="KEYS"),
        environ={"KEYS": "k-two, k-three"},
    )
    for good in (b"Bearer k-one", b"bearer k-two", b"Bearer k-three"):
        auth.check(good)
    for bad in (None, b"", b"Bearer", b"Bearer k-four", b"Basic k-one", b"k-one"):
        with pytest.raises(Unauthorized):
            auth.check(bad)
    ClientAuth.from_settings(AuthSettings()).check(None)  # no keys configured: open


async def test_the_api_answers_401_in_the_openai_shape_without_a_key(gateway_at: Any) -> None:
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        config = lanes_config([engine_url], [engine_url])
        config["auth"] = {"api_key_sha256": [hashlib.sha256(b"sk-good").hexdigest()]}
        async with gateway_at(config) as (url, _), httpx.AsyncClient(base_url=url) as client:
            for headers in ({}, {"authorization": "Bearer sk-bad"}):
                r = await client.post("/v1/chat/completions", json=chat("hi"), headers=headers)
                assert r.status_code == 401
                assert r.json()["error"]["type"] == "authentication_error"
                models = await client.get("/v1/models", headers=headers)
                assert models.status_code == 401
            ok = await client.post(
                "/v1/chat/completions", json=chat("hi"), headers={"authorization": "Bearer sk-good"}
            )
            assert ok.status_code == 200
            assert (
                await client.get("/v1/models", headers={"authorization": "Bearer sk-good"})
            ).is_success
    assert len(engine.seen) == 1
    assert "authorization" not in next(iter(engine.seen.values())).headers


async def test_only_allowed_headers_reach_the_engine_and_its_key_comes_from_env(
    gateway_at: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAST_ENGINE_KEY", "engine-secret")
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        config = lanes_config([engine_url], [engine_url])
        config["clusters"][0]["api_key_env"] = "FAST_ENGINE_KEY"
        async with gateway_at(config) as (url, _), httpx.AsyncClient() as client:
            r = await client.post(
                url + "/v1/chat/completions",
                json=chat("hi"),
                headers={
                    "authorization": "Bearer client-key",
                    "proxy-authorization": "Basic x",
                    "te": "trailers",
                    "x-internal-debug": "1",
                    "cookie": "session=1",
                    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                    "x-request-id": "rid-1",
                },
            )
            assert r.status_code == 200
            # The engine's own headers pass, but not the one naming its software.
            assert r.headers["x-engine"] == "fake"
            assert "fake-engine" not in repr(r.headers.multi_items())
    seen = engine.seen["rid-1"].headers
    assert seen["authorization"] == "Bearer engine-secret"
    assert seen["traceparent"].startswith("00-0af7")
    for name in ("proxy-authorization", "te", "x-internal-debug", "cookie"):
        assert name not in seen


async def test_no_prompt_text_in_logs_metrics_or_state_on_any_path(gateway_at: Any) -> None:
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        config = lanes_config([engine_url], [engine_url])
        config["lanes"][0]["timeouts"] = {"first_byte_s": 0.3, "idle_s": 0.3, "total_s": 5}
        async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=10) as client:
            with capture_logs() as logs:
                bodies: list[dict[str, Any] | bytes] = [
                    chat(CANARY),
                    chat(CANARY, stream=True),
                    chat(CANARY, fake={"mode": "error", "status": 500}),
                    chat(CANARY, fake={"mode": "hang"}),
                    chat(CANARY, stream=True, fake={"mode": "stall", "chunks": 1}),
                    chat(CANARY, stream=True, fake={"mode": "drop", "chunks": 1}),
                    chat(CANARY * 10_000),  # heavy lane, exact count
                    f'{{"model": "qwen3.6", "messages": [{{"content": "{CANARY}"'.encode(),
                    {"model": "qwen3.6", "messages": [{"role": "user", "content": [CANARY]}]},
                    {"model": "qwen3.6", "messages": CANARY},
                    {"model": "qwen3.6", "prompt": {"text": CANARY}},
                ]
                for body in bodies:
                    for path in ("/v1/chat/completions", "/v1/completions"):
                        if isinstance(body, bytes):
                            await client.post(url + path, content=body, headers=JSON)
                        else:
                            await client.post(url + path, json=body)
            metrics = (await client.get(url + "/metrics")).text
            state = (await client.get(url + "/admin/state")).text
    assert len(logs) > 20
    assert CANARY not in repr(logs)
    assert CANARY not in metrics
    assert CANARY not in state
