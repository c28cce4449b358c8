"""Gateway processes (``shapegate serve``) sharing slots through a real Redis, in front of one
fake engine: the shared limit holds from the engine's side, a killed or frozen replica's slots
come back within TTL + 1 s, and a Redis outage follows the configured policy."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from tests.conftest import JSON, lanes_config
from tests.integration.redis_support import GatewayProcess, live_members, own_redis
from tests.support.fake_engine import FakeEngine, Seen
from tests.support.servers import serve_asgi
from tests.support.waiting import wait_for as wait_with_deadline

TTL_S = 1.0
LANE_KEY = "lane:fast"
# cl100k loads in 0.2 s where the demo's Qwen tokenizer takes 3 s: the tests start 8 gateways.
MODEL = {
    "name": "qwen3.6",
    "tokenizer": {"source": "builtin", "name": "cl100k_base", "chat_template": "chatml"},
}


def gateway_config(
    engine_url: str, redis_url: str, prefix: str, lane_slots: int, **state: Any
) -> dict[str, Any]:
    config = lanes_config([engine_url], [engine_url], models=[MODEL])
    config["lanes"][0].update(
        # One endpoint: the lane limit is the binding one (per_endpoint may not exceed it).
        slots={"lane": lane_slots, "per_endpoint": lane_slots},
        queue={"depth": 512, "max_wait_s": 20},
        timeouts={"connect_s": 2, "first_byte_s": 30, "idle_s": 30, "total_s": 60},
    )
    config["state"] = {
        "backend": "redis",
        "redis_url": redis_url,
        "key_prefix": prefix,
        "lease_ttl_s": TTL_S,
        "poll_interval_s": 0.02,
        **state,
    }
    return config


@asynccontextmanager
async def gateways(tmp_path: Path, *configs: dict[str, Any]) -> AsyncIterator[list[GatewayProcess]]:
    procs = [GatewayProcess(config, tmp_path) for config in configs]
    try:
        await asyncio.gather(*(p.start() for p in procs))
        yield procs
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture
async def engine() -> AsyncIterator[tuple[FakeEngine, str]]:
    fake = FakeEngine()
    async with serve_asgi(fake) as url:
        yield fake, url


def body(rid: str, **fake: Any) -> bytes:
    return orjson.dumps(
        {
            "model": "qwen3.6",
            "stream": True,
            "fake": fake,
            "messages": [{"role": "user", "content": f"request {rid}"}],
        }
    )


async def chat(client: httpx.AsyncClient, url: str, rid: str, **fake: Any) -> httpx.Response:
    return await client.post(
        url + "/v1/chat/completions",
        content=body(rid, **fake),
        headers={"x-request-id": rid, **JSON},
    )


def complete(response: httpx.Response, chunks: int) -> bool:
    text = response.content
    return (
        response.status_code == 200
        and text.count(b'"chat.completion.chunk"') == chunks
        and text.endswith(b"data: [DONE]\n\n")
        and b'"error"' not in text
    )


def peak_overlap(seen: Iterable[Seen]) -> int:
    """Most requests the engine had open at one instant (a close sorts before an open)."""
    events = []
    for s in seen:
        assert s.closed is not None, s.request_id
        events += [(s.arrived, 1), (s.closed, -1)]
    peak = now = 0
    for _, step in sorted(events):
        now += step
        peak = max(peak, now)
    return peak


async def wait_for(check: Any, within_s: float) -> float:
    """Poll ``check()`` until true; return how long it took, or fail after ``within_s``."""
    started = time.monotonic()
    await wait_with_deadline(check, within_s)
    return time.monotonic() - started


async def test_two_replicas_never_admit_more_than_the_shared_limit(
    engine: tuple[FakeEngine, str], redis_url: str, prefix: str, tmp_path: Path
) -> None:
    fake, engine_url = engine
    n = 3
    config = gateway_config(engine_url, redis_url, prefix, n)
    async with (
        gateways(tmp_path, config, config) as (a, b),
        httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=100)) as client,
    ):
        results = await asyncio.gather(
            *(chat(client, (a, b)[i % 2].url, f"load-{i}", chunks=4, gap=0.03) for i in range(40))
        )
        # Released by the live gateways, not lapsed: a client can read a response's last byte
        # before its handler's release reaches Redis (a CI run stopped the gateways with -9 in
        # between and found one lease), and a held lease is renewed, so it would stay; a lease
        # left unreleased lapses only after TTL_S, twice this deadline.
        await wait_for(lambda: live_members(redis_url, prefix, LANE_KEY) == 0, TTL_S / 2)
    broken = [(r.status_code, r.content[-300:]) for r in results if not complete(r, 4)]
    assert not broken, broken
    assert len(fake.seen) == 40
    # The engine saw exactly N at once at the busiest instant: the limit held and was used.
    assert peak_overlap(fake.seen.values()) == n


async def test_a_killed_replicas_slots_come_back_within_ttl_while_the_other_serves(
    engine: tuple[FakeEngine, str], redis_url: str, prefix: str, tmp_path: Path
) -> None:
    fake, engine_url = engine
    config = gateway_config(engine_url, redis_url, prefix, 4)
    async with (
        gateways(tmp_path, config, config) as (doomed, survivor),
        httpx.AsyncClient(timeout=30) as client,
    ):
        held = [
            asyncio.create_task(chat(client, doomed.url, f"held-{i}", mode="stall", chunks=1))
            for i in range(3)
        ]
        await wait_for(lambda: len(fake.open_requests()) == 3, 5)
        assert live_members(redis_url, prefix, LANE_KEY) == 3
        doomed.signal(signal.SIGKILL)
        killed = time.monotonic()
        # Four at once at the survivor, whose lane (limit 4) the dead replica's leases still
        # fill to 3: one is admitted now, three when those leases lapse (within TTL + 1 s).
        after = [
            asyncio.create_task(
                chat(client, survivor.url, f"after-{i}", mode="slow_first_byte", delay=1.5)
            )
            for i in range(4)
        ]
        await wait_for(lambda: sum(rid.startswith("after") for rid in fake.seen) == 4, 5)
        arrivals = sorted(s.arrived - killed for r, s in fake.seen.items() if r.startswith("after"))
        assert all(complete(r, 3) for r in await asyncio.gather(*after))
        await asyncio.gather(*held, return_exceptions=True)
        reaped_s = arrivals[-1]
        assert arrivals[0] < arrivals[1]  # the survivor served while the dead leases held
        # No dead lease lapses before 2/3 TTL (renewed every TTL/3), and all are gone at TTL.
        assert arrivals[1] >= TTL_S * 0.6 and reaped_s <= TTL_S + 1.0, arrivals
        # All four slots were reused at once: four concurrent requests held them together.
        assert peak_overlap(s for rid, s in fake.seen.items() if rid.startswith("after")) == 4
    print(f"kill -9: slots free {reaped_s:.2f}s after the kill (TTL {TTL_S}s)")


async def test_a_long_request_keeps_its_lease_until_its_replica_freezes(
    engine: tuple[FakeEngine, str], redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """A 13 s stream with a 1 s TTL (a 10-minute request at a 1-minute TTL, time-scaled) is
    never reaped during the 10 s its gateway runs; SIGSTOP the gateway and the lease goes
    within TTL + 1 s, and SIGCONT does not bring it back."""
    _, engine_url = engine
    config = gateway_config(engine_url, redis_url, prefix, 2)
    async with gateways(tmp_path, config) as (gw,), httpx.AsyncClient(timeout=60) as client:
        # It ends ~2 s after the SIGCONT: the renewal that finds its lease reaped comes first
        # (at 11 s it ended with the SIGCONT, and the renewal never ran: a flaky race).
        long = asyncio.create_task(chat(client, gw.url, "long", chunks=52, gap=0.25))
        await wait_for(lambda: live_members(redis_url, prefix, LANE_KEY) == 1, 5)
        started = time.monotonic()
        while time.monotonic() - started < 10.0:  # ten TTLs alive
            assert live_members(redis_url, prefix, LANE_KEY) == 1
            assert not long.done()
            await asyncio.sleep(0.1)
        gw.signal(signal.SIGSTOP)
        try:
            reaped_s = await wait_for(lambda: live_members(redis_url, prefix, LANE_KEY) == 0, 3)
        finally:
            gw.signal(signal.SIGCONT)
        await wait_for(lambda: bool(gw.events("slot.lease_lost")), 2)
        assert live_members(redis_url, prefix, LANE_KEY) == 0  # not resurrected
        response = await long
    assert reaped_s <= TTL_S + 1.0
    assert complete(response, 52)  # the request itself carried on
    print(f"frozen replica: lease reaped {reaped_s:.2f}s after SIGSTOP (TTL {TTL_S}s)")


async def test_fail_closed_answers_503_fast_and_recovers_when_redis_returns(
    engine: tuple[FakeEngine, str], prefix: str, tmp_path: Path
) -> None:
    fake, engine_url = engine
    with own_redis() as server:
        config = gateway_config(engine_url, server.url, prefix, 4, on_redis_down="fail_closed")
        async with gateways(tmp_path, config) as (gw,), httpx.AsyncClient(timeout=30) as client:
            in_flight = [
                asyncio.create_task(chat(client, gw.url, f"inflight-{i}", chunks=15, gap=0.1))
                for i in range(3)
            ]
            await wait_for(lambda: len(fake.open_requests()) == 3, 5)
            server.stop()
            latencies = []
            for i in range(5):
                started = time.monotonic()
                refused = await chat(client, gw.url, f"refused-{i}", chunks=1)
                latencies.append(time.monotonic() - started)
                assert refused.status_code == 503
                assert int(refused.headers["retry-after"]) >= 1
                assert refused.json()["error"]["type"] == "service_unavailable"
            assert max(latencies) < 2.0
            assert all(complete(r, 15) for r in await asyncio.gather(*in_flight))
            server.start()
            recovered_s = await wait_for_200(client, gw.url, within_s=3)
            # Nothing is stuck: the full limit is usable and everything is given back.
            burst = await asyncio.gather(
                *(
                    chat(client, gw.url, f"burst-{i}", mode="slow_first_byte", delay=0.2)
                    for i in range(8)
                )
            )
            assert all(complete(r, 3) for r in burst)
            assert peak_overlap(s for rid, s in fake.seen.items() if rid.startswith("burst")) == 4
            assert live_members(server.url, prefix, LANE_KEY) == 0
            raw = redis.Redis.from_url(server.url)
            assert raw.zcard("{" + prefix + "}:queue:lane:fast") == 0
            raw.close()
            assert "refused-0" not in fake.seen
            assert gw.events("state.degraded") and gw.events("state.recovered")
    print(
        f"fail_closed: 503 in at most {max(latencies) * 1000:.0f} ms; "
        f"served again {recovered_s:.2f}s after Redis restarted"
    )


async def wait_for_200(client: httpx.AsyncClient, url: str, within_s: float) -> float:
    started = time.monotonic()
    while (await chat(client, url, f"probe-{time.monotonic()}", chunks=1)).status_code != 200:
        if time.monotonic() - started > within_s:
            pytest.fail(f"still refused {within_s}s after Redis came back")
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def test_fail_open_local_serves_under_the_replicas_share_while_redis_is_down(
    engine: tuple[FakeEngine, str], prefix: str, tmp_path: Path
) -> None:
    fake, engine_url = engine
    with own_redis() as server:
        config = gateway_config(
            engine_url, server.url, prefix, 4, on_redis_down="fail_open_local", replicas=2
        )
        async with gateways(tmp_path, config) as (gw,), httpx.AsyncClient(timeout=30) as client:
            assert complete(await chat(client, gw.url, "warm", chunks=1), 1)
            server.stop()
            during = await asyncio.gather(
                *(chat(client, gw.url, f"local-{i}", chunks=4, gap=0.05) for i in range(6))
            )
            assert all(complete(r, 4) for r in during)
            # Lane limit 4 shared by 2 replicas: alone, this one admits 2.
            assert peak_overlap(s for rid, s in fake.seen.items() if rid.startswith("local")) == 2
            server.start()
            tries: list[str] = []

            async def admitted_through_redis() -> bool:
                """One request; True when its slot is a lease in Redis (Redis is back)."""
                rid = f"shared-{len(tries)}"
                tries.append(rid)
                task = asyncio.create_task(
                    chat(client, gw.url, rid, mode="slow_first_byte", delay=0.3)
                )
                await wait_for(lambda: rid in fake.seen, 2)
                shared = live_members(server.url, prefix, LANE_KEY) == 1
                assert complete(await task, 3)
                return shared

            await wait_with_deadline(admitted_through_redis, 5, interval=0.05)
            assert gw.events("state.degraded") and gw.events("state.recovered")
