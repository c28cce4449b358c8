"""Wiring: ``create_app(settings)`` builds every service of one gateway and the FastAPI app.

Everything is built here and passed explicitly: no module globals, no ``app.state`` grab-bag, so
each test builds a fresh gateway. Tokenizers are loaded and warmed in ``Gateway.build`` (a load
failure is a start-up error), never on the first request. The lifespan runs the engine monitor
and the boot probe in the background, closes what was opened and, on shutdown, stops admitting
and lets in-flight requests drain up to ``server.drain_timeout_s``.

With a config file (``shapegate serve``), the policy reloads on ``POST /admin/reload``, on
SIGHUP, and, if ``server.watch_config`` is set, when the file changes (gateway/reload.py).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from fastapi import FastAPI

from engine_pool.cluster import Cluster
from engine_pool.monitor import EngineMonitor
from engine_pool.registry import EnginePool
from gateway.admission import Admission
from gateway.auth import ClientAuth
from gateway.engines import EngineEvents, probe_plans
from gateway.exchange import Receive, Scope, Send
from gateway.log import Logger, get_logger, swallowed
from gateway.metrics import Metrics
from gateway.pipeline import Pipeline, Policy
from gateway.proxy import Upstream
from gateway.readiness import BootProbe
from gateway.reload import ReloadResult, apply_reload
from gateway.response_affinity import build_affinity
from gateway.routes import ENGINE_ROUTES
from gateway.settings import ConfigError, Settings, load_settings
from gateway.slots import MemorySlotStore, SlotStore
from gateway.tokens import TokenCounter


def build_store(settings: Settings, metrics: Metrics, log: Logger) -> SlotStore:
    if settings.state.backend == "redis":
        from gateway.slots_redis import RedisSlotStore

        return RedisSlotStore.from_settings(settings.state, metrics, log)
    return MemorySlotStore()


def _set_limits(metrics: Metrics, settings: Settings) -> None:
    for lane in settings.lanes:
        metrics.queue_depth.labels(lane=lane.name).set(0)
        for name in (*lane.clusters, *lane.emergency_clusters):
            cluster = settings.cluster(name)
            metrics.slots_limit.labels(lane=lane.name, cluster=name).set(
                min(lane.slots.lane, lane.slots.per_endpoint * len(cluster.endpoints))
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
    started_at: float = field(default_factory=time.time)
    _monitor_scope: anyio.CancelScope | None = None

    @classmethod
    def build(
        cls,
        settings: Settings,
        counter: TokenCounter | None = None,
        config_path: Path | None = None,
    ) -> Gateway:
        metrics = Metrics()
        log = get_logger("gateway")
        counter = counter or TokenCounter.from_settings(settings, metrics)
        pool = EnginePool(
            Cluster(name=c.name, kind=c.kind, endpoints=c.endpoints, models=c.models)
            for c in settings.clusters
        )
        store = build_store(settings, metrics, log)
        admission = Admission(store, metrics, log, poll_interval_s=settings.state.poll_interval_s)
        upstream = Upstream(metrics, log)
        keys = cls.engine_keys_for(settings)
        pipeline = Pipeline(
            Policy(settings, counter, keys, ClientAuth.from_settings(settings.auth)),
            pool,
            admission,
            upstream,
            metrics,
            log,
            build_affinity(settings, log, metrics),
        )
        monitor = EngineMonitor(pool, probe_plans(settings), EngineEvents(settings, metrics, log))
        probe = BootProbe(settings, pool, upstream, log, keys)
        _set_limits(metrics, settings)
        return cls(
            metrics, log, pool, store, admission, upstream, pipeline, monitor, probe, config_path
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
    def counter(self) -> TokenCounter:
        return self.pipeline.policy.counter

    @property
    def ready(self) -> bool:
        probed = self.probe.ready or not self.settings.server.boot_probe
        return probed and self.pipeline.accepting

    def adopt(self, settings: Settings) -> None:
        """Point the background services at a reloaded policy (gateway/reload.py)."""
        self.monitor = EngineMonitor(
            self.pool, probe_plans(settings), EngineEvents(settings, self.metrics, self.log)
        )
        if self._monitor_scope is not None:
            self._monitor_scope.cancel()
        self.probe.adopt(settings, self.pipeline.policy.engine_keys)
        _set_limits(self.metrics, settings)

    async def reload(self, settings: Settings | None = None) -> ReloadResult:
        """Re-read the config file (or take ``settings``) and apply it; ConfigError if invalid."""
        if settings is None:
            if self.config_path is None:
                raise ConfigError("this gateway was not started from a config file")
            settings = load_settings(self.config_path)
        return await apply_reload(self, settings)

    async def run_monitor(self) -> None:
        """The engine monitor, restarted whenever a reload replaces it."""
        while True:
            with anyio.CancelScope() as self._monitor_scope:
                await self.monitor.run()

    async def reload_on_signal(self) -> None:
        with anyio.open_signal_receiver(signal.SIGHUP) as signals:
            async for _ in signals:
                await self._reload_logged("sighup")

    async def watch_config(self) -> None:
        assert self.config_path is not None
        seen = self.config_path.stat().st_mtime_ns
        while True:
            await anyio.sleep(self.settings.server.watch_interval_s)
            try:
                mtime = self.config_path.stat().st_mtime_ns
            except OSError as exc:
                swallowed(self.log, self.metrics, "app.watch_config", exc, decision="keep_policy")
                continue
            if mtime != seen:
                seen = mtime
                await self._reload_logged("file_changed")

    async def _reload_logged(self, trigger: str) -> None:
        try:
            await self.reload()
        except ConfigError as exc:
            self.log.warning("policy.reload_failed", trigger=trigger, error=str(exc))

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
        await self.pipeline.affinity.aclose()


def create_app(
    settings: Settings, counter: TokenCounter | None = None, config_path: Path | None = None
) -> ShapegateApp:
    from gateway.api import add_routes

    gateway = Gateway.build(settings, counter, config_path)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gateway.log.info(
            "gateway.started",
            lanes=[lane.name for lane in settings.lanes],
            clusters=[c.name for c in settings.clusters],
            state_backend=settings.state.backend,
        )
        async with anyio.create_task_group() as background:
            background.start_soon(gateway.run_monitor)
            if settings.server.boot_probe:
                background.start_soon(gateway.probe.run_until_ready)
            if gateway.pipeline.trace is not None:
                background.start_soon(gateway.pipeline.trace.run)
            if config_path is not None:
                background.start_soon(gateway.reload_on_signal)
                if settings.server.watch_config:
                    background.start_soon(gateway.watch_config)
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
    return ShapegateApp(app, gateway)


class ShapegateApp:
    """The ASGI app: the engine routes (gateway/routes.py) go straight to the pipeline,
    everything else (and the lifespan) to FastAPI. The hot path skips the middleware stack,
    which the overhead benchmark's profile showed at 6-8% of a request's CPU; the routes stay
    registered in FastAPI too, so nothing depends on this shortcut for correctness."""

    def __init__(self, api: FastAPI, gateway: Gateway) -> None:
        self.api = api
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = ENGINE_ROUTES.get(scope["path"])
            if route is not None:
                await self.gateway.pipeline.handle(route, scope, receive, send)
                return
        await self.api(scope, receive, send)
