"""Draining endpoints (gateway/upstream/drain.py, POST /admin/engines/drain): a rolling restart
of every engine of a lane under load ends with no client error; the policy's
``clusters[].draining`` and a reload that removes an endpoint drain it; the admin state and the
dashboard show it draining."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from structlog.testing import capture_logs

from engine_pool.sim.server import run_sim
from engine_pool.sim.wire import output_text
from gateway.count.tokens import TokenCounter
from gateway.settings import ConfigError, parse_settings
from gateway.tools.sim_support import RegistryCounter
from tests.conftest import JSON, GatewayFactory, lanes_config
from tests.reliability.reliability_support import admin_state, held, settled
from tests.support.sim_process import sim_processes

ENGINES = 3
CLIENTS = 4
MAX_TOKENS = 60
DRAIN_S = 1.0
ADMIN = {"x-shapegate-admin": "1"}
QUICK_PROBES = {"interval_s": 0.2, "timeout_s": 1, "up_after_successes": 1}


@dataclass
class Tally:
    ok: int = 0
    errors: list[str] = field(default_factory=list)


def text_of(raw: bytes) -> str:
    out = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: {") and b'"choices":[{' in block:
            out.append(orjson.loads(block[6:])["choices"][0]["delta"].get("content") or "")
    return "".join(out)


async def client_loop(
    client: httpx.AsyncClient, url: str, n: int, stop: asyncio.Event, tally: Tally
) -> None:
    i = 0
    while not stop.is_set():
        body = {
            "model": "qwen3.6",
            "messages": [{"role": "user", "content": f"client {n} request {i}"}],
            "max_tokens": MAX_TOKENS,
            "stream": True,
        }
        i += 1
        try:
            r = await client.post(
                url + "/v1/chat/completions", content=orjson.dumps(body), headers=JSON
            )
            whole = r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")
            if (
                whole
                and b'"error"' not in r.content
                and text_of(r.content) == output_text(0, MAX_TOKENS)
            ):
                tally.ok += 1
            else:
                tally.errors.append(f"{r.status_code} {r.content[-300:]!r}")
        except httpx.HTTPError as exc:
            tally.errors.append(repr(exc))


async def endpoint_of(client: httpx.AsyncClient, url: str, engine: str) -> dict[str, Any]:
    state = await admin_state(client, url)
    return next(e for c in state["clusters"] for e in c["endpoints"] if e["url"] == engine)


async def wait_until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_a_rolling_restart_of_every_engine_of_a_lane_fails_no_client(
    gateway_at: GatewayFactory,
) -> None:
    with sim_processes(ENGINES, time_scale=1.0) as sims:
        config = lanes_config([s.url for s in sims], ["http://127.0.0.1:9"])
        config["clusters"][0]["drain_s"] = DRAIN_S
        config["lanes"][0]["health"] = QUICK_PROBES
        tally, stop = Tally(), asyncio.Event()
        with capture_logs() as logs:
            async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=60) as client:
                loops = [
                    asyncio.create_task(client_loop(client, url, n, stop, tally))
                    for n in range(CLIENTS)
                ]
                await asyncio.sleep(1.0)
                for sim in sims:
                    r = await client.post(
                        url + "/admin/engines/drain", json={"url": sim.url}, headers=ADMIN
                    )
                    assert r.status_code == 200 and r.json()["endpoints"][0]["state"] == "draining"

                    async def idle(engine: str = sim.url) -> bool:
                        return bool((await endpoint_of(client, url, engine))["in_flight"] == 0)

                    await wait_until(idle, DRAIN_S + 5, f"{sim.url} never drained")
                    sim.kill()
                    await asyncio.to_thread(sim.restart)
                    r = await client.post(
                        url + "/admin/engines/undrain", json={"url": sim.url}, headers=ADMIN
                    )
                    assert r.status_code == 200

                    async def up(engine: str = sim.url) -> bool:
                        return bool((await endpoint_of(client, url, engine))["state"] == "up")

                    await wait_until(up, 10, f"{sim.url} never came back")
                    await asyncio.sleep(0.5)  # load on the restarted engine before the next
                stop.set()
                await asyncio.gather(*loops)
                state = await settled(client, url)
                assert held(state) == 0, state
    drains = [e for e in logs if e["event"] == "engine.draining"]
    migrated = [e for e in logs if e["event"] == "route.migrated"]
    print(
        f"\nrolling restart of {ENGINES} engines under {CLIENTS} client loops: {tally.ok} streams "
        f"ok, {len(tally.errors)} client errors; {len(migrated)} migrated past the {DRAIN_S} s "
        f"drain deadline ({sorted({e['reason'] for e in migrated})})"
    )
    assert tally.errors == []
    assert tally.ok >= 3 * CLIENTS
    assert [e["endpoint"] for e in drains] == [s.url for s in sims]
    assert all(e["reason"] == "drained" for e in migrated)


async def test_the_policy_and_a_reload_drain_endpoints_and_the_state_shows_it(
    gateway_at: GatewayFactory, counter: TokenCounter
) -> None:
    shared = RegistryCounter(counter, "qwen3.6")
    async with (
        run_sim("h100-fast", time_scale=1.0, counter=shared, seed=1) as a,
        run_sim("h100-fast", time_scale=1.0, counter=shared, seed=2) as b,
    ):
        config = lanes_config([a.url, b.url], ["http://127.0.0.1:9"])
        config["clusters"][0]["draining"] = [a.url]
        config["lanes"][0]["health"] = {"interval_s": 60, "timeout_s": 5, "up_after_successes": 1}
        async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=30) as client:
            assert (await endpoint_of(client, url, a.url))["state"] == "draining"
            body = {"model": "qwen3.6", "messages": [{"role": "user", "content": "hi"}]}
            for _ in range(4):  # every request goes to b: a takes no new ones
                r = await client.post(url + "/v1/chat/completions", json={**body, "max_tokens": 2})
                assert r.headers["x-shapegate-cluster"] == "fast"
            assert a.requests() == [] and len(b.requests()) == 4
            dashboard = (await client.get(url + "/admin/dashboard.json")).json()
            rows = [e for c in dashboard["clusters"] for e in c["endpoints"] if e["draining"]]
            assert [e["url"] for e in rows] == [a.url]
            # A reload without a's drain brings it back; one without b drains b (removed)
            # under the cluster's drain_s, while b's stream in flight goes on to its end.
            config["clusters"][0]["draining"] = []
            config["clusters"][0]["drain_s"] = 0.5
            r = await client.post(url + "/admin/reload", json=config, headers=ADMIN)
            assert r.status_code == 200
            assert (await endpoint_of(client, url, a.url))["state"] == "up"
            stream = asyncio.create_task(
                client.post(
                    url + "/v1/chat/completions",
                    json={**body, "max_tokens": 80, "stream": True},
                    headers={"x-request-id": "long"},
                )
            )
            await wait_until(lambda: _arrived(b, a, "long"), 5, "the stream never started")
            on = a if a.requests("long") else b
            other = b if on is a else a
            config["clusters"][0]["endpoints"] = [other.url]
            with capture_logs() as logs:
                r = await client.post(url + "/admin/reload", json=config, headers=ADMIN)
                assert r.status_code == 200
                gone = await endpoint_of(client, url, on.url)
                assert gone["state"] == "draining" and gone["in_flight"] == 1
                raw = (await stream).content
            assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
            assert text_of(raw) == output_text(0, 80)
            events = [e["event"] for e in logs]
            assert "engine.draining" in events and "route.migrated" in events
            assert [e["reason"] for e in logs if e["event"] == "route.migrated"] == ["drained"]
            assert held(await settled(client, url)) == 0


async def _arrived(b: Any, a: Any, rid: str) -> bool:
    return bool(a.requests(rid) or b.requests(rid))


def test_a_policy_cannot_drain_an_endpoint_its_cluster_does_not_have() -> None:
    config = lanes_config(["http://a:1"], ["http://b:1"])
    config["clusters"][0]["draining"] = ["http://c:1"]
    with pytest.raises(ConfigError, match="draining"):
        parse_settings(config, environ={})
    config["clusters"][0]["draining"] = ["http://a:1"]
    config["clusters"][0]["drain_s"] = -1
    with pytest.raises(ConfigError, match="drain_s"):
        parse_settings(config, environ={})
