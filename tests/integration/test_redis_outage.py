"""The store when Redis is down, frozen or slow: the configured policy, recovery without a
restart, and releases that do not leak while clients cancel."""

from __future__ import annotations

import asyncio
import random
import time

import redis
from structlog.testing import capture_logs

from engine_pool.cluster import EngineState, EngineView
from gateway.core.slots import Limit
from gateway.errors import StateUnavailable
from gateway.observe.log import get_logger
from gateway.observe.metrics import Metrics
from gateway.request.admission import Admission
from gateway.settings import LaneSettings, StateSettings
from gateway.slots.lua import PROBE_INTERVAL_S
from gateway.slots.redis_store import RedisSlotStore
from tests.integration.redis_support import RedisProcess, delay_proxy, live_members, own_redis

LANE = Limit("lane:fast", 4)
EP = Limit("ep:c:http://a", 4)


def store_at(url: str, prefix: str, metrics: Metrics, **state: object) -> RedisSlotStore:
    spec = StateSettings.model_validate(
        {"backend": "redis", "redis_url": url, "key_prefix": prefix, **state}
    )
    return RedisSlotStore.from_settings(spec, metrics)


async def timed_acquire(store: RedisSlotStore, token: str) -> tuple[float, BaseException | None]:
    started = time.monotonic()
    try:
        await store.try_acquire(token, LANE, [EP])
    except StateUnavailable as exc:
        return time.monotonic() - started, exc
    return time.monotonic() - started, None


async def restart(server: RedisProcess) -> None:
    server.stop()
    server.start()  # same port, empty: what a crashed Redis without persistence comes back as
    await asyncio.sleep(PROBE_INTERVAL_S)


async def test_fail_closed_refuses_new_work_fast_and_recovers_without_a_restart(
    prefix: str,
) -> None:
    metrics = Metrics()
    with own_redis() as server, capture_logs() as logs:
        store = store_at(server.url, prefix, metrics, redis_timeout_s=0.5, lease_ttl_s=2)
        try:
            assert await store.try_acquire("before", LANE, [EP]) == 0
            server.freeze()  # hung, not refusing: only the timeout can tell
            took, error = await timed_acquire(store, "hung")
            assert isinstance(error, StateUnavailable)
            assert error.headers()["retry-after"] == "2"
            assert 0.4 <= took < 2.0
            assert metrics.state_degraded._value.get() == 1
            took, error = await timed_acquire(store, "while-degraded")
            assert isinstance(error, StateUnavailable)
            assert took < 0.05  # no Redis call until the next probe
            server.thaw()
            server.stop()
            took, error = await timed_acquire(store, "refused")
            assert isinstance(error, StateUnavailable)
            assert took < 2.0
            server.start()
            await asyncio.sleep(PROBE_INTERVAL_S)
            # Redis came back empty: for half a TTL nothing new is admitted, so that leases
            # still in flight ("before" never renews here) can be re-established first.
            assert await store.try_acquire("during-recovery", LANE, [EP]) is None
            await asyncio.sleep(1.1)
            took, error = await timed_acquire(store, "after")
            assert error is None
            assert await store.in_use([LANE.key]) == {LANE.key: 1}  # the restart lost "before"
            assert metrics.state_degraded._value.get() == 0
        finally:
            await store.aclose()
    events = [e["event"] for e in logs]
    assert events.count("state.degraded") == 1
    assert events.count("state.recovered") == 1
    assert events.index("state.degraded") < events.index("state.recovered")


async def test_fail_open_local_serves_under_the_replicas_share_and_returns_to_redis(
    prefix: str,
) -> None:
    metrics = Metrics()
    with own_redis() as server:
        store = store_at(server.url, prefix, metrics, on_redis_down="fail_open_local", replicas=2)
        try:
            server.stop()
            # Lane limit 4 over 2 replicas: this replica alone may admit 2.
            assert await store.try_acquire("l1", LANE, [EP]) == 0
            assert await store.try_acquire("l2", LANE, [EP]) == 0
            assert await store.try_acquire("l3", LANE, [EP]) is None
            assert await store.in_use([LANE.key]) == {LANE.key: 2}
            assert metrics.state_degraded._value.get() == 1
            await store.release("l1", [LANE.key, EP.key])
            assert await store.try_acquire("l3", LANE, [EP]) == 0
            server.start()
            await asyncio.sleep(PROBE_INTERVAL_S)
            assert await store.try_acquire("r1", LANE, [EP]) == 0
            assert metrics.state_degraded._value.get() == 0
            assert live_members(server.url, prefix, LANE.key) == 1  # r1 is in Redis
            # Local grants from the outage stay local until released, and count meanwhile.
            assert await store.in_use([LANE.key]) == {LANE.key: 3}
            for token in ("l2", "l3", "r1"):
                await store.release(token, [LANE.key, EP.key])
            assert await store.in_use([LANE.key]) == {LANE.key: 0}
        finally:
            await store.aclose()


