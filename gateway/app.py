"""Wiring: ``create_app(settings)`` builds every service of one gateway and the FastAPI app.

Everything is built here and passed explicitly: no module globals, no ``app.state`` grab-bag, so
each test builds a fresh gateway. Tokenizers are loaded and warmed in ``Gateway.build`` (a load
failure is a start-up error), never on the first request. The lifespan closes what was opened and,
on shutdown, stops admitting and lets in-flight requests drain up to ``server.drain_timeout_s``.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
from fastapi import FastAPI

from engine_pool.cluster import Cluster
from engine_pool.monitor import EngineMonitor
from engine_pool.registry import EnginePool
from gateway.admission import Admission
from gateway.engines import EngineEvents, probe_plans
from gateway.log import Logger, get_logger
from gateway.metrics import Metrics
from gateway.pipeline import Pipeline
from gateway.proxy import Upstream
from gateway.readiness import BootProbe
from gateway.settings import ConfigError, Settings
from gateway.slots import MemorySlotStore, SlotStore
from gateway.tokens import TokenCounter


def _engine_keys(settings: Settings) -> dict[str, str]:
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


def build_store(settings: Settings) -> SlotStore:
    if settings.state.backend == "redis":
        from gateway.slots_redis import RedisSlotStore

        return RedisSlotStore.from_settings(settings.state)
    return MemorySlotStore()


@dataclass
class Gateway:
    settings: Settings
    metrics: Metrics
    log: Logger
    counter: TokenCounter
    pool: EnginePool
    store: SlotStore
    admission: Admission
    upstream: Upstream
    pipeline: Pipeline
    monitor: EngineMonitor
    probe: BootProbe
    started_at: float

    @classmethod
    def build(cls, settings: Settings, counter: TokenCounter | None = None) -> Gateway:
        metrics = Metrics()
        log = get_logger("gateway")
        counter = counter or TokenCounter.from_settings(settings, metrics)
        pool = EnginePool(
            Cluster(name=c.name, kind=c.kind, endpoints=c.endpoints, models=c.models)
            for c in settings.clusters
        )
        store = build_store(settings)
        admission = Admission(store, metrics, log, poll_interval_s=settings.state.poll_interval_s)
        upstream = Upstream(metrics, log)
        keys = _engine_keys(settings)
        pipeline = Pipeline(settings, counter, pool, admission, upstream, metrics, log, keys)
        monitor = EngineMonitor(pool, probe_plans(settings), EngineEvents(settings, metrics, log))
        probe = BootProbe(settings, pool, upstream, log, keys)
        for lane in settings.lanes:
            metrics.queue_depth.labels(lane=lane.name).set(0)
            for name in (*lane.clusters, *lane.emergency_clusters):
                cluster = settings.cluster(name)
                metrics.slots_limit.labels(lane=lane.name, cluster=name).set(
                    min(lane.slots.lane, lane.slots.per_endpoint * len(cluster.endpoints))
                )
                metrics.slots_in_use.labels(lane=lane.name, cluster=name).set(0)
        return cls(
            settings,
            metrics,
            log,
            counter,
            pool,
            store,
            admission,
            upstream,
            pipeline,
            monitor,
            probe,
            time.time(),
        )

    @property
    def ready(self) -> bool:
        probed = self.probe.ready or not self.settings.server.boot_probe
        return probed and self.pipeline.accepting

    async def drain(self) -> None:
        """Stop admitting; wait for in-flight requests up to the drain deadline."""
        self.pipeline.accepting = False
        with anyio.move_on_after(self.settings.server.drain_timeout_s):
            while self.pipeline.in_flight:  # noqa: ASYNC110 - a bounded poll at shutdown
                await anyio.sleep(0.05)
        self.log.info("gateway.drained", left_in_flight=self.pipeline.in_flight)

    async def aclose(self) -> None:
        await self.upstream.aclose()
        await self.store.aclose()


def create_app(settings: Settings, counter: TokenCounter | None = None) -> FastAPI:
    from gateway.api import add_routes

    gateway = Gateway.build(settings, counter)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gateway.log.info(
            "gateway.started",
            lanes=[lane.name for lane in settings.lanes],
            clusters=[c.name for c in settings.clusters],
            state_backend=settings.state.backend,
        )
        async with anyio.create_task_group() as background:
            background.start_soon(gateway.monitor.run)
            if settings.server.boot_probe:
                background.start_soon(gateway.probe.run_until_ready)
            try:
                yield
            finally:
                await gateway.drain()
                background.cancel_scope.cancel()
                await gateway.aclose()
                gateway.log.info("gateway.stopped")

    app = FastAPI(
        title="shapegate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    add_routes(app, gateway)
    return app
