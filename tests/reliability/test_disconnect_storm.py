"""A disconnect storm: 1,000 clients reset their connection at random phases of their request.

Phases: queued behind a full lane, during a long silent prefill (the heavy engine is slowed
down so its prefill stays silent for a while), mid-decode in a stream, and waiting for a
non-streaming answer. For every client: the gateway released what it held within 1 s of the
reset (its ``route.finished``, logged after the release, says ``client_disconnect``), and the
engine saw the request closed within 1 s. A queued request whose client left never reaches an
engine, even once the slot it waited for frees up. At the end nothing is held, by the admin
state and by the ``shapegate_slots_in_use`` metric, and the gateway still serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from engine_pool.sim.server import SimServer, run_sim
from gateway.count.tokens import TokenCounter
from gateway.tools.sim_support import RegistryCounter
from tests.conftest import JSON, MODEL
from tests.reliability.reliability_support import (
    RawClient,
    RecordIndex,
    chat_body,
    finished,
    held,
    settled,
    slots_metric,
    timed_logs,
    words,
)

HEAVY_FROM = 600  # prompt tokens
MONSTER_FROM = 6000
GENEROUS = {"connect_s": 2, "first_byte_s": 30, "idle_s": 30, "total_s": 60}
PLAN = {"queued": 200, "silent_prefill": 250, "mid_decode": 275, "plain_waiting": 275}


def storm_config(fast: Sequence[str], heavy: Sequence[str], monster: str) -> dict[str, Any]:
    def lane(name: str, low: int, high: int, slots: int, per_endpoint: int) -> dict[str, Any]:
        return {
            "name": name,
            "min_prompt_tokens": low,
            "max_prompt_tokens": high,
            "clusters": [name],
            "slots": {"lane": slots, "per_endpoint": per_endpoint},
            "queue": {"depth": 512, "max_wait_s": 60},
            "timeouts": GENEROUS,
        }

    return {
        "server": {"boot_probe": False},
        "models": [MODEL],
        "clusters": [
            {"name": "fast", "endpoints": list(fast)},
            {"name": "heavy", "endpoints": list(heavy)},
            {"name": "monster", "endpoints": [monster]},
        ],
        "lanes": [
            lane("fast", 0, HEAVY_FROM, 48, 24),
            lane("heavy", HEAVY_FROM, MONSTER_FROM, 16, 8),
            # One slot, held by one request for the whole storm: everyone else here queues.
            lane("monster", MONSTER_FROM, 1_000_000, 1, 1),
        ],
    }


@contextlib.asynccontextmanager
async def sims(counter: TokenCounter) -> AsyncIterator[list[SimServer]]:
    shared = RegistryCounter(counter, "qwen3.6")
    async with contextlib.AsyncExitStack() as stack:
        # The heavy engines run 3x slower than real time: a 1-3k-token prompt is then silent for
        # about half a second (and longer when it waits behind others in the engine).
        plan = [("h100-fast", 1.0)] * 2 + [("h100-heavy", 3.0)] * 2 + [("h100-heavy", 1.0)]
        yield [
            await stack.enter_async_context(
                run_sim(profile, time_scale=scale, counter=shared, seed=i)
            )
            for i, (profile, scale) in enumerate(plan)
        ]


async def test_a_storm_of_1000_resets_leaves_nothing_behind(
    gateway_at: Any, counter: TokenCounter
) -> None:
    rng = random.Random(2024)
    async with sims(counter) as engines:
        fast, heavy, monster = engines[:2], engines[2:4], engines[4]
        index = RecordIndex(engines)
        config = storm_config([s.url for s in fast], [s.url for s in heavy], monster.url)
        with timed_logs() as logs:
            async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=30) as client:
                reset_at, phase_seen = await _storm(url, index, monster, rng)
                state = await settled(client, url, within=2.0)
                slots = await slots_metric(client, url)
                started = time.monotonic()
                after = await client.post(
                    url + "/v1/chat/completions",
                    content=chat_body("still there?", stream=False),
                    headers=JSON,
                )
                after_s = time.monotonic() - started

    # Every client was reset, in the phase it was meant to be in.
    assert len(reset_at) == sum(PLAN.values())
    assert phase_seen["silent_prefill"] >= 200, phase_seen
    assert phase_seen["mid_decode"] == PLAN["mid_decode"], phase_seen

    # The gateway let go of each within a second: route.finished comes after the release.
    done = finished(logs)
    assert {done[rid]["outcome"] for rid in reset_at} == {"client_disconnect"}
    release_s = {rid: done[rid]["at_wall"] - gone for rid, gone in reset_at.items()}
    assert not {rid: round(s, 3) for rid, s in release_s.items() if s >= 1.0}

    # The engine saw every abandoned request closed within a second.
    records = index.all()
    for rid in reset_at:
        if rid not in records:
            assert not rid.startswith("mid_decode"), rid  # the others may leave before it
    reached = {rid: records[rid] for rid in reset_at if rid in records}
    assert all(r.outcome == "aborted" for r in reached.values()), reached
    close_s = {
        rid: (r.closed_wall if r.closed_wall is not None else float("inf")) - reset_at[rid]
        for rid, r in reached.items()
    }
    slow_close = {rid: round(s, 3) for rid, s in close_s.items() if s >= 1.0}
    assert not slow_close, slow_close
    print(
        f"storm: phases {dict(phase_seen)}; release max {max(release_s.values()):.3f}s; "
        f"engine close max {max(close_s.values()):.3f}s over {len(close_s)} requests"
    )
    by_phase = Counter(rid.rsplit("-", 1)[0] for rid in reset_at if rid in records)
    assert by_phase["mid_decode"] == PLAN["mid_decode"] and by_phase["plain_waiting"] > 200

    # No queued request whose client left ever took the slot, even after the holder let go.
    assert [r.request_id for r in monster.requests()] == ["holder"]
    assert not any(rid.startswith("queued") for rid in records)

    # Nothing held, by the admin state and by the metric; the gateway serves as before.
    assert held(state) == 0, state
    assert all(lane["queue_depth"] == 0 for lane in state["lanes"])
    assert slots == 0
    assert after.status_code == 200 and after_s < 5.0


async def _storm(
    url: str, index: RecordIndex, monster: SimServer, rng: random.Random
) -> tuple[dict[str, float], Counter[str]]:
    reset_at: dict[str, float] = {}
    phase_seen: Counter[str] = Counter()

    holder = await RawClient.send(
        url, "holder", chat_body(words(MONSTER_FROM + 500, "holder"), stream=False, max_tokens=5000)
    )
    await index.arrival("holder")

    async def queued(rid: str) -> None:
        raw = await RawClient.send(
            url, rid, chat_body(words(MONSTER_FROM + 300, rid), stream=False, max_tokens=20)
        )
        await asyncio.sleep(rng.uniform(0.02, 0.3))
        reset_at[rid] = raw.reset()
        phase_seen["queued"] += 1

    async def silent_prefill(rid: str) -> None:
        prompt = words(rng.randrange(1200, 3000), rid)
        raw = await RawClient.send(url, rid, chat_body(prompt, stream=True, max_tokens=50))
        try:
            record = await index.arrival(rid, timeout=20)
        except AssertionError:
            with contextlib.suppress(TimeoutError):
                await raw.read_until(lambda _: False, timeout=0.5)
            raise AssertionError(f"{rid} never reached an engine: {raw.received!r}") from None
        finally:
            await asyncio.sleep(rng.uniform(0, 0.05))
            reset_at[rid] = raw.reset()
        # Nothing was generated before the reset: the gateway had no byte to send yet.
        silent = record.first_token_wall is None or record.first_token_wall > reset_at[rid]
        phase_seen["silent_prefill" if silent else "late_prefill"] += 1

    async def mid_decode(rid: str) -> None:
        raw = await RawClient.send(url, rid, chat_body(rid, stream=True, max_tokens=400))
        await raw.read_until(lambda got: got.count(b"data: ") >= 3, timeout=20)
        await asyncio.sleep(rng.uniform(0, 0.1))
        reset_at[rid] = raw.reset()
        phase_seen["mid_decode"] += 1

    async def plain_waiting(rid: str) -> None:
        raw = await RawClient.send(url, rid, chat_body(rid, stream=False, max_tokens=400))
        try:
            if rng.random() < 0.8:  # most wait until the engine has it; the rest leave at once
                await index.arrival(rid, timeout=20)
            await asyncio.sleep(rng.uniform(0, 0.1))
        finally:
            reset_at[rid] = raw.reset()
        phase_seen["plain_waiting"] += 1

    kinds = {
        "queued": queued,
        "silent_prefill": silent_prefill,
        "mid_decode": mid_decode,
        "plain_waiting": plain_waiting,
    }
    plan = [kind for kind, n in PLAN.items() for _ in range(n)]
    rng.shuffle(plan)
    gate = asyncio.Semaphore(64)

    async def one(i: int, kind: str) -> None:
        async with gate:
            await kinds[kind](f"{kind}-{i}")

    await asyncio.gather(*(one(i, kind) for i, kind in enumerate(plan)))
    # The holder leaves last: a queued leaver still in the queue would take the slot now.
    holder.reset()
    await asyncio.sleep(1.0)
    return reset_at, phase_seen
