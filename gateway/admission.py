"""Admission: wait for a lane slot and an endpoint slot, in arrival order, and give them back.

    async with admission.slot(lane, candidates, token, limit_of) as held:
        ...  # the request runs here; the slots are released when the block exits, however
        await admission.move(held, lane, candidates, limit_of)  # fail over, slot and all

Contract:
- A request first tries the store at once if nobody is queued ahead of it in its lane.
- Otherwise, with ``on_full: reject`` it gets ``Overloaded`` (429); with ``wait`` it joins the
  lane's FIFO queue (``Overloaded`` if the queue is at its depth) and only the head of the queue
  tries the store. It gives up with ``QueueTimeout`` (503) after ``queue.max_wait_s``.
- The head is woken by any local release, and also polls at ``poll_interval_s`` when the store is
  shared with other replicas (their releases cannot wake us). A waiter also holds its place in
  the store's ``waiting`` block (Redis: one arrival-ordered list for the lane across replicas).
- A waiter cancelled in the queue (its client left) leaves the queue at once and never takes a
  slot. An acquire cancelled while the store call was in flight releases by token, which is
  idempotent, so a half-finished acquire cannot leak.
- Release is shielded from cancellation and bounded by ``release_timeout_s``; a release that
  fails is logged and counted, and the store's lease TTL is the backstop.
- ``candidates()`` is called on every try, so an endpoint that went down while we waited is not
  picked. ``limit_of(view)`` is the endpoint's slot limit for this lane (its engine's share,
  gateway/lanes.py ``endpoint_limit``); by default the lane's ``per_endpoint``. Either way it is
  scaled down while the endpoint slow-starts (``EngineView.ramp``).
- ``move`` fails a granted request over to another endpoint: the old endpoint slot is given up
  and a new one taken in one store step, the lane slot kept, so it never holds two; it waits
  for room up to ``queue.max_wait_s`` (renewing its lane lease meanwhile) and returns False if
  none came, or at once when there is no candidate at all.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, nullcontext
from dataclasses import dataclass, field

import anyio

from engine_pool.cluster import EngineView
from engine_pool.outlier import ramped_limit
from gateway.errors import Overloaded, QueueTimeout
from gateway.log import Logger, swallowed
from gateway.metrics import Metrics
from gateway.settings import LaneSettings
from gateway.slots import Limit, SlotStore, endpoint_key, lane_key

# Without a shared store, local releases wake waiters; this only bounds a missed health change.
LOCAL_POLL_S = 0.25


@dataclass(frozen=True, slots=True)
class Grant:
    token: str
    lane: str
    cluster: str
    url: str
    keys: tuple[str, ...]
    queued_s: float


LimitOf = Callable[[EngineView], int]


class Held:
    """A granted slot as the request holds it: the current grant, which ``move`` may replace."""

    __slots__ = ("_stack", "grant", "moves")

    def __init__(self, grant: Grant) -> None:
        self.grant = grant
        self.moves = 0
        self._stack = AsyncExitStack()

    @property
    def token(self) -> str:
        return self.grant.token

    @property
    def lane(self) -> str:
        return self.grant.lane

    @property
    def cluster(self) -> str:
        return self.grant.cluster

    @property
    def url(self) -> str:
        return self.grant.url

    @property
    def keys(self) -> tuple[str, ...]:
        return self.grant.keys

    @property
    def queued_s(self) -> float:
        return self.grant.queued_s


@dataclass(eq=False, slots=True)
class _Waiter:
    token: str
    since: float = field(default_factory=time.monotonic)
    wake: anyio.Event = field(default_factory=anyio.Event)


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

    def queue_depth(self, lane: str) -> int:
        return len(self._queues.get(lane, ()))

    @asynccontextmanager
    async def slot(
        self,
        lane: LaneSettings,
        candidates: Callable[[], Sequence[EngineView]],
        token: str,
        limit_of: LimitOf | None = None,
    ) -> AsyncIterator[Held]:
        limit_of = limit_of or (lambda _: lane.slots.per_endpoint)
        held = Held(await self._acquire(lane, candidates, token, limit_of))
        m = self._metrics
        m.child(m.slots_in_use, held.lane, held.cluster).inc()
        try:
            await held._stack.enter_async_context(self.store.hold(held.token, held.keys))
            yield held
        finally:
            await held._stack.aclose()
            m.child(m.slots_in_use, held.lane, held.cluster).dec()
            await self._release(held.token, held.keys, lane=held.lane)

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
    ) -> Grant:
        started = time.monotonic()
        queue = self._queues.setdefault(lane.name, deque())
        if not queue:
            grant = await self._try(lane, candidates, token, started, limit_of)
            if grant is not None:
                return grant
        if lane.on_full == "reject":
            raise Overloaded(f"lane '{lane.name}' is full", retry_after_s=1)
        if len(queue) >= lane.queue.depth:
            raise Overloaded(
                f"lane '{lane.name}' queue is full ({lane.queue.depth} waiting)",
                retry_after_s=max(1.0, lane.queue.max_wait_s / 4),
            )
        waiter = _Waiter(token)
        queue.append(waiter)
        self._queue_changed(lane.name)
        try:
            with anyio.fail_after(lane.queue.max_wait_s):
                # A shared store keeps the place in a queue shared by every replica.
                async with self.store.waiting(token, lane_key(lane.name)):
                    while True:
                        if queue[0] is waiter:
                            grant = await self._try(lane, candidates, token, started, limit_of)
                            if grant is not None:
                                return grant
                        waiter.wake = anyio.Event()
                        with anyio.move_on_after(self._poll_s):
                            await waiter.wake.wait()
        except TimeoutError:
            raise QueueTimeout(
                f"no slot in lane '{lane.name}' within {lane.queue.max_wait_s:g}s",
                retry_after_s=max(1.0, lane.queue.max_wait_s / 4),
            ) from None
        finally:
            queue.remove(waiter)
            self._queue_changed(lane.name)
            if queue:
                queue[0].wake.set()

    async def _try(
        self,
        lane: LaneSettings,
        candidates: Callable[[], Sequence[EngineView]],
        token: str,
        started: float,
        limit_of: LimitOf,
    ) -> Grant | None:
        views = list(candidates())
        if not views:
            return None
        lane_limit = Limit(lane_key(lane.name), lane.slots.lane)
        limits = [self._endpoint_limit(v, limit_of) for v in views]
        try:
            index = await self.store.try_acquire(token, lane_limit, limits)
        except BaseException:
            # The store may have taken slots before the failure or cancellation reached us.
            await self._release(token, [lane_limit.key, *(lim.key for lim in limits)], lane.name)
            raise
        if index is None:
            return None
        view = views[index]
        return Grant(
            token=token,
            lane=lane.name,
            cluster=view.cluster,
            url=view.url,
            keys=(lane_limit.key, limits[index].key),
            queued_s=time.monotonic() - started,
        )

    async def _release(self, token: str, keys: Sequence[str], lane: str) -> None:
        # An in-process store never awaits while it releases (slots.py), so nothing can cancel
        # or delay it: the shield and the deadline (two cancel scopes, a measurable share of a
        # request's CPU) guard only a shared store's network round trip.
        local = not self.store.shared
        with nullcontext() if local else anyio.CancelScope(shield=True):
            try:
                with nullcontext() if local else anyio.fail_after(self._release_timeout_s):
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
        for queue in self._queues.values():
            if queue:
                queue[0].wake.set()

    def _queue_changed(self, lane: str) -> None:
        queue = self._queues.get(lane, deque())
        self._metrics.queue_depth.labels(lane=lane).set(len(queue))

    def oldest_wait_s(self, lane: str) -> float:
        queue = self._queues.get(lane)
        return time.monotonic() - queue[0].since if queue else 0.0
