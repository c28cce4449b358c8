"""The dashboard's routes: the static page and its JSON state, behind the admin guard.

    GET /dashboard                  the page (index.html); no build step, no CDN, no fonts
    GET /dashboard/static/<file>    app.js, style.css (read once at start-up, served from memory)
    GET /admin/dashboard.json       the state the page polls (see state.py); with workers
                                    (gateway/edge/workers.py), every worker's merged
                                    (gateway/edge/admin/merge.py)

The page's files are package data, read when the routes are added: a missing file is a start-up
error, and no request path ever reaches the filesystem.
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from gateway.edge.admin.guard import AdminGuard
from gateway.edge.admin.merge import merge_dashboard
from gateway.edge.admin.state import StateCache, StoreWatch, build_state
from gateway.edge.peers import worker_only

if TYPE_CHECKING:
    from gateway.edge.services import Gateway

STATIC = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# Everything the page loads comes from this origin; nothing inline, nothing framed.
PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def _read_static() -> dict[str, bytes]:
    folder = resources.files("gateway.edge.admin") / "static"
    return {name: (folder / name).read_bytes() for name in STATIC}


def add_dashboard_routes(app: FastAPI, gateway: Gateway, min_interval_s: float = 0.5) -> None:
    def token_of() -> str | None:
        token = gateway.settings.server.admin_token  # the policy in force, reloads included
        return None if token is None else token.get_secret_value()

    app.add_middleware(AdminGuard, token_of=token_of)
    gateway.log.info("admin.guard", mode="loopback_only" if token_of() is None else "bearer_token")
    files = _read_static()
    watch = StoreWatch()

    async def build() -> dict[str, object]:
        return await build_state(gateway, watch)

    async def build_all() -> dict[str, object]:
        local = orjson.loads(await cache.get())
        if gateway.peers is None:
            return dict(local)
        answers = await gateway.peers.ask("GET", "/admin/dashboard.json")
        ok = [a.response.json() for a in answers if a.response and a.response.status_code == 200]
        return merge_dashboard([local, *ok])

    cache = StateCache(build, min_interval_s)  # this worker's
    whole = StateCache(build_all, min_interval_s)  # the gateway's

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return Response(files["index.html"], media_type=STATIC["index.html"], headers=PAGE_HEADERS)

    @app.get("/dashboard/static/{name}")
    async def dashboard_static(name: str) -> Response:
        if name not in files or name == "index.html":
            return Response(b"not found", status_code=404, media_type="text/plain")
        return Response(files[name], media_type=STATIC[name], headers=PAGE_HEADERS)

    @app.get("/admin/dashboard.json")
    async def dashboard_state(request: Request) -> Response:
        alone = gateway.peers is None or worker_only(request.scope)
        return Response(
            await (cache if alone else whole).get(),
            media_type="application/json",
            headers={"cache-control": "no-store", "x-content-type-options": "nosniff"},
        )
