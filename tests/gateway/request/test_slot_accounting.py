"""Slots come back on every path: success, engine error, timeouts and client disconnects in
every phase (queued, waiting for the first byte, mid-stream, non-streaming); under uvicorn's own
HTTP protocol (the disconnect seen by a task reading ``receive()``) and under shapegate's
(gateway/edge/http_protocol.py: the disconnect a callback of the connection)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from gateway.count.tokens import TokenCounter
from gateway.edge.app import create_app
from gateway.edge.http_protocol import guarded_protocol
from gateway.settings import Settings, parse_settings
from tests.conftest import JSON, lanes_config
from tests.support.fake_engine import FakeEngine
from tests.support.servers import serve_asgi
from tests.support.waiting import wait_for

# first_byte_s leaves room for a saturated loop: gateway and fake engine share one event loop
# here, and 300 requests at once on 2 busy cores delayed a prompt first byte past 0.6 s in CI.
TIMEOUTS = {"connect_s": 1, "first_byte_s": 1.2, "idle_s": 0.4, "total_s": 5}


def body(rid: str, *, stream: bool, text: str = "", **fake: Any) -> bytes:
    return orjson.dumps(
        {
            "model": "qwen3.6",
            "stream": stream,
            "fake": fake,
            "messages": [{"role": "user", "content": f"request {rid} {text}"}],
        }
    )


async def open_request(
    url: str, rid: str, payload: bytes
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send a request on a raw socket and leave it open; the caller resets it."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {parts.netloc}\r\n"
        f"content-type: application/json\r\nx-request-id: {rid}\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    ).encode()
    writer.write(head + payload)
    await writer.drain()
    return reader, writer


async def raw_request(
    url: str, rid: str, payload: bytes, *, read_bytes: int, hold_s: float
) -> float:
    """Send a request on a raw socket, read up to ``read_bytes`` (0: none), wait ``hold_s``,
    then reset the connection. Returns when the client went away (monotonic)."""
    reader, writer = await open_request(url, rid, payload)
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


# The heavy lane has one slot, held by one request for the whole mix: a heavy request in the mix
# is always queued when its client resets.
HEAVY_PROMPT = "monster " * 3000
# What each kind of request must answer; a client-side reset has no answer.
EXPECTED = {
    "ok_stream": 200,
    "ok_plain": 200,
    "error_500": 500,
    "hang_timeout": 504,
    "stall_idle": 200,  # the error arrives inside the stream
    "drop_mid_stream": 200,
}
LEAVERS = ("gone_waiting_first_byte", "gone_mid_stream", "gone_plain", "gone_queued")


@pytest.fixture(params=["uvicorn", "shapegate"])
def served(request: pytest.FixtureRequest, counter: TokenCounter) -> Callable[..., Any]:
    """``async with served(config) as (url, settings)``: a real gateway on a socket, under
    uvicorn's HTTP protocol or under the one ``shapegate serve`` runs."""

    @asynccontextmanager
    async def start(config: dict[str, Any]) -> AsyncIterator[tuple[str, Settings]]:
        settings = parse_settings(config, environ={})
        app = create_app(settings, counter)
        protocol: dict[str, Any] = {}
        if request.param == "shapegate":
            protocol["http"] = guarded_protocol(settings.server)
        async with serve_asgi(app, **protocol) as url:
            yield url, settings

    return start


@pytest.fixture
async def setup(served: Any) -> Any:
    engine, heavy = FakeEngine(), FakeEngine()
    async with serve_asgi(engine) as engine_url, serve_asgi(heavy) as heavy_url:
        config = lanes_config([engine_url], [heavy_url])
        config["lanes"][0].update(
            slots={"lane": 8, "per_endpoint": 8},
            timeouts=TIMEOUTS,
            queue={"depth": 1000, "max_wait_s": 30},
        )
        config["lanes"][1].update(
            slots={"lane": 1, "per_endpoint": 1},
            timeouts={"connect_s": 1, "first_byte_s": 60, "idle_s": 60, "total_s": 60},
            queue={"depth": 1000, "max_wait_s": 30},
        )
        async with served(config) as (url, _):
            yield engine, heavy, url


