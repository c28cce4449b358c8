"""The lender's side of borrowing in the live admission (gateway/request/lending.py, owned by
gateway/request/admission.py), on the memory store: a lender's waiter reserves an endpoint for
its borrowers to drain, and the reservation goes when the waiter does."""

from __future__ import annotations

import pytest

from gateway.request.borrowing import loans_for
from tests.gateway.request.test_borrowing import one_heavy_engine


async def test_admission_reserves_for_the_lender_and_drops_the_reservation_when_it_leaves() -> None:
    import asyncio

    from engine_pool.cluster import EngineState, EngineView
    from gateway.core.slots import reserve_key
    from gateway.observe.log import get_logger
    from gateway.observe.metrics import Metrics
    from gateway.request.admission import Admission
    from gateway.request.slot import Want
    from gateway.slots.store import MemorySlotStore

    settings = one_heavy_engine(max_drain_s=60)
    fast, heavy = settings.lane("fast"), settings.lane("heavy")
    store = MemorySlotStore()
    adm = Admission(store, Metrics(), get_logger("test"))
    heavy_view = EngineView("heavy", "http://127.0.0.1:9201", EngineState.UP, 0)
    loans = loans_for(fast, settings.lanes, 1000, 64)
    want = Want(loans=loans, lent=lambda: [(heavy_view, loans[0])])
    entered = asyncio.Event()
    leave = asyncio.Event()

    async def borrower() -> None:
        async with adm.slot(fast, lambda: [], "b1", want=want) as held:
            assert held.grant.lender == "heavy" and held.cluster == "heavy"
            entered.set()
            await leave.wait()

    async def monster(token: str) -> None:
        async with adm.slot(heavy, lambda: [heavy_view], token) as held:
            assert held.grant.lender is None

    lent = asyncio.create_task(borrower())
    await entered.wait()
    waiting = asyncio.create_task(monster("m1"))
    key = reserve_key("heavy", heavy_view.url)
    for _ in range(100):
        if adm.reserved():
            break
        await asyncio.sleep(0.01)
    assert list(adm.reserved()) == [f"ep:heavy:{heavy_view.url}"]
    assert (await store.in_use([key]))[key] == 1
    # No new borrower while the monster waits: it stays in the fast lane's queue.
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            async with adm.slot(fast, lambda: [], "b2", want=want):
                pass
    waiting.cancel()  # the monster's client left: its reservation goes with it
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert adm.reserved() == {} and (await store.in_use([key]))[key] == 0
    async with adm.slot(fast, lambda: [], "b3", want=want) as again:
        assert again.grant.lender == "heavy"
    # The monster that stays is granted as soon as the borrower leaves.
    staying = asyncio.create_task(monster("m2"))
    await asyncio.sleep(0.1)
    assert not staying.done()
    leave.set()
    await asyncio.wait_for(asyncio.gather(lent, staying), 5)
