"""The Prometheus metrics move as an operator reading them would expect, with real traffic
through a real gateway in front of simulated vLLM engines (and the scriptable fake engine where
one request must fail in a precise way)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib.metadata import version
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.utils import floatToGoString

from engine_pool.sim.server import SimServer
from gateway.edge.services import deadlines_of
from gateway.observe.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS, Metrics, latency_buckets
from gateway.settings import parse_settings
from tests.conftest import chat, lanes_config
from tests.support.fake_engine import FakeEngine
from tests.support.prom import Scrape, parse
from tests.support.servers import serve_asgi


def long_text(words: int) -> str:
    # Unique per call, so the session-wide count cache cannot answer for it.
    return uuid.uuid4().hex + " " + " ".join(f"w{i % 97}" for i in range(words))


async def scrape(client: httpx.AsyncClient) -> Scrape:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return parse(response.text)


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not await check():
            await asyncio.sleep(0.02)


async def stream_chat(client: httpx.AsyncClient, payload: dict[str, Any]) -> dict[str, Any]:
    """Stream one chat; return the gateway's headers and the usage the engine reported."""
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                event = orjson.loads(line[6:])
                usage = event.get("usage") or usage
        return {"headers": dict(response.headers), "usage": usage}


async def test_slots_rise_while_held_and_return_to_zero(
    sims: tuple[SimServer, SimServer], gateway_at: Any
) -> None:
    fast, heavy = sims
    config = lanes_config([fast.url], [heavy.url])
    config["lanes"][0]["slots"] = {"lane": 3, "per_endpoint": 3}
    # Every response is held 0.6 s before its first byte: the slots stay taken that long.
    await fast.set_faults({"first_byte_delay_s": 0.6})
    async with (
        gateway_at(config) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        before = await scrape(client)
        assert before.value("shapegate_slots_limit", lane="fast", cluster="fast") == 3
        assert before.value("shapegate_slots_in_use", lane="fast", cluster="fast") == 0
        sent = [
            asyncio.create_task(client.post("/v1/chat/completions", json=chat(f"hi {i}")))
            for i in range(5)
        ]

        async def held() -> bool:
            now = await scrape(client)
            return (
                now.value("shapegate_slots_in_use", lane="fast", cluster="fast") == 3
                and now.value("shapegate_queue_depth", lane="fast") == 2
            )

        await until(held)
        replies = await asyncio.gather(*sent)
        assert [r.status_code for r in replies] == [200] * 5
        after = await scrape(client)
    assert after.value("shapegate_slots_in_use", lane="fast", cluster="fast") == 0
    assert after.value("shapegate_slots_in_use") == 0
    assert after.value("shapegate_queue_depth", lane="fast") == 0
    assert after.value("shapegate_requests_total", lane="fast", cluster="fast", outcome="ok") == 5
    # Two of the five waited for a whole held request (0.6 s) before their slot.
    assert after.value("shapegate_queue_wait_seconds_count", lane="fast") == 5
    assert after.value("shapegate_queue_wait_seconds_sum", lane="fast") >= 2 * 0.5
    assert after.value("shapegate_queue_wait_seconds_bucket", lane="fast", le="0.25") == 3


async def test_ttft_itl_and_tokens_are_observed_per_lane(
    sims: tuple[SimServer, SimServer], gateway_at: Any
) -> None:
    fast, heavy = sims
    async with (
        gateway_at(lanes_config([fast.url], [heavy.url])) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        options = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 12}
        short = [chat(f"say hi {i}", **options) for i in range(3)]
        monsters = [chat(long_text(20_000), **options) for _ in range(2)]
        results = await asyncio.gather(*(stream_chat(client, p) for p in short + monsters))
        m = await scrape(client)
    lanes = [r["headers"]["x-shapegate-lane"] for r in results]
    assert lanes == ["fast"] * 3 + ["heavy"] * 2
    for lane, n in (("fast", 3), ("heavy", 2)):
        assert m.value("shapegate_ttft_seconds_count", lane=lane, cluster=lane) == n
        assert m.value("shapegate_e2e_seconds_count", lane=lane, cluster=lane) == n
        # 12 tokens in 12+ chunks: the gaps between relayed chunks are observed per lane (the
        # relay writes what arrived together in one piece, so on a loaded machine neighbouring
        # chunks can share one gap; most are still apart at this engine's pace).
        assert m.value("shapegate_itl_seconds_count", lane=lane, cluster=lane) >= n * 6
        mine = [r for r, name in zip(results, lanes, strict=True) if name == lane]
        assert m.value("shapegate_prompt_tokens_sum", lane=lane) == sum(
            int(r["headers"]["x-shapegate-prompt-tokens"]) for r in mine
        )
        assert m.value("shapegate_output_tokens_sum", lane=lane) == sum(
            r["usage"]["completion_tokens"] for r in mine
        )
    # A 20k-token prefill takes the heavy engine far longer than a short prompt takes the fast.
    fast_mean = m.value("shapegate_ttft_seconds_sum", lane="fast") / 3
    heavy_mean = m.value("shapegate_ttft_seconds_sum", lane="heavy") / 2
    assert heavy_mean > 2 * fast_mean
    # Each monster lands in the histogram bucket its real token count belongs to.
    counts = [int(r["headers"]["x-shapegate-prompt-tokens"]) for r in results[3:]]
    assert min(counts) > 20_000
    for le in TOKEN_BUCKETS:
        assert m.value(
            "shapegate_prompt_tokens_bucket", lane="heavy", le=floatToGoString(le)
        ) == sum(c <= le for c in counts)


async def test_decisions_are_counted_by_count_method(
    sims: tuple[SimServer, SimServer], gateway_at: Any
) -> None:
    fast, heavy = sims
    monster = long_text(6_000)
    # Over the threshold in bytes but under it in tokens: only an exact count can tell.
    dense_but_short = uuid.uuid4().hex + " hello" * 400
    async with (
        gateway_at(lanes_config([fast.url], [heavy.url])) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        for payload in (
            chat("hi", max_tokens=2),
            chat("hello there", max_tokens=2),
            chat(dense_but_short, max_tokens=2),
            chat(monster, max_tokens=2),
            chat(monster, max_tokens=2),  # the same prompt again: counted from the cache
        ):
            response = await client.post("/v1/chat/completions", json=payload)
            assert response.status_code == 200
        m = await scrape(client)

    def decided(lane: str, method: str) -> float:
        return m.value(
            "shapegate_route_decisions_total", lane=lane, reason="in_range", count_method=method
        )

    assert decided("fast", "bound") == 2
    assert decided("fast", "exact") == 1
    assert decided("heavy", "exact") == 1
    assert decided("heavy", "cache") == 1
    assert m.value("shapegate_route_decisions_total") == 5


@contextlib.asynccontextmanager
async def fake_gateway(gateway_at: Any, **timeouts: float) -> AsyncIterator[httpx.AsyncClient]:
    async with serve_asgi(FakeEngine()) as engine:
        config = lanes_config([engine], [engine])
        limits = {"connect_s": 2, "first_byte_s": 5, "idle_s": 5, "total_s": 30, **timeouts}
        config["lanes"][0]["timeouts"] = limits
        async with (
            gateway_at(config) as (url, _),
            httpx.AsyncClient(base_url=url, timeout=30) as client,
        ):
            yield client


async def test_requests_are_counted_by_outcome(gateway_at: Any) -> None:
    async with fake_gateway(gateway_at, first_byte_s=0.3) as client:
        ok = await client.post("/v1/chat/completions", json=chat("a"))
        failed = await client.post(
            "/v1/chat/completions", json=chat("b", fake={"mode": "error", "status": 503})
        )
        # Streamed, so first_byte_s bounds it (a non-streamed answer comes whole, under total_s).
        hung = await client.post(
            "/v1/chat/completions", json=chat("c", stream=True, fake={"mode": "hang"})
        )
        unknown = await client.post("/v1/chat/completions", json={**chat("d"), "model": "nope"})
        with pytest.raises(httpx.ReadTimeout):
            await client.post(
                "/v1/chat/completions",
                json=chat("e", fake={"mode": "slow_first_byte", "delay": 0.25}, stream=True),
                timeout=httpx.Timeout(5, read=0.1),
            )

        async def left() -> bool:
            m = await scrape(client)
            return m.value("shapegate_requests_total", outcome="client_disconnect") == 1

        await until(left)
        m = await scrape(client)
    assert [ok.status_code, failed.status_code, hung.status_code, unknown.status_code] == [
        200,
        503,
        504,
        404,
    ]

    def requests(outcome: str, lane: str = "fast", cluster: str = "fast") -> float:
        return m.value("shapegate_requests_total", lane=lane, cluster=cluster, outcome=outcome)

    assert requests("ok") == 1
    assert requests("upstream_error") == 1
    assert requests("timeout") == 1
    assert requests("client_disconnect") == 1
    assert requests("rejected", lane="none", cluster="none") == 1
    assert m.value("shapegate_requests_total") == 5
    assert (
        m.value("shapegate_watchdog_events_total", lane="fast", cluster="fast", kind="first_byte")
        == 1
    )
    assert m.value("shapegate_slots_in_use") == 0


def test_latency_buckets_reach_the_longest_lane_deadline() -> None:
    config = lanes_config(["http://x"], ["http://y"])
    config["lanes"][1]["timeouts"] = {"first_byte_s": 900, "idle_s": 120, "total_s": 3600}
    settings = parse_settings(config, environ={})
    metrics = Metrics(deadlines_of(settings))
    assert latency_buckets(deadlines_of(settings))[-1] == 3600 > LATENCY_BUCKETS[-1]
    metrics.e2e.labels(lane="heavy", cluster="heavy", endpoint="http://y").observe(3000)
    m = parse(metrics.render().decode())
    assert m.value("shapegate_e2e_seconds_bucket", lane="heavy", le="1800.0") == 0
    assert m.value("shapegate_e2e_seconds_bucket", lane="heavy", le="3600.0") == 1
    assert m.value("shapegate_build_info", version=version("shapegate")) == 1


async def test_per_endpoint_in_flight_ttft_and_e2e_and_time_per_output_token(
    sims: tuple[SimServer, SimServer], gateway_at: Any
) -> None:
    fast, heavy = sims
    endpoint = {"cluster": "fast", "endpoint": fast.url}
    async with (
        gateway_at(lanes_config([fast.url], [heavy.url])) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        options = {"stream": True, "max_tokens": 64}  # ~0.3 s of decoding at this pace
        held = asyncio.create_task(stream_chat(client, chat("hold on", **options)))

        async def in_flight() -> bool:
            return (await scrape(client)).value("shapegate_endpoint_in_flight", **endpoint) == 1

        await until(in_flight)
        await held
        m = await scrape(client)
    assert m.value("shapegate_endpoint_in_flight", **endpoint) == 0
    assert m.value("shapegate_endpoint_in_flight", cluster="heavy", endpoint=heavy.url) == 0
    assert m.value("shapegate_ttft_seconds_count", lane="fast", **endpoint) == 1
    assert m.value("shapegate_e2e_seconds_count", lane="fast", **endpoint) == 1
    assert m.value("shapegate_tpot_seconds_count", lane="fast") == 1
    ok = {"outcome": "ok", "status_class": "2xx"}
    assert m.value("shapegate_requests_total", lane="fast", **ok) == 1


def test_a_remembered_child_scrapes_as_the_library_child_would() -> None:
    """``Metrics.child`` moves the values itself (no observability check, a bisection for the
    bucket): the same operations through it and through prometheus_client's own children
    render the same lines, boundaries, +Inf, NaN and a refused negative increment included."""
    ours, theirs = Metrics(), Metrics()
    amounts = [0.0, 0.001, 0.0011, 0.25, 2.5, 1800.0, 1800.5, 1e9, float("nan")]
    for amount in amounts:
        ours.child(ours.e2e, "fast", "c", "u").observe(amount)
        theirs.e2e.labels("fast", "c", "u").observe(amount)
    for amount in (16, 17, 1048576, 2_000_000):
        ours.child(ours.prompt_tokens, "fast").observe(amount)
        theirs.prompt_tokens.labels("fast").observe(amount)
    for _ in range(3):
        ours.child(ours.requests, "fast", "c", "ok", "2xx").inc()
        theirs.requests.labels("fast", "c", "ok", "2xx").inc()
    ours.child(ours.requests, "fast", "c", "ok", "2xx").inc(2.5)
    theirs.requests.labels("fast", "c", "ok", "2xx").inc(2.5)
    with pytest.raises(ValueError, match="non-negative"):
        ours.child(ours.requests, "fast", "c", "ok", "2xx").inc(-1)
    gauge = ours.child(ours.slots_in_use, "fast", "c")
    gauge.inc()
    gauge.inc(3)
    gauge.dec()
    theirs.slots_in_use.labels("fast", "c").inc()
    theirs.slots_in_use.labels("fast", "c").inc(3)
    theirs.slots_in_use.labels("fast", "c").dec()
    ours.child(ours.queue_depth, "fast").set(7)
    theirs.queue_depth.labels("fast").set(7)

    def lines(metrics: Metrics) -> list[str]:
        return [
            line
            for line in metrics.render().decode().splitlines()
            if not line.startswith("#") and "_created" not in line
        ]

    assert lines(ours) == lines(theirs)
    assert 'shapegate_e2e_seconds_bucket{cluster="c",endpoint="u",lane="fast",le="+Inf"} 8.0' in (
        lines(ours)
    )
