"""The ``SlotStore`` contract (gateway/slots/store.py), one suite run by every store.

    memory   MemorySlotStore: one process, every client is the same store
    host     HostSlotStore clients of a real SlotServer on a unix socket (serve --workers N)
    redis    RedisSlotStore replicas on the real Redis, a key prefix of their own per test

A test asks ``backend.client()`` for a store; a second call gives another client of the same
slots (another worker, another replica; the same store in memory), so limits are shown to hold
across clients, not just inside one. What a store promises beyond the protocol (Redis's degraded
modes and data-loss epoch, the host's worker reclaim on kill -9, the shared waiting order) is in
its own tests: tests/integration/test_redis_*.py and tests/gateway/slots/test_slots_host.py.

Where one store cannot honour a point of the contract because the point does not exist for it
(memory has no lease to lose), that one parametrization is skipped with the reason.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gateway.core.slots import Limit
from gateway.observe.metrics import Metrics
from gateway.settings import StateSettings
from gateway.slots.host import HostSlotStore
from gateway.slots.host_server import SlotServer
from gateway.slots.redis_store import RedisSlotStore
from gateway.slots.store import MemorySlotStore, SlotStore
from tests.integration.redis_support import delete_prefix, new_prefix, shared_or_own_redis
from tests.support.waiting import wait_for

# Short, so that a lapsed lease is seen in about a second; long enough that no lease lapses by
# itself inside a test that does not wait for it (each runs in milliseconds).
TTL_S = 1.0

LANE = Limit("lane:fast", 3)
EP_A, EP_B, EP_C = Limit("ep:c:a", 1), Limit("ep:c:b", 2), Limit("ep:c:c", 5)
KEYS = [LANE.key, EP_A.key, EP_B.key, EP_C.key]

NO_LEASE = (
    "memory: one process; a slot cannot outlive its holder, so there is no lease to lose "
    "(its only way out is release, tested above)"
)


class Backend:
    """The shared slots of one store kind; ``client()`` opens another client of them."""

    def __init__(self, kind: str, tmp: Path, redis_url: str | None) -> None:
        self.kind = kind
        self._tmp = tmp
        self._redis_url = redis_url
        self._prefix = new_prefix()
        self._memory = MemorySlotStore()
        self._server: SlotServer | None = None
        self._clients: list[SlotStore] = []

    async def client(self) -> SlotStore:
        store: SlotStore
        if self.kind == "memory":
            return self._memory
        if self.kind == "host":
            if self._server is None:
                self._server = SlotServer(self._tmp / "slots.sock")
                await self._server.start()
            host = HostSlotStore(self._server.path, worker=len(self._clients))
            await host.connect()
            store = host
        else:
            assert self._redis_url is not None
            state = StateSettings.model_validate(
                {
                    "backend": "redis",
                    "redis_url": self._redis_url,
                    "key_prefix": self._prefix,
                    "lease_ttl_s": TTL_S,
                    # The rules, not the call bound: a loaded CI machine may delay a call.
                    "redis_timeout_s": 5.0,
                }
            )
            store = RedisSlotStore.from_settings(state, Metrics())
        self._clients.append(store)
        return store

    async def lose(self, store: SlotStore) -> None:
        """What ends a holder that never released: Redis, its renewals stop (nothing to do: the
        lease lapses within a TTL); host, its worker's connection closes."""
        if self.kind == "host":
            await store.aclose()

    async def aclose(self) -> None:
        for store in self._clients:
            await store.aclose()
        await self._memory.aclose()
        if self._server is not None:
            await self._server.aclose()
        if self._redis_url is not None:
            delete_prefix(self._redis_url, self._prefix)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with shared_or_own_redis() as url:
        yield url


