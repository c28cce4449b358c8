"""``/readyz`` tells each lane's current truth (gateway/upstream/readiness.py), after the boot
probe."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from engine_pool.cluster import EngineState
from gateway.settings import parse_settings
from gateway.upstream.readiness import EndpointHealth, lane_states
from tests.conftest import lanes_config
from tests.support.fake_engine import FakeEngine
from tests.support.servers import free_port, serve_asgi

UP, DOWN = EngineState.UP, EngineState.DOWN
FAST_PROBES = {"interval_s": 0.1, "timeout_s": 1, "up_after_successes": 1}


def policy(fast: str, heavy: str, *, emergency: bool) -> dict[str, Any]:
    config = lanes_config([fast], [heavy])
    config["server"] = {"boot_probe": True}
    for lane in config["lanes"]:
        lane["health"] = FAST_PROBES
    if emergency:
        config["lanes"][1]["emergency_clusters"] = ["fast"]
    return config


def test_lane_states_ready_degraded_and_down() -> None:
    settings = parse_settings(policy("http://f", "http://h", emergency=True), environ={})
    fast_up = [EndpointHealth("http://f", UP, "probe ok")]
    heavy_down = [EndpointHealth("http://h", DOWN, "probe failed: refused")]
    states = lane_states(settings.lanes, {"fast": fast_up, "heavy": heavy_down})
    assert states["fast"]["state"] == "ready" and states["fast"]["serving"] == ["fast"]
    heavy = states["heavy"]
    assert heavy["state"] == "degraded" and heavy["serving"] == ["fast"]
    assert heavy["clusters"]["heavy"] == {
        "role": "primary",
        "routable": 0,
        "endpoints": {"http://h": "down: probe failed: refused"},
    }
    assert heavy["clusters"]["fast"]["role"] == "emergency"
    fast_down = [EndpointHealth("http://f", DOWN, "ejected: 2 requests in a row")]
    states = lane_states(settings.lanes, {"fast": fast_down, "heavy": heavy_down})
    assert states["heavy"]["state"] == "down" and states["heavy"]["serving"] == []


async def eventually(check: Callable[[], Awaitable[bool]], within: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "never happened"
        await asyncio.sleep(0.05)


async def test_a_lane_served_by_its_emergency_cluster_is_ready_but_degraded(
    gateway_at: Any,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with serve_asgi(FakeEngine()) as fast_url:
        config = policy(fast_url, dead, emergency=True)
        async with gateway_at(config) as (url, _), httpx.AsyncClient() as client:

            async def ready() -> bool:
                return (await client.get(url + "/readyz")).status_code == 200

            await eventually(ready)
            body = (await client.get(url + "/readyz")).json()
            assert body["ready"] is True and body["degraded"] is True
            heavy = body["lanes"]["heavy"]
            assert heavy["state"] == "degraded" and heavy["serving"] == ["fast"]
            assert heavy["clusters"]["heavy"]["endpoints"][dead].startswith("down: probe failed")
            assert body["lanes"]["fast"]["state"] == "ready"
            probe = (
                await client.post(url + "/admin/probe", headers={"x-shapegate-admin": "1"})
            ).json()
            assert probe["lanes"]["heavy"]["passed"] is True
            assert probe["lanes"]["heavy"]["detail"].startswith(
                "degraded: served by emergency cluster fast"
            )


async def test_readyz_turns_503_while_a_lane_has_no_routable_cluster(gateway_at: Any) -> None:
    heavy_port = free_port()
    heavy_url = f"http://127.0.0.1:{heavy_port}"
    async with serve_asgi(FakeEngine()) as fast_url:
        config = policy(fast_url, heavy_url, emergency=False)
        async with gateway_at(config) as (url, _), httpx.AsyncClient() as client:

            async def status(want: int) -> bool:
                return (await client.get(url + "/readyz")).status_code == want

            async with serve_asgi(FakeEngine(), port=heavy_port):
                await eventually(lambda: status(200))  # the boot probe passed
                body = (await client.get(url + "/readyz")).json()
                assert body == {**body, "ready": True, "degraded": False}
            # The heavy engine is gone: the boot probe passed once, but the lane has nothing.
            await eventually(lambda: status(503))
            body = (await client.get(url + "/readyz")).json()
            assert body["ready"] is False and set(body["why"]) == {"heavy"}
            heavy = body["lanes"]["heavy"]
            assert heavy["state"] == "down"
            assert heavy["clusters"]["heavy"]["endpoints"][heavy_url].startswith("down: probe")
            async with serve_asgi(FakeEngine(), port=heavy_port):
                await eventually(lambda: status(200))
