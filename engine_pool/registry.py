"""The engine pool: every cluster's endpoints, their health and load, and in-flight counts.

Contract:
- ``EnginePool(clusters)`` builds one record per endpoint, UP; nothing here does I/O (the
  monitor, monitor.py, writes what its probers and scrapers find through ``set_state`` and
  ``set_load``; a change of state returns a ``StateChange``, None when nothing changed).
- ``reconcile(clusters)`` adopts a reloaded cluster list: endpoints that stay keep their state
  and in-flight counts, new ones start UP, removed ones leave routing at once and are forgotten
  when their last in-flight request ends.
- ``healthy_clusters()`` and ``views(cluster)`` are snapshots for the pure decisions in
  gateway/lanes.py and picker.py.
- ``track(cluster, url, scope)`` counts a request in flight on an endpoint for as long as the
  context is open (the count can never leak: release is the context's exit) and registers the
  request's cancel scope: when the endpoint goes DOWN, its in-flight requests are cancelled so
  they end with an error and free their slots instead of waiting out their deadlines.
- The caller logs each ``StateChange`` once, with its evidence.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import anyio

from engine_pool.cluster import Cluster, Engine, EngineState, EngineView
from engine_pool.latency import Latency, LatencyBook


@dataclass(frozen=True, slots=True)
class StateChange:
    cluster: str
    url: str
    old: EngineState
    new: EngineState
    evidence: str


class EnginePool:
    def __init__(self, clusters: Iterable[Cluster]) -> None:
        self.clusters = {c.name: c for c in clusters}
        self._engines = {
            (c.name, url): Engine(cluster=c.name, url=url, kind=c.kind)
            for c in self.clusters.values()
            for url in c.endpoints
        }
        self._scopes: dict[tuple[str, str], set[anyio.CancelScope]] = {
            key: set() for key in self._engines
        }
        self._retired: dict[tuple[str, str], Engine] = {}
        # What requests measured on each endpoint; judged against its peers (latency.py).
        self.latency = LatencyBook()

    def reconcile(self, clusters: Iterable[Cluster]) -> None:
        """Adopt a new cluster list (a policy reload). Endpoints that stay keep their state and
        in-flight counts; new ones start UP; removed ones leave routing at once, and their
        records live on, out of sight, until their in-flight requests finish."""
        self.clusters = {c.name: c for c in clusters}
        wanted = {(c.name, url): c for c in self.clusters.values() for url in c.endpoints}
        for key, cluster in wanted.items():
            if key not in self._engines:
                self._engines[key] = Engine(cluster=key[0], url=key[1], kind=cluster.kind)
                self._scopes[key] = set()
        for key in [k for k in self._engines if k not in wanted]:
            self._retired[key] = self._engines.pop(key)
        self.latency.forget(wanted)
        self._drop_idle_retired()

    def _drop_idle_retired(self) -> None:
        for key in [k for k, e in self._retired.items() if e.in_flight == 0]:
            del self._retired[key]
            self._scopes.pop(key, None)

    def engines(self) -> list[Engine]:
        return list(self._engines.values())

    def engine(self, cluster: str, url: str) -> Engine:
        return self._engines[(cluster, url)]

    def views(self, cluster: str) -> list[EngineView]:
        return [
            EngineView(
                cluster=e.cluster,
                url=e.url,
                state=e.state,
                in_flight=e.in_flight,
                waiting=e.waiting,
            )
            for e in self._engines.values()
            if e.cluster == cluster
        ]

    def routable(self, cluster: str, url: str) -> bool:
        engine = self._engines.get((cluster, url))
        return engine is not None and engine.state.routable

    def healthy_clusters(self) -> dict[str, bool]:
        healthy = dict.fromkeys(self.clusters, False)
        for engine in self._engines.values():
            if engine.state.routable:
                healthy[engine.cluster] = True
        return healthy

    def set_state(
        self, cluster: str, url: str, state: EngineState, evidence: str
    ) -> StateChange | None:
        engine = self._engines.get((cluster, url))
        if engine is None:  # removed by a reload while its prober was stopping
            return None
        engine.evidence = evidence
        if engine.state is state:
            return None
        change = StateChange(cluster, url, engine.state, state, evidence)
        engine.state = state
        engine.changed_at = time.time()
        if not state.routable:
            for scope in self._scopes[(cluster, url)]:
                scope.cancel()
        return change

    def set_load(
        self,
        cluster: str,
        url: str,
        *,
        running: float | None,
        waiting: float | None,
        kv_usage: float | None,
    ) -> None:
        engine = self._engines.get((cluster, url))
        if engine is None:
            return
        engine.running, engine.waiting, engine.kv_usage = running, waiting, kv_usage
        engine.load_at = time.time()

    def set_latency(self, cluster: str, url: str, latency: Latency) -> bool:
        """Record an endpoint's judged latency; True when it turned slow or recovered."""
        engine = self._engines.get((cluster, url))
        if engine is None:
            return False
        engine.ttft_p95 = latency.ttft_p95
        changed = (engine.slow is None) != (latency.slow is None)
        if changed:
            engine.slow_since = time.time() if latency.slow is not None else None
        engine.slow = latency.slow
        return changed

    @contextmanager
    def track(self, cluster: str, url: str, scope: anyio.CancelScope) -> Iterator[Engine]:
        engine = self._engines.get((cluster, url)) or self._retired[(cluster, url)]
        scopes = self._scopes[(cluster, url)]
        engine.in_flight += 1
        scopes.add(scope)
        try:
            yield engine
        finally:
            scopes.discard(scope)
            engine.in_flight -= 1
            if self._retired:
                self._drop_idle_retired()
