"""RedisSlotStore against a real Redis: limits, all-or-nothing, idempotence, reaping, renewal,
and arrival order across replicas."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from engine_pool.cluster import EngineState, EngineView
from gateway.core.slots import Limit
from gateway.errors import StateUnavailable
from gateway.observe.log import get_logger
from gateway.observe.metrics import Metrics
from gateway.request.admission import Admission
from gateway.settings import LaneSettings, StateSettings
from gateway.slots.redis_store import RedisSlotStore
from tests.integration.redis_support import delete_prefix, live_members, new_prefix
from tests.support.waiting import wait_for

LANE = Limit("lane:m", 3)
ENDPOINTS = {"ep:a": 2, "ep:b": 1, "ep:c": 2}
TOKENS = [f"t{i}" for i in range(6)]
REPLICA = {token: i % 2 for i, token in enumerate(TOKENS)}
ALL_KEYS = [LANE.key, *ENDPOINTS]
# Short enough that a lease's deadline is a figure the model checks (now + TTL after an acquire
# or a renewal), long enough that no lease lapses by itself within one hypothesis example.
TTL_S = 5.0
TTL_MS = int(TTL_S * 1000)


def store_for(url: str, prefix: str, **state: object) -> RedisSlotStore:
    # These tests check the lease rules, not the call bound: a Redis call delayed past the
    # default 0.5 s by a loaded CI machine (two cores, the suite in parallel) must not read as an
    # outage (tests/integration/test_redis_outage.py owns the bound).
    state.setdefault("redis_timeout_s", 5.0)
    spec = StateSettings.model_validate(
        {"backend": "redis", "redis_url": url, "key_prefix": prefix, **state}
    )
    return RedisSlotStore.from_settings(spec, Metrics())


class LeaseModel(RuleBasedStateMachine):
    """Two replicas' stores against a plain-Python model of the same rules, waiting list
    included. Each token belongs to one replica, as a request does."""

    url = ""

    def __init__(self) -> None:
        super().__init__()
        self.runner = asyncio.Runner()
        self.prefix = new_prefix()
        self.stores = [store_for(self.url, self.prefix, lease_ttl_s=TTL_S) for _ in range(2)]
        self.raw = redis.Redis.from_url(self.url)
        self.held: dict[str, str] = {}  # token -> endpoint key it holds with the lane
        self.queue: list[str] = []
        self.frozen: dict[str, str] = {}  # token -> endpoint of a lease left to expire
        self.deadline: dict[str, int] = {}  # token -> earliest its lease may end (Redis ms)

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.runner.run(coro)

    def key(self, name: str) -> str:
        return "{" + self.prefix + "}:" + name

    def store(self, token: str) -> RedisSlotStore:
        return self.stores[REPLICA[token]]

    def count(self, key: str) -> int:
        return sum(1 for ep in self.held.values() if key in (LANE.key, ep))

    @rule(
        tokens=st.lists(st.sampled_from(TOKENS), min_size=1, max_size=4),
        order=st.permutations(sorted(ENDPOINTS)),
        take=st.integers(1, 3),
    )
    def acquire_in_turn(self, tokens: list[str], order: list[str], take: int) -> None:
        for token in tokens:
            self.acquire(token, order, take)

    def acquire(self, token: str, order: list[str], take: int) -> None:
        candidates = [Limit(key, ENDPOINTS[key]) for key in order[:take]]
        sent = redis_now_ms(self.raw)
        got = self.run(self.store(token).try_acquire(token, LANE, candidates))
        expected: int | None = None
        if token in self.held:
            keys = [c.key for c in candidates]
            if self.held[token] in keys:
                expected = keys.index(self.held[token])
        else:
            free = LANE.limit - len(self.held)
            before = self.queue[: self.queue.index(token)] if token in self.queue else self.queue
            ahead = sum(1 for other in before if REPLICA[other] != REPLICA[token])
            if free > 0 and ahead < free:
                for i, c in enumerate(candidates):
                    if self.count(c.key) < c.limit:
                        expected = i
                        break
            if expected is not None:
                self.held[token] = candidates[expected].key
                self.deadline[token] = sent + TTL_MS
                self.frozen.pop(token, None)
                if token in self.queue:
                    self.queue.remove(token)
        assert got == expected

    @rule(token=st.sampled_from(TOKENS), twice=st.booleans())
    def release(self, token: str, twice: bool) -> None:
        for _ in range(2 if twice else 1):
            self.run(self.store(token).release(token, ALL_KEYS))
        self.held.pop(token, None)

    @rule(token=st.sampled_from(TOKENS), left_ms=st.integers(50, TTL_MS // 2))
    def renew(self, token: str, left_ms: int) -> None:
        """A live lease is extended to now + TTL; a reaped one (its holder froze) is never
        brought back."""
        endpoint = self.held.get(token) or self.frozen.pop(token, None) or "ep:a"
        before = redis_now_ms(self.raw)
        if token in self.held:  # time passed: the lease has only ``left_ms`` to live
            for key in (LANE.key, endpoint):
                self.raw.zadd(self.key(key), {token: before + left_ms}, xx=True)
        alive = self.run(self.store(token).renew(token, [LANE.key, endpoint]))
        assert alive is (token in self.held)
        if alive:
            self.deadline[token] = before + TTL_MS

    @rule(token=st.sampled_from(TOKENS))
    def freeze_and_expire(self, token: str) -> None:
        """The holder stopped renewing and its deadline passed: the lease must be reaped."""
        for key in ALL_KEYS:
            self.raw.zadd(self.key(key), {token: 1}, xx=True)
        endpoint = self.held.pop(token, None)
        if endpoint is not None:
            self.frozen[token] = endpoint

    @rule(token=st.sampled_from(TOKENS))
    def join_queue(self, token: str) -> None:
        joined = self.run(self.store(token).join(token, LANE.key))
        assert joined is (token not in self.queue)
        if token not in self.queue:
            self.queue.append(token)

    @rule(token=st.sampled_from(TOKENS))
    def refresh_place(self, token: str) -> None:
        """A refresh keeps a live place and never puts back one that is gone."""
        kept = self.run(self.store(token).join(token, LANE.key, mode="refresh"))
        assert kept is (token in self.queue)

    @rule(token=st.sampled_from(TOKENS))
    def leave_queue(self, token: str) -> None:
        self.run(self.store(token).leave(token, LANE.key))
        if token in self.queue:
            self.queue.remove(token)

    @invariant()
    def redis_agrees_with_the_model_and_no_limit_is_exceeded(self) -> None:
        used = self.run(self.stores[0].in_use(ALL_KEYS))
        assert used[LANE.key] == len(self.held) <= LANE.limit
        for key, limit in ENDPOINTS.items():
            assert used[key] == self.count(key) <= limit
        live = live_members_by_key(self.raw, self.prefix)
        for token in TOKENS:  # all or nothing: the lane slot exactly when one endpoint slot
            holds = [k for k in ALL_KEYS if token in live[k]]
            assert holds == ([LANE.key, self.held[token]] if token in self.held else [])
        now = redis_now_ms(self.raw)
        leases = [(token, key) for token, ep in self.held.items() for key in (LANE.key, ep)]
        pipe = self.raw.pipeline(transaction=False)
        for token, key in leases:
            pipe.zscore(self.key(key), token)
        for (token, _), score in zip(leases, pipe.execute(), strict=True):
            # Each lease runs to the now + TTL of its last acquire or renewal.
            assert score is not None and self.deadline[token] <= score <= now + TTL_MS

    def teardown(self) -> None:
        for store in self.stores:
            self.run(store.aclose())
        self.runner.close()
        self.raw.close()
        delete_prefix(self.url, self.prefix)


def redis_now_ms(raw: redis.Redis) -> int:
    secs, micros = raw.time()
    return int(secs * 1000 + micros // 1000)


def live_members_by_key(raw: redis.Redis, prefix: str) -> dict[str, set[str]]:
    now_ms = redis_now_ms(raw)
    pipe = raw.pipeline(transaction=False)
    for key in ALL_KEYS:
        pipe.zrangebyscore("{" + prefix + "}:" + key, f"({now_ms}", "+inf")
    found = pipe.execute()
    return {
        key: {m.decode() for m in members} for key, members in zip(ALL_KEYS, found, strict=True)
    }


def test_the_store_follows_the_lease_rules(redis_url: str) -> None:
    LeaseModel.url = redis_url
    run_state_machine_as_test(
        LeaseModel, settings=settings(max_examples=50, stateful_step_count=30, deadline=None)
    )


async def test_an_acquire_purges_expired_leases_before_it_counts(
    redis_url: str, prefix: str
) -> None:
    store = store_for(redis_url, prefix, lease_ttl_s=TTL_S)
    raw = redis.Redis.from_url(redis_url)
    try:
        full = Limit(LANE.key, 1)
        assert await store.try_acquire("dead", full, [Limit("ep:a", 1)]) == 0
        assert await store.try_acquire("next", full, [Limit("ep:a", 1)]) is None  # full
        for key in (LANE.key, "ep:a"):  # its holder stopped renewing long ago
            raw.zadd("{" + prefix + "}:" + key, {"dead": 1}, xx=True)
        assert await store.try_acquire("next", full, [Limit("ep:a", 1)]) == 0
        assert await store.in_use([LANE.key, "ep:a"]) == {LANE.key: 1, "ep:a": 1}
    finally:
        raw.close()
        await store.aclose()


async def test_an_unrenewed_lease_is_reaped_and_a_held_one_is_not(
    redis_url: str, prefix: str
) -> None:
    store = store_for(redis_url, prefix, lease_ttl_s=0.3)
    try:
        assert await store.try_acquire("gone", LANE, [Limit("ep:a", 1)]) == 0
        assert await store.try_acquire("kept", LANE, [Limit("ep:b", 1)]) == 0
        started = time.monotonic()
        async with store.hold("kept", [LANE.key, "ep:b"]):
            while (await store.in_use(["ep:a"]))["ep:a"]:
                assert time.monotonic() - started < 0.3 + 1.0
                await asyncio.sleep(0.02)
            reaped_after = time.monotonic() - started
            await asyncio.sleep(max(0.0, 2.0 - reaped_after))  # ~7 TTLs in all
            assert await store.in_use([LANE.key, "ep:a", "ep:b"]) == {
                LANE.key: 1,
                "ep:a": 0,
                "ep:b": 1,
            }
        assert 0.25 <= reaped_after <= 1.3
        # The block is over: renewal stopped, so the lease lapses within a TTL (the release is
        # the caller's, admission's, job).
        await wait_for(lambda: live_members(redis_url, prefix, "ep:b") == 0, 0.3 + 0.5)
    finally:
        await store.aclose()


async def test_a_lease_is_not_renewed_past_its_maximum_life(redis_url: str, prefix: str) -> None:
    store = store_for(redis_url, prefix, lease_ttl_s=0.3, lease_max_life_s=0.6)
    try:
        assert await store.try_acquire("runaway", LANE, [Limit("ep:a", 1)]) == 0
        started = time.monotonic()
        async with store.hold("runaway", [LANE.key, "ep:a"]):
            while (await store.in_use([LANE.key]))[LANE.key]:
                await asyncio.sleep(0.02)
            lived = time.monotonic() - started
        assert 0.55 <= lived <= 0.6 + 0.3 + 0.3
    finally:
        await store.aclose()


def fast_lane(limit: int, max_wait_s: float = 10) -> LaneSettings:
    return LaneSettings.model_validate(
        {
            "name": "fast",
            "max_prompt_tokens": 100,
            "clusters": ["c"],
            "slots": {"lane": limit, "per_endpoint": limit},
            "queue": {"depth": 100, "max_wait_s": max_wait_s},
        }
    )


VIEWS = [EngineView("c", "http://a", EngineState.UP, 0)]


async def test_waiters_are_served_in_arrival_order_across_replicas(
    redis_url: str, prefix: str
) -> None:
    """Two replicas, one slot: waiters arriving alternately at either are served in arrival
    order, and one whose client left drops out of the shared list at once."""
    stores = [store_for(redis_url, prefix, poll_interval_s=0.01) for _ in range(2)]
    replicas = [Admission(s, Metrics(), get_logger("test"), poll_interval_s=0.01) for s in stores]
    spec = fast_lane(1)
    order: list[str] = []
    raw = redis.Redis.from_url(redis_url)

    async def user(replica: Admission, name: str) -> None:
        async with replica.slot(spec, lambda: VIEWS, name):
            order.append(name)
            await asyncio.sleep(0.03)

    try:
        async with replicas[1].slot(spec, lambda: VIEWS, "holder"):
            tasks = {}
            for i in range(8):
                name = f"w{i}"
                tasks[name] = asyncio.create_task(user(replicas[i % 2], name))
                while name not in waiting(raw, prefix):
                    await asyncio.sleep(0.002)
            assert waiting(raw, prefix) == [f"w{i}" for i in range(8)]
            tasks["w3"].cancel()
            await asyncio.sleep(0.01)
            assert waiting(raw, prefix) == ["w0", "w1", "w2", "w4", "w5", "w6", "w7"]
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        assert order == ["w0", "w1", "w2", "w4", "w5", "w6", "w7"]
        assert waiting(raw, prefix) == []
        assert await stores[0].in_use(["lane:fast", "ep:c:http://a"]) == {
            "lane:fast": 0,
            "ep:c:http://a": 0,
        }
    finally:
        raw.close()
        for store in stores:
            await store.aclose()


def waiting(raw: redis.Redis, prefix: str) -> list[str]:
    """The lane's shared waiting list, in order, as tokens."""
    members = raw.zrange("{" + prefix + "}:queue:lane:fast", 0, -1)
    return [m.decode().split("|", 1)[1] for m in members]


