"""``shapegate serve --workers 2``: real processes, real sockets, the tests' fake engine.

One lane limit holds across both workers (the supervisor's slot server, or Redis), nothing is
held afterwards, a worker killed with -9 leaks no slot and is started again, the admin state and
metrics count the whole gateway, a reload reaches every worker, and SIGTERM drains both."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from tests.conftest import JSON, lanes_config
from tests.support.checkout import ROOT, checkout_env, gateway_cli
from tests.support.fake_engine import FakeEngine
from tests.support.logs import log_events
from tests.support.prom import parse
from tests.support.servers import free_port, serve_asgi
from tests.support.waiting import wait_for

LIMIT = 3


@dataclass
class Workers:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    config: Path

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        return log_events(self.log, name)

    async def state(self, client: httpx.AsyncClient) -> dict[str, Any]:
        response = await client.get(self.url + "/admin/state")
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body


@contextlib.asynccontextmanager
async def serve_workers(
    tmp_path: Path, config: dict[str, Any], count: int = 2
) -> AsyncIterator[Workers]:
    port = free_port()
    config["server"] = {**config.get("server", {}), "port": port, "host": "127.0.0.1"}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            gateway_cli("serve", "--config", str(path), "--workers", str(count)),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=checkout_env(),
        )
    served = Workers(f"http://127.0.0.1:{port}", process, log, path)
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            await wait_for(
                lambda: _all_answer(client, served, count), 120, interval=0.1, what="every worker"
            )
        yield served
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def _all_answer(client: httpx.AsyncClient, served: Workers, count: int) -> bool:
    assert served.process.poll() is None, served.log.read_text()
    try:
        state = await served.state(client)
    except httpx.HTTPError:
        return False
    return len(state.get("workers", [])) == count


def chat(rid: str, **fake: Any) -> bytes:
    return orjson.dumps(
        {
            "model": "qwen3.6",
            "messages": [{"role": "user", "content": f"hello {rid}"}],
            "max_tokens": 8,
            # A stream when the fake engine is told how to pace one.
            "stream": "gap" in fake,
            "fake": fake,
        }
    )


async def post(client: httpx.AsyncClient, url: str, rid: str, **fake: Any) -> httpx.Response:
    """A chat request; ``fake`` tells the fake engine how to answer (tests/support)."""
    return await client.post(
        url + "/v1/chat/completions",
        content=chat(rid, **fake),
        headers={"x-request-id": rid, **JSON},
    )


@pytest.fixture
async def engine() -> AsyncIterator[tuple[FakeEngine, str]]:
    fake = FakeEngine()
    async with serve_asgi(fake) as url:
        yield fake, url


def policy(url: str, **state: Any) -> dict[str, Any]:
    config = lanes_config([url], [url])
    config["server"] = {"boot_probe": False, "drain_timeout_s": 10}
    config["lanes"][0]["slots"] = {"lane": LIMIT, "per_endpoint": LIMIT}
    config["lanes"][0]["queue"] = {"depth": 512, "max_wait_s": 20}
    if state:
        config["state"] = state
    return config


def metric(text: str, name: str, **labels: str) -> float:
    return parse(text).value(name, **labels)


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_two_workers_hold_one_lane_limit_and_sigterm_drains_both(
    tmp_path: Path,
    engine: tuple[FakeEngine, str],
    backend: str,
    request: pytest.FixtureRequest,
) -> None:
    fake, url = engine
    state: dict[str, Any] = {}
    if backend == "redis":
        state = {
            "backend": "redis",
            "redis_url": request.getfixturevalue("redis_url"),
            "key_prefix": request.getfixturevalue("prefix"),
        }
    limits = httpx.Limits(max_connections=64)
    async with (
        serve_workers(tmp_path, policy(url, **state)) as gw,
        httpx.AsyncClient(timeout=30, limits=limits) as c,
    ):
        # A burst of 30 at once, each holding its engine 0.2 s before the first byte.
        burst = [post(c, gw.url, f"b{i}", mode="slow_first_byte", delay=0.2) for i in range(30)]
        statuses = [r.status_code for r in await asyncio.gather(*burst)]
        assert statuses == [200] * 30
        assert fake.peak_in_flight == LIMIT  # never above the limit, and the limit was used
        finished = gw.events("route.finished")
        assert {e["worker"] for e in finished} == {0, 1}  # both workers served the burst

        # A client can read a response's last byte a moment before its handler has released
        # (a CI run read in_flight 2 here): wait briefly for both to settle, then check.
        async def settled() -> bool:
            now = await gw.state(c)
            return now["in_flight"] == 0 and now["lanes"][0]["slots_in_use"] == 0

        await wait_for(settled, 2, interval=0.05, what="every request released")
        state_now = await gw.state(c)
        assert [w["index"] for w in state_now["workers"]] == [0, 1]
        assert state_now["lanes"][0]["slots_in_use"] == 0
        assert state_now["in_flight"] == 0
        assert all(e["slots_in_use"] == 0 for e in state_now["clusters"][0]["endpoints"])
        scrape = (await c.get(gw.url + "/metrics")).text
        assert metric(scrape, "shapegate_requests_total", lane="fast") == 30  # both counted
        assert metric(scrape, "shapegate_workers", state="answered") == 2
        # A limit every worker exports is the limit, not twice it; held slots add up (to 0).
        assert metric(scrape, "shapegate_slots_limit", lane="fast", cluster="fast") == LIMIT
        assert metric(scrape, "shapegate_slots_in_use", lane="fast", cluster="fast") == 0

        # SIGTERM while both workers have requests in flight: every one finishes. Each on a
        # new connection (the burst's idle ones may all belong to one worker).
        streams: list[asyncio.Task[httpx.Response]] = []
        fresh = httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_keepalive_connections=0))

        async def both_busy() -> bool:
            if len(streams) < 24:
                rid = f"s{len(streams)}"
                streams.append(asyncio.create_task(post(fresh, gw.url, rid, chunks=15, gap=0.1)))
            workers = (await gw.state(c))["workers"]
            return all(w["in_flight"] > 0 for w in workers)

        await wait_for(both_busy, 10, interval=0.05, what="both workers with requests")
        gw.process.send_signal(signal.SIGTERM)
        responses = await asyncio.gather(*streams)
        await fresh.aclose()
        code = await asyncio.to_thread(gw.process.wait, 30)
    assert code == 0
    assert [r.status_code for r in responses] == [200] * len(streams)
    assert all(r.text.count("data: ") >= 15 for r in responses)  # whole streams, not cut
    assert fake.peak_in_flight == LIMIT
    drained = gw.events("gateway.drained")
    assert sorted(e["worker"] for e in drained) == [0, 1]
    assert all(e["left_in_flight"] == 0 for e in drained)
    (stopped,) = gw.events("workers.stopped")
    assert stopped["codes"] == {"0": 0, "1": 0}


async def test_a_worker_killed_with_sigkill_leaks_no_slot_and_comes_back(
    tmp_path: Path, engine: tuple[FakeEngine, str]
) -> None:
    fake, url = engine
    async with serve_workers(tmp_path, policy(url)) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            tasks: list[asyncio.Task[httpx.Response]] = []

            async def both_hold() -> list[dict[str, Any]] | None:
                # Twelve streams in flight, replaced as they end, until both workers hold slots
                # at once: the kernel spreads connections by address hash, so a round of three
                # (one stream's 3 s) can go to one worker, and now and then three rounds did.
                if sum(not task.done() for task in tasks) < 12:
                    rid = f"k{len(tasks)}"
                    tasks.append(asyncio.create_task(post(c, gw.url, rid, chunks=30, gap=0.1)))
                state = await gw.state(c)
                # A worker's in_flight counts its waiters too: the victim must hold slots, not
                # only wait for them, and every request in flight is either held or waiting.
                holding = [w["in_flight"] - w["queued"] for w in state["workers"]]
                full = state["lanes"][0]["slots_in_use"] == LIMIT == sum(holding)
                return state["workers"] if full and min(holding) > 0 else None

            workers = await wait_for(both_hold, 30, interval=0.05, what="both workers hold slots")
            victim = workers[0]
            survivor_pid = workers[1]["pid"]
            os.kill(victim["pid"], signal.SIGKILL)
            # From now on a new connection each time: pooled ones may be the killed worker's.
            probe = httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_keepalive_connections=0))

            async def reclaimed() -> bool:
                # The killed worker's slots are back at once, long before its streams would end.
                state = await gw.state(probe)
                mine = [w for w in state["workers"] if w["pid"] == survivor_pid]
                return bool(mine) and state["lanes"][0]["slots_in_use"] <= mine[0]["in_flight"]

            await wait_for(reclaimed, 2, interval=0.05, what="the killed worker's slots back")
            results = await asyncio.gather(*tasks, return_exceptions=True)

            async def restarted() -> bool:
                state = await gw.state(probe)
                return len(state["workers"]) == 2 and victim["pid"] not in {
                    w["pid"] for w in state["workers"]
                }

            await wait_for(restarted, 60, interval=0.1, what="the worker started again")
            state = await gw.state(probe)
            await probe.aclose()
            assert state["lanes"][0]["slots_in_use"] == 0 and state["in_flight"] == 0
        # The limit still holds with the new worker (new connections: the pool's old ones to the
        # killed worker are dead).
        fake.peak_in_flight = 0
        async with httpx.AsyncClient(timeout=30) as c:
            burst = [post(c, gw.url, f"a{i}", mode="slow_first_byte", delay=0.2) for i in range(12)]
            assert [r.status_code for r in await asyncio.gather(*burst)] == [200] * 12
            assert fake.peak_in_flight == LIMIT
    assert any(isinstance(r, httpx.HTTPError) for r in results)  # the victim's clients saw it
    (exited,) = gw.events("workers.exited")
    assert exited["pid"] == victim["pid"] and exited["code"] == -signal.SIGKILL
    assert [e["worker"] for e in gw.events("workers.restarted")] == [victim["index"]]
    reclaimed_events = [e for e in gw.events("slots.reclaimed") if e["tokens"] > 0]
    assert reclaimed_events and reclaimed_events[0]["worker"] == victim["index"]


async def test_reload_and_sighup_reach_every_worker(
    tmp_path: Path, engine: tuple[FakeEngine, str]
) -> None:
    _, url = engine
    async with serve_workers(tmp_path, policy(url)) as gw:
        async with httpx.AsyncClient(timeout=10) as c:
            changed = policy(url)
            changed["server"] = {**changed["server"], "port": 1, "host": "127.0.0.1"}
            changed["lanes"][0]["slots"] = {"lane": 5, "per_endpoint": 5}
            response = await c.post(
                gw.url + "/admin/reload",
                content=yaml.safe_dump(changed),
                headers={"content-type": "application/yaml", "x-shapegate-admin": "1"},
            )
            assert response.status_code == 200, response.text
            assert response.json()["workers"] == {"reloaded": 2, "failed": []}
            state = await gw.state(c)
            assert [w["policy_version"] for w in state["workers"]] == [2, 2]
            scrape = (await c.get(gw.url + "/metrics")).text
            assert metric(scrape, "shapegate_slots_limit", lane="fast", cluster="fast") == 5

            gw.process.send_signal(signal.SIGHUP)  # the file (limit 3) again, on every worker

            async def all_reloaded() -> bool:
                state = await gw.state(c)
                return [w["policy_version"] for w in state["workers"]] == [3, 3]

            await wait_for(all_reloaded, 10, interval=0.05, what="both workers reloaded")
            assert (await gw.state(c))["lanes"][0]["slot_limit"] == LIMIT
            dashboard = (await c.get(gw.url + "/admin/dashboard.json")).json()
            assert [w["index"] for w in dashboard["workers"]] == [0, 1]
        gw.process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(gw.process.wait, 30) == 0
