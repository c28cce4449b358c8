"""The engine pool: every cluster's endpoints, their health and load, and in-flight counts.

Contract:
- ``EnginePool(clusters)`` builds one record per endpoint, UP; nothing here does I/O (the
  monitor, monitor.py, writes what its probers and scrapers find through ``set_state`` and
  ``set_load``; a change of state returns a ``StateChange``, None when nothing changed).
- ``reconcile(clusters)`` adopts a reloaded cluster list: endpoints that stay keep their state
  and in-flight counts, new ones start UP (DOWN until probed in a ``probe_first`` cluster),
  removed ones leave routing at once and are forgotten when their last in-flight request ends.
- ``healthy_clusters()`` and ``views(cluster)`` are snapshots for the pure decisions in
  gateway/request/lanes.py and picker.py.
- ``track(cluster, url, scope)`` counts a request in flight on an endpoint for as long as the
  context is open (the count can never leak: release is the context's exit) and registers the
  request's cancel scope: when the endpoint goes DOWN, its in-flight requests are cancelled so
  they end with an error and free their slots instead of waiting out their deadlines.
- Every state change is returned as a ``StateChange`` so the caller logs it once with evidence.
- Passive health (engine_pool/outlier.py): ``unreachable`` and ``answered`` feed what real
  requests saw; enough consecutive failures eject the endpoint (DOWN, without cancelling its
  in-flight requests: they meet the failure themselves). The prober brings it back.
- Capability (engine_pool/capability.py): ``set_capability`` records what the engine reports
  (served names, context) and whether it is misconfigured for its lanes; views carry the
  context so routing keeps prompts it cannot hold away from it.
- Draining: ``drain(cluster, url)`` takes an endpoint out of routing (no view shows it, its
  cluster is not healthy through it) while its in-flight requests go on; ``undrain`` brings it
  back; ``drain_expired(cluster, url)`` cancels the requests still on it (as a DOWN endpoint's
  are; the gateway migrates their streams). An endpoint a reload removes is draining (``retired``
  lists those still serving requests).
- Slow start: an endpoint that joins (``reconcile``) or comes back from DOWN is ramped over its
  cluster's ``slow_start_s``; ``views`` carry the share (``EngineView.ramp``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from engine_pool.capability import Capability
from engine_pool.cluster import Cluster, Engine, EngineState, EngineView
from engine_pool.latency import Latency, LatencyBook
from engine_pool.outlier import judge_failure, ramp


class Cancellable(Protocol):
    """What ``track`` cancels when its endpoint is marked down: a cancel scope (anyio's, or
    the gateway's own on asyncio's cancellation)."""

    def cancel(self) -> None: ...


@dataclass(frozen=True, slots=True)
class StateChange:
    cluster: str
    url: str
    old: EngineState
    new: EngineState
    evidence: str
    # Back from DOWN into a slow start of this many seconds (0: full admission at once).
    slow_start_s: float = 0.0


@dataclass(frozen=True, slots=True)
class CapabilityChange:
    """An endpoint turned misconfigured (or no longer is), with the evidence."""

    cluster: str
    url: str
    misconfigured: bool
    evidence: str


class EnginePool:
    def __init__(self, clusters: Iterable[Cluster]) -> None:
        self.clusters = {c.name: c for c in clusters}
        self._engines = {
            (c.name, url): Engine(cluster=c.name, url=url, kind=c.kind)
            for c in self.clusters.values()
            for url in c.endpoints
        }
        self._scopes: dict[tuple[str, str], set[Cancellable]] = {
            key: set() for key in self._engines
        }
        self._retired: dict[tuple[str, str], Engine] = {}
        # What requests measured on each endpoint; judged against its peers (latency.py).
        self.latency = LatencyBook()

    def reconcile(self, clusters: Iterable[Cluster]) -> list[Engine]:
        """Adopt a new cluster list (a policy reload). Endpoints that stay keep their state and
        in-flight counts; new ones start UP (slow-starting if their cluster says so) and are
        returned; removed ones leave routing at once, and their records live on, out of sight,
        until their in-flight requests finish."""
        self.clusters = {c.name: c for c in clusters}
        wanted = {(c.name, url): c for c in self.clusters.values() for url in c.endpoints}
        joined = []
        for key, cluster in wanted.items():
            if key not in self._engines:
                engine = self._engines[key] = Engine(cluster=key[0], url=key[1], kind=cluster.kind)
                self._scopes[key] = set()
                if cluster.probe_first:
                    # Its first passing probe brings it UP and starts the slow start (set_state).
                    engine.state, engine.evidence = EngineState.DOWN, "joined, not probed yet"
                    engine.changed_at = time.time()
                else:
                    self._warm(engine, cluster.slow_start_s)
                joined.append(engine)
        for key in [k for k in self._engines if k not in wanted]:
            engine = self._retired[key] = self._engines.pop(key)
            self._mark_draining(engine, True, "removed by a reload")
        self.latency.forget(wanted)
        self._drop_idle_retired()
        return joined

    def _drop_idle_retired(self) -> None:
        for key in [k for k, e in self._retired.items() if e.in_flight == 0]:
            del self._retired[key]
            self._scopes.pop(key, None)

    def engines(self) -> list[Engine]:
        return list(self._engines.values())

    def retired(self) -> list[Engine]:
        """Endpoints a reload removed that still serve requests (draining)."""
        return list(self._retired.values())

    def _find(self, cluster: str, url: str) -> Engine | None:
        return self._engines.get((cluster, url)) or self._retired.get((cluster, url))

    def _mark_draining(self, engine: Engine, draining: bool, why: str) -> None:
        if engine.draining != draining:
            engine.draining = draining
            engine.draining_since = time.time() if draining else None
            engine.drain_reason = why if draining else None

    def drain(self, cluster: str, url: str, why: str = "drained") -> bool:
        """Take the endpoint out of routing; its requests in flight go on. False: unknown."""
        engine = self._engines.get((cluster, url))
        if engine is None:
            return False
        self._mark_draining(engine, True, why)
        return True

    def undrain(self, cluster: str, url: str) -> bool:
        """Bring a drained endpoint back into routing. False: unknown (or removed)."""
        engine = self._engines.get((cluster, url))
        if engine is None:
            return False
        self._mark_draining(engine, False, "")
        return True

    def drain_expired(self, cluster: str, url: str) -> int:
        """The drain deadline passed: cancel the requests still in flight on a draining
        endpoint (their streams migrate); how many were cancelled."""
        engine = self._find(cluster, url)
        if engine is None or not engine.draining:
            return 0
        scopes = self._scopes.get((cluster, url), set())
        for scope in scopes:
            scope.cancel()
        return len(scopes)

    def has(self, cluster: str, url: str) -> bool:
        """Whether the endpoint is in routing (not removed by a reload)."""
        return (cluster, url) in self._engines

    def engine(self, cluster: str, url: str) -> Engine:
        return self._engines[(cluster, url)]

    def state_of(self, cluster: str, url: str) -> EngineState:
        engine = self._engines.get((cluster, url))
        return EngineState.UP if engine is None else engine.state

    def views(self, cluster: str) -> list[EngineView]:
        # Read on every request by the active path (and a shadow policy): the clock only for
        # an endpoint still warming up.
        out, now = [], None
        for e in self._engines.values():
            if e.cluster != cluster or e.draining:
                continue
            share = 1.0
            if e.warming_since is not None:
                now = time.monotonic() if now is None else now
                share = ramp(e.warming_since, e.warming_s, now)
                if share >= 1.0:
                    e.warming_since = None
            # Positional, in the field order: a named tuple's keywords cost ~40% more.
            out.append(
                EngineView(
                    e.cluster,
                    e.url,
                    e.state,
                    e.in_flight,
                    e.waiting,
                    share,
                    e.context_tokens,
                    e.kv_capacity_tokens,
                )
            )
        return out

    def _warm(self, engine: Engine, window_s: float) -> None:
        if window_s > 0:
            engine.warming_since, engine.warming_s = time.monotonic(), window_s

    def routable(self, cluster: str, url: str) -> bool:
        engine = self._engines.get((cluster, url))
        return engine is not None and engine.state.routable and not engine.draining

    def healthy_clusters(self) -> dict[str, bool]:
        healthy = dict.fromkeys(self.clusters, False)
        for engine in self._engines.values():
            if engine.state.routable and not engine.draining:
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
        window = self.clusters[cluster].slow_start_s if engine.state is EngineState.DOWN else 0.0
        change = StateChange(cluster, url, engine.state, state, evidence, window)
        engine.state = state
        engine.changed_at = time.time()
        if not state.routable:
            for scope in self._scopes[(cluster, url)]:
                scope.cancel()
        elif change.old is EngineState.DOWN:
            engine.connect_failures = engine.errors_5xx = 0
            self._warm(engine, window)
        return change

    def unreachable(
        self, cluster: str, url: str, *, refused: bool, eject_after: int, why: str
    ) -> StateChange | None:
        """A real request could not reach the endpoint; eject it after ``eject_after`` in a row."""
        engine = self._engines.get((cluster, url))
        if engine is None:
            return None
        engine.connect_failures += 1
        return self._judged(
            engine,
            engine.connect_failures,
            eject_after,
            refused=refused,
            evidence=f"{engine.connect_failures} requests in a row: {why}",
        )

    def answered(
        self, cluster: str, url: str, status: int, eject_after_5xx: int
    ) -> StateChange | None:
        """A real request got an answer with ``status``; eject after enough 5xx in a row."""
        engine = self._engines.get((cluster, url))
        if engine is None:
            return None
        engine.connect_failures = 0
        if status < 500:
            engine.errors_5xx = 0
            return None
        engine.errors_5xx += 1
        return self._judged(
            engine,
            engine.errors_5xx,
            eject_after_5xx,
            refused=False,
            evidence=f"{engine.errors_5xx} requests in a row answered HTTP {status}",
        )

    def _judged(
        self, engine: Engine, failures: int, threshold: int, *, refused: bool, evidence: str
    ) -> StateChange | None:
        if engine.state is EngineState.DOWN:
            return None
        others = sum(
            1
            for e in self._engines.values()
            if e.cluster == engine.cluster and e is not engine and e.state.routable
        )
        if not judge_failure(failures, threshold, refused=refused, others_routable=others):
            return None
        return self._eject(engine, evidence)

    def _eject(self, engine: Engine, evidence: str) -> StateChange:
        # Its in-flight requests are not cancelled: each meets the engine's failure itself, and
        # one erroring request is no proof the others are lost.
        change = StateChange(
            engine.cluster, engine.url, engine.state, EngineState.DOWN, "ejected: " + evidence
        )
        engine.state, engine.evidence = EngineState.DOWN, change.evidence
        engine.changed_at = time.time()
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

    def set_capability(
        self, cluster: str, url: str, capability: Capability | None, problem: str | None
    ) -> CapabilityChange | None:
        """Record what the engine reported (None: it could not be read; what was known stays)
        and whether it falls short of its lanes; a change of verdict is returned once."""
        engine = self._engines.get((cluster, url))
        if engine is None:
            return None
        engine.capability_read = True
        if capability is None:
            return None
        engine.served = capability.models
        engine.max_model_len = capability.max_model_len
        engine.context_tokens = capability.context_tokens
        engine.kv_capacity_tokens = capability.kv_capacity_tokens
        was = engine.misconfigured
        engine.misconfigured = problem
        if (was is None) == (problem is None):
            return None
        engine.misconfigured_since = time.time() if problem is not None else None
        evidence = problem if problem is not None else f"no longer misconfigured (was: {was})"
        return CapabilityChange(cluster, url, problem is not None, evidence)

    def capability_read(self, cluster: str, url: str) -> bool:
        engine = self._engines.get((cluster, url))
        return engine is None or engine.capability_read

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

    def track(self, cluster: str, url: str, scope: Cancellable) -> Tracked:
        """``with pool.track(...) as engine:`` counts the request in flight on the endpoint
        and registers ``scope`` until the block exits."""
        return Tracked(self, cluster, url, scope)


class Tracked:
    """One request in flight on an endpoint (``EnginePool.track``), as a class rather than a
    generator context manager: entered on every attempt of every request, where the
    generator, its two resumptions and ``contextlib``'s wrapper cost several calls."""

    __slots__ = ("_engine", "_pool", "_scope", "_scopes")

    def __init__(self, pool: EnginePool, cluster: str, url: str, scope: Cancellable) -> None:
        key = (cluster, url)
        self._pool = pool
        self._engine = pool._engines.get(key) or pool._retired[key]
        self._scopes = pool._scopes[key]
        self._scope = scope

    def __enter__(self) -> Engine:
        self._engine.in_flight += 1
        self._scopes.add(self._scope)
        return self._engine

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._scopes.discard(self._scope)
        self._engine.in_flight -= 1
        if self._pool._retired:
            self._pool._drop_idle_retired()