async def test_a_dead_replicas_waiters_stop_holding_up_the_queue(
    redis_url: str, prefix: str
) -> None:
    dead, alive = (store_for(redis_url, prefix, lease_ttl_s=0.3) for _ in range(2))
    lane, endpoint = Limit("lane:fast", 1), [Limit("ep:a", 1)]
    try:
        assert await dead.join("ghost", "lane:fast") is True  # then its replica dies
        assert await alive.try_acquire("late", lane, endpoint) is None
        started = time.monotonic()
        while await alive.try_acquire("late", lane, endpoint) is None:
            await asyncio.sleep(0.02)
        assert time.monotonic() - started <= 0.3 + 0.2
    finally:
        for store in (dead, alive):
            await store.aclose()


async def test_a_replicas_own_waiters_never_block_its_queue_head(
    redis_url: str, prefix: str
) -> None:
    """Two waiters of one replica whose joins reached Redis in the opposite order: the replica's
    local head may still go (only it asks), but not past another replica's earlier waiter."""
    mine, other = (store_for(redis_url, prefix) for _ in range(2))
    lane, endpoint = Limit("lane:fast", 1), [Limit("ep:a", 1)]
    try:
        await mine.join("second", "lane:fast")
        await mine.join("head", "lane:fast")
        assert await mine.try_acquire("head", lane, endpoint) == 0
        await mine.release("head", [lane.key, "ep:a"])
        await mine.leave("second", "lane:fast")
        await other.join("earlier", "lane:fast")
        await mine.join("later", "lane:fast")
        assert await mine.try_acquire("later", lane, endpoint) is None
        assert await other.try_acquire("earlier", lane, endpoint) == 0
    finally:
        for store in (mine, other):
            await store.aclose()


