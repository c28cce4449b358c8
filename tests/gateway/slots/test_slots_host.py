"""The supervisor's slot server (gateway/slots/host_server.py) and the workers' client
(host.py): one table for every worker of a host, exact limits, and a worker's slots back the
moment its connection ends, kill -9 included."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.core.slots import Limit
from gateway.errors import StateUnavailable
from gateway.slots.host import HostSlotStore
from gateway.slots.host_server import SlotServer
from tests.support.checkout import ROOT, checkout_env
from tests.support.waiting import wait_for

LANE = Limit("lane:fast", 3)
EP_A, EP_B = Limit("ep:c:a", 2), Limit("ep:c:b", 2)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[SlotServer]:
    slot_server = SlotServer(tmp_path / "slots.sock")
    await slot_server.start()
    try:
        yield slot_server
    finally:
        await slot_server.aclose()


async def test_two_workers_share_one_exact_limit(server: SlotServer) -> None:
    a, b = HostSlotStore(server.path, 0), HostSlotStore(server.path, 1)
    try:
        grants = await asyncio.gather(
            *(s.try_acquire(f"t{i}", LANE, [EP_A, EP_B]) for i, s in enumerate([a, b] * 4))
        )
        assert sorted(g for g in grants if g is not None) == [0, 0, 1]
        assert (await b.in_use([LANE.key]))[LANE.key] == 3
        for i, s in enumerate([a, b] * 4):
            await s.release(f"t{i}", [LANE.key, EP_A.key, EP_B.key])

        async def released() -> bool:
            # Releases expect no answer: each connection's lines apply in order, and two
            # connections' in the order they reach the server.
            return await a.in_use([LANE.key, EP_A.key]) == {LANE.key: 0, EP_A.key: 0}

        await wait_for(released, 5, what="every release applied")
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_closed_connection_gives_its_slots_back(server: SlotServer) -> None:
    a, b = HostSlotStore(server.path, 0), HostSlotStore(server.path, 1)
    await a.try_acquire("t1", LANE, [EP_A])
    await a.try_acquire("t2", LANE, [EP_A])
    assert (await b.in_use([LANE.key]))[LANE.key] == 2
    await a.aclose()

    async def held() -> int:
        return (await b.in_use([LANE.key]))[LANE.key]

    await wait_for(lambda: _zero(held), 5, what="the closed worker's slots reclaimed")
    await b.aclose()


async def _zero(held: object) -> bool:
    assert callable(held)
    return bool(await held() == 0)


HOLDER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from gateway.core.slots import Limit
    from gateway.slots.host import HostSlotStore

    async def main():
        store = HostSlotStore(Path(sys.argv[1]), 7)
        lane, endpoint = Limit("lane:fast", 3), Limit("ep:c:a", 3)
        for i in range(3):
            assert await store.try_acquire(f"k{i}", lane, [endpoint]) == 0
        print("held", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
    """
)


async def test_a_worker_killed_with_sigkill_leaks_no_slot(server: SlotServer) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(server.path)],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env=checkout_env(),
    )
    watcher = HostSlotStore(server.path, 0)
    try:
        assert holder.stdout is not None
        line = await asyncio.to_thread(holder.stdout.readline)
        assert line == b"held\n"
        assert (await watcher.in_use([LANE.key]))[LANE.key] == 3
        # The lane is full for everyone else while the holder lives.
        assert await watcher.try_acquire("mine", LANE, [EP_A]) is None
        holder.send_signal(signal.SIGKILL)
        holder.wait(5)

        async def freed() -> bool:
            return (await watcher.in_use([LANE.key, "ep:c:a"])) == {LANE.key: 0, "ep:c:a": 0}

        await wait_for(freed, 5, what="the killed worker's 3 slots came back")
        assert await watcher.try_acquire("mine", LANE, [EP_A]) == 0
    finally:
        holder.kill()
        holder.communicate()
        await watcher.aclose()


SERVER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from gateway.slots.host_server import SlotServer

    async def main():
        await SlotServer(Path(sys.argv[1])).start()
        print("serving", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
    """
)


async def test_a_killed_supervisor_is_a_503_and_tells_the_worker(tmp_path: Path) -> None:
    path = tmp_path / "slots.sock"
    supervisor = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(path)],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env=checkout_env(),
    )
    lost = asyncio.Event()
    store = HostSlotStore(path, 0, timeout_s=0.5, on_lost=lost.set)
    try:
        assert supervisor.stdout is not None
        assert await asyncio.to_thread(supervisor.stdout.readline) == b"serving\n"
        assert await store.try_acquire("t1", LANE, [EP_A]) == 0
        supervisor.send_signal(signal.SIGKILL)
        await asyncio.wait_for(lost.wait(), 5)
        with pytest.raises(StateUnavailable, match="went away"):
            await store.try_acquire("t2", LANE, [EP_A])
    finally:
        supervisor.kill()
        supervisor.communicate()
        await store.aclose()


async def test_no_server_at_all_is_a_503(tmp_path: Path) -> None:
    store = HostSlotStore(tmp_path / "nothing.sock", 0)
    with pytest.raises(StateUnavailable, match="slot server"):
        await store.try_acquire("t1", LANE, [EP_A])


async def test_borrowing_guards_and_reservations_hold_across_workers(server: SlotServer) -> None:
    """The same mutual exclusion as MemorySlotStore and the Redis scripts: a borrower's slot on
    a lender's endpoint is guarded by the endpoint's own-lane key and its reservation key, a
    lender's own request by the borrowers' key; a reservation dies with its worker."""
    own, borrow, reserve = "ep:heavy:h1", "borrow:heavy:h1", "reserve:heavy:h1"
    heavy_lane, fast_lane = Limit("lane:heavy", 4), Limit("lane:fast", 8)
    as_borrower = Limit(borrow, 4, (own, reserve))
    as_owner = Limit(own, 4, (borrow,))
    a, b = HostSlotStore(server.path, 0), HostSlotStore(server.path, 1)
    try:
        assert await a.try_acquire("small", fast_lane, [as_borrower]) == 0
        # Worker b's monster may not enter beside worker a's borrower.
        assert await b.try_acquire("monster", heavy_lane, [as_owner]) is None
        await b.reserve("monster", reserve)
        # While reserved, no new borrower enters, from either worker.
        assert await a.try_acquire("small2", fast_lane, [as_borrower]) is None
        await a.release("small", [fast_lane.key, borrow])
        assert await b.try_acquire("monster", heavy_lane, [as_owner]) == 0
        await b.release("monster", [reserve])
        await b.aclose()  # worker b's connection ends: its slots and reservation go with it

        async def freed() -> bool:
            counts = await a.in_use([own, reserve, heavy_lane.key])
            return counts == {own: 0, reserve: 0, heavy_lane.key: 0}

        await wait_for(freed, 5, what="worker b's slots reclaimed")
        assert await a.try_acquire("small3", fast_lane, [as_borrower]) == 0
    finally:
        await a.aclose()
        await b.aclose()
