"""A client that goes away aborts its request inside the engine at once: seat and KV freed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from engine_pool.sim.records import RequestRecord
from engine_pool.sim.server import SimServer, run_sim
from gateway.tools.sim_support import RegistryCounter


def chat(content: str, max_tokens: int, stream: bool = False) -> dict[str, object]:
    return {
        "model": "qwen3.6",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


@pytest.fixture
async def sim(engine_counter: RegistryCounter) -> AsyncIterator[SimServer]:
    async with run_sim("h100-heavy", time_scale=0.02, counter=engine_counter) as server:
        yield server


async def closed(sim: SimServer, request_id: str, within: float = 1.0) -> RequestRecord:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        records = sim.requests(request_id)
        if records and records[0].closed_wall is not None:
            return records[0]
        await asyncio.sleep(0.005)
    raise AssertionError(f"{request_id} still open in the engine")


async def test_closing_a_stream_mid_decode_aborts_it(sim: SimServer) -> None:
    async with (
        httpx.AsyncClient(base_url=sim.url) as client,
        client.stream(
            "POST",
            "/v1/chat/completions",
            json=chat("hi", 5000, True),
            headers={"X-Request-Id": "reader"},
        ) as r,
    ):
        lines = r.aiter_lines()
        for _ in range(3):
            await anext(lines)
        gave_up = time.time()
    record = await closed(sim, "reader")
    assert record.outcome == "aborted" and record.abort_reason == "client_disconnect"
    assert record.closed_wall is not None and record.closed_wall - gave_up < 0.5
    snap = sim.engine.snapshot()
    assert (snap.running, snap.kv_used_tokens, snap.kv_reserved_tokens) == (0, 0, 0)


async def test_disconnect_during_a_silent_prefill_aborts_it(sim: SimServer) -> None:
    monster = " hello" * 150_000  # ~36 s of simulated prefill, ~0.7 s of wall time
    async with httpx.AsyncClient(base_url=sim.url, timeout=30) as client:

        async def first_line() -> str:
            body = chat(monster, 10, True)
            headers = {"X-Request-Id": "impatient"}
            async with client.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as r:
                return await anext(r.aiter_lines())

        reader = asyncio.create_task(first_line())
        while not sim.requests("impatient"):
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.1)  # 5 simulated seconds into its prefill: no byte sent yet
        assert not reader.done()
        reader.cancel()  # the client goes away
        gave_up = time.time()
        await asyncio.gather(reader, return_exceptions=True)
    record = await closed(sim, "impatient")
    assert record.first_token_s is None and record.outcome == "aborted"
    assert record.closed_wall is not None and record.closed_wall - gave_up < 0.5
    assert sim.engine.snapshot().running == 0


async def test_non_streaming_disconnect_aborts_it(sim: SimServer) -> None:
    async with httpx.AsyncClient(base_url=sim.url, timeout=0.3) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(
                "/v1/chat/completions", json=chat("hi", 5000), headers={"X-Request-Id": "blocking"}
            )
        gave_up = time.time()
    record = await closed(sim, "blocking")
    assert record.outcome == "aborted" and 0 < record.tokens_generated < 5000
    assert record.closed_wall is not None and record.closed_wall - gave_up < 0.5


async def test_an_abandoned_seat_goes_to_the_next_request_at_once(sim: SimServer) -> None:
    seats = sim.profile.scheduler.max_num_seqs
    async with httpx.AsyncClient(base_url=sim.url, timeout=5) as client:
        holders = [
            asyncio.create_task(
                client.post(
                    "/v1/chat/completions",
                    json=chat("hi", 100_000),
                    headers={"X-Request-Id": f"holder-{i}"},
                )
            )
            for i in range(seats)
        ]
        while sim.engine.snapshot().running < seats:
            await asyncio.sleep(0.005)
        async with client.stream(
            "POST",
            "/v1/chat/completions",
            json=chat("next", 5, True),
            headers={"X-Request-Id": "next"},
        ) as waiter:
            await asyncio.sleep(0.1)  # 5 simulated seconds: nobody leaves by themselves
            assert sim.requests("next")[0].first_token_s is None
            assert sim.engine.snapshot().waiting == 1
            holders[0].cancel()
            events = [line async for line in waiter.aiter_lines() if line.startswith("data: ")]
        for task in holders[1:]:
            task.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
    assert events[-1] == "data: [DONE]"
    freed = (await closed(sim, "holder-0")).aborted_s
    started = sim.requests("next")[0].first_token_s
    assert freed is not None and started is not None
    assert started - freed < 0.5  # simulated seconds: the very next steps
