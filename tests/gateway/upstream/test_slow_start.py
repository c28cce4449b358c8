"""Slow start through real sockets: an endpoint back from down gets its admission ramped over
``clusters[].outlier.slow_start_s``, logged and shown in the admin state."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import httpx
from structlog.testing import capture_logs

from tests.conftest import lanes_config
from tests.support.fake_engine import FakeEngine
from tests.support.servers import serve_asgi

LIMIT = 8
WINDOW_S = 3.0


async def endpoint(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    state = (await client.get(url + "/admin/state")).json()
    found: dict[str, Any] = state["clusters"][0]["endpoints"][0]
    return found


async def test_an_endpoint_back_from_down_is_ramped_over_its_window(gateway_at: Any) -> None:
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        config = lanes_config([engine_url], ["http://127.0.0.1:9"])
        config["clusters"][0]["outlier"] = {"slow_start_s": WINDOW_S}
        fast = config["lanes"][0]
        fast["slots"] = {"lane": LIMIT, "per_endpoint": LIMIT}
        fast["health"] = {"interval_s": 0.1, "timeout_s": 1, "up_after_successes": 1}
        async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=30) as client:
            assert (await endpoint(client, url))["slow_start"] is None  # at boot: no ramp
            with capture_logs() as logs:
                engine.health_status = 503
                while (await endpoint(client, url))["state"] != "down":
                    await asyncio.sleep(0.02)
                engine.health_status = 200
                while (await endpoint(client, url))["state"] != "up":
                    await asyncio.sleep(0.02)
                body = {
                    "model": "qwen3.6",
                    "messages": [{"role": "user", "content": "hi"}],
                    "fake": {"mode": "hang"},
                }
                burst = [
                    asyncio.create_task(client.post(url + "/v1/chat/completions", json=body))
                    for _ in range(LIMIT)
                ]
                try:
                    await asyncio.sleep(0.3)
                    early = engine.in_flight
                    share = (await endpoint(client, url))["slow_start"]["share"]
                    assert share < 0.8, "measured too late to see the ramp"
                    assert early <= math.ceil(LIMIT * share) < LIMIT
                    for _ in range(300):  # the rest are admitted as the window passes
                        if engine.in_flight == LIMIT:
                            break
                        await asyncio.sleep(0.05)
                    assert engine.in_flight == LIMIT
                    await asyncio.sleep(WINDOW_S * (1 - share))
                    assert (await endpoint(client, url))["slow_start"] is None  # ramp complete
                finally:
                    for task in burst:
                        task.cancel()
                    await asyncio.gather(*burst, return_exceptions=True)
    (started,) = [e for e in logs if e["event"] == "engine.slow_start"]
    assert started["endpoint"] == engine_url and started["window_s"] == WINDOW_S
    assert started["why"] == "recovered"
