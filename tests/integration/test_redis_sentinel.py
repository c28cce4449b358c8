"""Redis with Sentinel: two gateway replicas follow a failover without a restart, and the
failover counts as data loss, so the lane limit holds at the engine throughout.

A primary, a replica and three sentinels (real ``redis-server`` and ``redis-sentinel``), two
gateways (each its own ``RedisSlotStore`` and Sentinel client) in front of one simulated engine,
eight streaming client loops. ``kill -9`` of the primary: no primary answers until the sentinels
promote the replica (~2-3 s, past the 1.5 s lease TTL, so every lease lapses on the replica),
and the replica carries the old epoch. Without the epoch naming its server (gateway/slots/lua.py)
the gateways took the lapsed slots for free: the engine ran the four old streams and four new
ones against a lane limit of four.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from engine_pool.sim.server import SimServer, run_sim
from gateway.count.tokens import TokenCounter
from gateway.tools.sim_support import RegistryCounter
from tests.conftest import JSON, lanes_config
from tests.integration.redis_support import live_members
from tests.integration.sentinel_support import MASTER, sentinel_deployment
from tests.reliability.reliability_support import chat_body

LIMIT = 4
TTL_S = 1.5
# About 4.5 s a stream: the streams running at the kill outlive the outage (~2.5 s).
STREAM_TOKENS = 200


@pytest.fixture
async def sim(counter: TokenCounter) -> AsyncIterator[SimServer]:
    async with run_sim(
        "h100-fast", time_scale=1.0, counter=RegistryCounter(counter, "qwen3.6")
    ) as server:
        yield server


def in_flight(sim: SimServer) -> int:
    snap = sim.engine.snapshot()
    return snap.running + snap.waiting


async def test_two_replicas_follow_a_sentinel_failover_and_never_exceed_the_limit(
    gateway_at: Any, sim: SimServer, prefix: str, tmp_path: Path
) -> None:
    samples: list[tuple[float, int]] = []
    # (gateway, sent, finished, status)
    results: list[tuple[int, float, float, int]] = []
    first_bytes: list[tuple[int, float]] = []  # (gateway, when a 200 stream's first bytes came)
    with sentinel_deployment(tmp_path) as deployment, capture_logs() as logs:
        config = lanes_config([sim.url], ["http://127.0.0.1:9"])
        config["lanes"][0]["slots"] = {"lane": LIMIT, "per_endpoint": LIMIT}
        config["state"] = {
            "backend": "redis",
            "sentinel": {"hosts": deployment.hosts, "master_name": MASTER},
            "key_prefix": prefix,
            "lease_ttl_s": TTL_S,  # renewals every 0.5 s; the outage outlasts a lease
            "poll_interval_s": 0.02,
        }
        async with (
            gateway_at(config) as (url_a, _),
            gateway_at(config) as (url_b, _),
            httpx.AsyncClient(timeout=30) as client,
        ):
            urls = [url_a, url_b]
            stop = asyncio.Event()

            async def client_loop(n: int) -> None:
                i = 0
                while not stop.is_set():
                    sent = time.monotonic()
                    async with client.stream(
                        "POST",
                        urls[n % 2] + "/v1/chat/completions",
                        content=chat_body(
                            f"loop {n} request {i}", stream=True, max_tokens=STREAM_TOKENS
                        ),
                        headers=JSON,
                    ) as r:
                        first = True
                        async for _ in r.aiter_bytes():
                            if first and r.status_code == 200:
                                first_bytes.append((n % 2, time.monotonic()))
                            first = False
                    i += 1
                    results.append((n % 2, sent, time.monotonic(), r.status_code))
                    if r.status_code != 200:  # no primary for a moment: 503
                        await asyncio.sleep(0.1)

            async def sample() -> None:
                while not stop.is_set():
                    samples.append((time.monotonic(), in_flight(sim)))
                    await asyncio.sleep(0.2)

            tasks = [asyncio.create_task(client_loop(n)) for n in range(2 * LIMIT)]
            sampler = asyncio.create_task(sample())
            while in_flight(sim) < LIMIT:  # the lane is full, the others wait
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            assert deployment.primary.proc is not None
            deployment.primary.proc.kill()
            killed = time.monotonic()
            while not await asyncio.to_thread(deployment.promoted):
                assert time.monotonic() - killed < 20, "the sentinels never promoted the replica"
                await asyncio.sleep(0.05)
            promoted = time.monotonic()
            back: dict[int, float] = {}
            # A replica takes requests again when a stream's first bytes reach its client.
            while len(back) < 2 and time.monotonic() - promoted < 10:
                for gw, at in first_bytes:
                    if at >= promoted and gw not in back:
                        back[gw] = at - promoted
                await asyncio.sleep(0.05)
            await asyncio.sleep(3.0)  # the load goes on past the recovery grace
            stop.set()
            await asyncio.gather(*tasks, sampler)
            # Every stream has ended and released: nothing held anywhere.
            assert in_flight(sim) == 0
            for url in urls:
                metrics = (await client.get(url + "/metrics")).text
                held = [
                    line
                    for line in metrics.splitlines()
                    if line.startswith("shapegate_slots_in_use{") and not line.endswith(" 0.0")
                ]
                assert not held, held
            leases = {
                key: live_members(deployment.replica.url, prefix, key)
                for key in ("lane:fast", f"ep:fast:{sim.url}")
            }
    outage = promoted - killed
    peak = max(n for _, n in samples)
    during = [n for at, n in samples if killed <= at <= promoted + 3]
    ok_after = sum(1 for _, sent, _, s in results if s == 200 and sent >= promoted)
    print(
        f"\nprimary killed; promoted after {outage:.2f}s; back at the gateways "
        f"{ {gw: round(s, 2) for gw, s in back.items()} }s after the promotion; in-flight at "
        f"5 Hz: max {peak} ({len(samples)} samples, {len(during)} around the failover); "
        f"{ok_after} streams ok after the promotion"
    )
    assert sorted(back) == [0, 1], back  # both replicas served again ...
    assert max(back.values()) < 10  # ... within 10 s of the promotion, without a restart
    assert peak <= LIMIT, samples
    assert sim.engine.snapshot().running == 0
    assert leases == {"lane:fast": 0, f"ep:fast:{sim.url}": 0}, leases
    changed = [e for e in logs if e["event"] == "state.epoch_changed"]
    assert changed, "no gateway saw the failover as a new epoch"
