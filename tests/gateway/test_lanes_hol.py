"""The fix, end to end: with shapegate's lanes in front of a heavy and a fast simulated engine,
a small request arriving while a monster prefills goes to the fast lane and gets its first
token within 1.5x of its isolated time to first token (on one shared engine it would wait for
the monster's whole prefill: tests/engine_pool/test_sim_hol.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from engine_pool.sim.server import run_sim
from gateway.sim_support import RegistryCounter
from gateway.tokens import TokenCounter
from tests.conftest import lanes_config

SCALE = 0.005


def chat(content: str) -> dict[str, Any]:
    return {
        "model": "qwen3.6",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "stream": True,
    }


async def stream(client: httpx.AsyncClient, url: str, content: str, rid: str) -> httpx.Headers:
    async with client.stream(
        "POST", url + "/v1/chat/completions", json=chat(content), headers={"x-request-id": rid}
    ) as r:
        assert r.status_code == 200
        async for _ in r.aiter_raw():
            pass
        return r.headers


async def test_a_small_request_skips_the_monster_through_the_lanes(
    counter: TokenCounter, gateway_at: Any
) -> None:
    small_text = " world" * 3_000
    monster_text = " hello" * 359_000
    shared = RegistryCounter(counter, "qwen3.6")
    async with (
        run_sim("h100-heavy", time_scale=SCALE, counter=shared) as heavy,
        run_sim("h100-fast", time_scale=SCALE, counter=shared) as fast,
        httpx.AsyncClient(timeout=60) as client,
    ):
        config = lanes_config([fast.url], [heavy.url], threshold=32768)
        async with gateway_at(config) as (url, _):
            await stream(client, url, small_text, "isolated")
            isolated = fast.requests("isolated")[0].ttft_s
            monster = asyncio.create_task(stream(client, url, monster_text, "monster"))
            while not heavy.requests("monster"):
                await asyncio.sleep(0.001)
            await asyncio.sleep(30 * SCALE)
            headers = await stream(client, url, small_text, "small")
            monster_headers = await monster
    small = fast.requests("small")[0]
    assert headers["x-shapegate-lane"] == "fast"
    assert monster_headers["x-shapegate-lane"] == "heavy"
    assert int(monster_headers["x-shapegate-prompt-tokens"]) > 350_000
    assert small.ttft_s is not None and isolated is not None
    assert small.ttft_s <= isolated * 1.5, (small.ttft_s, isolated)
    assert (heavy.requests("monster")[0].ttft_s or 0) > 60  # the monster's prefill took minutes
