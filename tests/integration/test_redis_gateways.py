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

from tests.conftest import lanes_config
from tests.integration.redis_support import GatewayProcess, live_members, own_redis
from tests.support.fake_engine import FakeEngine, Seen
from tests.support.servers import serve_asgi

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
        url + "/v1/chat/completions", content=body(rid, **fake), headers={"x-request-id": rid}
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


async def wait_for(check: Any, within_s: float, every_s: float = 0.01) -> float:
    """Poll ``check()`` until true; return how long it took, or fail after ``within_s``."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > within_s:
            pytest.fail(f"condition not met within {within_s}s")
        await asyncio.sleep(every_s)
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
    assert all(complete(r, 4) for r in results)
    assert len(fake.seen) == 40
    # The engine saw exactly N at once at the busiest instant: the limit held and was used.
    assert peak_overlap(fake.seen.values()) == n
    assert live_members(redis_url, prefix, LANE_KEY) == 0


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

        served: list[httpx.Response] = []

        async def keep_serving() -> None:
            while True:
                served.append(await chat(client, survivor.url, f"during-{len(served)}", chunks=2))

        serving = asyncio.create_task(keep_serving())
        reaped_s = await wait_for(lambda: live_members(redis_url, prefix, LANE_KEY) <= 1, 3)
        serving.cancel()
        await asyncio.gather(*held, serving, return_exceptions=True)
        assert reaped_s <= TTL_S + 1.0
        assert len(served) >= 5
        assert all(complete(r, 2) for r in served)
        # All four slots are usable again: four concurrent requests are admitted at once.
        again = await asyncio.gather(
            *(
                chat(client, survivor.url, f"after-{i}", mode="slow_first_byte", delay=0.3)
                for i in range(4)
            )
        )
        assert all(complete(r, 3) for r in again)
        assert peak_overlap(s for rid, s in fake.seen.items() if rid.startswith("after")) == 4
    print(f"kill -9: slots free {reaped_s:.2f}s after the kill (TTL {TTL_S}s)")


async def test_a_long_request_keeps_its_lease_until_its_replica_freezes(
    engine: tuple[FakeEngine, str], redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """A 10 s stream with a 1 s TTL (a 10-minute request at a 1-minute TTL, time-scaled) is
    never reaped while its gateway runs; SIGSTOP the gateway and the lease goes within TTL + 1 s,
    and SIGCONT does not bring it back."""
    _, engine_url = engine
    config = gateway_config(engine_url, redis_url, prefix, 2)
    async with gateways(tmp_path, config) as (gw,), httpx.AsyncClient(timeout=60) as client:
        long = asyncio.create_task(chat(client, gw.url, "long", chunks=40, gap=0.25))
        await wait_for(lambda: live_members(redis_url, prefix, LANE_KEY) == 1, 5)
        started = time.monotonic()
        while time.monotonic() - started < 7.0:  # seven TTLs alive
            assert live_members(redis_url, prefix, LANE_KEY) == 1
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
    assert complete(response, 40)  # the request itself carried on
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
            await asyncio.sleep(1.1)  # the next probe finds Redis
            shared = asyncio.create_task(
                chat(client, gw.url, "shared", mode="slow_first_byte", delay=0.5)
            )
            await wait_for(lambda: live_members(server.url, prefix, LANE_KEY) == 1, 2)
            assert complete(await shared, 3)
            assert gw.events("state.degraded") and gw.events("state.recovered")
