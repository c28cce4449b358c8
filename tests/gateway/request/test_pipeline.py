"""End to end through real sockets: client -> gateway -> fake engine."""

from __future__ import annotations

import asyncio
import json
import os
import random
import string
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from structlog.testing import capture_logs

import gateway as gateway_package
from tests.conftest import JSON, lanes_config
from tests.support.fake_engine import FakeEngine
from tests.support.servers import serve_asgi

THRESHOLD = 2000


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "qwen3.6", "messages": [{"role": "user", "content": content}], **extra}


def dense_json(chars: int, seed: int = 7) -> str:
    """Random JSON records: ~2 characters per Qwen token, so chars/4 undercounts by half."""
    rng = random.Random(seed)
    records = []
    while sum(len(r) for r in records) < chars:
        record = {
            "".join(rng.choices(string.ascii_lowercase, k=3)): rng.randint(0, 99999),
            "id": "".join(rng.choices(string.hexdigits, k=12)),
            "v": [rng.random() for _ in range(2)],
        }
        records.append(json.dumps(record))
    return "[" + ",".join(records) + "]"


@pytest.fixture
async def gateway(engines: Any, gateway_at: Any) -> Any:
    config = lanes_config([engines["fast"][1]], [engines["heavy"][1]], threshold=THRESHOLD)
    async with gateway_at(config) as (url, _settings):
        yield url


async def test_routes_by_real_token_count_on_both_sides_of_the_threshold(
    gateway: str, engines: Any
) -> None:
    prose = "The quick brown fox jumps over the lazy dog. "
    small = prose * 20  # ~200 tokens
    large = prose * 300  # ~3000 tokens
    packed = dense_json(6000)
    assert len(packed) / 4 < THRESHOLD, "a chars/4 rule would put this in the fast lane"
    async with httpx.AsyncClient(base_url=gateway) as client:
        replies = {}
        for name, text in (("small", small), ("large", large), ("json", packed)):
            r = await client.post("/v1/chat/completions", json=chat(text))
            assert r.status_code == 200, r.text
            replies[name] = r
    assert replies["small"].headers["x-shapegate-lane"] == "fast"
    assert replies["large"].headers["x-shapegate-lane"] == "heavy"
    assert replies["json"].headers["x-shapegate-lane"] == "heavy"
    assert int(replies["json"].headers["x-shapegate-prompt-tokens"]) >= THRESHOLD
    assert replies["small"].headers["x-shapegate-cluster"] == "fast"
    assert len(engines["heavy"][0].seen) == 2 and len(engines["fast"][0].seen) == 1


