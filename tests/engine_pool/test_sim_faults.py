"""Fault injection on one simulated engine, set at start, through the handle and over HTTP."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_pool.load import parse_load
from engine_pool.sim.faults import FaultError, FaultSpec, parse_fault_arg
from engine_pool.sim.server import SimServer, run_sim
from engine_pool.sim.wire import ENGINE_DEAD_MESSAGE
from gateway.tools.sim_support import RegistryCounter
from tests.support.waiting import wait_for

CHAT = {"model": "qwen3.6", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
STREAM = {**CHAT, "stream": True}

SimFactory = Callable[..., AbstractAsyncContextManager[SimServer]]


@pytest.fixture
def start_sim(engine_counter: RegistryCounter) -> SimFactory:
    def start(**faults: Any) -> AbstractAsyncContextManager[SimServer]:
        return run_sim(
            "h100-fast",
            time_scale=0.01,
            faults=faults or None,
            seed=1,
            counter=engine_counter,
        )

    return start


@pytest.fixture
async def sim(start_sim: SimFactory) -> AsyncIterator[SimServer]:
    async with start_sim() as server:
        yield server


async def read_events(response: httpx.Response) -> list[str]:
    return [line async for line in response.aiter_lines() if line.startswith("data: ")]


async def test_crash_refuses_connections_until_cleared(sim: SimServer) -> None:
    async with httpx.AsyncClient(base_url=sim.url) as client:
        assert (await client.get("/health")).status_code == 200
        await sim.set_faults({"crash": True})
        with pytest.raises(httpx.ConnectError):
            await client.get("/health")
        await sim.set_faults({})
        assert (await client.get("/health")).status_code == 200


async def test_crash_resets_open_streams_and_aborts_their_requests(sim: SimServer) -> None:
    body = {**STREAM, "max_tokens": 10_000}
    async with (
        httpx.AsyncClient(base_url=sim.url) as client,
        client.stream(
            "POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": "victim"}
        ) as r,
    ):
        lines = r.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
        await sim.set_faults({"crash": True})
        with pytest.raises(httpx.TransportError):
            async for _ in lines:
                pass
    (record,) = sim.requests("victim")
    assert record.outcome == "aborted" and record.abort_reason == "crash"
    assert sim.engine.snapshot().running == 0


async def test_crash_over_http_then_restart_after(sim: SimServer) -> None:
    async with httpx.AsyncClient(base_url=sim.url) as client:
        r = await client.post("/sim/faults", json={"crash": True, "restart_after_s": 0.4})
        assert r.status_code == 200 and r.json() == {
            "faults": {"crash": True, "restart_after_s": 0.4}
        }
        await asyncio.sleep(0.15)
        with pytest.raises(httpx.ConnectError):
            await client.get("/health")
        await asyncio.sleep(0.5)
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/sim/faults")).json()["faults"] == {}


async def test_a_restart_is_a_new_process_start_time_on_metrics(sim: SimServer) -> None:
    """As a vLLM server's process collector exports it: constant while the server lives, new
    once it comes back after a crash or an engine-core death (what the gateway's monitor reads
    as a restart, engine_pool/load.py ``started_s``)."""

    async def started() -> float | None:
        try:  # a new connection each time: a crash resets kept-alive ones
            async with httpx.AsyncClient(base_url=sim.url) as client:
                return parse_load("vllm", (await client.get("/metrics")).text).started_s
        except httpx.HTTPError:
            return None  # not listening

    async def moved_from(before: float) -> float | None:
        now = await started()
        return now if now is not None and now > before else None

    first = await started()
    assert first is not None and abs(first - time.time()) < 60
    assert await started() == first
    await sim.set_faults({"crash": True, "restart_after_s": 0.2})
    after_crash = await wait_for(lambda: moved_from(first), 5, what="a new start after a crash")
    await sim.set_faults({"dead": True, "exit_after_s": 0.05, "restart_after_s": 0.1})
    await wait_for(lambda: moved_from(after_crash), 5, what="a new start after a death")


async def test_crash_at_start_never_listens(start_sim: SimFactory) -> None:
    async with start_sim(crash=True) as sim, httpx.AsyncClient(base_url=sim.url) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get("/health")


async def test_hang_accepts_and_never_answers_but_admin_works(sim: SimServer) -> None:
    await sim.set_faults({"hang": True})
    async with httpx.AsyncClient(base_url=sim.url, timeout=0.3) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/chat/completions", json=CHAT)
        with pytest.raises(httpx.ReadTimeout):
            await client.get("/health")
        assert (await client.post("/sim/faults", json={})).status_code == 200
        await asyncio.sleep(0.01)
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert sim.faults.injected["hang"] == 2


async def test_dead_engine_dies_as_vllm_does(sim: SimServer) -> None:
    """vLLM 0.32 when its engine core dies (measured): running requests end at once (a stream
    with an error event then [DONE], a non-streamed one with 500), new requests answer 500
    while /health still answers 200, and ~0.5 s later the server exits. No /health 503 phase.
    (The test gives the dying phase 1.5 s so that a loaded machine cannot end it early.)"""
    assert FaultSpec(dead=True).exit_after_s == 0.5
    slow = {**CHAT, "max_tokens": 5_000}
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as client:
        async with client.stream(
            "POST", "/v1/chat/completions", json={**slow, "stream": True}
        ) as r:
            waiting = asyncio.create_task(client.post("/v1/chat/completions", json=slow))
            await wait_for(lambda: sim.engine.snapshot().running == 2, 5, what="both run")
            started = time.monotonic()
            await sim.set_faults({"dead": True, "exit_after_s": 1.5})
            events = await read_events(r)
        assert r.status_code == 200
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert events[-1] == "data: [DONE]"
        assert error["code"] == 500 and error["message"] == ENGINE_DEAD_MESSAGE
        answered = await waiting
        assert answered.status_code == 500
        assert answered.json()["error"]["type"] == "InternalServerError"
        fresh = await client.post("/v1/chat/completions", json=CHAT)
        assert fresh.status_code == 500 and fresh.json()["error"]["message"] == ENGINE_DEAD_MESSAGE
        assert (await client.get("/health")).status_code == 200  # vLLM has no 503 phase
        assert time.monotonic() - started < 1.5

        async def refused() -> bool:
            try:
                await client.get("/health")
            except httpx.ConnectError:
                return True
            except (httpx.RemoteProtocolError, httpx.ReadError):
                # A kept-alive connection closed or reset as the server exits: try anew.
                return False
            return False

        await wait_for(refused, 3, what="the server exits")
        assert time.monotonic() - started >= 1.45
        assert sim.faults.injected["dead"] == 1
        await sim.set_faults({})  # an operator restarts it
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_an_engine_loop_failure_ends_as_an_engine_core_death(
    sim: SimServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulator's own engine loop failing ends as vLLM's engine core dying does: the
    request in it gets 500, then the server exits (no /health 503 phase)."""

    def broken(now: float) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(sim.engine._scheduler, "step", broken)
    async with httpx.AsyncClient(base_url=sim.url) as client:
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 500 and r.json()["error"]["message"] == ENGINE_DEAD_MESSAGE
        assert sim.engine.failed
        await wait_for(lambda: not sim.listening, 3, what="the server exits")


