"""Slots shared by every gateway replica: leases in Redis that cannot leak.

``RedisSlotStore`` implements the ``SlotStore`` protocol (gateway/slots/store.py) with the scripts
in
gateway/slots/lua.py. Contract, beyond the protocol's:

- A grant is a lease with a deadline in Redis server time. ``hold`` renews it every TTL/3 from a
  task that lives only as long as the request's ``hold`` block (and stops if the request's task
  ends some other way), so a finished, cancelled or killed request stops renewing and its slots
  come back within one TTL. A lease is not renewed past ``lease_max_life_s`` (a runaway).
  A renewal that finds its lease reaped (the holder was frozen past its TTL) logs
  ``slot.lease_lost`` and stops: it never resurrects it. A renewal that finds Redis lost its
  data since the grant (the store's epoch changed, gateway/slots/lua.py) re-establishes the
  lease (``slot.lease_restored``), and acquires take nothing for half a TTL meanwhile, so the
  leases in flight are back before anyone new is admitted. Renewal errors never end the request.
- ``waiting`` keeps a queued request's place in the lane's waiting list in Redis, shared by all
  replicas, so waiters are served by class, then arrival, across replicas (one past its
  ``starved_at`` goes before every class, from its next refresh); leaving the block (slot
  taken, timeout, client gone) leaves the list at once, and a dead replica's waiters lapse
  after one TTL.
- Every Redis call is bounded by ``redis_timeout_s``. When Redis cannot be reached the store is
  degraded (``state.degraded`` event, ``shapegate_state_degraded`` = 1) and follows
  ``on_redis_down``: ``fail_closed`` raises ``StateUnavailable`` (503 + Retry-After) for new
  requests; ``fail_open_local`` grants from a per-replica memory store with every limit divided
  by ``replicas``. In-flight requests carry on either way. While degraded, Redis is tried again
  once per ``PROBE_INTERVAL_S``; the first success logs ``state.recovered``. Local grants stay
  local until they are released.

Renewal and queue refresh run as plain asyncio tasks cancelled in the ``finally`` of their
block rather than in an anyio task group, which would wrap the request's own exceptions in an
ExceptionGroup.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
from redis.asyncio import Redis

from gateway.core.slots import Limit
from gateway.errors import StateUnavailable
from gateway.observe.log import Logger, get_logger, swallowed
from gateway.observe.metrics import Metrics
from gateway.settings import StateSettings
from gateway.slots import lua as slots_lua
from gateway.slots.connect import redis_client
from gateway.slots.store import MemorySlotStore

RETRY_AFTER_S = 2.0
__all__ = ["RedisSlotStore", "redis_client"]


class RedisSlotStore:
    shared = True

    def __init__(
        self,
        client: Redis,
        state: StateSettings,
        metrics: Metrics | None = None,
        log: Logger | None = None,
    ) -> None:
        self._state = state
        policy = state.on_redis_down
        self._redis = slots_lua.ScriptRunner(client, state.redis_timeout_s, policy, log, metrics)
        self._tag = "{" + state.key_prefix + "}:"
        # Names this replica's places in the shared waiting lists.
        self._replica = uuid.uuid4().hex[:12]
        self._ttl_s = state.lease_ttl_s
        self._fail_open = state.on_redis_down == "fail_open_local"
        self._log = log or get_logger("slots")
        self._local = MemorySlotStore()
        self._local_tokens: set[str] = set()
        self._queued: set[str] = set()
        # A queued token's class rank and when it starves (its place in the shared list).
        self._rank: dict[str, tuple[int, float]] = {}
        self._unsent: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        # The store's epoch as last seen, and the epoch each lease of ours was granted in.
        self._epoch = ""
        self._lease_epoch: dict[str, str] = {}

    @classmethod
    def from_settings(
        cls, state: StateSettings, metrics: Metrics | None = None, log: Logger | None = None
    ) -> RedisSlotStore:
        client = redis_client(state)
        return cls(client, state, metrics, log)

    def _member(self, token: str) -> str:
        return f"{self._replica}|{token}"

    def _keys(self, keys: Sequence[str]) -> list[str]:
        return [self._tag + key for key in keys]

    def _epoch_keys(self) -> list[str]:
        return self._keys(["epoch", "recovering"])

    def _epoch_args(self, known: str) -> list[str | int]:
        # A new epoch, should Redis have none; the recovery grace: renewals come every TTL/3.
        return [known, uuid.uuid4().hex, max(1, self._ttl_ms // 2)]

    def _queue_keys(self, lane_key: str) -> list[str]:
        return self._keys([f"queue:{lane_key}", f"qlive:{lane_key}", f"tickets:{lane_key}"])

    @property
    def _ttl_ms(self) -> int:
        return max(1, round(self._ttl_s * 1000))

    # -- the protocol ------------------------------------------------------------------------

    async def try_acquire(self, token: str, lane: Limit, candidates: Sequence[Limit]) -> int | None:
        if token in self._local_tokens:
            return await self._try_local(token, lane, candidates)
        if self._redis.skipping() and not self._fail_open:
            # Nothing reaches Redis, so the release admission makes next has nothing to undo.
            self._unsent.add(token)
            raise _unavailable()
        keys = [*self._keys([lane.key]), *self._queue_keys(lane.key), *self._epoch_keys()]
        keys += self._keys([c.key for c in candidates])
        guards = list(dict.fromkeys(g for c in candidates for g in c.guards))
        position = {g: len(keys) + 1 + i for i, g in enumerate(guards)}  # 1-based, as in Lua
        keys += self._keys(guards)
        waiter = f"1|{self._band(token)}" if token in self._queued else "0|0"
        args: list[str | int] = [token, self._ttl_ms, lane.limit, self._member(token), waiter]
        args += self._epoch_args(self._epoch)
        args += [c.limit for c in candidates]
        args += [",".join(str(position[g]) for g in c.guards) for c in candidates]
        reply = await self._redis.call("acquire", slots_lua.ACQUIRE, keys, args, gated=True)
        if reply is slots_lua.DOWN:
            if not self._fail_open:
                raise _unavailable()
            return await self._try_local(token, lane, candidates)
        index = int(reply[0])
        self._saw_epoch(reply[1].decode(), "acquire")
        if index < 0:
            return None
        self._queued.discard(token)  # the script took the token off the waiting list
        self._lease_epoch[token] = self._epoch
        return index

    async def _try_local(self, token: str, lane: Limit, candidates: Sequence[Limit]) -> int | None:
        def share(limit: Limit) -> Limit:
            return Limit(limit.key, max(1, limit.limit // self._state.replicas), limit.guards)

        index = await self._local.try_acquire(token, share(lane), [share(c) for c in candidates])
        if index is not None:
            self._local_tokens.add(token)
        return index

    async def move(
        self, token: str, lane: Limit, release: str, candidates: Sequence[Limit]
    ) -> int | None:
        if token in self._local_tokens:
            return await self._local.move(token, lane, release, candidates)
        keys = [*self._epoch_keys(), *self._keys([lane.key, release, *(c.key for c in candidates)])]
        args: list[str | int] = [token, self._ttl_ms]
        args += self._epoch_args(self._lease_epoch.get(token, ""))
        args += [c.limit for c in candidates]
        reply = await self._redis.call("move", slots_lua.MOVE, keys, args)
        if reply is slots_lua.DOWN:
            return None
        index, epoch = int(reply[0]), reply[1].decode()
        if token in self._lease_epoch:
            self._lease_epoch[token] = epoch
        if index == -1:
            return None
        if index == -2:
            self._log.warning("slot.lease_lost", token=token, keys=[lane.key], op="move")
            raise StateUnavailable(
                "the request's slot lease was lost before it could fail over",
                retry_after_s=RETRY_AFTER_S,
            )
        return index

    async def release(self, token: str, keys: Sequence[str]) -> None:
        if token in self._local_tokens:
            self._local_tokens.discard(token)
            await self._local.release(token, keys)
            return
        if token in self._unsent:
            self._unsent.discard(token)
            return
        self._lease_epoch.pop(token, None)
        full = self._keys(keys)
        # DOWN is already logged (decision left_to_lease_ttl): the TTL reclaims the lease.
        await self._redis.call("release", slots_lua.RELEASE, full, [token])

    async def reserve(self, token: str, key: str) -> None:
        """A lease on ``key`` for a waiter, renewed by calling again (admission does on every
        try); with Redis unreachable, held locally (fail_open_local) or not at all."""
        reply = await self._redis.call(
            "reserve", slots_lua.RESERVE, self._keys([key]), [token, self._ttl_ms], gated=True
        )
        if reply is slots_lua.DOWN and self._fail_open:
            await self._local.reserve(token, key)

    @asynccontextmanager
    async def hold(self, token: str, keys: Sequence[str]) -> AsyncIterator[None]:
        if token in self._local_tokens:
            yield
            return
        owner = asyncio.current_task()
        task = self._spawn(lambda: self._renew_loop(token, tuple(keys), owner))
        try:
            yield
        finally:
            task.cancel()

    @asynccontextmanager
    async def waiting(
        self, token: str, lane_key: str, rank: int = 0, starved_at: float = math.inf
    ) -> AsyncIterator[None]:
        self._rank[token] = (rank, starved_at)
        try:
            joined = await self.join(token, lane_key)
        except BaseException:
            # Cancelled mid-call: the place may have been taken anyway.
            with anyio.CancelScope(shield=True):
                await self.leave(token, lane_key)
            raise
        if joined is None and not self._fail_open:
            raise _unavailable()
        task = None
        if joined is not None:
            self._queued.add(token)
            owner = asyncio.current_task()
            task = self._spawn(lambda: self._refresh_loop(token, lane_key, owner))
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
            # A granted waiter already left the list inside the acquire script.
            if token in self._queued:
                with anyio.CancelScope(shield=True):
                    await self.leave(token, lane_key)
            self._rank.pop(token, None)

    async def in_use(self, keys: Sequence[str]) -> dict[str, int]:
        """Live leases in Redis plus this replica's local grants; only the local ones while
        Redis is unreachable (``shapegate_state_degraded`` says so)."""
        local = await self._local.in_use(keys)
        counts = await self._redis.call(
            "in_use", slots_lua.IN_USE, self._keys(keys), [], gated=True
        )
        if counts is slots_lua.DOWN:
            return local
        return {key: int(n) + local[key] for key, n in zip(keys, counts, strict=True)}

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self._redis.aclose()
        await self._local.aclose()

    # -- leases and queue places -------------------------------------------------------------

    async def renew(
        self, token: str, keys: Sequence[str], ttl_s: float | None = None
    ) -> bool | None:
        """Extend a live lease to now + TTL, or re-establish it if Redis lost its data since the
        grant: True. False: it was reaped (and is not brought back). None: Redis did not answer."""
        ttl_ms = max(1, round((self._ttl_s if ttl_s is None else ttl_s) * 1000))
        granted = self._lease_epoch.get(token, "")
        keys_ = [*self._epoch_keys(), *self._keys(keys)]
        args = [token, ttl_ms, *self._epoch_args(granted)]
        reply = await self._redis.call("renew", slots_lua.RENEW, keys_, args)
        if reply is slots_lua.DOWN:
            return None
        status, epoch = int(reply[0]), reply[1].decode()
        self._saw_epoch(epoch, "renew")
        if status == 2:
            self._log.warning(
                "slot.lease_restored", token=token, keys=list(keys), reason="redis_lost_data"
            )
            if self._redis.metrics is not None:
                self._redis.metrics.leases_restored.inc()
        if token in self._lease_epoch:
            self._lease_epoch[token] = epoch
        return status > 0

    def _saw_epoch(self, epoch: str, op: str) -> None:
        # Another epoch than the last one seen: Redis lost its data, or another server (a
        # promoted replica) now holds it; the scripts already paused admissions for the grace.
        if self._epoch and epoch != self._epoch:
            self._log.warning("state.epoch_changed", op=op, reason="data_loss_or_failover")
        self._epoch = epoch

    async def join(self, token: str, lane_key: str, mode: str = "join") -> bool | None:
        """``join``: take (or keep) a place in the lane's waiting list; True when it joined at
        the back, False when it kept its place. ``refresh``: keep a live place alive; True when
        it still has one. None: Redis did not answer."""
        keys = self._queue_keys(lane_key)
        args: list[str | int] = [self._member(token), self._ttl_ms, mode, self._band(token)]
        joined = await self._redis.call(mode, slots_lua.ENQUEUE, keys, args, gated=True)
        return None if joined is slots_lua.DOWN else bool(joined)

    async def leave(self, token: str, lane_key: str) -> None:
        """Leave the lane's waiting list; idempotent. On failure the place lapses in one TTL."""
        self._queued.discard(token)
        keys = self._queue_keys(lane_key)[:2]
        await self._redis.call("leave", slots_lua.LEAVE, keys, [self._member(token)])

    async def _renew_loop(
        self, token: str, keys: Sequence[str], owner: asyncio.Task[Any] | None
    ) -> None:
        started, max_life = time.monotonic(), self._state.lease_max_life_s
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            if owner is not None and owner.done():
                return
            age = time.monotonic() - started
            if age >= max_life:
                self._log.warning("slot.lease_max_life", token=token, age_s=round(age, 3))
                return
            alive = await self.renew(token, keys, min(self._ttl_s, max_life - age))
            # None: keep trying; the lease may outlive a short outage, and the TTL decides.
            if alive is False:
                self._log.warning(
                    "slot.lease_lost", token=token, keys=list(keys), age_s=round(age, 3)
                )
                return

    async def _refresh_loop(
        self, token: str, lane_key: str, owner: asyncio.Task[Any] | None
    ) -> None:
        while owner is None or not owner.done():
            # Refresh at TTL/3, and at the moment the waiter starves (it then moves ahead of
            # every class).
            pause = self._ttl_s / 3
            starved_at = self._rank.get(token, (0, math.inf))[1]
            if time.monotonic() < starved_at:
                pause = min(pause, starved_at - time.monotonic() + 0.001)
            await asyncio.sleep(pause)
            await self.join(token, lane_key, mode="refresh")

    def _band(self, token: str) -> int:
        rank, starved_at = self._rank.get(token, (0, math.inf))
        return slots_lua.band(rank, time.monotonic() >= starved_at)

    def _spawn(self, work: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        # A factory, not a coroutine: a task cancelled before it ever ran (a grant moved at
        # once, gateway/request/admission.py) must leave no coroutine behind that was never awaited.
        task = asyncio.create_task(self._guard(work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _guard(self, work: Callable[[], Awaitable[None]]) -> None:
        try:
            await work()
        except Exception as exc:  # noqa: BLE001 - a background loop must not end the request
            swallowed(
                self._log, self._redis.metrics, "slots_redis.background", exc, decision="stopped"
            )


def _unavailable() -> StateUnavailable:
    return StateUnavailable(
        "the shared slot store (Redis) is unreachable", retry_after_s=RETRY_AFTER_S
    )
