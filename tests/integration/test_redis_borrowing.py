"""Borrowing guards on a real Redis shared by two replicas: a borrower and the lender's own
request exclude each other on an endpoint in one atomic step, and a reservation made on one
replica keeps the other replica's borrowers out (gateway/request/borrowing.py, Limit.guards)."""

from __future__ import annotations

import asyncio

from gateway.core.slots import Limit
from gateway.observe.metrics import Metrics
from gateway.settings import StateSettings
from gateway.slots.redis_store import RedisSlotStore

LANE_FAST, LANE_HEAVY = Limit("lane:fast", 100), Limit("lane:heavy", 4)
BORROW = Limit("borrow:heavy:h", 4, guards=("ep:heavy:h", "reserve:heavy:h"))
OWN = Limit("ep:heavy:h", 4, guards=("borrow:heavy:h",))


def store(url: str, prefix: str) -> RedisSlotStore:
    spec = StateSettings.model_validate(
        {"backend": "redis", "redis_url": url, "key_prefix": prefix, "redis_timeout_s": 5.0}
    )
    return RedisSlotStore.from_settings(spec, Metrics())


async def test_guards_and_reservations_hold_across_replicas(redis_url: str, prefix: str) -> None:
    one, two = store(redis_url, prefix), store(redis_url, prefix)
    try:
        assert await one.try_acquire("b1", LANE_FAST, [BORROW]) == 0
        # The other replica's monster cannot enter while a borrower runs there...
        assert await two.try_acquire("m1", LANE_HEAVY, [OWN]) is None
        # ...and once it reserves the endpoint, no borrower of either replica enters.
        await two.reserve("m1", "reserve:heavy:h")
        assert await one.try_acquire("b2", LANE_FAST, [BORROW]) is None
        assert await two.try_acquire("b3", LANE_FAST, [BORROW]) is None
        assert (await one.in_use(["reserve:heavy:h"]))["reserve:heavy:h"] == 1
        await one.release("b1", ["lane:fast", "borrow:heavy:h"])
        assert await two.try_acquire("m1", LANE_HEAVY, [OWN]) == 0
        await two.release("m1", ["reserve:heavy:h"])
        # The lender's own request runs there: still no borrower.
        assert await one.try_acquire("b2", LANE_FAST, [BORROW]) is None
        # An unguarded candidate after a guarded one is still taken (index 1).
        assert await one.try_acquire("b2", LANE_FAST, [BORROW, Limit("ep:fast:f", 2)]) == 1
        await two.release("m1", ["lane:heavy", "ep:heavy:h"])
        assert await one.try_acquire("b4", LANE_FAST, [BORROW]) == 0
    finally:
        await asyncio.gather(one.aclose(), two.aclose())
