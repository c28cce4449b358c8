"""Failing over before the response began, and what real requests tell about engines.

    failover_candidates(lane, views, tried, serves) -> list[EngineView]      pure
    Failover(pool, metrics, log, on_change)                                  the edge: pool, logs

A request whose engine could not be reached (``EngineUnreachable``: refused, reset, or a
connection found closed, with no answer byte) may go elsewhere, because nothing reached the
client and the engine did not answer:

1. A kept-alive connection found closed (``stale``) is tried once more on a fresh connection
   to the same engine: the engine may only have closed an idle connection.
2. Otherwise the request moves, slot and all (``Admission.move``), to the next routable
   endpoint of its lane it has not tried: the lane's clusters first, then, only when none of
   those has one left, its emergency clusters; at most ``lanes[].retry.max_retries`` times,
   within the request's deadlines (one ``Watch`` spans every attempt).

Each retry is one ``route.retry`` event (request_id, lane, from, to, reason) and one
``shapegate_retries_total{lane,reason}``. Each failure (but a stale connection, which is no
evidence against the engine) and each answer feeds passive ejection in the pool
(engine_pool/outlier.py); an ejection is reported like any engine state change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from engine_pool.cluster import EngineView
from engine_pool.picker import order_endpoints
from engine_pool.registry import EnginePool, StateChange
from gateway.errors import EngineUnreachable
from gateway.log import Logger
from gateway.metrics import Metrics
from gateway.settings import ClusterSettings, LaneSettings


def failover_candidates(
    lane: LaneSettings,
    views: Mapping[str, Sequence[EngineView]],
    tried: set[tuple[str, str]],
    serves: Callable[[str], bool],
) -> list[EngineView]:
    """Routable endpoints not yet tried: the lane's clusters' first, else its emergency ones'."""
    for group in (lane.clusters, lane.emergency_clusters):
        found = [
            view
            for cluster in group
            if serves(cluster)
            for view in order_endpoints(views.get(cluster, ()))
            if (view.cluster, view.url) not in tried
        ]
        if found:
            return found
    return []


@dataclass(slots=True)
class Attempts:
    """One request's attempts: endpoints that failed it, and whether the next goes out fresh."""

    tried: set[tuple[str, str]] = field(default_factory=set)
    fresh: bool = False


class Failover:
    def __init__(
        self,
        pool: EnginePool,
        metrics: Metrics,
        log: Logger,
        on_change: Callable[[StateChange], None],
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._log = log
        self._on_change = on_change

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
