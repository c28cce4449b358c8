"""Failover with the Redis store: the slot moves with the request, leases and all."""

from __future__ import annotations

from typing import Any

from structlog.testing import capture_logs

from tests.gateway.request.test_failover import (
    engine_that_dies,
    events,
    fast_endpoints,
    gateway_over,
    ordered_ports,
    post,
)
from tests.integration.redis_support import live_members
from tests.support.fake_engine import FakeEngine
from tests.support.servers import serve_asgi


async def test_a_refused_endpoint_fails_over_with_redis_leases(
    gateway_at: Any, redis_url: str, prefix: str
) -> None:
    dead_port, live_port = ordered_ports()
    state = {"backend": "redis", "redis_url": redis_url, "key_prefix": prefix}
    wrapped = _with_state(gateway_at, state)
    async with (
        serve_asgi(FakeEngine(), port=live_port) as live_url,
        engine_that_dies(dead_port) as stop,
    ):
        dead_url = f"http://127.0.0.1:{dead_port}"
        async with gateway_over(wrapped, [dead_url, live_url]) as (url, client):
            await stop()
            with capture_logs() as logs:
                answers = [await post(client, url, f"r{i}") for i in range(4)]
            assert [r.status_code for r in answers] == [200] * 4
            moved = events(logs, "route.retry")
            assert [(e["from"], e["to"]) for e in moved] == [(dead_url, live_url)] * 2
            assert sum(e["slots_in_use"] for e in await fast_endpoints(client, url)) == 0
            for key in ("lane:fast", f"ep:fast:{dead_url}", f"ep:fast:{live_url}"):
                assert live_members(redis_url, prefix, key) == 0


def _with_state(gateway_at: Any, state: dict[str, Any]) -> Any:
    """``gateway_at`` with ``state`` set in every config it is given."""

    def start(config: dict[str, Any]) -> Any:
        return gateway_at({**config, "state": state})

    return start
