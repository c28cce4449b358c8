"""The host slots' table (``HostSlots``), kept by the supervisor's slot server
(host_server.py): who holds which slot and who waits, across every worker of one host. Plain
data, no I/O.

Contract: the same rules as the Redis scripts (gateway/slots/lua.py): a lane slot and the first
candidate endpoint with room, all or nothing; a retried acquire reports what the token already
holds; ``move`` gives up one endpoint slot and takes another in one step; release is exact and
idempotent. Waiting places keep arrival order across workers as the Redis waiting list does: a
waiter goes only while fewer other workers' waiters stand ahead of it than there are free slots,
and a newcomer stands behind every waiter of the other workers. Owners are connection ids:
``reclaim`` drops everything one owner held or waited for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.core.slots import Limit
from gateway.slots.host_wire import limit_from_wire


@dataclass
class HostSlots:
    """Who holds which slot and who waits, across every worker. Owners are connection ids."""

    held: dict[str, set[str]] = field(default_factory=dict)
    owned: dict[int, dict[str, set[str]]] = field(default_factory=dict)
    # Lane key -> waiting member -> owner, in arrival order (dicts keep insertion order).
    queues: dict[str, dict[str, int]] = field(default_factory=dict)

    def _take(self, owner: int, token: str, key: str) -> None:
        self.held.setdefault(key, set()).add(token)
        self.owned.setdefault(owner, {}).setdefault(token, set()).add(key)

    def _drop(self, owner: int, token: str, key: str) -> None:
        self.held.get(key, set()).discard(token)
        keys = self.owned.get(owner, {}).get(token)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self.owned[owner][token]

    def _ahead(self, owner: int, lane_key: str, token: str, free: int) -> bool:
        """True when ``free`` or more other workers' waiters stand ahead of ``token``."""
        queue = self.queues.get(lane_key, {})
        ahead = 0
        for member, waiter_owner in queue.items():
            if member == token:
                break
            if waiter_owner != owner:
                ahead += 1
                if ahead >= free:
                    return True
        return False

    def _room(self, limit: Limit, token: str) -> bool:
        """Room under ``limit`` and no other token in any of its guards (borrowing's mutual
        exclusion, gateway/request/borrowing.py), as MemorySlotStore judges it."""
        if any(self.held.get(guard, set()) - {token} for guard in limit.guards):
            return False
        holders = self.held.get(limit.key, set())
        return token in holders or len(holders) < limit.limit

    def acquire(self, owner: int, token: str, lane: Limit, candidates: Sequence[Limit]) -> int:
        """The index of the candidate granted (with the lane slot), or -1."""
        holders = self.held.get(lane.key, set())
        if token in holders:
            for index, candidate in enumerate(candidates):
                if token in self.held.get(candidate.key, ()):
                    return index
            return -1
        free = lane.limit - len(holders)
        if free <= 0 or not self._room(lane, token) or self._ahead(owner, lane.key, token, free):
            return -1
        for index, candidate in enumerate(candidates):
            if self._room(candidate, token):
                self._take(owner, token, lane.key)
                self._take(owner, token, candidate.key)
                self.queues.get(lane.key, {}).pop(token, None)
                return index
        return -1

    def move(self, owner: int, token: str, release: str, candidates: Sequence[Limit]) -> int:
        self._drop(owner, token, release)
        for index, candidate in enumerate(candidates):
            if self._room(candidate, token):
                self._take(owner, token, candidate.key)
                return index
        return -1

    def release(self, owner: int, token: str, keys: Sequence[str]) -> None:
        for key in keys:
            self._drop(owner, token, key)

    def reserve(self, owner: int, token: str, key: str) -> None:
        """A lender's waiter holds ``key`` so that borrowers' guards keep them out; owned by the
        worker's connection like a slot, so a dead worker's reservation goes with it."""
        self._take(owner, token, key)

    def join(self, owner: int, token: str, lane_key: str) -> None:
        self.queues.setdefault(lane_key, {}).setdefault(token, owner)

    def leave(self, token: str, lane_key: str) -> None:
        self.queues.get(lane_key, {}).pop(token, None)

    def in_use(self, keys: Sequence[str]) -> list[int]:
        return [len(self.held.get(key, ())) for key in keys]

    def reclaim(self, owner: int) -> int:
        """Drop everything ``owner`` holds or waits for; the number of tokens it held."""
        tokens = self.owned.pop(owner, {})
        for token, keys in tokens.items():
            for key in keys:
                self.held.get(key, set()).discard(token)
        for queue in self.queues.values():
            for member in [m for m, o in queue.items() if o == owner]:
                del queue[member]
        return len(tokens)

    def handle(self, owner: int, request: dict[str, Any]) -> Any:
        """One wire request against the table; its reply value."""
        op = request["op"]
        if op == "acquire":
            lane = limit_from_wire(request["lane"])
            return self.acquire(
                owner, request["t"], lane, [limit_from_wire(c) for c in request["c"]]
            )
        if op == "move":
            return self.move(
                owner, request["t"], request["release"], [limit_from_wire(c) for c in request["c"]]
            )
        if op == "reserve":
            self.reserve(owner, request["t"], request["key"])
            return None
        if op == "release":
            self.release(owner, request["t"], request["keys"])
            return None
        if op == "join":
            self.join(owner, request["t"], request["lane_key"])
            return None
        if op == "leave":
            self.leave(request["t"], request["lane_key"])
            return None
        if op == "in_use":
            return self.in_use(request["keys"])
        raise ValueError(f"unknown slot operation {op!r}")
