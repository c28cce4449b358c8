"""A replica promoted to primary carries the old epoch, and the leases it replicated may have
lapsed while no primary answered: the epoch names the server that wrote it (its run_id,
gateway/slots/lua.py), so the promoted replica starts a new epoch, new acquires wait out the
recovery grace and the holders re-establish their leases. On the old scripts the newcomer was
admitted beside the holder: two requests on a limit of one."""

from __future__ import annotations

import asyncio

import redis

from gateway.core.slots import Limit
from gateway.observe.metrics import Metrics
from gateway.settings import StateSettings
from gateway.slots.redis_store import RedisSlotStore
from tests.integration.redis_support import own_redis
from tests.support.waiting import wait_for

LANE = Limit("lane:m", 1)
ENDPOINT = Limit("ep:a", 1)
TTL_S = 1.0


def store_for(url: str, prefix: str) -> RedisSlotStore:
    spec = StateSettings.model_validate(
        {"backend": "redis", "redis_url": url, "key_prefix": prefix, "lease_ttl_s": TTL_S}
    )
    return RedisSlotStore.from_settings(spec, Metrics())


async def test_a_promoted_replica_with_lapsed_leases_admits_no_one_before_the_holder_returns(
    prefix: str,
) -> None:
    with own_redis() as primary, own_redis() as replica:
        raw = redis.Redis.from_url(replica.url, socket_timeout=2)
        raw.replicaof("127.0.0.1", primary.port)
        holder = store_for(primary.url, prefix)
        try:
            assert await holder.try_acquire("holder", LANE, [ENDPOINT]) == 0
            lane = "{" + prefix + "}:" + LANE.key
            await wait_for(lambda: raw.zcard(lane), 10, what="the lease replicated")
            primary.stop()
            await asyncio.sleep(TTL_S + 0.2)  # the outage outlasts the lease
            raw.replicaof("NO", "ONE")
            # The holder's replica follows the promotion (as its Sentinel client would).
            pool = holder._redis.client.connection_pool
            pool.connection_kwargs["port"] = replica.port
            await pool.disconnect()
            pool.reset()  # connections keep their address: new ones take the new port
            newcomer = store_for(replica.url, prefix)
            try:
                assert await newcomer.try_acquire("newcomer", LANE, [ENDPOINT]) is None
                assert await holder.renew("holder", [LANE.key, ENDPOINT.key]) is True
                await asyncio.sleep(TTL_S / 2 + 0.1)  # the recovery grace is over
                assert await newcomer.try_acquire("newcomer", LANE, [ENDPOINT]) is None
                assert await newcomer.in_use([LANE.key]) == {LANE.key: 1}
                await holder.release("holder", [LANE.key, ENDPOINT.key])
                assert await newcomer.try_acquire("newcomer", LANE, [ENDPOINT]) == 0
                await newcomer.release("newcomer", [LANE.key, ENDPOINT.key])
            finally:
                await newcomer.aclose()
        finally:
            raw.close()
            await holder.aclose()
