"""Stateful Responses: a follow-up carrying ``previous_response_id`` reaches the engine that
stored that response (simulated vLLM engines keep responses in their own memory and answer 404
elsewhere, as vLLM does); when that engine is down the gateway says so (503)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from engine_pool.sim.server import SimServer, run_sim
from gateway.count.tokens import TokenCounter
from gateway.request.response_affinity import MemoryAffinity, response_id_of
from gateway.tools.sim_support import RegistryCounter
from tests.conftest import lanes_config

FAST_HEALTH = {"interval_s": 0.1, "timeout_s": 0.5, "up_after_successes": 1}


async def test_memory_map_is_bounded_and_expires() -> None:
    affinity = MemoryAffinity(max_entries=3, ttl_s=0.2)
    for i in range(5):
        await affinity.remember(f"resp_{i}", "fast", f"http://e{i}")
    assert len(affinity) == 3
    assert await affinity.lookup("resp_0") is None  # evicted, oldest first
    assert await affinity.lookup("resp_4") == ("fast", "http://e4")
    await asyncio.sleep(0.25)
    assert await affinity.lookup("resp_4") is None  # expired
    off = MemoryAffinity(max_entries=0, ttl_s=10)
    await off.remember("resp_x", "fast", "http://e")
    assert await off.lookup("resp_x") is None


def test_response_id_is_read_from_a_body_or_the_first_event() -> None:
    assert response_id_of(b'{"id": "resp_1", "object": "response"}') == "resp_1"
    event = b'event: response.created\ndata: {"response": {"id": "resp_2"}, "type": "x"}\n\n'
    assert response_id_of(event) == "resp_2"
    assert response_id_of(b"event: response.created\ndata: {broken") is None
    assert response_id_of(b"[1, 2]") is None


@pytest.fixture
async def two_engines(counter: TokenCounter) -> AsyncIterator[list[SimServer]]:
    shared = RegistryCounter(counter, "qwen3.6")
    async with (
        run_sim("h100-fast", time_scale=0.05, counter=shared, seed=1) as a,
        run_sim("h100-fast", time_scale=0.05, counter=shared, seed=2) as b,
    ):
        yield sorted([a, b], key=lambda s: s.url)  # the picker breaks ties by URL


async def _first_response_on_second_engine(
    client: httpx.AsyncClient, engines: list[SimServer]
) -> str:
    """Hold a stream on the first engine so that the first response is made on the second."""
    hold = {"model": "qwen3.6", "messages": [{"role": "user", "content": "x"}], "stream": True}
    hold["max_tokens"] = 20_000
    async with client.stream("POST", "/v1/chat/completions", json=hold) as held:
        assert held.status_code == 200
        lines = held.aiter_lines()
        await anext(lines)
        first = await client.post("/v1/responses", json={"model": "qwen3.6", "input": "hi"})
    assert first.status_code == 200, first.text
    deadline = (
        time.monotonic() + 5
    )  # the held stream's slot is released once the gateway sees it go
    while time.monotonic() < deadline:
        state = (await client.get("/admin/state")).json()
        if all(e["in_flight"] == 0 for c in state["clusters"] for e in c["endpoints"]):
            break
        await asyncio.sleep(0.02)
    assert len(engines[1].requests()) == 1 and engines[1].requests()[0].route == "responses"
    response_id: str = first.json()["id"]
    return response_id


def _config(engines: list[SimServer], **routes: Any) -> dict[str, Any]:
    config = lanes_config([e.url for e in engines], ["http://127.0.0.1:9"], routes=routes)
    config["lanes"][0]["health"] = FAST_HEALTH
    return config


async def test_follow_ups_reach_the_engine_holding_the_previous_response(
    two_engines: list[SimServer], gateway_at: Any
) -> None:
    async with (
        gateway_at(_config(two_engines)) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        previous = await _first_response_on_second_engine(client, two_engines)
        for i in range(5):
            streamed = i % 2 == 1  # learned from the stream's first event, too
            body = {"model": "qwen3.6", "input": "and then?", "previous_response_id": previous}
            follow = await client.post("/v1/responses", json={**body, "stream": streamed})
            assert follow.status_code == 200, follow.text
            if streamed:
                first_data = follow.content.split(b"\n", 2)[1].removeprefix(b"data: ")
                previous = orjson.loads(first_data)["response"]["id"]
            else:
                previous = follow.json()["id"]
    assert [r.route for r in two_engines[1].requests()] == ["responses"] * 6
    assert not [r for r in two_engines[0].requests() if r.route == "responses"]


async def test_without_the_map_a_follow_up_lands_elsewhere_and_the_engine_says_404(
    two_engines: list[SimServer], gateway_at: Any
) -> None:
    config = _config(two_engines, response_affinity_entries=0)
    async with (
        gateway_at(config) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        previous = await _first_response_on_second_engine(client, two_engines)
        follow = await client.post(
            "/v1/responses",
            json={"model": "qwen3.6", "input": "and then?", "previous_response_id": previous},
        )
    assert follow.status_code == 404
    assert follow.json()["error"]["message"] == f"Response with id '{previous}' not found."


async def test_when_the_holding_engine_is_down_the_gateway_answers_503(
    two_engines: list[SimServer], gateway_at: Any
) -> None:
    async with (
        gateway_at(_config(two_engines)) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        previous = await _first_response_on_second_engine(client, two_engines)
        await two_engines[1].set_faults({"crash": True})
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            state = (await client.get("/admin/state")).json()
            endpoints = state["clusters"][0]["endpoints"]
            if any(e["url"] == two_engines[1].url and e["state"] == "down" for e in endpoints):
                break
            await asyncio.sleep(0.05)
        follow = await client.post(
            "/v1/responses",
            json={"model": "qwen3.6", "input": "and then?", "previous_response_id": previous},
        )
        fresh = await client.post("/v1/responses", json={"model": "qwen3.6", "input": "new"})
    assert follow.status_code == 503, follow.text
    assert "is down" in follow.json()["error"]["message"]
    assert follow.headers["retry-after"] == "5"
    assert fresh.status_code == 200  # a new conversation goes to the engine that is up
