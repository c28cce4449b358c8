"""Redis restarted empty under load: the limit still holds at the engine.

Four streams hold the whole lane (limit 4) and more clients wait for a slot. Redis is restarted
without its data. Without the epoch (gateway/slots/lua.py) the holders' leases vanish, four
waiters are admitted into the empty Redis and the engine runs eight requests against a limit of
four. With it, acquires take nothing until the holders have re-established their leases at
their next renewal: the engine's in-flight count, sampled at 5 Hz, never exceeds 4.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from structlog.testing import capture_logs

from tests.conftest import lanes_config
from tests.integration.redis_support import own_redis
from tests.support.fake_engine import FakeEngine
from tests.support.servers import serve_asgi

LIMIT = 4
STREAM = {"chunks": 25, "gap": 0.1}  # 2.5 s a stream


async def test_redis_restarted_empty_never_lets_the_engine_exceed_the_limit(
    gateway_at: Any, prefix: str
) -> None:
    engine = FakeEngine()
    samples: list[int] = []
    statuses: list[int] = []
    with own_redis() as redis_server, capture_logs() as logs:
        async with serve_asgi(engine) as engine_url:
            config = lanes_config([engine_url], ["http://127.0.0.1:9"])
            config["lanes"][0]["slots"] = {"lane": LIMIT, "per_endpoint": LIMIT}
            config["state"] = {
                "backend": "redis",
                "redis_url": redis_server.url,
                "key_prefix": prefix,
                "lease_ttl_s": 1.5,  # renewals every 0.5 s
            }
            async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=30) as client:
                until = time.monotonic() + 8.0

                async def client_loop(n: int) -> None:
                    i = 0
                    while time.monotonic() < until:
                        body = {
                            "model": "qwen3.6",
                            "stream": True,
                            "messages": [{"role": "user", "content": f"{n}-{i}"}],
                            "fake": STREAM,
                        }
                        i += 1
                        r = await client.post(url + "/v1/chat/completions", json=body)
                        statuses.append(r.status_code)
                        if r.status_code != 200:  # Redis unreachable for a moment: 503
                            await asyncio.sleep(0.1)

                async def sample() -> None:
                    while time.monotonic() < until:
                        samples.append(engine.in_flight)
                        await asyncio.sleep(0.2)

                tasks = [asyncio.create_task(client_loop(n)) for n in range(2 * LIMIT)]
                sampler = asyncio.create_task(sample())
                while engine.in_flight < LIMIT:  # the lane is full, the others wait
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.5)
                redis_server.stop()
                redis_server.start()  # same port, no data: a crash without persistence
                restarted = time.monotonic()
                await asyncio.gather(*tasks, sampler)
    print(
        f"\nin-flight samples at 5 Hz: max {max(samples)}, {len(samples)} samples; "
        f"statuses {sorted(set(statuses))}; ok {statuses.count(200)}"
    )
    assert max(samples) <= LIMIT, samples
    assert engine.peak_in_flight <= LIMIT
    restored = [e for e in logs if e["event"] == "slot.lease_restored"]
    assert len(restored) >= 1, "no lease was re-established"
    assert time.monotonic() - restarted > 4  # the load went on well past the restart
    assert statuses.count(200) >= 2 * LIMIT  # and the lane kept serving
