"""Slots come back on every path: success, engine error, timeouts and client disconnects in
every phase (queued, waiting for the first byte, mid-stream, non-streaming)."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from tests.conftest import JSON, lanes_config
from tests.support.fake_engine import FakeEngine
from tests.support.servers import serve_asgi

TIMEOUTS = {"connect_s": 1, "first_byte_s": 0.6, "idle_s": 0.4, "total_s": 5}


def body(rid: str, *, stream: bool, **fake: Any) -> bytes:
    return orjson.dumps(
        {
            "model": "qwen3.6",
            "stream": stream,
            "fake": fake,
            "messages": [{"role": "user", "content": f"request {rid}"}],
        }
    )


async def raw_request(
    url: str, rid: str, payload: bytes, *, read_bytes: int, hold_s: float
) -> float:
    """Send a request on a raw socket, read up to ``read_bytes`` (0: none), wait ``hold_s``,
    then reset the connection. Returns when the client went away (monotonic)."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {parts.netloc}\r\n"
        f"content-type: application/json\r\nx-request-id: {rid}\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    ).encode()
    writer.write(head + payload)
    await writer.drain()
    got = b""
    if read_bytes:
        while len(got) < read_bytes:
            piece = await asyncio.wait_for(reader.read(65536), 5)
            if not piece:
                break
            got += piece
    await asyncio.sleep(hold_s)
    writer.transport.abort()
    return time.monotonic()


async def admin_state(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    response = await client.get(url + "/admin/state")
    state: dict[str, Any] = response.json()
    return state


def slots_in_use(state: dict[str, Any]) -> int:
    lanes = sum(lane["slots_in_use"] + lane["queue_depth"] for lane in state["lanes"])
    endpoints = sum(
        e["slots_in_use"] + e["in_flight"] for c in state["clusters"] for e in c["endpoints"]
    )
    return lanes + endpoints


@pytest.fixture
async def setup(gateway_at: Any) -> Any:
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        config = lanes_config([engine_url], [engine_url])
        config["lanes"][0].update(
            slots={"lane": 8, "per_endpoint": 8},
            timeouts=TIMEOUTS,
            queue={"depth": 1000, "max_wait_s": 30},
        )
        async with gateway_at(config) as (url, _):
            yield engine, url


async def test_a_few_hundred_mixed_requests_leave_no_slot_behind(setup: Any) -> None:
    engine, url = setup
    rng = random.Random(42)
    kinds = [
        "ok_stream",
        "ok_plain",
        "error_500",
        "hang_timeout",
        "stall_idle",
        "drop_mid_stream",
        "gone_waiting_first_byte",
        "gone_mid_stream",
        "gone_plain",
    ]
    abandoned: dict[str, float] = {}
    outcomes: dict[str, int] = {}
    gate = asyncio.Semaphore(40)

    async def one(i: int, kind: str, client: httpx.AsyncClient) -> None:
        rid = f"{kind}-{i}"
        async with gate:
            if kind == "gone_waiting_first_byte":
                abandoned[rid] = await raw_request(
                    url,
                    rid,
                    body(rid, stream=True, mode="slow_first_byte", delay=0.4),
                    read_bytes=0,
                    hold_s=0.1,
                )
                return
            if kind == "gone_mid_stream":
                abandoned[rid] = await raw_request(
                    url,
                    rid,
                    body(rid, stream=True, chunks=50, gap=0.02),
                    read_bytes=200,
                    hold_s=0.05,
                )
                return
            if kind == "gone_plain":
                abandoned[rid] = await raw_request(
                    url, rid, body(rid, stream=False, mode="hang"), read_bytes=0, hold_s=0.1
                )
                return
            fake: dict[str, Any] = {
                "ok_stream": {"chunks": 5},
                "ok_plain": {"chunks": 2},
                "error_500": {"mode": "error", "status": 500},
                "hang_timeout": {"mode": "hang"},
                "stall_idle": {"mode": "stall", "chunks": 2},
                "drop_mid_stream": {"mode": "drop", "chunks": 2},
            }[kind]
            stream = kind in ("ok_stream", "stall_idle", "drop_mid_stream")
            r = await client.post(
                url + "/v1/chat/completions",
                content=body(rid, stream=stream, **fake),
                headers={"x-request-id": rid, **JSON},
            )
            outcomes[f"{kind}:{r.status_code}"] = outcomes.get(f"{kind}:{r.status_code}", 0) + 1
            if kind == "stall_idle" or kind == "drop_mid_stream":
                assert r.status_code == 200
                assert b'"error"' in r.content and r.content.endswith(b"data: [DONE]\n\n")

    plan = [rng.choice(kinds) for _ in range(300)]
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=100)) as client:
        await asyncio.gather(*(one(i, kind, client) for i, kind in enumerate(plan)))
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            state = await admin_state(client, url)
            if slots_in_use(state) == 0 and not engine.open_requests():
                break
            await asyncio.sleep(0.05)
        assert slots_in_use(state) == 0, state
    assert not engine.open_requests()
    reached = {rid.split("-")[0] for rid in abandoned if rid in engine.seen}
    assert reached == {"gone_waiting_first_byte", "gone_mid_stream", "gone_plain"}
    for rid, gone_at in abandoned.items():
        seen = engine.seen.get(rid)
        if seen is not None:  # it reached the engine before the client left
            assert seen.closed is not None and seen.closed - gone_at < 1.0, rid
            assert not seen.completed or rid.startswith("gone_mid"), rid
    assert outcomes.get("ok_plain:200", 0) and outcomes.get("ok_stream:200", 0)
    assert outcomes.get("error_500:500", 0) and outcomes.get("hang_timeout:504", 0)
    assert not any(key.endswith(":502") for key in outcomes if key.startswith("ok"))
    assert engine.peak_in_flight <= 8