async def test_dead_engine_restarts_after_restart_after_s(start_sim: SimFactory) -> None:
    async with (
        start_sim(dead=True, exit_after_s=0.1, restart_after_s=0.2) as sim,
        httpx.AsyncClient(base_url=sim.url) as client,
    ):

        async def healthy_again() -> bool:
            try:
                r = await client.post("/v1/chat/completions", json=CHAT)
            except httpx.TransportError:
                return False
            return r.status_code == 200

        await wait_for(healthy_again, 5, what="restarted")
        assert not sim.faults.spec.dead


async def test_slow_first_byte_holds_even_the_headers(sim: SimServer) -> None:
    await sim.set_faults({"first_byte_delay_s": 0.4})
    async with httpx.AsyncClient(base_url=sim.url) as client:
        started = time.monotonic()
        async with client.stream("POST", "/v1/chat/completions", json=STREAM) as r:
            waited = time.monotonic() - started
            events = await read_events(r)
    assert waited >= 0.4
    assert events[-1] == "data: [DONE]"


async def test_stall_mid_stream_for_a_while(sim: SimServer) -> None:
    await sim.set_faults({"stall_after_tokens": 2, "stall_for_s": 0.4})
    stamps = []
    async with (
        httpx.AsyncClient(base_url=sim.url) as client,
        client.stream("POST", "/v1/chat/completions", json=STREAM) as r,
    ):
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                stamps.append(time.monotonic())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    # role chunk, token 1, token 2, [stall], token 3 ...
    assert gaps[2] >= 0.4
    assert max(gaps) == gaps[2]  # the stall, and only there
    assert len(stamps) == 1 + 8 + 1


