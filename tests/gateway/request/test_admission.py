from __future__ import annotations

import asyncio

import pytest

from engine_pool.cluster import EngineState, EngineView
from gateway.core.slots import Limit
from gateway.errors import Overloaded, QueueTimeout
from gateway.observe.log import get_logger
from gateway.observe.metrics import Metrics
from gateway.request import admission as admission_module
from gateway.request.admission import Admission
from gateway.settings import LaneSettings
from gateway.slots.store import MemorySlotStore
from tests.support.waiting import wait_for


def lane(**overrides: object) -> LaneSettings:
    spec: dict[str, object] = {
        "name": "fast",
        "max_prompt_tokens": 100,
        "clusters": ["c"],
        "slots": {"lane": 2, "per_endpoint": 2},
        "queue": {"depth": 10, "max_wait_s": 5},
    }
    spec.update(overrides)
    return LaneSettings.model_validate(spec)


VIEWS = [
    EngineView("c", "http://a", EngineState.UP, 0),
    EngineView("c", "http://b", EngineState.UP, 0),
]


def admission() -> Admission:
    return Admission(MemorySlotStore(), Metrics(), get_logger("test"))


async def test_memory_store_is_all_or_nothing_and_idempotent() -> None:
    store = MemorySlotStore()
    lane_limit = Limit("lane:x", 2)
    assert await store.try_acquire("t1", lane_limit, [Limit("ep:a", 1)]) == 0
    assert await store.try_acquire("t1", lane_limit, [Limit("ep:a", 1)]) == 0  # same token
    assert await store.try_acquire("t2", lane_limit, [Limit("ep:a", 1)]) is None
    assert (await store.in_use(["lane:x"]))["lane:x"] == 1  # nothing half-taken
    assert await store.try_acquire("t2", lane_limit, [Limit("ep:a", 1), Limit("ep:b", 1)]) == 1
    await store.release("t1", ["lane:x", "ep:a"])
    await store.release("t1", ["lane:x", "ep:a"])
    assert await store.in_use(["lane:x", "ep:a", "ep:b"]) == {"lane:x": 1, "ep:a": 0, "ep:b": 1}


async def test_waiters_are_served_in_arrival_order() -> None:
    adm, spec = admission(), lane(slots={"lane": 1, "per_endpoint": 1})
    order: list[int] = []
    gate = asyncio.Event()  # the first user holds the slot until everyone else is queued

    async def user(i: int) -> None:
        async with adm.slot(spec, lambda: VIEWS, f"t{i}"):
            order.append(i)
            await gate.wait()

    tasks = [asyncio.create_task(user(0))]
    await wait_for(lambda: order, 1, what="the first user holding the slot")
    for i in range(1, 6):
        tasks.append(asyncio.create_task(user(i)))
        await wait_for(lambda: adm.queue_depth("fast") == len(tasks) - 1, 1, what="queued")
    gate.set()
    await asyncio.gather(*tasks)
    assert order == list(range(6))
    assert adm.queue_depth("fast") == 0


async def test_full_queue_and_reject_policy_answer_overloaded() -> None:
    adm = admission()
    spec = lane(slots={"lane": 1, "per_endpoint": 1}, queue={"depth": 1, "max_wait_s": 5})
    async with adm.slot(spec, lambda: VIEWS, "a"):
        waiter = asyncio.create_task(adm.slot(spec, lambda: VIEWS, "b").__aenter__())
        await wait_for(lambda: adm.queue_depth("fast") == 1, 1, what="b queued")
        with pytest.raises(Overloaded, match="queue is full"):
            async with adm.slot(spec, lambda: VIEWS, "c"):
                pass
        waiter.cancel()
    await wait_for(lambda: adm.queue_depth("fast") == 0, 1, what="b gone from the queue")
    rejecting = lane(slots={"lane": 1, "per_endpoint": 1}, on_full="reject")
    async with adm.slot(rejecting, lambda: VIEWS, "d"):
        with pytest.raises(Overloaded, match="is full"):
            async with adm.slot(rejecting, lambda: VIEWS, "e"):
                pass


async def test_queue_wait_is_bounded() -> None:
    adm = admission()
    spec = lane(slots={"lane": 1, "per_endpoint": 1}, queue={"depth": 5, "max_wait_s": 0.1})
    async with adm.slot(spec, lambda: VIEWS, "a"):
        with pytest.raises(QueueTimeout) as info:
            async with adm.slot(spec, lambda: VIEWS, "b"):
                pass
    assert info.value.headers()["retry-after"] == "1"


