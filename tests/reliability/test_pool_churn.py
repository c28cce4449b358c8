"""Upstream connection pool churn: after thousands of cancelled requests, a request to a healthy
engine still succeeds within 5 s, and the pool's whole capacity is still there.

httpx/httpcore 1.0.9 (encode/httpcore#1093) failed this: a request cancelled right after the pool
handed it a new connection left that connection behind, neither idle nor closed, for ever; once
``max_connections`` of them piled up, every request waited for the pool and failed against a
healthy server (reproduced here 3 runs of 3 with the httpx client: 2,000 cancellations filled a
pool of 8). ``gateway.upstream.http1`` takes and owns a connection with no await in between;
these tests hold any client the proxy uses to the behaviour.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gateway.core.watchdog import Deadlines, Watch
from gateway.errors import UpstreamError
from gateway.upstream.proxy import Upstream
from tests.conftest import JSON, lanes_config
from tests.reliability.reliability_support import (
    chat_body,
    held,
    settled,
    timed_logs,
)
from tests.support.fake_engine import FakeEngine
from tests.support.servers import serve_asgi
from tests.support.waiting import wait_for

DEADLINES = Deadlines(connect_s=2, first_byte_s=10, idle_s=10, total_s=10)


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A healthy keep-alive HTTP/1.1 server answering every request at once."""
    try:
        while True:
            head = b""
            while b"\r\n\r\n" not in head:
                piece = await reader.read(65536)
                if not piece:
                    return
                head += piece
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()
    except ConnectionError:
        return
    finally:
        writer.close()


@pytest.fixture
async def healthy_url() -> AsyncIterator[str]:
    server = await asyncio.start_server(_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1/chat/completions"
    finally:
        server.close()


async def _one(upstream: Upstream, url: str) -> bytes:
    async with upstream.open(url, b"{}", {}, Watch(DEADLINES)) as response:
        return await response.read(Watch(DEADLINES))


async def _churn(upstream: Upstream, url: str, rng: random.Random, rounds: int = 250) -> None:
    """``rounds`` x 8 requests, each cancelled after 0 to 5 trips through the event loop: while
    it waits for a connection, connects, sends, or waits for the answer."""
    for _ in range(rounds):
        tasks = [asyncio.create_task(_one(upstream, url)) for _ in range(8)]
        for task in tasks:
            for _ in range(rng.randrange(6)):
                await asyncio.sleep(0)
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _full_capacity(upstream: Upstream, url: str, width: int) -> float:
    """``width`` requests holding a connection each at the same time; seconds until all had one."""
    started = time.monotonic()
    ready = asyncio.Event()
    opened = 0

    async def hold() -> None:
        nonlocal opened
        async with upstream.open(url, b"{}", {}, Watch(DEADLINES)) as response:
            opened += 1
            if opened == width:
                ready.set()
            await ready.wait()
            assert await response.read(Watch(DEADLINES)) == b"{}"

    await asyncio.wait_for(asyncio.gather(*(hold() for _ in range(width))), 5)
    return time.monotonic() - started


async def test_thousands_of_cancelled_requests_leave_the_pool_whole(healthy_url: str) -> None:
    upstream = Upstream(max_connections=8)
    try:
        with timed_logs() as logs:
            await _churn(upstream, healthy_url, random.Random(7))  # 2,000 cancelled requests
            started = time.monotonic()
            assert await asyncio.wait_for(_one(upstream, healthy_url), 5) == b"{}"
            first = time.monotonic() - started
            # Every one of the 8 connections can still be had at once, without waiting.
            whole = await _full_capacity(upstream, healthy_url, 8)
    finally:
        await upstream.aclose()
    assert first < 0.5 and whole < 0.5
    assert not [e for e in logs if e["log_level"] in ("warning", "error")]


async def test_a_really_full_pool_fails_fast_and_recovers(healthy_url: str) -> None:
    """Every connection really busy: the next request fails (502, pool timeout) rather than
    queueing a second time behind admission; once they are back it goes through."""
    upstream = Upstream(max_connections=2)
    hold = asyncio.Event()
    holding: list[int] = []

    async def holder() -> None:
        async with upstream.open(healthy_url, b"{}", {}, Watch(DEADLINES)):
            holding.append(1)
            await hold.wait()

    try:
        holders = [asyncio.create_task(holder()) for _ in range(2)]
        await wait_for(lambda: len(holding) == 2, 5, what="both connections held")
        started = time.monotonic()
        with pytest.raises(UpstreamError, match="PoolTimeout"):
            await _one(upstream, healthy_url)
        assert time.monotonic() - started < 3.0
        hold.set()
        await asyncio.gather(*holders)
        assert await _full_capacity(upstream, healthy_url, 2) < 0.5
    finally:
        await upstream.aclose()


async def test_the_gateway_answers_within_5s_after_thousands_of_cancellations(
    gateway_at: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Client resets through the gateway rarely land in the one await where httpcore leaked, so
    the gateway's own upstream client is churned directly (as its pipeline would cancel it);
    then clients ask the gateway, as many at once as the lane has slots."""
    made: list[Upstream] = []

    def small_pool() -> Upstream:
        made.append(Upstream(max_connections=16))
        return made[-1]

    monkeypatch.setattr("gateway.edge.services.Upstream", small_pool)
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        config = lanes_config([engine_url], [engine_url])
        config["lanes"][0].update(slots={"lane": 12, "per_endpoint": 12})
        async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=30) as client:
            (upstream,) = made
            await _churn(upstream, engine_url + "/v1/chat/completions", random.Random(11))
            started = time.monotonic()
            answers = await asyncio.gather(
                *(
                    client.post(
                        url + "/v1/chat/completions",
                        content=chat_body(f"after the churn {i}", stream=False),
                        headers={"x-request-id": f"after-{i}", **JSON},
                    )
                    for i in range(12)
                )
            )
            took = time.monotonic() - started
            state = await settled(client, url)
    assert [r.status_code for r in answers] == [200] * 12, [r.text for r in answers]
    assert took < 5.0
    assert held(state) == 0
    assert all(engine.seen[f"after-{i}"].completed for i in range(12))
