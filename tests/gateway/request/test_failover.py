"""Failover before the first byte (gateway/request/failover.py) and passive ejection, through real
sockets: a refused endpoint, a kept-alive connection the engine closed, engines that answer 500
and close, and the choice of the next endpoint as a pure function."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from engine_pool.cluster import EngineState, EngineView
from gateway.request.failover import failover_candidates
from gateway.settings import ConfigError, LaneSettings, parse_settings
from tests.conftest import lanes_config
from tests.support.fake_engine import FakeEngine
from tests.support.prom import parse
from tests.support.raw_engine import RawEngine
from tests.support.servers import free_port, serve_asgi

QUIET_PROBER = {"interval_s": 60, "timeout_s": 5, "up_after_successes": 2}


def chat(text: str = "hi") -> dict[str, Any]:
    return {"model": "qwen3.6", "messages": [{"role": "user", "content": text}], "max_tokens": 3}


def lane(**extra: Any) -> LaneSettings:
    return LaneSettings.model_validate(
        {
            "name": "fast",
            "max_prompt_tokens": 100,
            "clusters": ["a", "b"],
            "emergency_clusters": ["e"],
            "slots": {"lane": 8, "per_endpoint": 4},
            **extra,
        }
    )


def view(cluster: str, url: str, state: EngineState = EngineState.UP) -> EngineView:
    return EngineView(cluster, url, state, 0)


def test_next_endpoint_skips_tried_and_down_ones_and_keeps_lane_order() -> None:
    views = {
        "a": [view("a", "http://a1"), view("a", "http://a2", EngineState.DOWN)],
        "b": [view("b", "http://b1")],
        "e": [view("e", "http://e1")],
    }
    every = lambda _: True  # noqa: E731
    got = failover_candidates(lane(), views, {("a", "http://a1")}, every)
    assert [v.url for v in got] == ["http://b1"]  # a2 is down; emergency only when none left


def test_emergency_clusters_come_only_after_every_primary_endpoint_failed() -> None:
    views = {"a": [view("a", "http://a1")], "b": [view("b", "http://b1")], "e": [view("e", "x")]}
    tried = {("a", "http://a1"), ("b", "http://b1")}
    assert [v.url for v in failover_candidates(lane(), views, tried, lambda _: True)] == ["x"]
    tried.add(("e", "x"))
    assert failover_candidates(lane(), views, tried, lambda _: True) == []


def test_next_endpoint_honours_the_clusters_that_serve_the_model() -> None:
    views = {"a": [view("a", "http://a1")], "b": [view("b", "http://b1")], "e": []}
    got = failover_candidates(lane(), views, set(), lambda c: c == "b")
    assert [v.url for v in got] == ["http://b1"]


@pytest.mark.parametrize(
    ("where", "value"),
    [
        (("lanes", 0, "retry", "max_retries"), -1),
        (("lanes", 0, "retry", "tries"), 2),
        (("clusters", 0, "outlier", "eject_after_connect_failures"), 0),
        (("clusters", 0, "outlier", "eject_after_5xx"), -1),
        (("clusters", 0, "outlier", "slow_start_s"), -5),
    ],
)
def test_failover_settings_are_validated(where: tuple[Any, ...], value: Any) -> None:
    config = lanes_config(["http://a"], ["http://b"])
    node: Any = config
    for key in where[:-2]:
        node = node[key]
    node.setdefault(where[-2], {})[where[-1]] = value
    with pytest.raises(ConfigError, match=str(where[-2])):
        parse_settings(config, environ={})


def ordered_ports() -> tuple[int, int]:
    """Two free ports whose URLs sort in this order (the picker's tie-break is the URL)."""
    ports = sorted({free_port() for _ in range(2)}, key=str)
    assert len(ports) == 2
    return ports[0], ports[1]


@asynccontextmanager
async def gateway_over(
    gateway_at: Any,
    fast: list[str],
    *,
    lane: dict[str, Any] | None = None,
    outlier: dict[str, Any] | None = None,
    health: dict[str, Any] | None = None,
) -> AsyncIterator[tuple[str, httpx.AsyncClient]]:
    config = lanes_config(fast, ["http://127.0.0.1:9"])
    config["lanes"][0]["health"] = health or QUIET_PROBER
    config["lanes"][0].update(lane or {})
    if outlier:
        config["clusters"][0]["outlier"] = outlier
    async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        await first_probe(client, url)
        yield url, client


@asynccontextmanager
async def raw_gateway(
    gateway_at: Any, engine: RawEngine
) -> AsyncIterator[tuple[str, str, httpx.AsyncClient]]:
    """A gateway whose fast lane has ``engine`` as its only endpoint."""
    async with engine.serving() as engine_url, gateway_over(gateway_at, [engine_url]) as gw:
        yield engine_url, *gw


async def fast_endpoints(client: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    state = (await client.get(url + "/admin/state")).json()
    endpoints: list[dict[str, Any]] = state["clusters"][0]["endpoints"]
    return endpoints


async def first_probe(client: httpx.AsyncClient, url: str) -> None:
    for _ in range(300):
        if all(e["evidence"] != "not probed yet" for e in await fast_endpoints(client, url)):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the first probe never reported")


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


async def post(client: httpx.AsyncClient, url: str, rid: str) -> httpx.Response:
    return await client.post(
        url + "/v1/chat/completions", json=chat(), headers={"x-request-id": rid}
    )


@asynccontextmanager
async def engine_that_dies(port: int) -> AsyncIterator[Callable[[], Any]]:
    """A FakeEngine on ``port``; the yielded coroutine function stops it (connections refused)."""
    server = serve_asgi(FakeEngine(), port=port)
    await server.__aenter__()
    stopped = False

    async def stop() -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            await server.__aexit__(None, None, None)

    try:
        yield stop
    finally:
        await stop()


async def test_a_refused_endpoint_fails_over_and_is_ejected(gateway_at: Any) -> None:
    """The endpoint picked first on ties dies after the first probe (the prober is quiet for a
    minute): every request still answers 200, moved to the other endpoint, each move one
    ``route.retry``; two refusals in a row eject the dead endpoint, so later requests go
    straight to the live one."""
    dead_port, live_port = ordered_ports()
    async with (
        serve_asgi(FakeEngine(), port=live_port) as live_url,
        engine_that_dies(dead_port) as stop,
    ):
        dead_url = f"http://127.0.0.1:{dead_port}"
        async with gateway_over(gateway_at, [dead_url, live_url]) as (url, client):
            await stop()
            with capture_logs() as logs:
                answers = [await post(client, url, f"r{i}") for i in range(6)]
            assert [r.status_code for r in answers] == [200] * 6
            assert {r.headers["x-shapegate-cluster"] for r in answers} == {"fast"}
            moved = events(logs, "route.retry")
            assert [(e["from"], e["to"], e["reason"]) for e in moved] == [
                (dead_url, live_url, "refused")
            ] * 2
            assert [e["request_id"] for e in moved] == ["r0", "r1"]
            (ejected,) = events(logs, "engine.state_changed")
            assert ejected["endpoint"] == dead_url and ejected["new"] == "down"
            assert ejected["evidence"].startswith("ejected: 2 requests in a row")
            finished = {e["request_id"]: e for e in events(logs, "route.finished")}
            assert finished["r0"]["outcome"] == "ok"
            decided = {e["request_id"]: e for e in events(logs, "route.decision")}
            assert decided["r0"]["endpoint"] == dead_url  # where admission first put it
            endpoints = await fast_endpoints(client, url)
            assert [e["state"] for e in endpoints] == ["down", "up"]
            assert sum(e["slots_in_use"] + e["in_flight"] for e in endpoints) == 0
            scrape = parse((await client.get(url + "/metrics")).text)
            assert scrape.value("shapegate_retries_total", lane="fast", reason="refused") == 2
            assert scrape.value("shapegate_engine_ejections_total", cause="connect_failure") == 1
            assert scrape.value("shapegate_slots_in_use") == 0


@pytest.mark.parametrize("max_retries", [0, 1])
async def test_max_retries_bounds_the_moves(gateway_at: Any, max_retries: int) -> None:
    """With the dead endpoint never ejected, each request meets it first: ``max_retries: 0``
    answers the refusal (502), ``1`` moves the request and answers 200."""
    dead_port, live_port = ordered_ports()
    async with (
        serve_asgi(FakeEngine(), port=live_port) as live_url,
        engine_that_dies(dead_port) as stop,
    ):
        dead_url = f"http://127.0.0.1:{dead_port}"
        async with gateway_over(
            gateway_at,
            [dead_url, live_url],
            lane={"retry": {"max_retries": max_retries}},
            outlier={"eject_after_connect_failures": 100},
        ) as (url, client):
            await stop()
            with capture_logs() as logs:
                answers = [await post(client, url, f"m{i}") for i in range(3)]
            if max_retries == 0:
                assert [r.status_code for r in answers] == [502] * 3
                assert all("refused" in r.json()["error"]["message"].lower() for r in answers)
                assert events(logs, "route.retry") == []
            else:
                assert [r.status_code for r in answers] == [200] * 3
                assert len(events(logs, "route.retry")) == 3
            assert sum(e["slots_in_use"] for e in await fast_endpoints(client, url)) == 0


async def test_a_stale_kept_alive_connection_is_retried_fresh_on_the_same_engine(
    gateway_at: Any,
) -> None:
    """The engine drops every second request on a connection without answering, as an engine
    whose keep-alive timer fired as the request arrived: each is sent again on a new
    connection to the same engine and answers 200; the engine is not ejected."""
    engine = RawEngine(lambda _, on_conn: ("drop", None) if on_conn == 1 else ("ok", None))
    async with raw_gateway(gateway_at, engine) as (engine_url, url, client):
        with capture_logs() as logs:
            answers = [await post(client, url, f"s{i}") for i in range(6)]
        assert [r.status_code for r in answers] == [200] * 6
        moved = events(logs, "route.retry")
        assert moved, "no request met a closed kept-alive connection"
        assert all(
            (e["from"], e["to"], e["reason"]) == (engine_url, engine_url, "stale") for e in moved
        )
        assert events(logs, "engine.state_changed") == []


async def test_engine_500_then_close_without_connection_close_never_poisons_the_pool(
    gateway_at: Any,
) -> None:
    """An engine answers 500 and closes its socket a few ms later without saying
    ``Connection: close``, alternating with normal answers, 50 times: every 500 reaches the
    client as the engine's 500, every other request answers 200, none meets a closed
    connection (``ConnectionLost``), and nothing is retried."""
    engine = RawEngine(lambda index, _: ("500", 0.005) if index % 2 == 0 else ("ok", None))
    async with raw_gateway(gateway_at, engine) as (_, url, client):
        with capture_logs() as logs:
            # Back to back: the next request goes out before the engine's close lands.
            answers = [await post(client, url, f"x{i}") for i in range(100)]
        statuses = [r.status_code for r in answers]
        assert statuses == [500, 200] * 50
        assert not any("ConnectionLost" in r.text for r in answers)
        assert events(logs, "route.retry") == []
        # 50 failed connections and at most a few for the 200s (kept alive and reused).
        assert engine.connections <= 50 + 5


async def test_consecutive_5xx_eject_an_endpoint_but_never_the_last_one(gateway_at: Any) -> None:
    """``eject_after_5xx: 3``: the endpoint answering 500 is ejected after three in a row and
    the other serves; a cluster's last routable endpoint is never ejected for 5xx."""
    failing = RawEngine(lambda *_: ("500", None))
    bad_port, good_port = ordered_ports()  # the failing one is picked first on ties
    async with (
        failing.serving(bad_port) as bad_url,
        serve_asgi(FakeEngine(), port=good_port) as good_url,
    ):
        outlier = {"eject_after_5xx": 3}
        async with gateway_over(gateway_at, [bad_url, good_url], outlier=outlier) as (url, client):
            with capture_logs() as logs:
                for i in range(12):
                    await post(client, url, f"e{i}")
            (ejected,) = events(logs, "engine.state_changed")
            assert ejected["endpoint"] == bad_url
            assert "3 requests in a row answered HTTP 500" in ejected["evidence"]
            assert failing.posts == 3
            scrape = parse((await client.get(url + "/metrics")).text)
            assert scrape.value("shapegate_engine_ejections_total", cause="5xx") == 1
        async with gateway_over(gateway_at, [bad_url], outlier=outlier) as (url, client):
            with capture_logs() as logs:
                answers = [await post(client, url, f"l{i}") for i in range(5)]
            assert [r.status_code for r in answers] == [500] * 5
            assert events(logs, "engine.state_changed") == []


async def test_the_prober_brings_an_ejected_endpoint_back_after_successes_in_a_row(
    gateway_at: Any,
) -> None:
    """Ejected by 5xx answers while its /health stays fine: only ``up_after_successes`` good
    probes in a row make it routable again, not the next one."""
    answers = iter([("500", None)] * 2)
    failing = RawEngine(lambda *_: next(answers, ("ok", None)))
    health = {"interval_s": 0.1, "timeout_s": 2, "up_after_successes": 4}
    bad_port, good_port = ordered_ports()  # the failing one is picked first on ties
    async with (
        failing.serving(bad_port) as bad_url,
        serve_asgi(FakeEngine(), port=good_port) as good_url,
    ):
        outlier = {"eject_after_5xx": 2}
        async with gateway_over(
            gateway_at, [bad_url, good_url], outlier=outlier, health=health
        ) as (url, client):
            with capture_logs() as logs:
                for i in range(6):
                    await post(client, url, f"p{i}")
                deadline = asyncio.get_running_loop().time() + 5
                seen = set()
                while (endpoint := (await fast_endpoints(client, url))[0])["state"] != "up":
                    seen.add(endpoint["evidence"].rpartition("(")[2])
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.02)
            changes = [(e["endpoint"], e["new"]) for e in events(logs, "engine.state_changed")]
            assert changes == [(bad_url, "down"), (bad_url, "up")]
            assert "3/4 to recover)" in seen, seen