async def test_stall_forever_goes_silent_after_n_tokens(sim: SimServer) -> None:
    await sim.set_faults({"stall_after_tokens": 3})
    events: list[str] = []
    async with httpx.AsyncClient(base_url=sim.url, timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            async with client.stream(
                "POST", "/v1/chat/completions", json=STREAM, headers={"X-Request-Id": "stalled"}
            ) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line)
    assert len(events) == 1 + 3
    await asyncio.sleep(0.05)
    # The engine had finished the tokens; the client giving up closes the request there too.
    assert sim.requests("stalled")[0].closed_wall is not None


async def test_dropped_connection_after_n_chunks(sim: SimServer) -> None:
    await sim.set_faults({"drop_after_chunks": 3})
    events: list[str] = []
    async with httpx.AsyncClient(base_url=sim.url) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream(
                "POST",
                "/v1/chat/completions",
                json={**STREAM, "max_tokens": 1000},
                headers={"X-Request-Id": "dropped"},
            ) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line)
        # The server survives it.
        assert (await client.get("/health")).status_code == 200
    assert len(events) == 3
    (record,) = sim.requests("dropped")
    assert record.outcome == "aborted" and record.tokens_generated < 1000


@pytest.mark.parametrize(("fault", "status"), [("error_500_rate", 500), ("error_429_rate", 429)])
async def test_error_rates_of_one_always_fail(sim: SimServer, fault: str, status: int) -> None:
    await sim.set_faults({fault: 1.0})
    async with httpx.AsyncClient(base_url=sim.url) as client:
        r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == status
    assert r.json()["error"]["code"] == status
    if status == 429:
        assert r.headers["retry-after"] == "1"
    assert sim.requests() == []  # refused before the engine saw it


async def test_error_rates_are_rates(sim: SimServer) -> None:
    await sim.set_faults({"error_500_rate": 0.25, "error_429_rate": 0.25})
    async with httpx.AsyncClient(base_url=sim.url) as client:
        statuses = [
            (await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})).status_code
            for _ in range(80)
        ]
    assert 8 <= statuses.count(500) <= 32
    assert 8 <= statuses.count(429) <= 32
    assert statuses.count(200) == len(sim.requests())


def test_fault_arguments_parse_like_the_cli_writes_them() -> None:
    assert parse_fault_arg("dead") == FaultSpec(dead=True)
    assert parse_fault_arg("error_500_rate=0.2, drop_after_chunks=3") == FaultSpec(
        error_500_rate=0.2, drop_after_chunks=3
    )
    assert parse_fault_arg('{"hang": true}') == FaultSpec(hang=True)
    with pytest.raises(FaultError, match="error_500_rate"):
        parse_fault_arg("error_500_rate=2")
    with pytest.raises(FaultError, match="explode"):
        parse_fault_arg("explode")


async def test_bad_fault_json_is_a_400(sim: SimServer) -> None:
    async with httpx.AsyncClient(base_url=sim.url) as client:
        r = await client.post("/sim/faults", json={"hang": "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "faults"
    assert sim.faults.spec == FaultSpec()


def test_the_readme_documents_every_fault() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Simulator faults", 1)[1].split("\n## ", 1)[0]
    for name in FaultSpec.model_fields:
        assert f"`{name}`" in section, name
    assert parse_fault_arg("error_500_rate=0.2,drop_after_chunks=3").drop_after_chunks == 3