async def test_streaming_is_passed_through_byte_for_byte_and_chunk_by_chunk(
    gateway: str, engines: Any
) -> None:
    body = chat("hello", stream=True, fake={"chunks": 5, "gap": 0.2})
    async with httpx.AsyncClient() as client:
        direct = await client.post(engines["fast"][1] + "/v1/chat/completions", json=body)
        received: list[tuple[float, bytes]] = []
        import time

        start = time.monotonic()
        async with client.stream("POST", gateway + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            async for chunk in r.aiter_raw():
                received.append((time.monotonic() - start, chunk))
    assert b"".join(c for _, c in received) == direct.content
    # The first chunk reached the client long before the engine sent its last one.
    assert received[0][0] < 0.5 < received[-1][0]


async def test_original_body_bytes_reach_the_engine(gateway: str, engines: Any) -> None:
    raw = b'{"model":"qwen3.6",  "messages":[{"role":"user","content":"hi"}],"x_custom":1.50}'
    async with httpx.AsyncClient() as client:
        r = await client.post(
            gateway + "/v1/chat/completions",
            content=raw,
            headers={
                "content-type": "application/json",
                "x-request-id": "req-123",
                "authorization": "Bearer client-secret",
                "connection": "keep-alive",
            },
        )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "req-123"
    seen = engines["fast"][0].seen["req-123"]
    assert seen.body == raw
    assert "authorization" not in seen.headers  # not forwarded unless the cluster says so


@pytest.mark.parametrize("status", [400, 404, 500, 503])
async def test_engine_errors_are_passed_through_unchanged(
    gateway: str, status: int, engines: Any
) -> None:
    body = chat("hi", fake={"mode": "error", "status": status, "message": f"boom {status}"})
    async with httpx.AsyncClient() as client:
        direct = await client.post(engines["fast"][1] + "/v1/chat/completions", json=body)
        via = await client.post(gateway + "/v1/chat/completions", json=body)
    assert via.status_code == status
    assert via.content == direct.content
    assert via.json()["error"]["message"] == f"boom {status}"


@pytest.mark.parametrize(
    ("raw", "status", "needle"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', 400, "'model' is required"),
        (
            b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}',
            404,
            "The model `gpt-9` does not exist.",
        ),
        (b'{"model": "qwen3.6", "messages": "hello"}', 400, "'messages' must be"),
        (b'{"model": "qwen3.6", "messages": [{"role": "user", "content": 5}]}', 400, "content"),
        (
            b'{"model": "qwen3.6", "messages": [{"role": "user", "content": "x"}], '
            b'"max_tokens": -1}',
            400,
            "max_tokens",
        ),
        (b"[" * 100_000 + b"]" * 100_000, 400, "not valid JSON"),
        (
            b'{"model": "qwen3.6", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
            400,
            "not valid JSON",
        ),
    ],
)
async def test_bad_input_gets_an_openai_shaped_4xx(
    gateway: str, raw: bytes, status: int, needle: str
) -> None:
    async with httpx.AsyncClient() as client:
        with capture_logs() as logs:
            r = await client.post(gateway + "/v1/chat/completions", content=raw, headers=JSON)
    assert r.status_code == status
    error = r.json()["error"]
    assert needle in error["message"]
    assert error["code"] == status and "type" in error and "param" in error
    assert any(e["event"] == "route.rejected" for e in logs)


async def test_body_over_the_limit_is_refused_without_buffering_it(
    engines: Any, gateway_at: Any
) -> None:
    config = lanes_config(
        [engines["fast"][1]], [engines["heavy"][1]], server={"max_body_bytes": 64 * 1024}
    )
    async with gateway_at(config) as (url, _), httpx.AsyncClient() as client:
        r = await client.post(url + "/v1/chat/completions", json=chat("x" * 70_000))
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
            b"content-type: application/json\r\n\r\n"
        )
        for _ in range(20):  # 80 KiB, no length declared up front
            writer.write(b"1000\r\n" + b"x" * 4096 + b"\r\n")
        await writer.drain()
        chunked = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
    assert r.headers["connection"] == "close"
    assert chunked.startswith(b"HTTP/1.1 413 ")


async def test_prompt_above_every_lane_is_rejected(engines: Any, gateway_at: Any) -> None:
    config = lanes_config([engines["fast"][1]], [engines["heavy"][1]])
    config["lanes"][1]["max_prompt_tokens"] = 3000
    async with gateway_at(config) as (url, _), httpx.AsyncClient() as client:
        r = await client.post(url + "/v1/chat/completions", json=chat("word " * 5000))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "input_tokens"
    assert "above every lane" in r.json()["error"]["message"]


async def test_decision_log_says_why(gateway: str) -> None:
    async with httpx.AsyncClient() as client:
        with capture_logs() as logs:
            r = await client.post(
                gateway + "/v1/chat/completions",
                json=chat("secret canary text", max_tokens=7),
                headers={"x-request-id": "abc"},
            )
    assert r.status_code == 200
    decision = next(e for e in logs if e["event"] == "route.decision")
    finished = next(e for e in logs if e["event"] == "route.finished")
    assert decision["request_id"] == "abc" and decision["lane"] == "fast"
    assert decision["reason"] == "in_range" and decision["count_method"] == "bound"
    # The free bound decided: it goes by its own name; the exact count comes with the finish.
    assert "prompt_tokens" not in decision and decision["cluster"] == "fast"
    assert decision["prompt_tokens_bound"] >= finished["prompt_tokens"] > 0
    assert decision["max_tokens"] == 7 and "tokenizer" in decision
    assert finished["outcome"] == "ok" and finished["status"] == 200
    assert finished["output_tokens"] == 3
    assert "canary" not in repr(logs)


GATEWAY_CODE = str(Path(gateway_package.__file__).parent) + os.sep


