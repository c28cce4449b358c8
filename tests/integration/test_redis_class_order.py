"""Priority classes across replicas: with Redis, a higher class waiting on any replica is
admitted before a lower class waiting on another.

Two gateways share a lane of 1 through Redis. A batch flood on one holds the lane and queues
seven more; then three interactive requests arrive at the other. As the slot frees, the three
interactive ones reach the engine before any of the queued batch ones. (With a lane of 2, two
slots freeing together admit the list's first two in one round, and which of them reaches the
engine first is a race: a CI run saw batch-2 arrive a moment before interactive-2 that way.)
With the shared waiting list in arrival order (before class bands, gateway/slots/lua.py) the
batch waiters, earlier in, went first and the interactive ones came last.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import orjson
import redis

from gateway.observe.metrics import Metrics
from gateway.settings import StateSettings
from gateway.slots.redis_store import RedisSlotStore
from tests.conftest import JSON, lanes_config
from tests.support.fake_engine import FakeEngine
from tests.support.servers import serve_asgi
from tests.support.waiting import wait_for

LIMIT = 1


def body(rid: str) -> bytes:
    return orjson.dumps(
        {
            "model": "qwen3.6",
            "stream": True,
            "fake": {"chunks": 4, "gap": 0.1},  # 0.4 s a stream
            "messages": [{"role": "user", "content": f"request {rid}"}],
        }
    )


async def test_interactive_waiters_on_one_replica_go_before_batch_waiters_on_another(
    gateway_at: Any, redis_url: str, prefix: str
) -> None:
    engine = FakeEngine()
    raw = redis.Redis.from_url(redis_url)
    queue = "{" + prefix + "}:queue:lane:fast"
    async with serve_asgi(engine) as engine_url:
        config = lanes_config([engine_url], ["http://127.0.0.1:9"])
        config["lanes"][0]["slots"] = {"lane": LIMIT, "per_endpoint": LIMIT}
        config["classes"] = {"default": "interactive"}
        config["state"] = {
            "backend": "redis",
            "redis_url": redis_url,
            "key_prefix": prefix,
            "lease_ttl_s": 3,
            "poll_interval_s": 0.02,
        }
        async with (
            gateway_at(config) as (batch_gw, _),
            gateway_at(config) as (interactive_gw, _),
            httpx.AsyncClient(timeout=30) as client,
        ):

            async def send(url: str, rid: str, klass: str) -> int:
                headers = {"x-request-id": rid, "x-shapegate-class": klass, **JSON}
                r = await client.post(
                    url + "/v1/chat/completions", content=body(rid), headers=headers
                )
                return r.status_code

            flood = [asyncio.create_task(send(batch_gw, f"batch-{i}", "batch")) for i in range(8)]
            await wait_for(lambda: raw.zcard(queue) == 7, 5, what="seven batch waiters")
            rush = [
                asyncio.create_task(send(interactive_gw, f"interactive-{i}", "interactive"))
                for i in range(3)
            ]
            await wait_for(lambda: raw.zcard(queue) == 10, 5, what="the interactive waiters")
            statuses = await asyncio.gather(*flood, *rush)
    raw.close()
    assert statuses == [200] * 11
    order = [s.request_id for s in sorted(engine.seen.values(), key=lambda s: s.arrived)]
    print(f"\nengine arrival order: {order}")
    first_in = order[:LIMIT]
    assert all(rid.startswith("batch") for rid in first_in)
    # Every interactive request reached the engine before any batch request that was queued.
    assert all(rid.startswith("interactive") for rid in order[LIMIT : LIMIT + 3]), order


async def test_a_starved_waiter_moves_ahead_of_every_class_in_the_shared_list(
    redis_url: str, prefix: str
) -> None:
    """The shared list is class, then arrival; a waiter past ``starved_at`` moves ahead of every
    class at that moment (its refresh re-scores it, its ticket kept)."""
    spec = StateSettings.model_validate(
        {
            "backend": "redis",
            "redis_url": redis_url,
            "key_prefix": prefix,
            "lease_ttl_s": 30,
            "redis_timeout_s": 5.0,
        }
    )
    low, high = (RedisSlotStore.from_settings(spec, Metrics()) for _ in range(2))
    raw = redis.Redis.from_url(redis_url)
    queue = "{" + prefix + "}:queue:lane:fast"

    def order() -> list[str]:
        return [m.decode().split("|")[1] for m in raw.zrange(queue, 0, -1)]

    try:
        starves = time.monotonic() + 0.5
        async with (
            low.waiting("batch", "lane:fast", rank=2, starved_at=starves),
            high.waiting("interactive", "lane:fast", rank=0),
        ):
            assert order() == ["interactive", "batch"]
            await wait_for(lambda: order() == ["batch", "interactive"], 2)
            assert time.monotonic() >= starves
        assert order() == []
    finally:
        raw.close()
        await low.aclose()
        await high.aclose()
