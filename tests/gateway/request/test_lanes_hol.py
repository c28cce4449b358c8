"""The fix, end to end: with shapegate's lanes in front of a heavy and a fast simulated engine,
a small request arriving while a monster prefills goes to the fast lane and gets its first
token within 1.5x of its isolated time to first token (on one shared engine it would wait for
the monster's whole prefill: tests/engine_pool/test_sim_hol.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from engine_pool.sim.server import run_sim
from gateway.count.tokens import TokenCounter
from gateway.tools.sim_support import RegistryCounter
from tests.conftest import lanes_config
from tests.support.waiting import wait_for

SCALE = 0.005


def chat(content: str) -> dict[str, Any]:
    return {
        "model": "qwen3.6",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "stream": True,
    }


async def stream(
    client: httpx.AsyncClient, url: str, content: str, rid: str
) -> tuple[httpx.Headers, float, float]:
    """The response headers, and when (monotonic) it was sent and its first token arrived at
    the client, through the gateway."""
    sent = time.monotonic()
    first = 0.0
    async with client.stream(
        "POST", url + "/v1/chat/completions", json=chat(content), headers={"x-request-id": rid}
    ) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not first and '"content"' in line:
                first = time.monotonic()
        assert first
        return r.headers, sent, first


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
            _, sent, first = await stream(client, url, small_text, "isolated")
            isolated = first - sent
            monster = asyncio.create_task(stream(client, url, monster_text, "monster"))
            await wait_for(lambda: heavy.requests("monster"), 30, interval=0.001)
            await asyncio.sleep(30 * SCALE)  # the small one arrives 30 s into the prefill
            headers, sent, small_first = await stream(client, url, small_text, "small")
            monster_headers, _, monster_first = await monster
    small = small_first - sent
    assert headers["x-shapegate-lane"] == "fast"
    assert monster_headers["x-shapegate-lane"] == "heavy"
    assert int(monster_headers["x-shapegate-prompt-tokens"]) > 350_000
    # At the client, through the gateway: the small request's first token came while the
    # monster still prefilled (on one engine it waits for that whole prefill), and within 1.5x
    # of its isolated time to first token (plus 50 ms for a loaded test machine).
    assert small_first < monster_first
    assert small <= isolated * 1.5 + 0.05, (small, isolated)
    assert small < (monster_first - small_first) / 2, (small, monster_first - small_first)
    assert (heavy.requests("monster")[0].ttft_s or 0) > 60  # the monster's prefill took minutes