def _from_gateway(asked: list[str], real: Callable[..., Any]) -> Callable[..., Any]:
    """``real``, noting each call the gateway's own code makes (itself or through asyncio's
    ``current_task``): the client and the fake engine share the loop."""

    def counting(*args: Any) -> Any:
        for depth in (1, 2):
            name = sys._getframe(depth).f_code.co_filename
            if name.startswith(GATEWAY_CODE):
                asked.append(name.removeprefix(GATEWAY_CODE))
                break
        return real(*args)

    return counting


async def test_a_request_asks_for_the_running_loop_once_and_draws_its_ids_at_once(
    gateway: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In Python 3.11 every ``get_running_loop`` (``current_task`` asks too) is a getpid system
    call and every ``os.urandom`` a getrandom: the pipeline asks for the loop once and hands it
    to the request's scopes, deadlines and body read; the upstream connection holds its own;
    the request id and the slot token come from one draw."""
    async with httpx.AsyncClient(base_url=gateway) as client:
        warm = await client.post("/v1/chat/completions", json=chat("hello"))
        assert warm.status_code == 200  # the upstream connection is open, kept alive
        loops: list[str] = []
        draws: list[str] = []
        monkeypatch.setattr(
            asyncio, "get_running_loop", _from_gateway(loops, asyncio.get_running_loop)
        )
        monkeypatch.setattr(
            asyncio.events,
            "get_running_loop",
            _from_gateway(loops, asyncio.events.get_running_loop),
        )
        monkeypatch.setattr(os, "urandom", _from_gateway(draws, os.urandom))
        r = await client.post("/v1/chat/completions", json=chat("hello again"))
        monkeypatch.undo()
    assert r.status_code == 200 and len(r.headers["x-request-id"]) == 32
    # Not counted: the exact count's task in the counting worker (gateway/count/), which this
    # suite's counter takes for a bound-decided prompt; under ``serve`` a small prompt is
    # counted inline.
    assert [name for name in loops if not name.startswith("count" + os.sep)] == [
        "request" + os.sep + "pipeline.py"
    ]
    assert draws == ["request" + os.sep + "read.py"]


async def test_models_health_and_admin_state(gateway: str) -> None:
    async with httpx.AsyncClient(base_url=gateway) as client:
        await client.post("/v1/chat/completions", json=chat("hi"))
        models = (await client.get("/v1/models")).json()
        state = (await client.get("/admin/state")).json()
        health = await client.get("/healthz")
    assert {m["id"] for m in models["data"]} == {"qwen3.6", "Qwen/Qwen3.6-35B-A3B"}
    assert health.status_code == 200
    fast = next(lane for lane in state["lanes"] if lane["name"] == "fast")
    assert fast["slots_in_use"] == 0 and fast["slot_limit"] == 64
    assert state["decisions"][0]["lane"] == "fast"
    assert state["decisions"][0]["outcome"] == "ok"


async def test_openai_sdk_works_unchanged(gateway: str) -> None:
    client = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
    reply = await client.chat.completions.create(
        model="qwen3.6", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    stream = await client.chat.completions.create(
        model="qwen3.6", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    pieces = [chunk.choices[0].delta.content async for chunk in stream]
    assert "".join(p or "" for p in pieces) == "t0 t1 t2 "
    await client.close()


def test_a_cluster_may_name_its_model_by_an_alias(counter: Any) -> None:
    """``clusters[].models`` may list a model's alias (validation accepts it): the cluster then
    serves that model whichever name the client uses, and no other model."""
    from gateway.request.auth import ClientAuth
    from gateway.request.policy import Policy
    from gateway.settings import AuthSettings, parse_settings

    config = lanes_config(["http://a"], ["http://b"])
    config["models"].append(
        {"name": "other", "tokenizer": {"source": "builtin", "name": "qwen3.6"}}
    )
    config["clusters"][0]["models"] = ["Qwen/Qwen3.6-35B-A3B"]  # qwen3.6's alias
    settings = parse_settings(config, environ={})
    policy = Policy(settings, counter, {}, ClientAuth.from_settings(AuthSettings()))
    assert policy.serves("fast", "qwen3.6")
    assert not policy.serves("fast", "other")
    assert policy.serves("heavy", "qwen3.6") and policy.serves("heavy", "other")


async def test_a_request_reaches_a_cluster_that_lists_its_model_by_alias(gateway_at: Any) -> None:
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        config = lanes_config([engine_url], ["http://127.0.0.1:9"])
        config["clusters"][0]["models"] = ["Qwen/Qwen3.6-35B-A3B"]
        config["lanes"][0]["queue"] = {"depth": 4, "max_wait_s": 2}
        async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=10) as client:
            for name in ("qwen3.6", "Qwen/Qwen3.6-35B-A3B"):
                body = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
                answer = await client.post(url + "/v1/chat/completions", json=body, headers=JSON)
                assert answer.status_code == 200, answer.text
                assert answer.headers["x-shapegate-cluster"] == "fast"


async def test_a_batched_completion_reports_the_sum_of_its_prompts_and_no_drift(
    gateway: str, engines: Any, counter: Any
) -> None:
    """Defect 3: vLLM's usage for a batch is the sum of its prompts; the header and the drift
    check must say the same (they said the largest: 10 vs 12, 6 vs 9 against vLLM 0.32)."""
    prompts = ["Say hi.", "Count to three, slowly.", "Name a colour."]
    sizes = [len(counter.encode("qwen3.6", p)) for p in prompts]
    body = {"model": "qwen3.6", "prompt": prompts, "max_tokens": 2}
    async with httpx.AsyncClient(base_url=gateway) as client:
        with capture_logs() as logs:
            reply = await client.post(
                "/v1/completions", json={**body, "fake": {"prompt_tokens": sum(sizes)}}
            )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == sum(sizes)
    assert int(reply.headers["x-shapegate-prompt-tokens"]) == sum(sizes) > max(sizes)
    assert not [e for e in logs if e["event"] == "count.drift"]
    (finished,) = [e for e in logs if e["event"] == "route.finished"]
    assert finished["prompt_tokens"] == finished["engine_prompt_tokens"] == sum(sizes)


async def test_a_batch_whose_total_passes_the_threshold_takes_the_heavy_lane(
    gateway: str, engines: Any
) -> None:
    """Prefill work picks the lane: prompts that are each small are one large prefill together."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 100  # ~1000 tokens
    async with httpx.AsyncClient(base_url=gateway) as client:
        alone = await client.post("/v1/completions", json={"model": "qwen3.6", "prompt": prompt})
        batch = await client.post(
            "/v1/completions", json={"model": "qwen3.6", "prompt": [prompt] * 3}
        )
    assert alone.headers["x-shapegate-lane"] == "fast"
    assert batch.headers["x-shapegate-lane"] == "heavy"
    assert int(batch.headers["x-shapegate-prompt-tokens"]) == 3 * int(
        alone.headers["x-shapegate-prompt-tokens"]
    )


async def test_a_non_streamed_answer_is_bounded_by_the_total_deadline_not_the_first_byte(
    engines: Any, gateway_at: Any
) -> None:
    """Defect 4: vLLM sends a non-streamed answer's headers only when generation ends, so its
    wait for them is the whole decode: the total deadline bounds it. A streamed request keeps
    the first-byte deadline (its headers and first token come as soon as prefill ends)."""
    config = lanes_config([engines["fast"][1]], [engines["heavy"][1]], threshold=THRESHOLD)
    config["lanes"][0]["timeouts"] = {
        "connect_s": 2,
        "first_byte_s": 0.3,
        "idle_s": 5,
        "total_s": 2.5,
    }
    late = {"mode": "slow_first_byte", "delay": 1.0}  # past first_byte_s, within total_s
    async with gateway_at(config) as (url, _), httpx.AsyncClient(base_url=url) as client:
        plain = await client.post("/v1/chat/completions", json=chat("hi", fake=late))
        streamed = await client.post(
            "/v1/chat/completions", json=chat("hi", stream=True, fake=late)
        )
        hung = await client.post("/v1/chat/completions", json=chat("hi", fake={"mode": "hang"}))
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["message"]["content"]
    assert streamed.status_code == 504
    assert "first byte deadline of 0.3s" in streamed.json()["error"]["message"]
    assert hung.status_code == 504
    assert "total deadline of 2.5s" in hung.json()["error"]["message"]
