"""The services of one gateway, built and wired by ``Gateway.build(settings)``.

Everything is built here and passed explicitly: no module globals, no ``app.state`` grab-bag, so
each test builds a fresh gateway. Tokenizers are loaded and warmed in ``Gateway.build`` (a load
failure is a start-up error), never on the first request. ``drain`` stops admitting and waits
for in-flight requests up to ``server.drain_timeout_s``. The routes (api.py, dashboard/) and hot
reload (reload.py) take a ``Gateway``; the ASGI app and its lifespan are app.py's. ``aclose``
closes what the gateway built: the upstream pool, the slot store, the token counter it loaded
(its worker thread and tokenizer child process; a counter passed in belongs to the caller) and
the tracing exporter (flushed within its timeout).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import anyio

from engine_pool.cluster import Cluster
from engine_pool.kv_events import KvEventsReader
from engine_pool.monitor import EngineMonitor
from engine_pool.registry import EnginePool
from gateway.count.tokens import TokenCounter
from gateway.edge.peers import Peers
from gateway.observe.log import Logger, get_logger
from gateway.observe.metrics import Metrics
from gateway.observe.recorder import Recorder
from gateway.observe.tracing import Tracing
from gateway.request.admission import Admission
from gateway.request.auth import ClientAuth
from gateway.request.failover import Failover
from gateway.request.lanes import endpoint_limit
from gateway.request.pipeline import Pipeline
from gateway.request.policy import Policy
from gateway.request.prefix import readers
from gateway.request.response_affinity import build_affinity
from gateway.settings import ConfigError, Settings
from gateway.slots.host import HostSlotStore, WorkerGroup
from gateway.slots.store import MemorySlotStore, SlotStore
from gateway.upstream.drain import POLICY, Drainer
from gateway.upstream.engines import EngineEvents, probe_plans
from gateway.upstream.proxy import Upstream
from gateway.upstream.readiness import BootProbe


def clusters_of(settings: Settings) -> Iterator[Cluster]:
    """The engine pool's view of the configured clusters (at start and on every reload)."""
    for c in settings.clusters:
        yield Cluster(
            name=c.name,
            kind=c.kind,
            endpoints=c.endpoints,
            models=c.models,
            slow_start_s=c.outlier.slow_start_s,
            probe_first=c.discovery is not None,
        )


def deadlines_of(settings: Settings) -> list[float]:
    """Every lane's first-byte, idle and total deadline: latency histograms' bucket edges."""
    return [
        s
        for lane in settings.lanes
        for s in (lane.timeouts.first_byte_s, lane.timeouts.idle_s, lane.timeouts.total_s)
    ]


def build_store(
    settings: Settings, metrics: Metrics, log: Logger, group: WorkerGroup | None = None
) -> SlotStore:
    """Redis when configured; else the supervisor's slot server for a worker of a group
    (gateway/slots/host.py), else this process's memory."""
    if settings.state.backend == "redis":
        from gateway.slots.redis_store import RedisSlotStore

        state = settings.state
        if group is not None:
            # fail_open_local splits each limit between everything that shares it: each
            # worker of each replica.
            state = state.model_copy(update={"replicas": state.replicas * group.count})
        return RedisSlotStore.from_settings(state, metrics, log)
    if group is not None:
        return HostSlotStore(
            group.slot_socket,
            group.index,
            metrics=metrics,
            log=log,
            # Without the supervisor nothing can be admitted: drain and exit.
            on_lost=lambda: os.kill(os.getpid(), signal.SIGTERM),
        )
    return MemorySlotStore()


def _set_limits(metrics: Metrics, settings: Settings) -> None:
    for lane in settings.lanes:
        metrics.queue_depth.labels(lane=lane.name).set(0)
        for name in (*lane.clusters, *lane.emergency_clusters):
            cluster = settings.cluster(name)
            metrics.slots_limit.labels(lane=lane.name, cluster=name).set(
                min(
                    lane.slots.lane,
                    endpoint_limit(settings.lanes, lane, name) * len(cluster.endpoints),
                )
            )
            metrics.slots_in_use.labels(lane=lane.name, cluster=name).inc(0)