def lane(limit: int) -> LaneSettings:
    return LaneSettings.model_validate(
        {
            "name": "fast",
            "max_prompt_tokens": 100,
            "clusters": ["c"],
            "slots": {"lane": limit, "per_endpoint": limit},
            "queue": {"depth": 100, "max_wait_s": 20},
        }
    )


async def test_cancelled_clients_leak_nothing_through_a_slow_redis(
    redis_url: str, prefix: str
) -> None:
    """Every Redis call takes 200 ms longer; 40 clients are cancelled at random moments (queued,
    mid-acquire, holding). Once they are gone nothing is held or queued: no TTL needed."""
    port = int(redis_url.rsplit(":", 1)[1].split("/", maxsplit=1)[0])
    async with delay_proxy(port, 0.2) as slow_port:
        # The timeout stays well above the added latency even on a starved 2-core runner: this
        # test is about releases under cancellation, not about the timeout (tested above).
        store = store_at(f"redis://127.0.0.1:{slow_port}/0", prefix, Metrics(), redis_timeout_s=1.5)
        admission = Admission(store, Metrics(), get_logger("test"), poll_interval_s=0.05)
        views = [EngineView("c", "http://a", EngineState.UP, 0)]
        spec = lane(4)
        rng = random.Random(5)
        served: list[str] = []

        async def client(i: int) -> None:
            async with admission.slot(spec, lambda: views, f"c{i}"):
                served.append(f"c{i}")
                await asyncio.sleep(10)

        try:
            tasks = [asyncio.create_task(client(i)) for i in range(40)]
            for task in sorted(tasks, key=lambda _: rng.random()):
                await asyncio.sleep(rng.uniform(0.0, 0.05))
                task.cancel()
            started = time.monotonic()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            settled = time.monotonic() - started
            assert all(isinstance(r, asyncio.CancelledError) for r in results), results
            assert served  # some got a slot before they were cancelled
            for key in (LANE.key, EP.key):
                assert live_members(redis_url, prefix, key) == 0
            raw = redis.Redis.from_url(redis_url)
            try:
                assert raw.zcard("{" + prefix + "}:queue:lane:fast") == 0
            finally:
                raw.close()
            assert settled < 5.0  # released by the clients themselves, far inside the 30 s TTL
        finally:
            await store.aclose()


async def test_a_holder_carries_on_through_an_outage_and_restores_its_lease(prefix: str) -> None:
    """Renewal errors never reach the request; a lease that Redis lost with its data (restarted
    empty) is re-established by its holder at the next renewal, and reported."""
    with own_redis() as server, capture_logs() as logs:
        store = store_at(server.url, prefix, Metrics(), lease_ttl_s=0.3)
        try:
            assert await store.try_acquire("long", LANE, [EP]) == 0
            async with store.hold("long", [LANE.key, EP.key]):
                server.stop()
                await asyncio.sleep(0.8)  # renewals fail in here
                server.start()  # empty: the lease is gone until its holder renews
                await asyncio.sleep(0.5)
                assert live_members(server.url, prefix, LANE.key) == 1
                assert live_members(server.url, prefix, EP.key) == 1
            await store.release("long", [LANE.key, EP.key])  # no error reaches the caller
            assert live_members(server.url, prefix, LANE.key) == 0
        finally:
            await store.aclose()
    failed = [e for e in logs if e.get("where") == "slots_redis.renew"]
    assert failed
    assert all(e["decision"] == "retry_next_renewal" for e in failed)
    events = [e["event"] for e in logs]
    assert events.count("slot.lease_restored") == 1
    assert events.count("slot.lease_lost") == 0
