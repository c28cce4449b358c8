"""Slot stores: who holds which concurrency slot, behind one protocol.

A request needs two slots taken together: one in its lane and one on the engine endpoint that
will serve it. ``try_acquire`` is given the lane limit and the candidate endpoints in preference
order and takes the lane slot plus the first candidate with room, all or nothing, returning the
candidate's index (or None when nothing has room). Slots are keyed by a per-request token, so
acquire is idempotent per token and release is exact and idempotent.

    MemorySlotStore   one process; the default and the demo's
    RedisSlotStore    shared by every gateway replica through leases (gateway/slots/redis_store.py)

``move(token, lane, release, candidates)`` fails a granted request over: it gives up the
endpoint slot ``release`` and takes the first candidate with room, keeping the lane slot, in one
step (never two endpoint slots at once); None when no candidate has room (the token then holds
the lane slot only).

A candidate ``Limit`` may carry ``guards``: keys in which no other token may hold a slot for the
candidate to be taken, checked in the same atomic step (gateway/request/borrowing.py: borrowers and
the lender's own requests exclude each other on an endpoint). ``reserve(token, key)`` holds (or
renews) a lease on ``key`` for a waiter, so that guards naming ``key`` keep others out; it is
given up with ``release``.

``hold(token, keys)`` is the context a grant lives in: nothing to do in memory, lease renewal
for Redis. ``waiting(token, lane_key)`` is the context a queued request waits in: nothing in
memory; for Redis, a place in the lane's waiting list shared by every replica, which
``try_acquire`` honours (class ``rank``, 0 the highest, then arrival across replicas; after
``starved_at``, monotonic time, before every class) and which is left when the block exits.
Local waiting, timeouts and disconnects are admission.py's business, not the store's.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Protocol

from gateway.core.slots import Limit


class SlotStore(Protocol):
    # True when other processes share the store, so waiters must also poll for their releases.
    shared: bool

    async def try_acquire(
        self, token: str, lane: Limit, candidates: Sequence[Limit]
    ) -> int | None: ...

    async def move(
        self, token: str, lane: Limit, release: str, candidates: Sequence[Limit]
    ) -> int | None: ...

    async def release(self, token: str, keys: Sequence[str]) -> None: ...

    async def reserve(self, token: str, key: str) -> None: ...

    def hold(self, token: str, keys: Sequence[str]) -> AbstractAsyncContextManager[None]: ...

    def waiting(
        self, token: str, lane_key: str, rank: int = 0, starved_at: float = math.inf
    ) -> AbstractAsyncContextManager[None]: ...

    async def in_use(self, keys: Sequence[str]) -> dict[str, int]: ...

    async def aclose(self) -> None: ...


_NONE: frozenset[str] = frozenset()  # no holder (not a new empty set at every look)


class MemorySlotStore:
    """Slots of one gateway process. Every method is atomic: none awaits while it holds state."""

    shared = False

    def __init__(self) -> None:
        self._held: dict[str, set[str]] = {}

    def _room(self, limit: Limit, token: str) -> bool:
        held = self._held
        holders = held.get(limit.key, _NONE)
        for guard in limit.guards:
            if held.get(guard, _NONE) - {token}:
                return False
        return token in holders or len(holders) < limit.limit

    async def try_acquire(self, token: str, lane: Limit, candidates: Sequence[Limit]) -> int | None:
        if token in self._held.get(lane.key, ()):
            # A retried acquire reports what the token holds and never takes a second endpoint
            # slot (as the Redis script and the host's table do).
            for index, candidate in enumerate(candidates):
                if token in self._held.get(candidate.key, ()):
                    return index
            return None
        if not self._room(lane, token):
            return None
        for index, candidate in enumerate(candidates):
            if self._room(candidate, token):
                self._held.setdefault(lane.key, set()).add(token)
                self._held.setdefault(candidate.key, set()).add(token)
                return index
        return None

    async def move(
        self, token: str, lane: Limit, release: str, candidates: Sequence[Limit]
    ) -> int | None:
        self._held.get(release, set()).discard(token)
        for index, candidate in enumerate(candidates):
            if self._room(candidate, token):
                self._held.setdefault(candidate.key, set()).add(token)
                return index
        return None

    async def release(self, token: str, keys: Sequence[str]) -> None:
        for key in keys:
            self._held.get(key, set()).discard(token)

    async def reserve(self, token: str, key: str) -> None:
        self._held.setdefault(key, set()).add(token)

    @asynccontextmanager
    async def hold(self, token: str, keys: Sequence[str]) -> AsyncIterator[None]:
        # In one process a slot cannot outlive its holder: there is no lease to renew.
        yield

    @asynccontextmanager
    async def waiting(
        self, token: str, lane_key: str, rank: int = 0, starved_at: float = math.inf
    ) -> AsyncIterator[None]:
        # admission.py's own FIFO is the whole queue when no other process shares the slots.
        yield

    async def in_use(self, keys: Sequence[str]) -> dict[str, int]:
        return {key: len(self._held.get(key, ())) for key in keys}

    async def aclose(self) -> None:
        self._held.clear()
