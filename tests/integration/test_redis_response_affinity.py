"""With Redis as the state backend, the response id -> endpoint map is shared: a follow-up sent
to another gateway replica still reaches the engine that stored the previous response."""

from __future__ import annotations

from typing import Any

import httpx
import redis

from engine_pool.sim.server import SimServer
from tests.gateway.request.test_response_affinity import (
    _config,
    _first_response_on_second_engine,
    two_engines,  # noqa: F401 - the fixture
)


async def test_a_follow_up_through_another_replica_reaches_the_same_engine(
    two_engines: list[SimServer],  # noqa: F811 - the fixture
    gateway_at: Any,
    redis_url: str,
    prefix: str,
) -> None:
    config = _config(two_engines)
    config["state"] = {"backend": "redis", "redis_url": redis_url, "key_prefix": prefix}
    async with (
        gateway_at(config) as (one, _),
        gateway_at(config) as (two, _),
        httpx.AsyncClient(base_url=one, timeout=30) as first,
        httpx.AsyncClient(base_url=two, timeout=30) as second,
    ):
        previous = await _first_response_on_second_engine(first, two_engines)
        follow = await second.post(
            "/v1/responses",
            json={"model": "qwen3.6", "input": "and then?", "previous_response_id": previous},
        )
    assert follow.status_code == 200, follow.text
    assert [r.route for r in two_engines[1].requests()] == ["responses", "responses"]
    client = redis.Redis.from_url(redis_url)
    key = f"{prefix}:response:{previous}"
    assert client.exists(key) and 0 < client.pttl(key) <= 24 * 3600 * 1000
    client.close()