async def test_a_cancelled_waiter_leaves_the_queue_and_never_takes_a_slot() -> None:
    adm = admission()
    spec = lane(slots={"lane": 1, "per_endpoint": 1})
    got: list[str] = []

    async def user(token: str) -> None:
        async with adm.slot(spec, lambda: VIEWS, token):
            got.append(token)

    async with adm.slot(spec, lambda: VIEWS, "holder"):
        waiter = asyncio.create_task(user("leaver"))
        await wait_for(lambda: adm.queue_depth("fast") == 1, 1, what="the leaver queued")
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert adm.queue_depth("fast") == 0
    assert got == []
    assert (await adm.store.in_use(["lane:fast"]))["lane:fast"] == 0


async def test_slots_are_released_when_the_body_raises() -> None:
    adm = admission()
    with pytest.raises(RuntimeError):
        async with adm.slot(lane(), lambda: VIEWS, "x"):
            raise RuntimeError("boom")
    assert (await adm.store.in_use(["lane:fast"]))["lane:fast"] == 0


async def test_a_cancelled_slot_holder_gives_its_slots_back() -> None:
    # A client that leaves while its request holds the slot: the holder is cancelled.
    adm = admission()
    spec = lane(slots={"lane": 1, "per_endpoint": 1})
    holding = asyncio.Event()

    async def holder() -> None:
        async with adm.slot(spec, lambda: VIEWS, "holder"):
            holding.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(holder())
    await asyncio.wait_for(holding.wait(), 1)
    assert (await adm.store.in_use(["lane:fast"]))["lane:fast"] == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await adm.store.in_use(["lane:fast", "ep:c:http://a"]) == {
        "lane:fast": 0,
        "ep:c:http://a": 0,
    }
    async with adm.slot(spec, lambda: VIEWS, "next") as grant:  # and the next one gets it
        assert grant.url == "http://a"


async def test_down_endpoints_are_not_candidates_and_per_endpoint_limits_hold() -> None:
    adm = admission()
    spec = lane(slots={"lane": 10, "per_endpoint": 1}, queue={"depth": 5, "max_wait_s": 0.05})
    async with (
        adm.slot(spec, lambda: VIEWS, "a") as first,
        adm.slot(spec, lambda: VIEWS, "b") as second,
    ):
        assert {first.url, second.url} == {"http://a", "http://b"}
        with pytest.raises(QueueTimeout):
            async with adm.slot(spec, lambda: VIEWS, "c"):
                pass


async def test_a_waiter_holding_for_its_home_does_not_hold_the_queue_behind_it() -> None:
    """With ``prefix_hold_tokens`` a waiter that asks only for its full home a (the chain
    dropped b, ``engine_pool/chain.py _hold``) holds in the queue; one behind it whose chain
    offers b, which has room, takes b at once instead of waiting behind it. It never takes what
    the head waits for: a third one asking for a or b waits, and when a frees, the head gets
    it (the third only once the others leave). Without the setting the queue stays FIFO: the
    one behind waits for the head."""
    views = {u: EngineView("c", u, EngineState.UP, 0) for u in ("http://a", "http://b")}
    home, other = [views["http://a"]], [views["http://b"]]

    async def run(spec: LaneSettings) -> list[str]:
        adm, got = admission(), []
        release = asyncio.Event()

        async def user(token: str, candidates: list[EngineView]) -> None:
            try:
                async with adm.slot(spec, lambda: candidates, token) as held:
                    got.append(f"{token}@{held.url[-1]}")
                    await release.wait()
            except QueueTimeout:
                got.append(f"{token}:timeout")

        async with adm.slot(spec, lambda: home, "resident"):
            head = asyncio.create_task(user("head", home))
            await wait_for(lambda: adm.queue_depth("fast") == 1, 1, what="head queued")
            behind = asyncio.create_task(user("behind", other))
            third = asyncio.create_task(user("third", home + other))
            await asyncio.sleep(0.3)
        await asyncio.sleep(0.3)
        release.set()
        await asyncio.gather(head, behind, third)
        return got

    spec = {"slots": {"lane": 4, "per_endpoint": 1}, "queue": {"depth": 5, "max_wait_s": 1}}
    passed = await run(lane(prefix_hold_tokens=0, **spec))
    assert passed[:2] == ["behind@b", "head@a"] and passed[2].startswith("third@")  # once freed
    fifo = await run(lane(**spec))
    assert fifo[:2] == ["head@a", "behind@b"] and fifo[2].startswith("third@")


async def test_a_lanes_queue_and_drain_meter_are_made_once_not_a_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[object] = []

    class Counted(admission_module.DrainMeter):
        __slots__ = ()

        def __init__(self) -> None:
            made.append(self)
            super().__init__()

    monkeypatch.setattr(admission_module, "DrainMeter", Counted)
    adm = admission()
    for token in ("a", "b", "c"):
        async with adm.slot(lane(), lambda: VIEWS, token):
            pass
    assert len(made) == 1
    assert adm.drain_rate("fast") > 0  # the one meter counted all three grants
