"""A gateway that stops closes every connection it opened to Redis (the slot store's and the
response-affinity client's), however its lifespan ends: it cancels its background tasks' scope
first, and the closes that follow must not be cancelled with them, nor skipped when an earlier
one fails (gateway/edge/services.py).

Left open, those connections lived on with the gateway object (FastAPI's route caches keep it
long after its test) and were collected later as unclosed transports, a ResourceWarning that
failed whichever test was running then (the disconnect storm, in CI's serial stage)."""

from __future__ import annotations

from typing import Any

import httpx
import redis
from structlog.testing import capture_logs

from engine_pool.sim.server import SimServer
from gateway.upstream.proxy import Upstream
from tests.conftest import JSON, chat, lanes_config
from tests.integration.redis_support import own_redis
from tests.support.waiting import wait_for


async def test_a_stopped_gateway_leaves_no_connection_to_redis(
    gateway_at: Any, sims: tuple[SimServer, SimServer], prefix: str
) -> None:
    await serve_then_stop(gateway_at, sims, prefix)


async def test_a_close_that_fails_does_not_keep_the_later_ones_from_closing(
    gateway_at: Any, sims: tuple[SimServer, SimServer], prefix: str, monkeypatch: Any
) -> None:
    """The upstream pool's close (the first) raises, as a Redis disconnect's timeout does in
    redis-py: the slot store's close after it still runs, and the failure is logged (and raised
    to the lifespan, which uvicorn reports as a failed shutdown)."""
    close = Upstream.aclose

    async def closes_then_fails(self: Upstream) -> None:
        await close(self)
        raise OSError("closing failed")

    monkeypatch.setattr(Upstream, "aclose", closes_then_fails)
    with capture_logs() as logs:
        await serve_then_stop(gateway_at, sims, prefix)
    failed = [e for e in logs if e["event"] == "gateway.close_failed"]
    assert [(e["what"], e["error"]) for e in failed] == [("upstream", "OSError('closing failed')")]


async def serve_then_stop(gateway_at: Any, sims: tuple[SimServer, SimServer], prefix: str) -> None:
    """A gateway on a Redis of its own serves one request through it and stops: the Redis then
    has no client left but our probe."""
    fast, heavy = sims
    # A Redis of our own: nobody else's clients in its count.
    with own_redis() as server:
        probe = redis.Redis.from_url(server.url)

        def others() -> int:
            """Connected clients other than this probe."""
            return int(probe.info("clients")["connected_clients"]) - 1

        assert others() == 0
        config = lanes_config([fast.url], [heavy.url])
        config["state"] = {"backend": "redis", "redis_url": server.url, "key_prefix": prefix}
        async with (
            gateway_at(config) as (url, _),
            httpx.AsyncClient(timeout=30) as client,
        ):
            answer = await client.post(
                url + "/v1/chat/completions", json=chat("hello", max_tokens=4), headers=JSON
            )
            assert answer.status_code == 200, answer.text
            assert others() > 0  # its slot went through Redis
        # Redis sees a client's close at once; a second is slack for a loaded machine.
        await wait_for(lambda: others() == 0, 1.0, interval=0.02, what="no gateway client left")
        probe.close()
