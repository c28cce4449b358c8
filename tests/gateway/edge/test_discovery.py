"""Endpoints found by DNS, against a real resolver (dnsmasq, tests/support/dnsmasq.py) and
simulated engines on 127.0.0.2-4 (all of 127.0.0.0/8 is loopback), one port for all.

An address added to the name is probed (it joins DOWN), slow-starts and serves within two probe
intervals of the resolution that found it; an address removed gets no new request once a
resolution dropped it, and the streams it was serving finish whole."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest
from structlog.testing import capture_logs

from engine_pool.sim.server import SimServer, run_sim
from gateway.count.tokens import TokenCounter
from gateway.edge.app import create_app
from gateway.settings import parse_settings
from gateway.tools.sim_support import RegistryCounter
from tests.conftest import JSON, lanes_config
from tests.support.dnsmasq import dnsmasq
from tests.support.servers import free_port, serve_asgi
from tests.support.waiting import wait_for

NAME = "engines.test"
PROBE_S = 0.3
RESOLVE_S = 0.5
SLOW_START_S = 1.0


@pytest.fixture
async def engines(counter: TokenCounter) -> AsyncIterator[dict[str, SimServer]]:
    port = free_port()
    shared = RegistryCounter(counter, "qwen3.6")
    async with (
        run_sim("h100-fast", counter=shared, host="127.0.0.2", port=port, seed=1) as a,
        run_sim("h100-fast", counter=shared, host="127.0.0.3", port=port, seed=2) as b,
        run_sim("h100-fast", counter=shared, host="127.0.0.4", port=port, seed=3) as c,
    ):
        yield {"127.0.0.2": a, "127.0.0.3": b, "127.0.0.4": c}


def body(rid: str, tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": "qwen3.6",
            "stream": True,
            "max_tokens": tokens,
            "messages": [{"role": "user", "content": f"request {rid}"}],
        }
    )


async def test_dns_discovery_adds_probed_engines_and_drains_removed_ones(
    engines: dict[str, SimServer], counter: TokenCounter, tmp_path: Path
) -> None:
    port = engines["127.0.0.2"].port
    with dnsmasq(tmp_path) as dns, capture_logs() as logs:
        dns.set_hosts({NAME: ["127.0.0.2", "127.0.0.3"]})
        dns.reload()
        config = lanes_config(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])
        config["clusters"][0] = {
            "name": "fast",
            "endpoints": [],
            "discovery": {
                "name": NAME,
                "port": port,
                "interval_s": RESOLVE_S,
                "nameserver": dns.nameserver,
            },
            "outlier": {"slow_start_s": SLOW_START_S},
        }
        config["lanes"][0]["health"] = {
            "interval_s": PROBE_S,
            "timeout_s": 1.0,
            "up_after_successes": 1,
        }
        app = create_app(parse_settings(config, environ={}), counter)
        gateway = app.gateway
        url_of = {ip: f"http://{ip}:{port}" for ip in engines}

        def routable() -> set[str]:
            return {v.url for v in gateway.pool.views("fast") if v.state.routable}

        async with serve_asgi(app) as url, httpx.AsyncClient(timeout=30) as client:
            stop = asyncio.Event()
            statuses: list[tuple[int, bool]] = []

            async def loop(n: int) -> None:
                i = 0
                while not stop.is_set():
                    r = await client.post(
                        url + "/v1/chat/completions",
                        content=body(f"{n}-{i}", 60),  # ~1.4 s streams
                        headers=JSON,
                    )
                    i += 1
                    statuses.append((r.status_code, r.content.endswith(b"data: [DONE]\n\n")))

            async def ticker() -> None:
                # A short request every 50 ms, beside the streams: a new endpoint is offered
                # work within 50 ms of becoming routable.
                i = 0
                while not stop.is_set():
                    tick = asyncio.create_task(
                        client.post(
                            url + "/v1/chat/completions",
                            content=body(f"tick-{i}", 2),
                            headers=JSON,
                        )
                    )
                    ticks.append(tick)
                    i += 1
                    await asyncio.sleep(0.05)

            ticks: list[asyncio.Task[httpx.Response]] = []
            await wait_for(lambda: routable() == {url_of["127.0.0.2"], url_of["127.0.0.3"]}, 10)
            tasks = [asyncio.create_task(loop(n)) for n in range(4)]
            tasks.append(asyncio.create_task(ticker()))
            await wait_for(engines["127.0.0.2"].requests, 10)

            # An address appears: probed (DOWN until then), slow-started, then served.
            dns.set_hosts({NAME: ["127.0.0.2", "127.0.0.3", "127.0.0.4"]})
            dns.reload()
            await wait_for(lambda: url_of["127.0.0.4"] in gateway.discovered.get("fast", ()), 5)
            found_at = time.time()
            await wait_for(lambda: url_of["127.0.0.4"] in routable(), 5)
            up_at = time.time()
            await wait_for(engines["127.0.0.4"].requests, 5)
            print("UP after", up_at - found_at)
            first = min(r.arrived_wall for r in engines["127.0.0.4"].requests())
            served_after_s = first - found_at

            # An address vanishes while it serves streams: no new request after the resolution
            # that dropped it, and the streams it serves finish.
            await wait_for(
                lambda: any(r.finished_s is None for r in engines["127.0.0.2"].requests()), 5
            )
            dns.set_hosts({NAME: ["127.0.0.3", "127.0.0.4"]})
            dns.reload()
            await wait_for(lambda: url_of["127.0.0.2"] not in gateway.discovered.get("fast", ()), 5)
            dropped_at = time.time()
            open_at_drop = sum(r.finished_s is None for r in engines["127.0.0.2"].requests())
            await asyncio.sleep(2 * RESOLVE_S + 1.5)  # long enough for the drained streams
            stop.set()
            await asyncio.gather(*tasks)
            for tick in await asyncio.gather(*ticks):
                statuses.append((tick.status_code, tick.content.endswith(b"data: [DONE]\n\n")))
    removed = engines["127.0.0.2"].requests()
    late = [r.request_id for r in removed if r.arrived_wall > dropped_at]
    unfinished = [r.request_id for r in removed if r.finished_s is None]
    events = [e for e in logs if e["event"] == "discovery.changed"]
    joined = [
        e
        for e in logs
        if e["event"] == "engine.state_changed" and e.get("endpoint") == url_of["127.0.0.4"]
    ]
    print(
        f"\nadded: first request {served_after_s:.2f}s after the resolution found it (probe "
        f"{PROBE_S}s, slow start {SLOW_START_S}s); removed: {open_at_drop} streams open at the "
        f"drop, {len(late)} requests after it, {len(unfinished)} unfinished; "
        f"{len(statuses)} requests, {sum(s == 200 and done for s, done in statuses)} whole"
    )
    assert served_after_s <= 2 * PROBE_S + 0.1
    assert joined and joined[0]["old"] == "down" and joined[0]["new"] == "up"
    assert any(
        e["event"] == "engine.slow_start" and e.get("endpoint") == url_of["127.0.0.4"] for e in logs
    )
    assert open_at_drop >= 1
    assert late == [] and unfinished == []
    assert all(s == 200 and done for s, done in statuses), statuses
    assert [(e["added"], e["removed"]) for e in events] == [
        ([url_of["127.0.0.2"], url_of["127.0.0.3"]], []),
        ([url_of["127.0.0.4"]], []),
        ([], [url_of["127.0.0.2"]]),
    ]
