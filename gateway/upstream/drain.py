"""Draining endpoints: out of routing now, their requests in flight finish; past the deadline
the rest are cancelled, and their streams migrate (gateway/request/migration.py).

    Drainer(pool, log)
      drain(cluster, url, deadline_s, why) -> bool    POST /admin/engines/drain, the policy
      undrain(cluster, url) -> bool                   POST /admin/engines/undrain, the policy
      adopt(old, new)                                 a reload: ``clusters[].draining`` applied,
                                                      removed endpoints drained (old drain_s)
      close()                                         the deadlines cancelled (shutdown)

Each drain is one ``engine.draining`` event (cluster, endpoint, reason, in_flight, deadline_s);
a deadline that cancels requests one ``engine.drain_expired`` (cluster, endpoint, cancelled).
The pool (engine_pool/registry.py) keeps the state; this module owns only the timers.
"""

from __future__ import annotations

import asyncio

from engine_pool.registry import EnginePool
from gateway.observe.log import Logger
from gateway.settings import Settings

POLICY = "clusters[].draining"
REMOVED = "removed by a reload"


class Drainer:
    def __init__(self, pool: EnginePool, log: Logger) -> None:
        self._pool = pool
        self._log = log
        self._timers: dict[tuple[str, str], asyncio.TimerHandle] = {}

    def drain(self, cluster: str, url: str, deadline_s: float, why: str) -> bool:
        """Drain one endpoint of a cluster; False when the pool does not know it."""
        if not self._pool.drain(cluster, url, why):
            return False
        self._start(cluster, url, deadline_s, why)
        return True

    def _start(self, cluster: str, url: str, deadline_s: float, why: str) -> None:
        key = (cluster, url)
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()
        in_flight = sum(
            e.in_flight
            for e in (*self._pool.engines(), *self._pool.retired())
            if (e.cluster, e.url) == key
        )
        self._log.info(
            "engine.draining",
            cluster=cluster,
            endpoint=url,
            reason=why,
            in_flight=in_flight,
            deadline_s=deadline_s,
        )
        loop = asyncio.get_running_loop()
        self._timers[key] = loop.call_later(deadline_s, self._expired, cluster, url)

    def _expired(self, cluster: str, url: str) -> None:
        self._timers.pop((cluster, url), None)
        cancelled = self._pool.drain_expired(cluster, url)
        if cancelled:
            self._log.info(
                "engine.drain_expired", cluster=cluster, endpoint=url, cancelled=cancelled
            )

    def undrain(self, cluster: str, url: str) -> bool:
        timer = self._timers.pop((cluster, url), None)
        if timer is not None:
            timer.cancel()
        if not self._pool.undrain(cluster, url):
            return False
        self._log.info("engine.undrained", cluster=cluster, endpoint=url)
        return True

    def adopt(self, old: Settings | None, new: Settings) -> None:
        """After the pool adopted ``new``: endpoints a reload removed drain under their old
        cluster's ``drain_s``; ``clusters[].draining`` is drained, and an endpoint the policy
        drained before and no longer lists comes back."""
        for engine in self._pool.retired():
            key = (engine.cluster, engine.url)
            if key not in self._timers and engine.in_flight > 0:
                was = [c for c in old.clusters if c.name == engine.cluster] if old else []
                self._start(engine.cluster, engine.url, was[0].drain_s if was else 0.0, REMOVED)
        for cluster in new.clusters:
            listed = set(cluster.draining)
            for engine in self._pool.engines():
                if engine.cluster != cluster.name:
                    continue
                if engine.url in listed and not engine.draining:
                    self.drain(cluster.name, engine.url, cluster.drain_s, POLICY)
                elif engine.url not in listed and engine.drain_reason == POLICY:
                    self.undrain(cluster.name, engine.url)

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
