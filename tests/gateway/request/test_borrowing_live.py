"""Borrowing end to end, through sockets: a gateway in front of a fast and a lending heavy
simulated engine. Short fast-lane requests borrow the idle heavy engine; a monster arriving
there waits for those borrowers to finish before its prefill starts (never longer than their
budget, nor than ``max_drain_s``), and the borrowing shows in headers, metrics and admin state."""

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

SCALE = 0.2


def chat(content: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "qwen3.6",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
    }


async def stream(
    client: httpx.AsyncClient, url: str, content: str, rid: str, max_tokens: int
) -> tuple[httpx.Headers, float]:
    """The response headers and when (wall clock, as the engine records) it was sent."""
    sent = time.time()
    async with client.stream(
        "POST",
        url + "/v1/chat/completions",
        json=chat(content, max_tokens),
        headers={"x-request-id": rid},
    ) as r:
        assert r.status_code == 200, await r.aread()
        async for _ in r.aiter_lines():
            pass
        return r.headers, sent


def policy(fast: str, heavy: str, max_drain_s: float) -> dict[str, Any]:
    config = lanes_config([fast], [heavy], threshold=32768)
    # The fast engine takes two at a time, so a burst of six spills onto the heavy engine.
    config["lanes"][0]["slots"] = {"lane": 64, "per_endpoint": 2}
    config["lanes"][1]["lend"] = {
        "to": ["fast"],
        "max_prompt_tokens": 4096,
        "max_tokens": 400,
        "per_endpoint": 4,
        "max_drain_s": max_drain_s,
    }
    config["lanes"][1]["queue"] = {"depth": 8, "max_wait_s": 60}
    config["lanes"][1]["timeouts"] = {"connect_s": 2, "first_byte_s": 60, "total_s": 120}
    return config


async def burst_then_monster(
    counter: TokenCounter, gateway_at: Any, max_drain_s: float, max_tokens: int
) -> dict[str, Any]:
    shared = RegistryCounter(counter, "qwen3.6")
    async with (
        run_sim("h100-heavy-lending", time_scale=SCALE, counter=shared) as heavy,
        run_sim("h100-fast", time_scale=SCALE, counter=shared) as fast,
        httpx.AsyncClient(timeout=60) as client,
    ):
        async with gateway_at(policy(fast.url, heavy.url, max_drain_s)) as (url, _):
            smalls = [
                asyncio.create_task(stream(client, url, " world" * 1000, f"s{i}", max_tokens))
                for i in range(6)
            ]
            await wait_for(lambda: len(heavy.requests()) == 4, 30, what="four borrowers")
            state = (await client.get(url + "/admin/state")).json()
            monster = asyncio.create_task(stream(client, url, " hello" * 100_000, "monster", 4))

            async def reserved() -> dict[str, Any] | None:
                now = (await client.get(url + "/admin/state")).json()
                heavy_lane = next(lane for lane in now["lanes"] if lane["name"] == "heavy")
                return now if heavy_lane["reserved_endpoints"] else None

            # The monster found the borrowers there and reserved the engine.
            blocked = await wait_for(reserved, 30, what="the monster's reservation")
            answered = await asyncio.gather(*smalls)
            monster_headers, monster_sent = await monster
            metrics = (await client.get(url + "/metrics")).text
            after = (await client.get(url + "/admin/state")).json()
        return {
            "decisions": {d["request_id"]: d for d in after["decisions"]},
            "small": [h for h, _ in answered],
            "monster": monster_headers,
            "monster_sent": monster_sent,
            "engine": heavy.requests(),
            "state": state,
            "blocked": blocked,
            "metrics": metrics,
        }


async def test_borrowers_drain_before_the_monster_prefills_on_the_lent_engine(
    counter: TokenCounter, gateway_at: Any
) -> None:
    seen = await burst_then_monster(counter, gateway_at, max_drain_s=60, max_tokens=300)
    borrowed = [h for h in seen["small"] if h["x-shapegate-cluster"] == "heavy"]
    assert len(borrowed) == 4 and {h["x-shapegate-lane"] for h in borrowed} == {"fast"}
    assert seen["monster"]["x-shapegate-cluster"] == "heavy"
    (monster,) = [r for r in seen["engine"] if r.request_id == "monster"]
    borrowers = [r for r in seen["engine"] if r.request_id != "monster"]
    assert all(r.finished_wall is not None for r in borrowers)
    # The monster reached the engine (and so began its prefill) only after every borrower left.
    last = max(r.finished_wall for r in borrowers if r.finished_wall is not None)
    assert monster.arrived_wall >= last
    # It waited in the gateway no longer than its borrowers' budget: the longest a borrower ran
    # on the engine (its prefill and up to max_tokens), far under max_drain_s.
    waited = seen["decisions"]["monster"]["queue_wait_s"]
    budget = max(r.finished_wall - r.arrived_wall for r in borrowers if r.finished_wall)
    print(f"monster waited {waited:.3f}s in the gateway; longest borrower {budget:.3f}s")
    assert 0 < waited <= budget, (waited, budget)
    reasons = [seen["decisions"][f"s{i}"]["reason"] for i in range(6)]
    assert reasons.count("borrowed") == 4
    assert {seen["decisions"][f"s{i}"]["lender"] for i in range(6)} == {"heavy", None}
    # Visible: admin state during the loan, the metric after.
    fast_lane = next(lane for lane in seen["state"]["lanes"] if lane["name"] == "fast")
    heavy_lane = next(lane for lane in seen["state"]["lanes"] if lane["name"] == "heavy")
    assert fast_lane["borrowing"] == {"heavy": 4} and heavy_lane["lent"] == {"fast": 4}
    assert heavy_lane["lends"]["to"] == ["fast"]
    blocked = next(lane for lane in seen["blocked"]["lanes"] if lane["name"] == "heavy")
    assert len(blocked["reserved_endpoints"]) == 1
    assert blocked["queue_depth"] == 1
    assert 'shapegate_borrowed_total{lane="fast",lender="heavy"} 4.0' in seen["metrics"]
    assert 'reason="borrowed"' in seen["metrics"]


async def test_a_monster_waits_no_longer_than_max_drain_s_for_long_borrowers(
    counter: TokenCounter, gateway_at: Any
) -> None:
    # Borrowers that decode 400 tokens (~1 s here), a drain limit of 0.3 s: the monster goes in
    # beside them once the limit runs out instead of waiting for them.
    seen = await burst_then_monster(counter, gateway_at, max_drain_s=0.3, max_tokens=400)
    (monster,) = [r for r in seen["engine"] if r.request_id == "monster"]
    borrowers = [r for r in seen["engine"] if r.request_id != "monster"]
    waited = seen["decisions"]["monster"]["queue_wait_s"]
    print(f"monster waited {waited:.3f}s for borrowers with max_drain_s 0.3")
    assert 0.3 <= waited <= 0.3 + 0.15, waited
    assert any(
        r.finished_wall is not None and r.finished_wall > monster.arrived_wall for r in borrowers
    )