async def test_a_queued_request_whose_client_left_never_takes_a_slot(gateway_at: Any) -> None:
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        config = lanes_config([engine_url], [engine_url])
        config["lanes"][0].update(slots={"lane": 8, "per_endpoint": 8})
        async with gateway_at(config) as (url, _):
            await _queued_leaver(engine, url)


async def _queued_leaver(engine: FakeEngine, url: str) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        holders = [
            asyncio.create_task(
                client.post(
                    url + "/v1/chat/completions",
                    content=body(f"hold-{i}", stream=False, mode="slow_first_byte", delay=2.0),
                    headers={"x-request-id": f"hold-{i}", **JSON},
                )
            )
            for i in range(8)
        ]
        while len(engine.seen) < 8:
            await asyncio.sleep(0.01)
        state = await admin_state(client, url)
        assert state["lanes"][0]["slots_in_use"] == 8
        await raw_request(url, "queued-1", body("queued-1", stream=False), read_bytes=0, hold_s=0.1)
        await asyncio.sleep(0.05)
        assert (await admin_state(client, url))["lanes"][0]["queue_depth"] == 0
        assert all(r.status_code == 200 for r in await asyncio.gather(*holders))
        await asyncio.sleep(0.3)
        assert "queued-1" not in engine.seen
        assert slots_in_use(await admin_state(client, url)) == 0


async def test_a_full_lane_with_reject_policy_answers_429(gateway_at: Any) -> None:
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        config = lanes_config([engine_url], [engine_url])
        config["lanes"][0].update(slots={"lane": 1, "per_endpoint": 1}, on_full="reject")
        async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=10) as client:
            slow = asyncio.create_task(
                client.post(
                    url + "/v1/chat/completions",
                    content=body("a", stream=False, mode="slow_first_byte", delay=0.5),
                    headers=JSON,
                )
            )
            while not engine.seen:
                await asyncio.sleep(0.01)
            r = await client.post(
                url + "/v1/chat/completions", content=body("b", stream=False), headers=JSON
            )
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert (await slow).status_code == 200
