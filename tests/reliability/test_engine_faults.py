"""Engine faults through the simulator: crash, hang, 500s, 429s, a reset or a stall mid-stream.

Each client gets a clear error: a JSON OpenAI error body before the response started, an SSE
error event then ``data: [DONE]`` once a stream is under way. The slot is released, the engine
sees its request closed, and ``route.finished`` says what happened.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from engine_pool.sim.server import SimServer, run_sim
from engine_pool.sim.wire import ENGINE_DEAD_MESSAGE
from gateway.count.tokens import TokenCounter
from gateway.tools.sim_support import RegistryCounter
from tests.conftest import JSON, lanes_config
from tests.reliability.reliability_support import (
    admin_state,
    chat_body,
    held,
    settled,
    slots_metric,
    timed_logs,
)
from tests.support.waiting import wait_for

TIMEOUTS = {"connect_s": 1, "first_byte_s": 1.0, "idle_s": 0.6, "total_s": 20}


@dataclass
class Rig:
    sim: SimServer
    url: str
    client: httpx.AsyncClient
    logs: list[MutableMapping[str, Any]]

    def finished(self, rid: str) -> MutableMapping[str, Any]:
        (event,) = [
            e for e in self.logs if e["event"] == "route.finished" and e["request_id"] == rid
        ]
        return event

    async def stream_until(self, rid: str, body: bytes, chunks: int, then: Any) -> bytes:
        """Stream a request, run ``then()`` once ``chunks`` data events arrived, read the rest."""
        got = b""
        async with self.client.stream(
            "POST",
            self.url + "/v1/chat/completions",
            content=body,
            headers={"x-request-id": rid, **JSON},
        ) as r:
            assert r.status_code == 200
            fired = False
            async for piece in r.aiter_raw():
                got += piece
                if not fired and got.count(b"data: ") >= chunks:
                    fired = True
                    await then()
        return got

    async def post(self, rid: str, body: bytes) -> httpx.Response:
        return await self.client.post(
            self.url + "/v1/chat/completions", content=body, headers={"x-request-id": rid, **JSON}
        )

    async def nothing_held(self) -> None:
        state = await settled(self.client, self.url, within=1.0)
        assert held(state) == 0, state
        assert await slots_metric(self.client, self.url) == 0

    async def engine_closed(self, rid: str, since: float) -> None:
        """The engine saw the request leave within a second of ``since`` (wall time)."""
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            (record,) = self.sim.requests(rid)
            if record.closed_wall is not None:
                assert record.closed_wall - since < 1.0, record
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{rid} still open in the engine")


@pytest.fixture
async def rig(
    gateway_at: Any, counter: TokenCounter, request: pytest.FixtureRequest
) -> AsyncIterator[Rig]:
    # Probes run every 5 s by default: the faults below reach the engine before any probe does.
    health = getattr(request, "param", {}).get("health")
    timeouts = getattr(request, "param", {}).get("timeouts", TIMEOUTS)
    async with run_sim(
        "h100-fast", time_scale=1.0, counter=RegistryCounter(counter, "qwen3.6"), seed=3
    ) as sim:
        config = lanes_config([sim.url], [sim.url])
        for lane in config["lanes"]:
            lane["timeouts"] = timeouts
            if health:
                lane["health"] = health
        with timed_logs() as logs:
            async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=30) as client:
                await first_probe_done(client, url)
                yield Rig(sim, url, client, logs)


async def first_probe_done(client: httpx.AsyncClient, url: str) -> None:
    """The monitor probes and scrapes at start: let that happen before any fault is injected."""
    for _ in range(200):
        state = await admin_state(client, url)
        endpoints = [e for c in state["clusters"] for e in c["endpoints"]]
        if all(e["evidence"] != "not probed yet" and e["running"] is not None for e in endpoints):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no probe reported: {state}")


def sse_tail(payload: bytes) -> tuple[dict[str, Any], list[bytes]]:
    """The error event of a stream that ended in one, and every data line."""
    lines = [line for line in payload.split(b"\n") if line.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]", payload[-300:]
    assert payload.endswith(b"data: [DONE]\n\n")
    error = orjson.loads(lines[-2].removeprefix(b"data: "))
    assert set(error) == {"error"}, error
    assert lines.count(b"data: [DONE]") == 1
    return error["error"], lines


async def test_engine_crash_mid_stream(rig: Rig) -> None:
    crashed_at = 0.0

    async def crash() -> None:
        nonlocal crashed_at
        crashed_at = time.time()
        await rig.sim.set_faults({"crash": True})

    payload = await rig.stream_until(
        "crash", chat_body("hi", stream=True, max_tokens=200), 4, crash
    )
    error, lines = sse_tail(payload)
    assert error["type"] == "upstream_error" and error["code"] == 502
    assert "mid-response" in error["message"]
    assert len(lines) < 50  # it did not run to the end
    done = rig.finished("crash")
    assert done["outcome"] == "upstream_error"
    assert "mid-response" in done["error"]
    await rig.nothing_held()
    await rig.engine_closed("crash", crashed_at)
    assert rig.sim.requests("crash")[0].abort_reason == "crash"


async def test_crashed_engine_before_the_request_gets_a_json_error(rig: Rig) -> None:
    await rig.sim.set_faults({"crash": True})
    r = await rig.post("refused", chat_body("hi", stream=True, max_tokens=5))
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    done = rig.finished("refused")
    assert error["code"] == r.status_code == done["status"]
    if r.status_code == 502:  # the request found the engine's port closed
        assert error["type"] == "upstream_error" and "refused" in error["message"].lower()
        assert done["outcome"] == "upstream_error" and "refused" in done["error"].lower()
    else:  # the engine monitor saw it go first: the lane has no healthy cluster
        assert r.status_code == 503 and r.headers["retry-after"]
        assert error["type"] == "service_unavailable" and "no healthy cluster" in error["message"]
        assert done["outcome"] == "rejected"
    await rig.nothing_held()


async def test_engine_crash_while_a_plain_request_waits(rig: Rig) -> None:
    async def crash_soon() -> float:
        while not rig.sim.requests("plain-crash"):
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)
        await rig.sim.set_faults({"crash": True})
        return time.time()

    crasher = asyncio.create_task(crash_soon())
    r = await rig.post("plain-crash", chat_body("hi", stream=False, max_tokens=300))
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
    done = rig.finished("plain-crash")
    assert (done["outcome"], done["status"]) == ("upstream_error", 502)
    await rig.nothing_held()
    await rig.engine_closed("plain-crash", await crasher)


async def test_hung_engine_times_out_at_the_first_byte_deadline(rig: Rig) -> None:
    await rig.sim.set_faults({"hang": True})
    started = time.monotonic()
    r = await rig.post("hung", chat_body("hi", stream=True, max_tokens=5))
    took = time.monotonic() - started
    assert r.status_code == 504
    error = r.json()["error"]
    assert error["type"] == "timeout" and "first byte" in error["message"]
    assert 0.9 < took < 2.0
    done = rig.finished("hung")
    assert (done["outcome"], done["status"], done["deadline"]) == ("timeout", 504, "first_byte")
    await rig.nothing_held()


@pytest.mark.parametrize("rig", [{"timeouts": {**TIMEOUTS, "total_s": 3.0}}], indirect=True)
async def test_a_hung_non_streamed_request_times_out_at_the_total_deadline(rig: Rig) -> None:
    """vLLM sends a non-streamed answer's headers only when generation ends: the wait for them
    is bounded by total_s, not first_byte_s."""
    await rig.sim.set_faults({"hang": True})
    started = time.monotonic()
    r = await rig.post("hung", chat_body("hi", stream=False, max_tokens=5))
    took = time.monotonic() - started
    assert r.status_code == 504
    assert "total deadline of 3s" in r.json()["error"]["message"]
    assert 2.9 < took < 4.5
    done = rig.finished("hung")
    assert (done["outcome"], done["status"], done["deadline"]) == ("timeout", 504, "total")
    await rig.nothing_held()


async def test_slow_first_byte_past_the_deadline_is_abandoned_upstream(rig: Rig) -> None:
    await rig.sim.set_faults({"first_byte_delay_s": 5})
    # 500 tokens take ~12 s: the engine is still generating when the gateway gives up.
    r = await rig.post("slow", chat_body("hi", stream=True, max_tokens=500))
    gave_up = time.time()
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
    assert rig.finished("slow")["outcome"] == "timeout"
    await rig.nothing_held()
    await rig.engine_closed("slow", gave_up)
    assert rig.sim.requests("slow")[0].outcome == "aborted"


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(("fault", "status"), [("error_500_rate", 500), ("error_429_rate", 429)])
async def test_engine_errors_reach_the_client_in_the_openai_shape(
    rig: Rig, fault: str, status: int, stream: bool
) -> None:
    await rig.sim.set_faults({fault: 1.0})
    r = await rig.post("refused", chat_body("hi", stream=stream, max_tokens=5))
    assert r.status_code == status
    error = r.json()["error"]
    assert error["code"] == status and error["message"].startswith("injected fault")
    if status == 429:
        assert r.headers["retry-after"] == "1"
    done = rig.finished("refused")
    assert done["status"] == status
    assert done["outcome"] == ("upstream_error" if status >= 500 else "ok")
    await rig.nothing_held()


async def test_dead_engine_answers_500_and_nothing_is_held(rig: Rig) -> None:
    await rig.sim.set_faults({"dead": True, "exit_after_s": 5})
    r = await rig.post("dead", chat_body("hi", stream=True, max_tokens=5))
    assert r.status_code == 500 and r.json()["error"]["code"] == 500
    assert r.json()["error"]["message"] == ENGINE_DEAD_MESSAGE
    assert rig.finished("dead")["outcome"] == "upstream_error"
    await rig.nothing_held()


@pytest.mark.parametrize(
    "rig", [{"health": {"interval_s": 0.2, "timeout_s": 1, "up_after_successes": 1}}], indirect=True
)
async def test_an_engine_core_death_reaches_the_client_and_takes_the_engine_out(rig: Rig) -> None:
    """vLLM 0.32 when its engine core dies: the stream under way ends with vLLM's error event,
    new requests answer 500 while its /health still answers 200 (there is no 503 phase), and
    ~0.5 s later the server exits. The client gets the error event then [DONE]; the gateway
    takes the engine out of routing once it is gone (probes or requests refused), and nothing
    is held."""

    async def die() -> None:
        await rig.sim.set_faults({"dead": True})

    payload = await rig.stream_until("dying", chat_body("hi", stream=True, max_tokens=200), 4, die)
    error, lines = sse_tail(payload)
    assert error["code"] == 500 and error["message"] == ENGINE_DEAD_MESSAGE
    assert len(lines) < 50  # it did not run to the end
    assert rig.sim.requests("dying")[0].abort_reason == "engine_dead"
    await wait_for(lambda: not rig.sim.listening, 3, what="the dead engine's server exits")

    async def down() -> bool:
        state = await admin_state(rig.client, rig.url)
        return all(e["state"] == "down" for c in state["clusters"] for e in c["endpoints"])

    await wait_for(down, 3, what="the gateway marks the exited engine down")
    r = await rig.post("after", chat_body("hi", stream=False, max_tokens=3))
    assert r.status_code in (502, 503) and r.json()["error"]["code"] == r.status_code
    await rig.nothing_held()


async def test_connection_reset_mid_stream(rig: Rig) -> None:
    await rig.sim.set_faults({"drop_after_chunks": 4})
    r = await rig.post("dropped", chat_body("hi", stream=True, max_tokens=50))
    assert r.status_code == 200
    error, lines = sse_tail(r.content)
    assert error["type"] == "upstream_error" and "mid-response" in error["message"]
    assert len(lines) == 4 + 2  # the engine's four events, the error, [DONE]
    done = rig.finished("dropped")
    assert done["outcome"] == "upstream_error" and done["chunks"] >= 1
    await rig.nothing_held()
    assert rig.sim.faults.injected["drop"] == 1


async def test_stream_stalled_mid_way_ends_at_the_idle_deadline(rig: Rig) -> None:
    await rig.sim.set_faults({"stall_after_tokens": 3})
    started = time.monotonic()
    r = await rig.post("stalled", chat_body("hi", stream=True, max_tokens=50))
    gave_up = time.time()
    assert r.status_code == 200
    error, _ = sse_tail(r.content)
    assert error["type"] == "timeout" and "idle" in error["message"]
    assert time.monotonic() - started < 3.0
    done = rig.finished("stalled")
    assert (done["outcome"], done["deadline"]) == ("timeout", "idle")
    await rig.nothing_held()
    await rig.engine_closed("stalled", gave_up)


@pytest.mark.parametrize(
    "rig", [{"health": {"interval_s": 0.2, "timeout_s": 1, "up_after_successes": 1}}], indirect=True
)
async def test_the_engine_recovers_and_serves_again_after_a_crash(rig: Rig) -> None:
    """The failed request marks the engine down (503 with Retry-After while it is); once it
    restarted and the probes saw it up again, it serves. Nothing is held on the way."""
    await rig.sim.set_faults({"crash": True, "restart_after_s": 0.3})
    r = await rig.post("down", chat_body("hi", stream=False, max_tokens=3))
    assert r.status_code in (502, 503)  # refused, or already seen down by a probe
    statuses: list[int] = []
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        r = await rig.post(f"back-{len(statuses)}", chat_body("hi", stream=False, max_tokens=3))
        statuses.append(r.status_code)
        if r.status_code == 200:
            break
        assert r.status_code in (502, 503) and r.json()["error"]["code"] == r.status_code
        await asyncio.sleep(0.1)
    assert statuses[-1] == 200, statuses
    await rig.nothing_held()