async def test_a_few_hundred_mixed_requests_leave_no_slot_behind(setup: Any) -> None:
    engine, heavy, url = setup
    rng = random.Random(42)
    kinds = [*EXPECTED, *LEAVERS]
    abandoned: dict[str, float] = {}
    statuses: dict[str, set[int]] = {kind: set() for kind in EXPECTED}
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
                # A 4 s stream: a leaver that is not noticed runs on long past the bound below.
                abandoned[rid] = await raw_request(
                    url,
                    rid,
                    body(rid, stream=True, chunks=200, gap=0.02),
                    read_bytes=200,
                    hold_s=0.05,
                )
                return
            if kind == "gone_plain":
                abandoned[rid] = await raw_request(
                    url, rid, body(rid, stream=False, mode="hang"), read_bytes=0, hold_s=0.1
                )
                return
            if kind == "gone_queued":
                abandoned[rid] = await raw_request(
                    url, rid, body(rid, stream=False, text=HEAVY_PROMPT), read_bytes=0, hold_s=0.1
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
            statuses[kind].add(r.status_code)
            if kind == "stall_idle" or kind == "drop_mid_stream":
                assert b'"error"' in r.content and r.content.endswith(b"data: [DONE]\n\n")
            if kind == "ok_stream":
                assert r.content.count(b"data: ") == 6 and r.content.endswith(b"[DONE]\n\n")

    plan = [rng.choice(kinds) for _ in range(300)]
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=100)) as client:
        holder = asyncio.create_task(
            client.post(
                url + "/v1/chat/completions",
                content=body("holder", stream=False, mode="hang", text=HEAVY_PROMPT),
                headers={"x-request-id": "holder", **JSON},
            )
        )
        await wait_for(lambda: "holder" in heavy.seen, 5, what="the heavy slot taken")
        await asyncio.gather(*(one(i, kind, client) for i, kind in enumerate(plan)))
        # Every queued leaver left the heavy queue at once, though the holder never let go.
        await wait_for(
            lambda: _idle(client, url, engine, every_lane=False),
            2,
            what="every slot and queue place back",
        )
        assert (await admin_state(client, url))["lanes"][1]["slots_in_use"] == 1
        holder.cancel()  # a slot holder whose client leaves gives its slot back
        await wait_for(lambda: _idle(client, url, heavy), 2, what="holder released")
    assert statuses == {kind: {status} for kind, status in EXPECTED.items()}
    assert not heavy.seen.keys() - {"holder"}, "a queued leaver reached the engine"
    assert heavy.seen["holder"].closed is not None
    reached = {rid.rsplit("-", 1)[0] for rid in abandoned if rid in engine.seen}
    assert reached == {"gone_waiting_first_byte", "gone_mid_stream", "gone_plain"}
    assert {rid.rsplit("-", 1)[0] for rid in abandoned} == set(LEAVERS)
    for rid, gone_at in abandoned.items():
        seen = engine.seen.get(rid)
        if seen is not None:  # it reached the engine before the client left
            assert seen.closed is not None and seen.closed - gone_at < 1.0, rid
            assert not seen.completed, rid
    assert engine.peak_in_flight <= 8


async def _idle(
    client: httpx.AsyncClient, url: str, engine: FakeEngine, *, every_lane: bool = True
) -> bool:
    """No slot or queue place held (in the fast lane only, unless ``every_lane``) and nothing
    open at ``engine``."""
    state = await admin_state(client, url)
    if not every_lane:
        state["lanes"] = [state["lanes"][0]]
        state["clusters"] = [state["clusters"][0]]
    return slots_in_use(state) == 0 and not engine.open_requests()


async def test_a_queued_request_whose_client_left_never_takes_a_slot(served: Any) -> None:
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        config = lanes_config([engine_url], [engine_url])
        config["lanes"][0].update(slots={"lane": 8, "per_endpoint": 8})
        async with served(config) as (url, _):
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
        await wait_for(lambda: len(engine.seen) == 8, 5, what="8 holders at the engine")
        state = await admin_state(client, url)
        assert state["lanes"][0]["slots_in_use"] == 8

        async def queue_depth() -> int:
            return int((await admin_state(client, url))["lanes"][0]["queue_depth"])

        async def queue_empty() -> bool:
            return await queue_depth() == 0

        _, leaver = await open_request(url, "queued-1", body("queued-1", stream=False))
        await wait_for(queue_depth, 2, what="the leaver queued")
        leaver.transport.abort()
        # It leaves the queue at once, while the holders still hold every slot.
        await wait_for(queue_empty, 1, what="the leaver gone from the queue")
        assert not any(h.done() for h in holders)
        assert all(r.status_code == 200 for r in await asyncio.gather(*holders))
        await wait_for(lambda: _idle(client, url, engine), 2, what="every slot back")
        assert "queued-1" not in engine.seen


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
            await wait_for(lambda: engine.seen, 5, what="the slot taken")
            r = await client.post(
                url + "/v1/chat/completions", content=body("b", stream=False), headers=JSON
            )
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert (await slow).status_code == 200
