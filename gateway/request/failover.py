"""Failing over before the response began, and what real requests tell about engines.

    failover_candidates(lane, views, tried, serves, order) -> list[EngineView]   pure
    Failover(pool, admission, metrics, log, on_change)                       the edge
    await failover.next_attempt(request_id, held, exc, attempts, cluster) -> bool
    await failover.migrate(request_id, held, attempts, reason, tokens_sent) -> bool

A request whose engine could not be reached (``EngineUnreachable``: refused, reset, or a
connection found closed, with no answer byte) may go elsewhere, because nothing reached the
client and the engine did not answer:

1. A kept-alive connection found closed (``stale``) is tried once more on a fresh connection
   to the same engine: the engine may only have closed an idle connection.
2. Otherwise the request moves, slot and all (``Admission.move``), to the next routable
   endpoint of its lane it has not tried, in the request's own chain order (``Attempts.order``:
   the lane's weights, so a stream migrates where most of its prompt is believed cached): the
   lane's clusters first, then, only when none of those has one left, its emergency clusters;
   at most ``lanes[].retry.max_retries`` times, within the request's deadlines (one ``Watch``
   spans every attempt).

A stream whose engine failed after the answer began moves the same way (``migrate``; what it
sends there is gateway/request/migration.py's continuation): one ``route.migrated`` event
(request_id, lane, from, to, reason, tokens_sent) and ``shapegate_migrations_total{lane,outcome}``.

Each retry is one ``route.retry`` event (request_id, lane, from, to, reason) and one
``shapegate_retries_total{lane,reason}``. Each failure (but a stale connection, which is no
evidence against the engine) and each answer feeds passive ejection in the pool
(engine_pool/outlier.py); an ejection is reported like any engine state change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import anyio

from engine_pool.cluster import EngineView
from engine_pool.picker import order_endpoints
from engine_pool.registry import EnginePool, StateChange
from gateway.errors import EngineUnreachable
from gateway.observe.log import Logger
from gateway.observe.metrics import Metrics
from gateway.request.admission import Admission
from gateway.request.migration import Continuation
from gateway.request.slot import Held
from gateway.settings import ClusterSettings, LaneSettings


def failover_candidates(
    lane: LaneSettings,
    views: Mapping[str, Sequence[EngineView]],
    tried: set[tuple[str, str]],
    serves: Callable[[str], bool],
    order: Callable[[Sequence[EngineView]], Sequence[EngineView]] = order_endpoints,
) -> list[EngineView]:
    """Routable endpoints not yet tried, each cluster's in ``order`` (least loaded unless the
    request's chain says otherwise): the lane's clusters' first, else its emergency ones'."""
    for group in (lane.clusters, lane.emergency_clusters):
        found = [
            view
            for cluster in group
            if serves(cluster)
            for view in order(views.get(cluster, ()))
            if (view.cluster, view.url) not in tried
        ]
        if found:
            return found
    return []


@dataclass(slots=True)
class Attempts:
    """One request's attempts: its lane, where it may go, the endpoints that failed it, and
    whether the next attempt goes out on a fresh connection."""

    lane: LaneSettings
    views: Callable[[str], Sequence[EngineView]]
    serves: Callable[[str], bool]
    limit_of: Callable[[EngineView], int]
    # Seconds left of the request's total deadline: a move never waits past it.
    left_s: Callable[[], float]
    tried: set[tuple[str, str]] = field(default_factory=set)
    fresh: bool = False
    # A cluster's endpoints in the request's preference order (its endpoint chain).
    order: Callable[[Sequence[EngineView]], Sequence[EngineView]] = order_endpoints

    def candidates(self) -> list[EngineView]:
        lane = self.lane
        views = {c: self.views(c) for c in (*lane.clusters, *lane.emergency_clusters)}
        return failover_candidates(lane, views, self.tried, self.serves, self.order)


class Failover:
    def __init__(
        self,
        pool: EnginePool,
        admission: Admission,
        metrics: Metrics,
        log: Logger,
        on_change: Callable[[StateChange], None],
    ) -> None:
        self._pool = pool
        self._admission = admission
        self._metrics = metrics
        self._log = log
        self._on_change = on_change

    async def next_attempt(
        self,
        request_id: str,
        held: Held,
        exc: EngineUnreachable,
        attempts: Attempts,
        cluster: ClusterSettings,
    ) -> bool:
        """Record the failure and set up the next attempt: the same engine on a fresh
        connection, or the next endpoint with the slot moved there. False: give up (no retry
        left, or nowhere to go); the caller answers with ``exc``."""
        self.unreachable(cluster, held.url, exc)
        old, lane = held.url, attempts.lane
        if exc.stale and not attempts.fresh:
            attempts.fresh = True
        elif held.moves < lane.retry.max_retries:
            attempts.tried.add((held.cluster, held.url))
            attempts.fresh = False
            moved = False
            with anyio.move_on_after(attempts.left_s()):
                moved = await self._admission.move(
                    held, lane, attempts.candidates, attempts.limit_of
                )
            if not moved:
                return False
        else:
            return False
        self.retried(request_id, lane.name, old, held.url, exc.reason)
        return True

    async def migrate(
        self,
        request_id: str,
        held: Held,
        attempts: Attempts,
        reason: str,
        tokens_sent: int,
        continued: Callable[[str], Continuation],
    ) -> Continuation | None:
        """Move a stream whose engine failed mid-answer to the next routable endpoint of its
        lane, slot and all, and continue the answer there (``continued`` of its cluster,
        gateway/request/migration.py): one ``route.migrated`` event, naming how it continued.
        None when no endpoint took it within the deadlines."""
        old, lane = held.url, attempts.lane
        attempts.tried.add((held.cluster, held.url))
        attempts.fresh = False
        moved = False
        with anyio.move_on_after(attempts.left_s()):
            moved = await self._admission.move(held, lane, attempts.candidates, attempts.limit_of)
        if not moved:
            self.migration(lane.name, "failed")
            return None
        following = continued(held.cluster)
        where = {"from": old, "to": held.url}
        self._log.info(
            "route.migrated",
            request_id=request_id,
            lane=lane.name,
            reason=reason,
            tokens_sent=tokens_sent,
            continued=following.by,
            **where,
        )
        self.migration(lane.name, "migrated")
        return following

    def migration(self, lane: str, outcome: str) -> None:
        self._metrics.child(self._metrics.migrations, lane, outcome).inc()

    def unreachable(self, cluster: ClusterSettings, url: str, exc: EngineUnreachable) -> None:
        if exc.stale:
            return
        change = self._pool.unreachable(
            cluster.name,
            url,
            refused=exc.reason == "refused",
            eject_after=cluster.outlier.eject_after_connect_failures,
            why=exc.message,
        )
        self._ejected(change, "connect_failure")

    def answered(self, cluster: ClusterSettings, url: str, status: int) -> None:
        change = self._pool.answered(cluster.name, url, status, cluster.outlier.eject_after_5xx)
        self._ejected(change, "5xx")

    def _ejected(self, change: StateChange | None, cause: str) -> None:
        if change is not None:
            self._metrics.ejections.labels(cluster=change.cluster, cause=cause).inc()
            self._on_change(change)

    def retried(self, request_id: str, lane: str, old: str, new: str, reason: str) -> None:
        where = {"from": old, "to": new}  # "from" is a Python keyword
        self._log.info("route.retry", request_id=request_id, lane=lane, reason=reason, **where)
        self._metrics.child(self._metrics.retries, lane, reason).inc()
