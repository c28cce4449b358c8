"""SIGTERM to a ``shapegate serve`` process: it stops admitting, lets in-flight requests finish
up to ``server.drain_timeout_s``, releases everything and exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from engine_pool.sim.server import SimServer, run_sim
from gateway.count.tokens import TokenCounter
from gateway.tools.sim_support import RegistryCounter
from tests.conftest import JSON, lanes_config
from tests.reliability.reliability_support import admin_state, chat_body
from tests.support.checkout import ROOT, checkout_env, gateway_cli
from tests.support.servers import free_port
from tests.support.waiting import wait_for


@dataclass
class Served:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_bytes().splitlines():
            with contextlib.suppress(orjson.JSONDecodeError):
                event = orjson.loads(line)
                if isinstance(event, dict):
                    out.append(event)
        return out

    async def exit_code(self, within: float) -> int:
        deadline = time.monotonic() + within
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"still running {within}s after SIGTERM")
            await asyncio.sleep(0.02)
        return self.process.returncode


@contextlib.asynccontextmanager
async def serve(tmp_path: Path, config: dict[str, Any]) -> AsyncIterator[Served]:
    port = free_port()
    config["server"] = {**config.get("server", {}), "port": port, "host": "127.0.0.1"}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            gateway_cli("serve", "--config", str(path)),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=checkout_env(),
        )
    served = Served(f"http://127.0.0.1:{port}", process, log)
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            deadline = time.monotonic() + 30
            while True:
                assert process.poll() is None, log.read_text()
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get(served.url + "/readyz")).status_code == 200:
                        break
                assert time.monotonic() < deadline, log.read_text()
                await asyncio.sleep(0.05)
        yield served
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def refuses(url: str) -> bool:
    try:
        async with httpx.AsyncClient() as client:
            await client.get(url + "/readyz")
    except httpx.ConnectError:
        return True
    return False


@pytest.fixture
async def sim(counter: TokenCounter) -> AsyncIterator[SimServer]:
    async with run_sim(
        "h100-fast", time_scale=1.0, counter=RegistryCounter(counter, "qwen3.6")
    ) as server:
        yield server


async def test_sigterm_drains_in_flight_requests_and_exits_0(
    tmp_path: Path, sim: SimServer
) -> None:
    config = lanes_config([sim.url], [sim.url])
    config["server"] = {"boot_probe": False, "drain_timeout_s": 8}
    config["lanes"][0]["slots"] = {"lane": 2, "per_endpoint": 2}
    async with serve(tmp_path, config) as gw, httpx.AsyncClient(timeout=30) as client:

        async def post(rid: str, stream: bool) -> httpx.Response:
            return await client.post(
                gw.url + "/v1/chat/completions",
                content=chat_body(rid, stream=stream, max_tokens=60),  # ~1.4 s of decode
                headers={"x-request-id": rid, **JSON},
            )

        streamed = asyncio.create_task(post("streamed", True))
        plain = asyncio.create_task(post("plain", False))
        while len(sim.requests()) < 2:
            await asyncio.sleep(0.01)
        queued = asyncio.create_task(post("queued", False))
        while (await admin_state(client, gw.url))["lanes"][0]["queue_depth"] < 1:
            await asyncio.sleep(0.01)

        gw.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        await wait_for(lambda: refuses(gw.url), 2, what="the listening socket closed")
        with pytest.raises(httpx.ConnectError):
            await post("late", False)

        responses = await asyncio.gather(streamed, plain, queued)
        code = await gw.exit_code(within=10)
        took = time.monotonic() - signalled
        events = gw.events()
    assert code == 0
    assert took < 8  # they finished well inside the drain deadline, and so did the process
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert responses[0].text.endswith("data: [DONE]\n\n")
    assert all(r.outcome == "finished" for r in sim.requests())
    finished = {e["request_id"]: e for e in events if e["event"] == "route.finished"}
    assert [finished[rid]["outcome"] for rid in ("streamed", "plain", "queued")] == ["ok"] * 3
    assert "late" not in finished  # refused at the socket: it never reached the pipeline
    drained = [e for e in events if e["event"] == "gateway.drained"]
    assert drained and drained[0]["left_in_flight"] == 0
    assert events[-1]["event"] == "gateway.stopped"


@pytest.mark.parametrize("drain_s", [1.0, 0.4])
async def test_requests_past_the_drain_deadline_are_ended_and_released(
    tmp_path: Path, sim: SimServer, drain_s: float
) -> None:
    config = lanes_config([sim.url], [sim.url])
    config["server"] = {"boot_probe": False, "drain_timeout_s": drain_s}
    async with serve(tmp_path, config) as gw, httpx.AsyncClient(timeout=30) as client:
        got = b""

        async def endless() -> int:
            nonlocal got
            async with client.stream(
                "POST",
                gw.url + "/v1/chat/completions",
                content=chat_body("long", stream=True, max_tokens=2000),  # ~46 s
                headers={"x-request-id": "endless", **JSON},
            ) as r:
                with contextlib.suppress(httpx.HTTPError):
                    async for piece in r.aiter_raw():
                        got += piece
                return r.status_code

        reader = asyncio.create_task(endless())
        while got.count(b"data: ") < 3:
            await asyncio.sleep(0.01)
        gw.process.send_signal(signal.SIGTERM)
        signalled, signalled_wall = time.monotonic(), time.time()
        code = await gw.exit_code(within=6)
        took, exited_wall = time.monotonic() - signalled, time.time()
        status = await reader
        events = gw.events()
    assert code == 0 and status == 200
    assert drain_s < took < drain_s + 2.5  # uvicorn counts whole seconds: 0.4 s drains for 1 s
    assert not got.endswith(b"data: [DONE]\n\n")  # it was cut, not finished
    # The engine stopped generating for it at the drain deadline, not before, and before the
    # gateway's process was gone (which would close it anyway).
    (record,) = sim.requests("endless")
    assert record.outcome == "aborted" and record.closed_wall is not None
    assert signalled_wall + drain_s * 0.9 < record.closed_wall < exited_wall + 0.1
    finished = [e for e in events if e["event"] == "route.finished"]
    assert [(e["request_id"], e["outcome"]) for e in finished] == [("endless", "cancelled")]
    drained = [e for e in events if e["event"] == "gateway.drained"]
    assert drained and drained[0]["left_in_flight"] == 0
    assert events[-1]["event"] == "gateway.stopped"
