"""The lender's side of borrowing, inside admission (gateway/request/admission.py owns one).

    Lending(store, log, release)
      lending.reserved() -> {key: seconds}        endpoints reserved for their borrowers to drain
      lending.holds(token)                        has this waiter reserved an endpoint
      lending.sleep_s(lane, token, poll_s)        a waiter's sleep, cut to its drain limit
      lending.protected(lane, token, views, limits)   the lender's own limits, guarded by borrowers
      await lending.reserve(lane, token, views)   reserve the endpoint with the fewest borrowers
      await lending.unreserve(token, lane)        give back what this waiter reserved
      await lending.loans(lent) -> [Offer]        lenders' endpoints with room for a borrower

A lane that lends enters its own endpoints only once their borrowers drained (or after
``max_drain_s``); its waiter that is blocked by borrowers reserves the endpoint with the fewest,
and no borrower enters a reserved endpoint or one where the lender's own requests run. The rules
are gateway/request/borrowing.py's, pure; this holds this replica's reservations and asks the
store what every replica uses (the reservation itself is a lease in the store).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

from engine_pool.cluster import EngineView
from gateway.core.slots import Limit, borrow_key, endpoint_key, reserve_key
from gateway.observe.log import Logger
from gateway.request.borrowing import (
    EndpointUse,
    Loan,
    Offer,
    borrow_room,
    owner_may_enter,
    to_reserve,
)
from gateway.settings import LaneSettings
from gateway.slots.store import SlotStore

Release = Callable[[str, Sequence[str], str], Awaitable[None]]


class Lending:
    def __init__(self, store: SlotStore, log: Logger, release: Release) -> None:
        self._store = store
        self._log = log
        # Admission's release: it also wakes the waiters (borrowers may enter again).
        self._release = release
        # Endpoint key -> (token, since, reserve key) of this replica's lender waiter that
        # reserved it (the store holds the reservation itself, for every replica to see).
        self._reserved: dict[str, tuple[str, float, str]] = {}

    def reserved(self) -> dict[str, float]:
        """Endpoints reserved by a lender's waiter for its borrowers to drain: key -> seconds."""
        now = time.monotonic()
        return {key: round(now - since, 3) for key, (_, since, _) in self._reserved.items()}

    def holds(self, token: str) -> bool:
        return bool(self._reserved) and any(h == token for h, _, _ in self._reserved.values())

    def sleep_s(self, lane: LaneSettings, token: str, poll_s: float) -> float:
        """How long a waiter sleeps unless woken: the poll interval, or less when its drain
        limit on a reserved endpoint runs out sooner (``max_drain_s`` is kept to the moment)."""
        if lane.lend is None:
            return poll_s
        now, ends = time.monotonic(), [poll_s]
        for holder, since, _ in self._reserved.values():
            if holder == token:
                ends.append(max(0.0, since + lane.lend.max_drain_s - now) + 0.001)
        return min(ends)

    def protected(
        self, lane: LaneSettings, token: str, views: Sequence[EngineView], limits: list[Limit]
    ) -> list[Limit]:
        """The lender's own endpoint limits, each guarded by the endpoint's borrowers (the store
        takes it only while none is there), but for the endpoint this waiter reserved once it
        has waited ``max_drain_s`` for them."""
        assert lane.lend is not None
        now = time.monotonic()
        out = []
        for view, limit in zip(views, limits, strict=True):
            holder, since, _ = self._reserved.get(limit.key, ("", now, ""))
            waited = now - since if holder == token else 0.0
            drained = owner_may_enter(lane.lend, EndpointUse(0, 1), waited)
            guards = () if drained else (borrow_key(view.cluster, view.url),)
            out.append(Limit(limit.key, limit.limit, guards))
        return out

    async def reserve(self, lane: LaneSettings, token: str, views: Sequence[EngineView]) -> None:
        """Reserve (or keep reserving: the store's lease is renewed on every try) the endpoint
        with the fewest borrowers, when borrowers are what keeps this waiter out."""
        mine = [r for holder, _, r in self._reserved.values() if holder == token]
        if mine:
            await self._store.reserve(token, mine[0])
            return
        uses = await self._uses(views)
        free = {(v.cluster, v.url): u for v, u in zip(views, uses, strict=True) if not u.reserved}
        chosen = to_reserve(free, lane.slots.per_endpoint)
        if chosen is not None:
            key = reserve_key(*chosen)
            await self._store.reserve(token, key)
            self._reserved[endpoint_key(*chosen)] = (token, time.monotonic(), key)
            self._log.info("borrow.reserved", lane=lane.name, endpoint=chosen[1])

    async def unreserve(self, token: str, lane: str) -> None:
        if not self._reserved:  # the common case: no lending lane's waiter reserved anything
            return
        for key, (holder, _, reserved) in list(self._reserved.items()):
            if holder == token:
                del self._reserved[key]
                await self._release(token, [reserved], lane)  # wakes borrowers: it lends again

    async def loans(self, lent: Sequence[tuple[EngineView, Loan]]) -> list[Offer]:
        """Lenders' endpoints with room for one more borrower, as (view, borrow limit, lender)."""
        if not lent:
            return []
        uses = await self._uses([v for v, _ in lent])
        offers: list[Offer] = []
        for (view, loan), use in zip(lent, uses, strict=True):
            # The counts are a moment old (other replicas): the guards decide, atomically.
            if view.state.routable and borrow_room(loan.rule, use) > 0:
                guards = (endpoint_key(view.cluster, view.url), reserve_key(view.cluster, view.url))
                limit = Limit(borrow_key(view.cluster, view.url), loan.rule.per_endpoint, guards)
                offers.append((view, limit, loan.lender))
        return offers

    async def _uses(self, views: Sequence[EngineView]) -> list[EndpointUse]:
        """What the borrowing rules see of endpoints (every replica's, with a shared store):
        their own lane's slots, borrowers, and whether a waiter reserved them."""
        own = [endpoint_key(v.cluster, v.url) for v in views]
        lent = [borrow_key(v.cluster, v.url) for v in views]
        held = [reserve_key(v.cluster, v.url) for v in views]
        used = await self._store.in_use([*own, *lent, *held])
        return [
            EndpointUse(used[o], used[b], used[r] > 0)
            for o, b, r in zip(own, lent, held, strict=True)
        ]
