"""Health watchdogs by lane, emergency lanes, the boot probe and per-request deadlines, against
fake engines on real sockets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from engine_pool.cluster import EngineState
from engine_pool.monitor import EngineRestarted
from engine_pool.registry import StateChange
from engine_pool.sim.server import run_sim
from gateway.count.tokens import TokenCounter
from gateway.observe.log import get_logger
from gateway.observe.metrics import Metrics
from gateway.settings import parse_settings
from gateway.tools.sim_support import RegistryCounter
from gateway.upstream import engines
from tests.conftest import lanes_config
from tests.support.fake_engine import FakeEngine
from tests.support.prom import parse
from tests.support.servers import free_port, serve_asgi
from tests.support.waiting import wait_for

FAST_HEALTH = {
    "interval_s": 0.2,
    "timeout_s": 0.3,
    "down_after_timeouts": 2,
    "up_after_successes": 2,
    "scrape_interval_s": 0.2,
}
HEAVY_HEALTH = {
    "interval_s": 0.2,
    "timeout_s": 2.0,
    "down_after_timeouts": 2,
    "up_after_successes": 2,
    "scrape_interval_s": 0.2,
}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "qwen3.6", "messages": [{"role": "user", "content": "hi"}], **extra}


def watched(fast: list[str], heavy: list[str], spare: list[str] | None = None) -> dict[str, Any]:
    config = lanes_config(fast, heavy)
    config["lanes"][0]["health"] = FAST_HEALTH
    config["lanes"][1]["health"] = HEAVY_HEALTH
    if spare:
        config["clusters"].append({"name": "spare", "endpoints": spare})
        config["lanes"][0]["emergency_clusters"] = ["spare"]
    return config


async def endpoint_state(client: httpx.AsyncClient, url: str, endpoint: str) -> str:
    state = (await client.get(url + "/admin/state")).json()
    for cluster in state["clusters"]:
        for e in cluster["endpoints"]:
            if e["url"] == endpoint:
                return str(e["state"])
    raise KeyError(endpoint)


def is_state(
    client: httpx.AsyncClient, url: str, endpoint: str, state: str
) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await endpoint_state(client, url, endpoint) == state

    return check


async def test_a_crashed_engine_leaves_routing_within_one_probe_interval(gateway_at: Any) -> None:
    survivor, doomed = FakeEngine(), FakeEngine()
    async with AsyncExitStack() as doomed_stack, serve_asgi(survivor) as survivor_url:
        doomed_url = await doomed_stack.enter_async_context(serve_asgi(doomed))
        config = watched([survivor_url, doomed_url], [survivor_url])
        async with gateway_at(config) as (url, _), httpx.AsyncClient() as client:
            await wait_for(is_state(client, url, doomed_url, "up"), 5)
            with capture_logs() as logs:
                await doomed_stack.aclose()  # the engine process is gone: connection refused
                started = time.monotonic()
                await wait_for(is_state(client, url, doomed_url, "down"), 2, interval=0.02)
                took = time.monotonic() - started
            assert took < FAST_HEALTH["interval_s"] + 0.3
            change = next(e for e in logs if e["event"] == "engine.state_changed")
            assert change["new"] == "down" and "ConnectError" in change["evidence"]
            replies = [
                await client.post(url + "/v1/chat/completions", json=chat()) for _ in range(10)
            ]
            assert [r.status_code for r in replies] == [200] * 10
            assert all(r.headers["x-shapegate-cluster"] == "fast" for r in replies)


async def test_emergency_clusters_serve_only_while_every_primary_is_down(
    gateway_at: Any,
) -> None:
    primary, spare = FakeEngine(), FakeEngine()
    port = free_port()
    primary_url = f"http://127.0.0.1:{port}"
    async with serve_asgi(spare) as spare_url, AsyncExitStack() as stack:
        await stack.enter_async_context(serve_asgi(primary, port=port))
        config = watched([primary_url], [spare_url], spare=[spare_url])
        async with gateway_at(config) as (url, _), httpx.AsyncClient() as client:
            await wait_for(is_state(client, url, primary_url, "up"), 5)
            r = await client.post(url + "/v1/chat/completions", json=chat())
            assert r.headers["x-shapegate-cluster"] == "fast"
            await stack.aclose()
            await wait_for(is_state(client, url, primary_url, "down"), 5)
            with capture_logs() as logs:
                r = await client.post(url + "/v1/chat/completions", json=chat())
            assert r.status_code == 200 and r.headers["x-shapegate-cluster"] == "spare"
            decision = next(e for e in logs if e["event"] == "route.decision")
            assert decision["reason"] == "primary_unhealthy"
            assert decision["cluster_health"] == {"fast": False, "spare": True}
            async with serve_asgi(primary, port=port):
                await wait_for(is_state(client, url, primary_url, "up"), 5)
                r = await client.post(url + "/v1/chat/completions", json=chat())
                assert r.headers["x-shapegate-cluster"] == "fast"


async def test_a_hung_engine_is_marked_down_and_its_requests_end_with_free_slots(
    gateway_at: Any,
) -> None:
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        config = watched([engine_url], [engine_url])
        config["lanes"][0]["timeouts"] = {"first_byte_s": 60, "total_s": 120}
        config["lanes"][1]["health"] = FAST_HEALTH
        async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=30) as client:
            await wait_for(is_state(client, url, engine_url, "up"), 5)
            stuck = asyncio.create_task(
                client.post(url + "/v1/chat/completions", json=chat(fake={"mode": "hang"}))
            )
            await wait_for(lambda: engine.in_flight, 5, what="the request at the engine")
            engine.health_status = None  # accepts, never answers
            started = time.monotonic()
            with capture_logs() as logs:
                reply = await stuck
            assert time.monotonic() - started < 2.0  # not the 60 s first-byte deadline
            assert reply.status_code == 502 and "marked down" in reply.json()["error"]["message"]
            slow = [e for e in logs if e["event"] == "engine.slow"]
            assert slow, "timeouts alert before they evict"
            state = (await client.get(url + "/admin/state")).json()
            assert all(lane["slots_in_use"] == 0 for lane in state["lanes"])
            assert not engine.open_requests()


async def test_a_slow_heavy_engine_is_judged_by_its_own_lane(gateway_at: Any) -> None:
    fast, heavy = FakeEngine(), FakeEngine()
    heavy.health_delay = 0.8  # far past the fast lane's 0.3 s probe timeout
    async with serve_asgi(fast) as fast_url, serve_asgi(heavy) as heavy_url:
        config = watched([fast_url], [heavy_url])
        with capture_logs() as logs:
            async with gateway_at(config) as (url, _), httpx.AsyncClient() as client:
                # Three slow answers: under the fast lane's rules two would mark it down.
                await wait_for(lambda: heavy.health_answered >= 3, 10, what="3 heavy probes")
                assert await endpoint_state(client, url, heavy_url) == "up"
        assert not [e for e in logs if e["event"] in ("engine.slow", "engine.state_changed")]


async def test_the_boot_probe_catches_a_lane_whose_only_cluster_is_down(
    gateway_at: Any,
) -> None:
    fast = FakeEngine()
    dead_port = free_port()
    dead_url = f"http://127.0.0.1:{dead_port}"
    async with serve_asgi(fast) as fast_url:
        config = watched([fast_url], [dead_url])
        config["server"] = {"boot_probe": True}
        async with gateway_at(config) as (url, _), httpx.AsyncClient() as client:
            await wait_for(lambda: _probed(client, url), 5)
            ready = await client.get(url + "/readyz")
            assert ready.status_code == 503
            why = ready.json()["why"]
            assert set(why) == {"heavy"} and dead_url in why["heavy"]
            assert "shapegate-probe-fast" in fast.seen
            async with serve_asgi(FakeEngine(), port=dead_port):
                await wait_for(is_state(client, url, dead_url, "up"), 5)
                probe = await client.post(url + "/admin/probe", headers={"x-shapegate-admin": "1"})
                assert probe.status_code == 200 and probe.json()["lanes"]["heavy"]["passed"]
                assert (await client.get(url + "/readyz")).status_code == 200


async def _probed(client: httpx.AsyncClient, url: str) -> bool:
    why = (await client.get(url + "/readyz")).json().get("why", {})
    return "heavy" in why and why["heavy"] != "not probed" and "fast" not in why


async def test_a_stalled_stream_hits_the_idle_deadline(gateway_at: Any) -> None:
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        config = watched([engine_url], [engine_url])
        config["lanes"][0]["timeouts"] = {"first_byte_s": 5, "idle_s": 0.3, "total_s": 30}
        async with gateway_at(config) as (url, _), httpx.AsyncClient() as client:
            with capture_logs() as logs:
                r = await client.post(
                    url + "/v1/chat/completions",
                    json=chat(stream=True, fake={"mode": "stall", "chunks": 2}),
                )
            assert r.status_code == 200
            events = r.content.split(b"\n\n")
            assert b'"idle deadline' in r.content or b"idle deadline" in r.content
            assert events[-2] == b"data: [DONE]" and b'"error"' in events[-3]
            finished = next(e for e in logs if e["event"] == "route.finished")
            assert finished["outcome"] == "timeout"
            metrics = (await client.get(url + "/metrics")).text
            assert (
                'shapegate_watchdog_events_total{cluster="fast",kind="idle",lane="fast"} 1.0'
                in metrics
            )
            await wait_for(lambda: not engine.open_requests(), 2, what="upstream closed")


async def test_an_engine_dead_for_4_minutes_of_scrapes_moves_no_swallowed_error(
    gateway_at: Any,
) -> None:
    """4 minutes at the default 5 s scrape and probe intervals are 48 cycles each; here they
    run every 50 ms. A dead engine's failed checks are the engine's news, counted on their own."""
    quick = {**FAST_HEALTH, "interval_s": 0.05, "scrape_interval_s": 0.05}
    survivor, doomed = FakeEngine(), FakeEngine()
    async with AsyncExitStack() as doomed_stack, serve_asgi(survivor) as survivor_url:
        doomed_url = await doomed_stack.enter_async_context(serve_asgi(doomed))
        config = watched([survivor_url, doomed_url], [survivor_url])
        config["lanes"][0]["health"] = quick
        async with gateway_at(config) as (url, _), httpx.AsyncClient() as client:

            async def scrape() -> Any:
                return parse((await client.get(url + "/metrics")).text)

            async def scraped_ok() -> bool:
                return (await scrape()).has("shapegate_engine_load", endpoint=doomed_url)

            await wait_for(scraped_ok, 10)
            await doomed_stack.aclose()  # killed: every check now meets a refused connection
            await wait_for(is_state(client, url, doomed_url, "down"), 2)
            failed = {"cluster": "fast", "endpoint": doomed_url}

            async def four_minutes_of_cycles() -> bool:
                m = await scrape()
                scrapes = m.value("shapegate_engine_check_failures_total", check="scrape", **failed)
                probes = m.value("shapegate_engine_check_failures_total", check="probe", **failed)
                return scrapes >= 48 and probes >= 48

            await wait_for(four_minutes_of_cycles, 30)
            replies = [
                await client.post(url + "/v1/chat/completions", json=chat()) for _ in range(5)
            ]
            m = await scrape()
    assert [r.status_code for r in replies] == [200] * 5
    assert m.value("shapegate_swallowed_errors_total") == 0
    assert m.value("shapegate_engine_up", **failed) == 0


async def test_an_engine_alive_whose_metrics_fail_is_still_a_swallowed_error(
    gateway_at: Any,
) -> None:
    engine = FakeEngine()
    engine.metrics_status = 404  # e.g. SGLang started without --enable-metrics
    async with serve_asgi(engine) as engine_url:
        config = watched([engine_url], [engine_url])
        for lane in config["lanes"]:
            lane["health"] = {**FAST_HEALTH, "interval_s": 0.05, "scrape_interval_s": 0.05}
        async with gateway_at(config) as (url, _), httpx.AsyncClient() as client:
            with capture_logs() as logs:

                async def swallowed() -> bool:
                    m = parse((await client.get(url + "/metrics")).text)
                    return m.value("shapegate_swallowed_errors_total", where="load.scrape") >= 3

                await wait_for(swallowed, 10)
    lines = [e for e in logs if e["event"] == "error.swallowed" and e["where"] == "load.scrape"]
    # Logged once per endpoint (the engine serves both clusters here), counted every time.
    assert sorted(line["cluster"] for line in lines) == ["fast", "heavy"]
    assert {line["decision"] for line in lines} == {"route_without_load"}


async def test_an_engine_slow_to_first_token_among_its_peers_is_shown_slow_and_still_routed(
    counter: TokenCounter, gateway_at: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engines, "JUDGE_INTERVAL_S", 0.1)
    shared = RegistryCounter(counter, "qwen3.6")
    async with (
        run_sim("h100-fast", time_scale=0.05, counter=shared, seed=1) as good,
        run_sim("h100-fast", time_scale=0.05, counter=shared, seed=2) as slow,
    ):
        await slow.set_faults({"first_byte_delay_s": 0.8})  # probes still answer at once
        config = lanes_config([good.url, slow.url], [good.url])
        async with gateway_at(config) as (url, _), httpx.AsyncClient(base_url=url) as client:
            with capture_logs() as logs:
                for _ in range(6):  # in pairs, so least-in-flight spreads them over both
                    pair = [chat(stream=True, max_tokens=4) for _ in range(2)]
                    replies = await asyncio.gather(
                        *(client.post("/v1/chat/completions", json=p) for p in pair)
                    )
                    assert [r.status_code for r in replies] == [200, 200]
                await wait_for(is_state(client, url, slow.url, "slow"), 5)
                state = (await client.get("/admin/state")).json()
                metrics = parse((await client.get("/metrics")).text)
                # Slow is shown, never a reason to stop routing: both still take requests.
                before = len(slow.requests())
                for _ in range(3):
                    pair = [chat(stream=True, max_tokens=4) for _ in range(2)]
                    await asyncio.gather(
                        *(client.post("/v1/chat/completions", json=p) for p in pair)
                    )
                assert len(slow.requests()) > before
    fast = next(c for c in state["clusters"] if c["name"] == "fast")
    shown = {e["url"]: e for e in fast["endpoints"]}
    assert shown[good.url]["state"] == "up" and shown[good.url]["slow_evidence"] is None
    evidence = shown[slow.url]["evidence"]
    assert evidence.startswith("TTFT median") and "1 peer" in evidence
    assert shown[slow.url]["ttft_p95_s"] >= 0.8 > shown[good.url]["ttft_p95_s"]
    assert metrics.value("shapegate_engine_slow", endpoint=slow.url) == 1
    assert metrics.value("shapegate_engine_slow", endpoint=good.url) == 0
    warned = [e for e in logs if e["event"] == "engine.slow_requests"]
    assert [e["endpoint"] for e in warned] == [slow.url]


def test_an_engine_going_down_is_passed_on_and_nothing_else_is() -> None:
    settings = parse_settings(lanes_config(["http://a"], ["http://b"]), environ={})
    down: list[str] = []
    events = engines.EngineEvents(settings, Metrics(), get_logger("test"), on_down=down.append)
    events(StateChange("fast", "http://a", EngineState.UP, EngineState.SLOW, "probe 3s"))
    events(StateChange("fast", "http://a", EngineState.SLOW, EngineState.DOWN, "refused"))
    events(StateChange("fast", "http://a", EngineState.DOWN, EngineState.UP, "answers"))
    events(StateChange("heavy", "http://b", EngineState.UP, EngineState.DOWN, "ejected: 5xx"))
    assert down == ["http://a", "http://b"]


def test_an_engine_going_down_is_a_warning_and_coming_back_is_info() -> None:
    """An engine leaving routing is what an operator must see: warning level (it was info)."""
    settings = parse_settings(lanes_config(["http://a"], ["http://b"]), environ={})
    events = engines.EngineEvents(settings, Metrics(), get_logger("test"))
    with capture_logs() as logs:
        events(StateChange("fast", "http://a", EngineState.UP, EngineState.DOWN, "refused"))
        events(StateChange("fast", "http://a", EngineState.DOWN, EngineState.UP, "answers"))
        events(StateChange("fast", "http://a", EngineState.UP, EngineState.SLOW, "probe 3s"))
    assert [(e["new"], e["log_level"]) for e in logs] == [
        ("down", "warning"),
        ("up", "info"),
        ("slow", "info"),
    ]


def test_an_engine_restart_is_a_warning_counted_and_passed_on() -> None:
    settings = parse_settings(lanes_config(["http://a"], ["http://b"]), environ={})
    metrics = Metrics()
    told: list[str] = []
    events = engines.EngineEvents(settings, metrics, get_logger("test"), on_restart=told.append)
    with capture_logs() as logs:
        events(EngineRestarted("fast", "http://a", 100.0, 250.0))
    assert told == ["http://a"]
    [line] = logs
    assert (line["event"], line["log_level"], line["endpoint"]) == (
        "engine.restarted",
        "warning",
        "http://a",
    )
    assert (line["previous_started_s"], line["started_s"]) == (100.0, 250.0)
    sample = metrics.registry.get_sample_value(
        "shapegate_engine_restarts_total", {"cluster": "fast", "endpoint": "http://a"}
    )
    assert sample == 1


async def test_an_engine_restarted_between_two_probes_is_forgotten_by_the_prefix_index(
    gateway_at: Any,
) -> None:
    """A restart too quick for any probe to fail: only the engine's new process start time on
    /metrics tells it. What the prefix index believed that engine held is dropped, said once
    and counted; the other engine's record stays."""
    a, b = FakeEngine(), FakeEngine()
    a.started_s = b.started_s = 1_764_000_000.0
    async with serve_asgi(a) as url_a, serve_asgi(b) as url_b:
        config = lanes_config([url_a, url_b], [url_b])
        config["lanes"][0]["weights"] = {"prefix": 1.0}
        config["lanes"][0]["health"] = {"interval_s": 0.1, "scrape_interval_s": 0.05}
        async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=10) as client:

            async def held() -> dict[str, Any]:
                state = (await client.get(url + "/admin/state")).json()
                return dict(state["prefix_index"]["endpoints"])

            async def scraped() -> bool:
                state = (await client.get(url + "/admin/state")).json()
                ages = [e["load_age_s"] for c in state["clusters"] for e in c["endpoints"]]
                return all(age is not None for age in ages)

            # Both engines' start times read once before one of them moves.
            await wait_for(scraped, 5, what="both engines scraped")
            for agent in range(20):  # until both hold some prefix
                body = {
                    "model": "qwen3.6",
                    "messages": [{"role": "system", "content": f"agent {agent}. " * 200}],
                }
                assert (
                    await client.post(url + "/v1/chat/completions", json=body)
                ).status_code == 200
                if a.seen and b.seen:
                    break
            home, other = url_a, url_b
            before = await held()
            assert before[url_a]["blocks"] > 0 and before[url_b]["blocks"] > 0, before
            with capture_logs() as logs:
                a.started_s = 1_764_000_500.0
                await wait_for(
                    lambda: _forgotten(held, home), 5, what="the restarted engine forgotten"
                )
            assert (await held())[other]["blocks"] == before[other]["blocks"]
            metrics = parse((await client.get(url + "/metrics")).text)
            assert metrics.value("shapegate_engine_restarts_total", endpoint=home) == 1
            assert metrics.value("shapegate_engine_restarts_total", endpoint=other) == 0
    [restart] = [e for e in logs if e["event"] == "engine.restarted"]
    assert restart["endpoint"] == home and restart["started_s"] == 1_764_000_500.0
    [forgot] = [e for e in logs if e["event"] == "prefix_index.forgotten"]
    assert forgot["reason"] == "engine_restarted" and forgot["blocks"] > 0


async def _forgotten(held: Any, url: str) -> bool:
    """Whether ``url`` holds no block any more."""
    return bool((await held()).get(url, {}).get("blocks", 0) == 0)