@dataclass
class Gateway:
    metrics: Metrics
    log: Logger
    pool: EnginePool
    store: SlotStore
    admission: Admission
    upstream: Upstream
    pipeline: Pipeline
    monitor: EngineMonitor
    probe: BootProbe
    config_path: Path | None = None
    # Whether the policy's counter was loaded here (closed here) or passed in by the caller.
    owns_counter: bool = True
    group: WorkerGroup | None = None
    # The other workers of the group, for the gateway-wide views (gateway/edge/peers.py).
    peers: Peers | None = None
    started_at: float = field(default_factory=time.time)
    # Endpoints found by DNS per cluster (gateway/edge/discovery.py), added to the policy's.
    discovered: dict[str, tuple[str, ...]] = field(default_factory=dict)
    _monitor_scope: anyio.CancelScope | None = None
    # Draining endpoints' deadlines (gateway/upstream/drain.py).
    drainer: Drainer = field(init=False)

    def __post_init__(self) -> None:
        self.drainer = Drainer(self.pool, self.log)

    @classmethod
    def build(
        cls,
        settings: Settings,
        counter: TokenCounter | None = None,
        config_path: Path | None = None,
        group: WorkerGroup | None = None,
    ) -> Gateway:
        metrics = Metrics(deadlines_of(settings))
        log = get_logger("gateway")
        owns_counter = counter is None
        counter = counter or TokenCounter.from_settings(settings, metrics)
        pool = EnginePool(clusters_of(settings))
        for cluster in settings.clusters:  # planned removals: out of routing from the start
            for url in cluster.draining:
                pool.drain(cluster.name, url, POLICY)
        metrics.watch_in_flight(lambda: ((e.cluster, e.url, e.in_flight) for e in pool.engines()))
        store = build_store(settings, metrics, log, group)
        admission = Admission(store, metrics, log, poll_interval_s=settings.state.poll_interval_s)
        upstream = Upstream()
        keys = cls.engine_keys_for(settings)

        # An endpoint going down: the approximate prefix index forgets it (a restart empties
        # its engine's cache). ``pipeline`` is bound below, before any event can arrive.
        def on_down(url: str) -> None:
            pipeline.prefixes.engine_down(url)

        def on_restart(url: str) -> None:
            pipeline.prefixes.engine_restarted(url)

        events = EngineEvents(settings, metrics, log, pool, on_down=on_down, on_restart=on_restart)
        pipeline = Pipeline(
            Policy(settings, counter, keys, ClientAuth.from_settings(settings.auth)),
            pool,
            admission,
            upstream,
            Recorder(
                metrics,
                log,
                ring_size=settings.server.decision_ring_size,
                trace_file=settings.state.trace_file,
                latency=pool.latency,
                tracing=Tracing.from_settings(settings.tracing, metrics, log),
            ),
            Failover(pool, admission, metrics, log, events),
            build_affinity(settings, log, metrics),
        )
        monitor = EngineMonitor(pool, probe_plans(settings, keys), events)
        probe = BootProbe(settings, pool, upstream, log, keys)
        _set_limits(metrics, settings)
        peers = None
        if group is not None:

            def token_of() -> str | None:
                token = pipeline.policy.settings.server.admin_token
                return None if token is None else token.get_secret_value()

            peers = Peers(group, log, metrics, token_of)
        return cls(
            metrics,
            log,
            pool,
            store,
            admission,
            upstream,
            pipeline,
            monitor,
            probe,
            config_path,
            owns_counter,
            group,
            peers,
        )

    @staticmethod
    def engine_keys_for(settings: Settings) -> dict[str, str]:
        keys = {}
        for cluster in settings.clusters:
            if cluster.api_key_env:
                value = os.environ.get(cluster.api_key_env)
                if not value:
                    raise ConfigError(
                        f"cluster {cluster.name!r}: environment variable {cluster.api_key_env} "
                        "(api_key_env) is not set"
                    )
                keys[cluster.name] = value
        return keys

    @property
    def settings(self) -> Settings:
        """The policy in force for new requests."""
        return self.pipeline.policy.settings

    @property
    def recorder(self) -> Recorder:
        return self.pipeline.recorder

    @property
    def counter(self) -> TokenCounter:
        return self.pipeline.policy.counter

    @property
    def ready(self) -> bool:
        probed = self.probe.ready or not self.settings.server.boot_probe
        return probed and self.pipeline.accepting

    def adopt(self, settings: Settings) -> None:
        """Point the background services at a reloaded policy (gateway/edge/reload.py)."""
        self.monitor = EngineMonitor(
            self.pool,
            probe_plans(settings, self.pipeline.policy.engine_keys),
            EngineEvents(
                settings,
                self.metrics,
                self.log,
                self.pool,
                on_down=self.pipeline.prefixes.engine_down,
                on_restart=self.pipeline.prefixes.engine_restarted,
            ),
        )
        if self._monitor_scope is not None:
            self._monitor_scope.cancel()
        self.probe.adopt(settings, self.pipeline.policy.engine_keys)
        _set_limits(self.metrics, settings)

    async def run_kv_events(self) -> None:
        """The KV event readers (prefix_index.source kv_events), one per publishing endpoint;
        one that fails is logged, counted and started again after a second."""
        found = readers(self.settings, self.pipeline.prefixes, self.metrics)

        async def keep(reader: KvEventsReader) -> None:
            while True:
                try:
                    await reader.run()
                except Exception as exc:  # noqa: BLE001 - logged, counted, retried
                    self.metrics.kv_events_rebuilds.labels(reader.blocks.url).inc()
                    reader.blocks.restart_from(0)
                    self.log.warning(
                        "kv_events.reader_failed", endpoint=reader.blocks.url, error=repr(exc)
                    )
                await anyio.sleep(1.0)

        async with anyio.create_task_group() as group:
            for reader in found:
                group.start_soon(keep, reader)

    async def run_monitor(self) -> None:
        """The engine monitor, restarted whenever a reload replaces it."""
        while True:
            with anyio.CancelScope() as self._monitor_scope:
                await self.monitor.run()

    async def drain(self) -> None:
        """Stop admitting; wait for in-flight requests up to the drain deadline."""
        self.pipeline.accepting = False
        with anyio.move_on_after(self.settings.server.drain_timeout_s):
            while self.pipeline.in_flight:  # noqa: ASYNC110 - a bounded poll at shutdown
                await anyio.sleep(0.05)
        self.log.info("gateway.drained", left_in_flight=self.pipeline.in_flight)

    async def aclose(self) -> None:
        # Shielded, all of it: the lifespan calls this after cancelling its background tasks'
        # scope (app.py), and anyio delivers that cancellation at every await inside the scope.
        # Only the counter and tracing closes were shielded once: the store's first await (a
        # Redis pool's disconnect) was cancelled and nothing after it ran, so the Redis and
        # Sentinel clients' connections, the response-affinity client and the peer clients
        # stayed open, their sockets freed only when the garbage collector got to them. Each
        # close is bounded on its own (a Redis disconnect by ``redis_timeout_s``), and one that
        # fails (redis-py raises a disconnect's timeout, after the others in its pool) leaves the
        # rest to close all the same: the first failure is raised once everything was tried.
        with anyio.CancelScope(shield=True):
            self.drainer.close()
            closes: list[tuple[str, Callable[[], Awaitable[object]]]] = [
                ("upstream", self.upstream.aclose),
                ("store", self.store.aclose),
                ("affinity", self.pipeline.affinity.aclose),
            ]
            if self.owns_counter:
                closes.append(("counter", partial(anyio.to_thread.run_sync, self.counter.close)))
            tracing = self.recorder.tracing
            if tracing is not None:
                closes.append(("tracing", partial(anyio.to_thread.run_sync, tracing.close)))
            if self.peers is not None:
                closes.append(("peers", self.peers.aclose))
            failed: Exception | None = None
            for what, close in closes:
                try:
                    await close()
                except Exception as exc:  # noqa: BLE001 - logged, raised after the rest
                    self.log.warning("gateway.close_failed", what=what, error=repr(exc))
                    failed = failed or exc
            if failed is not None:
                raise failed
