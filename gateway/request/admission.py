"""Admission: wait for a lane slot and an endpoint slot, in arrival order, and give them back.

    async with admission.slot(lane, candidates, token, limit_of) as held:
        ...  # the request runs here; the slots are released when the block exits, however
        await admission.move(held, lane, candidates, limit_of)  # fail over, slot and all

(``Want``, ``Held`` and ``Slot``, the context ``slot`` returns: gateway/request/slot.py.)

Contract:
- A request first tries the store at once if nobody is queued ahead of it in its lane.
- Otherwise, with ``on_full: reject`` it gets ``Overloaded`` (429); with ``wait`` it joins the
  lane's FIFO queue (``Overloaded`` if the queue is at its depth) and only the head of the queue
  tries the store. It gives up with ``QueueTimeout`` (503) after ``queue.max_wait_s``.
- The head is woken by any local release, and also polls at ``poll_interval_s`` when the store is
  shared with other replicas (their releases cannot wake us). A waiter also holds its place in
  the store's ``waiting`` block (Redis: one list for the lane across replicas, ordered by
  class, then arrival, the starvation bound included).
- A waiter cancelled in the queue (its client left) leaves the queue at once and never takes a
  slot. An acquire cancelled while the store call was in flight releases by token, which is
  idempotent, so a half-finished acquire cannot leak.
- Release is shielded from cancellation and bounded by ``release_timeout_s``; a release that
  fails is logged and counted, and the store's lease TTL is the backstop.
- ``candidates()`` is called on every try, so an endpoint that went down while we waited is not
  picked. Its order is the endpoint chain's (engine_pool/chain.py: load and prefix overlap) and
  the store takes the first with room in that order: never re-sorted here (``merge_loans`` only
  places lent endpoints among them). ``limit_of(view)`` is the endpoint's slot limit for this
  lane (its engine's share, gateway/request/lanes.py ``endpoint_limit``); by default the lane's
  ``per_endpoint``. Either way it is
  scaled down while the endpoint slow-starts (``EngineView.ramp``).
- In a lane with ``prefix_hold_tokens`` (and no lending) a waiter holding for its full home
  does not hold the queue: once every waiter ahead of it (the head, then arrival order) has
  tried and found no room, it tries too, without the endpoints they asked for, at most
  ``classes.PASS_AHEAD`` places from the head (``classes.passing``); a refused waiter wakes the
  next. Other replicas' waiters still go first by the store's own order (slots/lua.py).
- Priority classes (gateway/request/classes.py): the waiter that tries the store is the one
  ``next_waiter`` picks (class, then arrival, starvation bound), not always the first in; a
  class may fill only the lane slots not reserved for the classes above it. 429 and 503 answers
  carry a ``Retry-After`` from the lane's measured drain rate (grants over the last minute).
- Borrowing (gateway/request/borrowing.py): ``Want.loans`` are lending lanes whose idle endpoints
  the request may take (``lent()`` gives their views); such a grant holds its own lane's slot and
  a ``borrow:`` slot on the lender's endpoint (``Grant.lender`` names the lender). The lender's
  side (its endpoints guarded by borrowers, reserved for them to drain) is ``self.lending``
  (gateway/request/lending.py). The exclusion is the store's (``Limit.guards``, checked in the
  same atomic step as the take, and the reservation a lease in the store): exact across replicas
  with Redis too.
- ``move`` fails a granted request over to another endpoint: the old endpoint slot is given up
  and a new one taken in one store step, the lane slot kept, so it never holds two; it waits
  for room up to ``queue.max_wait_s`` (renewing its lane lease meanwhile) and returns False if
  none came, or at once when there is no candidate at all.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import anyio

from engine_pool.cluster import EngineView
from engine_pool.outlier import ramped_limit
from gateway.core.decision import Grant
from gateway.core.slots import Limit, endpoint_key, lane_key
from gateway.errors import Overloaded, QueueTimeout
from gateway.observe.log import Logger, swallowed
from gateway.observe.metrics import Metrics
from gateway.request.borrowing import (
    merge_loans,
)
from gateway.request.classes import (
    PASS_AHEAD,
    DrainMeter,
    class_lane_limit,
    next_waiter,
    passing,
    retry_after_s,
)
from gateway.request.lending import Lending
from gateway.request.slot import NO_CLASSES, Held, LimitOf, Slot, Want
from gateway.settings import LaneSettings
from gateway.slots.store import SlotStore

# Without a shared store, local releases wake waiters; this only bounds a missed health change.
LOCAL_POLL_S = 0.25


@dataclass(eq=False, slots=True)
class _Waiter:
    token: str
    rank: int = 0
    since: float = field(default_factory=time.monotonic)
    wake: anyio.Event = field(default_factory=anyio.Event)
    # The endpoint URLs it asked for at its last try and found full (None: not tried yet).
    wants: frozenset[str] | None = None
    # At its try: the endpoints the holding waiters it passes wait for (empty: it is the head).
    passing: frozenset[str] = frozenset()


class Admission:
    def __init__(
        self,
        store: SlotStore,
        metrics: Metrics,
        log: Logger,
        poll_interval_s: float = 0.05,
        release_timeout_s: float = 2.0,
    ) -> None:
        self.store = store
        self._metrics = metrics
        self._log = log
        self._poll_s = poll_interval_s if store.shared else LOCAL_POLL_S
        self._release_timeout_s = release_timeout_s
        self._queues: dict[str, deque[_Waiter]] = {}
        self._starvation_s: dict[str, float] = {}
        self._drain: dict[str, DrainMeter] = {}
        # The lender's side of borrowing: this replica's reservations (gateway/request/lending.py).
        self.lending = Lending(store, log, self._release)
        # Borrowed grants in flight: (lane, lender) -> count (admin state and dashboard).
        self.borrowing: dict[tuple[str, str], int] = {}

    def queue_depth(self, lane: str) -> int:
        return len(self._queues.get(lane, ()))

    def reserved(self) -> dict[str, float]:
        """Endpoints reserved by a lender's waiter for its borrowers to drain: key -> seconds."""
        return self.lending.reserved()

    def drain_rate(self, lane: str) -> float:
        """Grants a second in ``lane`` over the last minute (what Retry-After is computed from)."""
        meter = self._drain.get(lane)
        return meter.rate(time.monotonic()) if meter is not None else 0.0

    def _retry_after(self, lane: LaneSettings, depth: int) -> float:
        return retry_after_s(depth, self.drain_rate(lane.name), lane.queue.max_wait_s)

    def slot(
        self,
        lane: LaneSettings,
        candidates: Callable[[], Sequence[EngineView]],
        token: str,
        limit_of: LimitOf | None = None,
        want: Want | None = None,
    ) -> Slot:
        """``async with admission.slot(...) as held``: the slots, waited for, held for the
        block, released on every way out of it (``Slot``)."""
        return Slot(
            self,
            lane,
            candidates,
            token,
            limit_of or (lambda _: lane.slots.per_endpoint),
            want or Want(),
        )

    async def move(
        self,
        held: Held,
        lane: LaneSettings,
        candidates: Callable[[], Sequence[EngineView]],
        limit_of: LimitOf | None = None,
    ) -> bool:
        """Move ``held`` to the first of ``candidates()`` with room; False if none in time."""
        limit_of = limit_of or (lambda _: lane.slots.per_endpoint)
        old = held.grant
        lane_limit = Limit(lane_key(lane.name), lane.slots.lane)
        # Renew the lane lease alone while no endpoint slot is held.
        await held._stack.aclose()
        held._stack = AsyncExitStack()
        await held._stack.enter_async_context(self.store.hold(old.token, (lane_limit.key,)))
        with anyio.move_on_after(lane.queue.max_wait_s):
            while views := list(candidates()):
                limits = [self._endpoint_limit(v, limit_of) for v in views]
                try:
                    index = await self.store.move(old.token, lane_limit, old.keys[1], limits)
                except BaseException:
                    # The store may have taken a candidate before the failure reached us.
                    await self._release(old.token, [lim.key for lim in limits], lane.name)
                    raise
                if index is not None:
                    view = views[index]
                    held.grant = Grant(
                        token=old.token,
                        lane=old.lane,
                        cluster=view.cluster,
                        url=view.url,
                        keys=(lane_limit.key, limits[index].key),
                        queued_s=old.queued_s,
                    )
                    held.moves += 1
                    self._metrics.slots_in_use.labels(lane=old.lane, cluster=old.cluster).dec()
                    self._metrics.slots_in_use.labels(lane=old.lane, cluster=view.cluster).inc()
                    await held._stack.aclose()
                    held._stack = AsyncExitStack()
                    await held._stack.enter_async_context(
                        self.store.hold(old.token, held.grant.keys)
                    )
                    self._wake_all()
                    return True
                await anyio.sleep(self._poll_s)
        self._wake_all()  # the old endpoint slot is free
        return False

    @staticmethod
    def _endpoint_limit(view: EngineView, limit_of: LimitOf) -> Limit:
        return Limit(endpoint_key(view.cluster, view.url), ramped_limit(limit_of(view), view.ramp))

    async def _acquire(
        self,
        lane: LaneSettings,
        candidates: Callable[[], Sequence[EngineView]],
        token: str,
        limit_of: LimitOf,
        want: Want,
    ) -> Grant:
        started = time.monotonic()
        # Made once a lane, not a request (``setdefault`` would build a spare each time).
        queue = self._queues.get(lane.name)
        if queue is None:
            queue = self._queues[lane.name] = deque()
        self._starvation_s[lane.name] = want.classes.starvation_s
        meter = self._drain.get(lane.name)
        if meter is None:
            meter = self._drain[lane.name] = DrainMeter()
        if not queue:
            grant = await self._try(lane, candidates, token, started, limit_of, want)
            if grant is not None:
                meter.granted(time.monotonic())
                return grant
        if lane.on_full == "reject":
            raise Overloaded(
                f"lane '{lane.name}' is full", retry_after_s=self._retry_after(lane, 0)
            )
        if len(queue) >= lane.queue.depth:
            raise Overloaded(
                f"lane '{lane.name}' queue is full ({lane.queue.depth} waiting)",
                retry_after_s=self._retry_after(lane, len(queue)),
            )
        waiter = _Waiter(token, want.rank)
        queue.append(waiter)
        self._queue_changed(lane.name)
        try:
            with anyio.fail_after(lane.queue.max_wait_s):
                # A shared store keeps the place in a queue shared by every replica.
                starved_at = waiter.since + want.classes.starvation_s
                async with self.store.waiting(token, lane_key(lane.name), want.rank, starved_at):
                    while True:
                        turn = self._turn(lane, waiter)
                        if turn is not None:
                            waiter.passing = turn
                            grant = await self._try(
                                lane, candidates, token, started, limit_of, want, waiter
                            )
                            if grant is not None:
                                meter.granted(time.monotonic())
                                return grant
                            self._wake_behind(lane, waiter)
                        waiter.wake = anyio.Event()
                        with anyio.move_on_after(self.lending.sleep_s(lane, token, self._poll_s)):
                            await waiter.wake.wait()
        except TimeoutError:
            raise QueueTimeout(
                f"no slot in lane '{lane.name}' within {lane.queue.max_wait_s:g}s",
                retry_after_s=self._retry_after(lane, len(queue)),
            ) from None
        finally:
            queue.remove(waiter)
            await self.lending.unreserve(token, lane.name)
            self._queue_changed(lane.name)
            head = self._head(lane.name)
            if head is not None:
                head.wake.set()

    @staticmethod
    def _passes(lane: LaneSettings) -> bool:
        """Waiters may pass holding ones: the lane holds for homes and lends nothing."""
        return lane.prefix_hold_tokens is not None and lane.lend is None

    def _order(self, lane: str) -> list[_Waiter]:
        """The lane's waiters that may pass holding ones: the one ``_head`` picks first, then
        the rest in arrival order, at most ``PASS_AHEAD`` behind it."""
        head = self._head(lane)
        if head is None:
            return []
        rest = (w for w in self._queues[lane] if w is not head)
        return [head, *itertools.islice(rest, PASS_AHEAD)]

    def _turn(self, lane: LaneSettings, waiter: _Waiter) -> frozenset[str] | None:
        """May ``waiter`` try the store now: the head may (nothing excluded); in a lane whose
        waiters pass holding ones, so may one behind holding waiters (``classes.passing``),
        without the endpoints they asked for. None: not its turn."""
        head = self._head(lane.name)
        if head is waiter:
            return frozenset()
        if head is None or not self._passes(lane):
            return None
        order = self._order(lane.name)
        if waiter not in order:
            return None
        return passing([w.wants for w in order[: order.index(waiter)]])

    def _wake_behind(self, lane: LaneSettings, waiter: _Waiter) -> None:
        """A waiter found no room: in a lane whose waiters pass holding ones, the next behind
        it may try now."""
        if not self._passes(lane):
            return
        order = self._order(lane.name)
        if waiter in order and order[-1] is not waiter:
            order[order.index(waiter) + 1].wake.set()

    def _head(self, lane: str) -> _Waiter | None:
        """The waiter that tries the store next: class, then arrival, within the starvation
        bound (gateway/request/classes.py)."""
        queue = self._queues.get(lane)
        if not queue:
            return None
        waiting = [(w.rank, w.since) for w in queue]
        starvation = self._starvation_s.get(lane, NO_CLASSES.starvation_s)
        return queue[next_waiter(waiting, time.monotonic(), starvation)]

    async def _try(
        self,
        lane: LaneSettings,
        candidates: Callable[[], Sequence[EngineView]],
        token: str,
        started: float,
        limit_of: LimitOf,
        want: Want,
        waiter: _Waiter | None = None,
    ) -> Grant | None:
        """One try of the store over the candidates, less the endpoints waiters ahead of a
        passing ``waiter`` hold for (``_Waiter.passing``); a refused waiter keeps the URLs it
        asked for (``_Waiter.wants``)."""
        own = list(candidates())
        if waiter is not None:
            waiter.wants = frozenset(v.url for v in own)
            if waiter.passing:
                own = [v for v in own if v.url not in waiter.passing]
        lent = list(want.lent()) if want.loans else []
        if not own and not lent:
            return None
        lane_limit = Limit(
            lane_key(lane.name), class_lane_limit(want.classes, want.priority, lane.slots.lane)
        )
        own_limits = [self._endpoint_limit(v, limit_of) for v in own]
        if lane.lend is not None:
            own_limits = self.lending.protected(lane, token, own, own_limits)
        offers = merge_loans(
            [(v, lim, None) for v, lim in zip(own, own_limits, strict=True)],
            await self.lending.loans(lent),
        )
        limits = [lim for _, lim, _ in offers]
        try:
            index = await self.store.try_acquire(token, lane_limit, limits)
        except BaseException:
            # The store may have taken slots before the failure or cancellation reached us.
            await self._release(token, [lane_limit.key, *(lim.key for lim in limits)], lane.name)
            raise
        if index is None:
            if lane.lend is not None and own:
                await self.lending.reserve(lane, token, own)
            return None
        view, _, lender = offers[index]
        await self.lending.unreserve(token, lane.name)
        return Grant(
            token=token,
            lane=lane.name,
            cluster=view.cluster,
            url=view.url,
            keys=(lane_limit.key, limits[index].key),
            queued_s=time.monotonic() - started,
            lender=lender,
        )

    async def _release(self, token: str, keys: Sequence[str], lane: str) -> None:
        # An in-process store never awaits while it releases (slots/store.py), so nothing can
        # cancel or delay it: the shield and the deadline (two cancel scopes, a measurable share
        # of a request's CPU) guard only a shared store's network round trip.
        try:
            if self.store.shared:
                with anyio.CancelScope(shield=True), anyio.fail_after(self._release_timeout_s):
                    await self.store.release(token, keys)
            else:
                await self.store.release(token, keys)
        except Exception as exc:  # noqa: BLE001 - the lease TTL reclaims what we could not
            swallowed(
                self._log,
                self._metrics,
                "admission.release",
                exc,
                decision="left_to_lease_ttl",
                lane=lane,
                token=token,
            )
        self._wake_all()

    def _wake_all(self) -> None:
        for lane in self._queues:
            head = self._head(lane)
            if head is not None:
                head.wake.set()

    def _queue_changed(self, lane: str) -> None:
        queue = self._queues.get(lane, deque())
        self._metrics.queue_depth.labels(lane=lane).set(len(queue))

    def oldest_wait_s(self, lane: str) -> float:
        queue = self._queues.get(lane)
        return time.monotonic() - queue[0].since if queue else 0.0