async def test_a_waiter_whose_place_lapsed_joins_again_at_the_back(
    redis_url: str, prefix: str
) -> None:
    """Its replica stalled past a TTL: the place is gone, but the next try puts the waiter back
    in the list (behind those who came meanwhile) instead of leaving it outside for ever."""
    mine, other = (store_for(redis_url, prefix) for _ in range(2))
    lane, endpoint = Limit("lane:fast", 1), [Limit("ep:a", 1)]
    raw = redis.Redis.from_url(redis_url)
    try:
        assert await other.try_acquire("holder", lane, endpoint) == 0
        async with mine.waiting("stalled", "lane:fast"):
            (member,) = raw.zrange("{" + prefix + "}:queue:lane:fast", 0, -1)
            raw.zadd("{" + prefix + "}:qlive:lane:fast", {member: 1}, xx=True)  # lapsed
            await other.join("newer", "lane:fast")
            assert waiting(raw, prefix) == ["stalled", "newer"]  # lapsed, not yet reaped
            assert await mine.try_acquire("stalled", lane, endpoint) is None
            assert waiting(raw, prefix) == ["newer", "stalled"]
            assert await mine.join("stalled", "lane:fast", mode="refresh") is True
        assert waiting(raw, prefix) == ["newer"]  # leaving the block left the list
    finally:
        raw.close()
        for store in (mine, other):
            await store.aclose()


