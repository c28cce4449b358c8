"""Head-of-line blocking on one engine, over HTTP: the failure shapegate's lanes exist to prevent.

A 359k-token prompt is prefilling on the shared H100 engine; a ~3k-token request arriving 30
simulated seconds later waits for the whole rest of that prefill before its first token.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from engine_pool.sim.profile import load_profile
from engine_pool.sim.server import run_sim
from engine_pool.sim.simulate import Arrival, simulate
from gateway.tools.sim_support import RegistryCounter

SCALE = 0.005  # 200x: the monster's ~3 simulated minutes of prefill take ~0.9 s


def chat(content: str, request_id: str) -> tuple[dict[str, Any], dict[str, str]]:
    body = {
        "model": "qwen3.6",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "stream": True,
    }
    return body, {"X-Request-Id": request_id}


async def first_token_wall(client: httpx.AsyncClient, content: str, request_id: str) -> float:
    """Wall seconds from sending the request to its first content token."""
    body, headers = chat(content, request_id)
    sent = time.monotonic()
    ttft = None
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        async for line in r.aiter_lines():  # drained to the end: the request finishes normally
            if ttft is None and '"content":" ' in line:
                ttft = time.monotonic() - sent
    assert ttft is not None
    return ttft


async def test_small_request_waits_for_the_whole_monster_prefill(
    engine_counter: RegistryCounter,
) -> None:
    monster_text = " hello" * 359_000
    small_text = " world" * 3_000
    profile = load_profile("h100-shared")
    async with (
        run_sim(profile, time_scale=SCALE, counter=engine_counter) as sim,
        httpx.AsyncClient(base_url=sim.url, timeout=30) as client,
    ):
        monster = asyncio.create_task(first_token_wall(client, monster_text, "monster"))
        while not sim.requests("monster"):
            await asyncio.sleep(0.001)
        await asyncio.sleep(30 * SCALE)  # the small one arrives 30 s into the prefill
        small_wall = await first_token_wall(client, small_text, "small")
        await monster
    (m,) = sim.requests("monster")
    (s,) = sim.requests("small")
    assert m.prompt_tokens > 359_000 and 3_000 < s.prompt_tokens < 3_100
    assert m.first_token_s is not None and s.ttft_s is not None
    remaining_prefill = m.first_token_s - s.arrived_s
    assert remaining_prefill > 100.0  # simulated seconds: minutes of someone else's prefill
    # TTFT of the small request = the monster's remaining prefill, plus at most one step.
    assert remaining_prefill <= s.ttft_s <= remaining_prefill + 1.0
    alone = simulate(profile, [Arrival("a", 0.0, s.prompt_tokens, 4)]).timelines["a"].ttft
    assert s.ttft_s > 300 * alone
    # The client sees the same wait, in wall time, at the chosen scale.
    assert small_wall >= 0.8 * remaining_prefill * SCALE
