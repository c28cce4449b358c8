"""The ASGI app: ``create_app(settings)`` builds a gateway (services.py) and serves it.

The lifespan first rehearses a monster burst (gateway/request/rehearsal.py; uvicorn accepts no
connection before it is over, so readiness comes after it), then runs the engine monitor, the
boot probe, the trace writer and, with a config file (``shapegate serve``), policy reload on
SIGHUP and on file change (gateway/edge/reload.py) in the background; on shutdown it stops
admitting, lets in-flight requests drain up to ``server.drain_timeout_s`` and closes what was
opened.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from fastapi import FastAPI

from gateway.core.exchange import Receive, Scope, Send
from gateway.count.tokens import TokenCounter
from gateway.edge.api import add_routes
from gateway.edge.discovery import run_discovery
from gateway.edge.reload import reload_on_signal, watch_config
from gateway.edge.services import Gateway
from gateway.protocols.routes import ENGINE_ROUTES
from gateway.request.rehearsal import rehearse
from gateway.settings import Settings
from gateway.slots.host import WorkerGroup
from gateway.upstream.engines import watch_latency


def create_app(
    settings: Settings,
    counter: TokenCounter | None = None,
    config_path: Path | None = None,
    group: WorkerGroup | None = None,
) -> ShapegateApp:
    gateway = Gateway.build(settings, counter, config_path, group)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gateway.log.info(
            "gateway.started",
            lanes=[lane.name for lane in settings.lanes],
            clusters=[c.name for c in settings.clusters],
            state_backend=settings.state.backend,
        )
        await rehearse(gateway.pipeline.policy, gateway.log, gateway.metrics)
        async with anyio.create_task_group() as background:
            background.start_soon(gateway.run_monitor)
            background.start_soon(gateway.run_kv_events)
            background.start_soon(run_discovery, gateway)
            background.start_soon(watch_latency, gateway.pool, gateway.metrics, gateway.log)
            if settings.server.boot_probe:
                background.start_soon(gateway.probe.run_until_ready)
            if gateway.recorder.trace is not None:
                background.start_soon(gateway.recorder.trace.run)
            if config_path is not None:
                background.start_soon(reload_on_signal, gateway)
                if settings.server.watch_config:
                    background.start_soon(watch_config, gateway)
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
    """The ASGI app: the engine routes (gateway/protocols/routes.py) go straight to the pipeline,
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