async def test_a_failover_moves_the_endpoint_lease_and_keeps_the_lane_lease(
    redis_url: str, prefix: str
) -> None:
    """``move``: the old endpoint lease goes, the first candidate with room is taken, the lane
    lease stays; never two endpoint leases at once; no room: the lane lease alone."""
    store = store_for(redis_url, prefix, lease_ttl_s=30)
    try:
        a, b, c = Limit("ep:a", 1), Limit("ep:b", 1), Limit("ep:c", 1)
        assert await store.try_acquire("mover", LANE, [a]) == 0
        assert await store.try_acquire("other", LANE, [b]) == 0  # b is full
        assert await store.move("mover", LANE, a.key, [b, c]) == 1
        used = await store.in_use([LANE.key, a.key, b.key, c.key])
        assert used == {LANE.key: 2, a.key: 0, b.key: 1, c.key: 1}
        assert await store.move("mover", LANE, c.key, [b]) is None  # nowhere with room
        assert await store.in_use([LANE.key, c.key]) == {LANE.key: 2, c.key: 0}
        assert await store.renew("mover", [LANE.key]) is True  # the lane lease lives on
        await store.release("mover", [LANE.key, c.key])
        await store.release("other", [LANE.key, b.key])
        assert await store.in_use([LANE.key]) == {LANE.key: 0}
    finally:
        await store.aclose()