@pytest.fixture(params=["memory", "host", "redis"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    # A unix socket path must stay under ~107 bytes: not under pytest's long tmp_path.
    tmp = Path(tempfile.mkdtemp(prefix="sg-conform-"))
    made = Backend(request.param, tmp, url)
    try:
        yield made
    finally:
        await made.aclose()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
async def store(backend: Backend) -> SlotStore:
    return await backend.client()


async def counts(store: SlotStore, keys: list[str] = KEYS) -> list[int]:
    got = await store.in_use(keys)
    assert list(got) == keys  # every key asked, in order
    return [got[key] for key in keys]


# -- try_acquire: limits, order, all or nothing -------------------------------------------------


async def test_the_lane_limit_bounds_grants(store: SlotStore) -> None:
    lane = Limit("lane:two", 2)
    assert await store.try_acquire("t1", lane, [EP_C]) == 0
    assert await store.try_acquire("t2", lane, [EP_C]) == 0
    assert await store.try_acquire("t3", lane, [EP_C]) is None  # room on C, none in the lane
    assert await counts(store, [lane.key, EP_C.key]) == [2, 2]


async def test_each_candidate_limit_bounds_it_and_the_first_with_room_is_taken(
    store: SlotStore,
) -> None:
    lane = Limit("lane:wide", 10)
    assert await store.try_acquire("t1", lane, [EP_A, EP_B]) == 0
    assert await store.try_acquire("t2", lane, [EP_A, EP_B]) == 1  # A is full
    assert await store.try_acquire("t3", lane, [EP_A, EP_B]) == 1
    assert await store.try_acquire("t4", lane, [EP_A, EP_B]) is None  # both full
    # All or nothing: the refused request holds no lane slot either.
    assert await counts(store, [lane.key, EP_A.key, EP_B.key]) == [3, 1, 2]


async def test_candidates_are_taken_in_the_order_given(store: SlotStore) -> None:
    assert await store.try_acquire("t1", LANE, [EP_C, EP_A]) == 0
    assert await store.try_acquire("t2", LANE, [EP_B, EP_C]) == 0
    assert await counts(store) == [2, 0, 1, 1]


async def test_a_full_or_empty_candidate_list_takes_nothing(store: SlotStore) -> None:
    assert await store.try_acquire("t1", LANE, []) is None
    assert await store.try_acquire("t2", LANE, [Limit("ep:c:zero", 0)]) is None
    assert await counts(store) == [0, 0, 0, 0]


async def test_a_retried_acquire_reports_what_the_token_holds_and_takes_nothing(
    store: SlotStore,
) -> None:
    assert await store.try_acquire("t1", LANE, [EP_B, EP_C]) == 0
    # The same token again, its endpoint now second in line behind one with room.
    assert await store.try_acquire("t1", LANE, [EP_C, EP_B]) == 1
    assert await counts(store) == [1, 0, 1, 0]


async def test_grants_across_clients_share_one_limit(backend: Backend) -> None:
    one, two = await backend.client(), await backend.client()
    assert await one.try_acquire("t1", LANE, [EP_A, EP_B]) == 0
    assert await two.try_acquire("t2", LANE, [EP_A, EP_B]) == 1
    assert await two.try_acquire("t3", LANE, [EP_A, EP_B]) == 1
    assert await one.try_acquire("t4", Limit(LANE.key, 9), [EP_A, EP_B]) is None
    assert await counts(two) == [3, 1, 2, 0]


async def test_many_concurrent_acquirers_never_exceed_a_limit(backend: Backend) -> None:
    clients = [await backend.client(), await backend.client()]
    lane = Limit("lane:busy", 4)
    candidates = [EP_A, EP_B, EP_C]
    grants = await asyncio.gather(
        *(clients[i % 2].try_acquire(f"t{i}", lane, candidates) for i in range(24))
    )
    taken = [g for g in grants if g is not None]
    assert len(taken) == 4  # the lane's limit, exactly: room on C for more
    assert sorted(taken) == [0, 1, 1, 2]  # A's one slot, B's two, then C
    by_key = await clients[0].in_use([lane.key, EP_A.key, EP_B.key, EP_C.key])
    assert by_key == {lane.key: 4, EP_A.key: 1, EP_B.key: 2, EP_C.key: 1}


# -- release --------------------------------------------------------------------------------


async def test_release_frees_exactly_what_was_taken_and_is_idempotent(store: SlotStore) -> None:
    assert await store.try_acquire("t1", LANE, [EP_A]) == 0
    assert await store.try_acquire("t2", LANE, [EP_B]) == 0
    await store.release("t1", [LANE.key, EP_A.key])
    assert await counts(store) == [1, 0, 1, 0]
    await store.release("t1", [LANE.key, EP_A.key])  # again: nothing more
    await store.release("never", [LANE.key, EP_B.key])  # a token that holds nothing
    await store.release("t2", [EP_C.key])  # a key the token does not hold
    assert await counts(store) == [1, 0, 1, 0]
    # The room is back: A is free again.
    assert await store.try_acquire("t3", LANE, [EP_A]) == 0


async def test_a_release_from_another_client_frees_the_room(backend: Backend) -> None:
    one, two = await backend.client(), await backend.client()
    lane = Limit("lane:one", 1)
    assert await one.try_acquire("t1", lane, [EP_C]) == 0
    assert await two.try_acquire("t2", lane, [EP_C]) is None
    await one.release("t1", [lane.key, EP_C.key])

    async def granted() -> bool:
        return await two.try_acquire("t2", lane, [EP_C]) == 0

    await wait_for(granted, 5, what="the released lane slot, seen by the other client")


# -- move ---------------------------------------------------------------------------------------


async def test_move_gives_up_one_endpoint_and_takes_the_first_other_with_room(
    store: SlotStore,
) -> None:
    assert await store.try_acquire("t1", LANE, [EP_A]) == 0
    assert await store.try_acquire("other", LANE, [EP_B]) == 0
    assert await store.try_acquire("other2", LANE, [EP_B]) == 0  # B is full now
    assert await store.move("t1", LANE, EP_A.key, [EP_B, EP_C]) == 1
    # The lane slot kept, one endpoint slot held: never two.
    assert await counts(store) == [3, 0, 2, 1]
    await store.release("t1", [LANE.key, EP_C.key])
    assert await counts(store) == [2, 0, 2, 0]


async def test_move_with_no_room_keeps_the_lane_slot_only(store: SlotStore) -> None:
    assert await store.try_acquire("t1", LANE, [EP_A]) == 0
    assert await store.move("t1", LANE, EP_A.key, [Limit("ep:c:zero", 0)]) is None
    assert await counts(store) == [1, 0, 0, 0]
    # What it gave up is free for others.
    assert await store.try_acquire("t2", LANE, [EP_A]) == 0
    await store.release("t1", [LANE.key])
    assert await counts(store) == [1, 1, 0, 0]


# -- guards and reserve -------------------------------------------------------------------------


async def test_a_guard_keeps_out_while_another_token_holds_its_key(store: SlotStore) -> None:
    guard = "reserve:c:a"
    borrow = Limit("borrow:c:a", 5, guards=(guard,))
    await store.reserve("lender", guard)
    assert await counts(store, [guard]) == [1]
    await store.reserve("lender", guard)  # renewed, not counted twice
    assert await counts(store, [guard]) == [1]
    # The borrow key has room but its guard is held: the next candidate is taken.
    assert await store.try_acquire("b1", LANE, [borrow, EP_C]) == 1
    # The guard's own holder is not kept out by itself.
    assert await store.try_acquire("lender", LANE, [borrow]) == 0
    await store.release("lender", [guard, LANE.key, borrow.key])
    assert await counts(store, [guard]) == [0]
    assert await store.try_acquire("b2", LANE, [borrow, EP_C]) == 0


# -- hold and waiting ---------------------------------------------------------------------------


async def test_a_held_grant_outlives_its_lease_ttl(backend: Backend) -> None:
    holder, observer = await backend.client(), await backend.client()
    assert await holder.try_acquire("t1", LANE, [EP_A]) == 0
    async with holder.hold("t1", [LANE.key, EP_A.key]):
        # Past two lease TTLs: Redis renews; the others have no lease to run out.
        await asyncio.sleep(2.5 * TTL_S)
        assert await counts(observer) == [1, 1, 0, 0]
        assert await observer.try_acquire("t2", LANE, [EP_A]) is None
    await holder.release("t1", [LANE.key, EP_A.key])

    async def released() -> bool:
        return await counts(observer, KEYS[:2]) == [0, 0]

    await wait_for(released, 5, what="the released grant, seen by the other client")


async def test_a_request_cancelled_in_its_hold_is_cancelled_and_its_release_frees_all(
    store: SlotStore,
) -> None:
    entered = asyncio.Event()

    async def request() -> None:
        assert await store.try_acquire("t1", LANE, [EP_A]) == 0
        try:
            async with store.hold("t1", [LANE.key, EP_A.key]):
                entered.set()
                await asyncio.Event().wait()
        finally:
            await store.release("t1", [LANE.key, EP_A.key])

    task = asyncio.create_task(request())
    await asyncio.wait_for(entered.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await counts(store) == [0, 0, 0, 0]


async def test_waiting_yields_and_leaving_it_blocks_no_one(backend: Backend) -> None:
    waiter, newcomer = await backend.client(), await backend.client()
    lane = Limit("lane:one", 1)
    assert await newcomer.try_acquire("h", lane, [EP_C]) == 0
    async with waiter.waiting("w", lane.key) as place:
        assert place is None
        assert await waiter.try_acquire("w", lane, [EP_C]) is None  # full
        await newcomer.release("h", [lane.key, EP_C.key])

        async def granted() -> bool:
            return await waiter.try_acquire("w", lane, [EP_C]) == 0

        await wait_for(granted, 5, what="the waiter granted once the slot is free")
    await waiter.release("w", [lane.key, EP_C.key])
    # A waiter that gives up (cancelled in its waiting block) leaves its place too.
    entered = asyncio.Event()
    gave_up = asyncio.create_task(_wait_forever(waiter, "g", lane.key, entered))
    await asyncio.wait_for(entered.wait(), 5)
    gave_up.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gave_up

    async def newcomer_granted() -> bool:
        return await newcomer.try_acquire("n", lane, [EP_C]) == 0

    await wait_for(newcomer_granted, 5, what="a newcomer, with no waiter left ahead of it")


async def _wait_forever(store: SlotStore, token: str, lane: str, entered: asyncio.Event) -> None:
    async with store.waiting(token, lane):
        entered.set()
        await asyncio.Event().wait()


# -- disconnect mid-acquire and lease loss --------------------------------------------------------


@pytest.mark.parametrize("steps", [0, 1, 2, 3, 5, 8, 13, 21])
async def test_an_acquire_cancelled_midway_leaves_nothing_once_released(
    store: SlotStore, steps: int
) -> None:
    """The client left while its acquire was on the wire: the acquire ends cancelled (or
    granted, if it finished first), and the release admission then makes leaves nothing."""
    task = asyncio.create_task(store.try_acquire("t1", LANE, [EP_A, EP_B]))
    for _ in range(steps):
        await asyncio.sleep(0)
    task.cancel()
    try:
        index = await task
    except asyncio.CancelledError:
        index = None
    else:
        assert index == 0  # it finished before the cancellation: a grant, reported
    await store.release("t1", [LANE.key, EP_A.key, EP_B.key])
    assert await counts(store) == [0, 0, 0, 0]
    # And the room is whole: the lane's three slots.
    grants = [await store.try_acquire(f"n{i}", LANE, [EP_A, EP_B]) for i in range(4)]
    assert grants == [0, 1, 1, None]


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("memory", marks=pytest.mark.skip(reason=NO_LEASE)),
        "host",
        "redis",
    ],
    indirect=True,
)
async def test_a_lost_holder_gives_its_slots_back(backend: Backend) -> None:
    """Redis: a request whose hold ended without a release (killed, frozen) stops renewing and
    its lease lapses within a TTL. Host: the worker's connection closes. Either way the room is
    free again for everyone else, and what was lost is not brought back."""
    holder, observer = await backend.client(), await backend.client()
    lane = Limit("lane:one", 1)
    assert await holder.try_acquire("t1", lane, [EP_A]) == 0
    await holder.reserve("t1", "reserve:c:a")
    entered = asyncio.Event()

    async def request() -> None:
        async with holder.hold("t1", [lane.key, EP_A.key]):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(request())
    await asyncio.wait_for(entered.wait(), 5)
    task.cancel()  # killed: no release follows
    with pytest.raises(asyncio.CancelledError):
        await task
    await backend.lose(holder)

    async def lost() -> bool:
        return await counts(observer, [lane.key, EP_A.key, "reserve:c:a"]) == [0, 0, 0]

    await wait_for(lost, 3 * TTL_S + 2, what="the lost holder's slots back")
    # The room is free, and a guard on the lost reservation keeps no one out any more.
    borrow = Limit("borrow:c:a", 1, guards=("reserve:c:a",))
    assert await observer.try_acquire("t2", lane, [borrow]) == 0