async def test_admission_moves_a_held_slot_and_keeps_renewing_it(
    redis_url: str, prefix: str
) -> None:
    store = store_for(redis_url, prefix, lease_ttl_s=0.3)
    admission = Admission(store, Metrics(), get_logger("test"), poll_interval_s=0.01)
    views = [EngineView("c", url, EngineState.UP, 0) for url in ("http://a", "http://b")]
    lane = fast_lane(2)
    try:
        async with admission.slot(lane, lambda: views[:1], "t") as held:
            assert held.url == "http://a"
            assert await admission.move(held, lane, lambda: views[1:])
            assert (held.url, held.moves) == ("http://b", 1)
            await asyncio.sleep(1.0)  # three TTLs: only renewal keeps the moved lease alive
            used = await store.in_use(["lane:fast", "ep:c:http://a", "ep:c:http://b"])
            assert used == {"lane:fast": 1, "ep:c:http://a": 0, "ep:c:http://b": 1}
        assert await store.in_use(["lane:fast", "ep:c:http://b"]) == {
            "lane:fast": 0,
            "ep:c:http://b": 0,
        }
    finally:
        await store.aclose()


async def test_a_failover_after_redis_lost_its_data_re_establishes_the_lane_lease(
    redis_url: str, prefix: str
) -> None:
    """Redis lost every key (the epoch included) between the grant and the move: the move puts
    the lane lease back and takes the new endpoint, as a renewal would, instead of failing."""
    store = store_for(redis_url, prefix, lease_ttl_s=30)
    try:
        a, b = Limit("ep:a", 1), Limit("ep:b", 1)
        assert await store.try_acquire("mover", LANE, [a]) == 0
        delete_prefix(redis_url, prefix)  # what a restart without persistence leaves
        assert await store.move("mover", LANE, a.key, [b]) == 0
        assert await store.in_use([LANE.key, a.key, b.key]) == {LANE.key: 1, a.key: 0, b.key: 1}
        # A lease reaped while its holder was frozen is not revived by a move.
        raw = redis.Redis.from_url(redis_url)
        for key in (LANE.key, b.key):
            raw.zadd("{" + prefix + "}:" + key, {"mover": 1}, xx=True)
        raw.close()
        with pytest.raises(StateUnavailable):
            await store.move("mover", LANE, b.key, [a])
        assert await store.in_use([LANE.key, a.key, b.key]) == {LANE.key: 0, a.key: 0, b.key: 0}
    finally:
        await store.aclose()
