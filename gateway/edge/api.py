"""Thin routes. The engine routes (gateway/protocols/routes.py) are raw ASGI endpoints handing the
exchange to the pipeline; the rest answer from config or from snapshots of the gateway's state.

    POST /v1/chat/completions, /v1/responses,    -> Pipeline.handle (every path in
         /v1/messages, /v1/embeddings, ...          gateway/protocols/routes.py ENGINE_ROUTES)
    GET  /v1/models                              the configured models (names and aliases)
    GET  /v1/models/{id}                         one of them, or an OpenAI-shaped 404
    GET  /version                                the gateway's version
    GET  /healthz                                the process answers
    GET  /readyz                                 503 until every lane passed the boot probe, while
                                                 draining, and while a lane has no routable
                                                 cluster; each lane's state and evidence
    POST /admin/probe                            run the boot probe now; per-lane results
    POST /admin/reload                           reload the policy (file, or a policy in the body)
    POST /admin/engines/drain, /undrain          ``{"url": ...}``: take an endpoint out of routing
                                                 (its requests finish, or past its cluster's
                                                 drain_s migrate), or bring it back
    GET  /admin/state                            lanes, clusters, slots, queues, recent decisions,
                                                 the prefix index (entries, bound, blocks, lag)
    POST/GET/DELETE /admin/shadow, POST /admin/shadow/promote
                                                 a candidate policy deciding on live traffic
                                                 beside the active one (edge/shadow_routes.py)
    GET  /metrics                                Prometheus
    GET  /dashboard, /admin/dashboard.json       the ops page and its state
    (gateway/edge/admin)

With ``serve --workers N`` the admin state, ``/metrics``, the dashboard's state and a reload
cover every worker (gateway/edge/peers.py asks the others, gateway/edge/admin/merge.py merges).

Any other path answers an OpenAI-shaped 404 and a wrong method an OpenAI-shaped 405
(Anthropic-shaped on /v1/messages), never FastAPI's ``{"detail": ...}``.
"""

from __future__ import annotations

import os
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.routing import Route

from gateway.config_check import parse_policy
from gateway.core.exchange import Receive, Scope, Send, header, read_body, require_media_type
from gateway.core.slots import endpoint_key, lane_key
from gateway.edge.admin.merge import merge_admin_state, merge_metrics
from gateway.edge.admin.routes import add_dashboard_routes
from gateway.edge.admin.state import borrowing_state
from gateway.edge.peers import worker_only
from gateway.edge.reload import reload_policy
from gateway.edge.services import Gateway
from gateway.edge.shadow_routes import add_shadow_routes
from gateway.errors import GatewayError, Unauthorized, anthropic_error_body, error_body
from gateway.protocols.routes import ENGINE_ROUTES, EngineRoute
from gateway.settings import ConfigError
from gateway.upstream.readiness import endpoint_health, lane_states

# A policy file is a few kB; anything near this cap is not one.
RELOAD_MAX_BYTES = 1024 * 1024
POLICY_MEDIA_TYPES = frozenset(
    {"application/json", "application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml"}
)


class _ProxyRoute:
    """A raw ASGI endpoint, so the pipeline sees ``receive`` and ``send`` itself."""

    def __init__(self, gateway: Gateway, route: EngineRoute) -> None:
        self._gateway = gateway
        self._route = route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._gateway.pipeline.handle(self._route, scope, receive, send)


def _gateway_version() -> str:
    try:
        return version("shapegate")
    except PackageNotFoundError:
        return "unknown"


def _model_cards(gateway: Gateway) -> list[dict[str, Any]]:
    return [
        {
            "id": name,
            "object": "model",
            "created": int(gateway.started_at),
            "owned_by": "shapegate",
            "root": model.name,
            "parent": None,
            "max_model_len": model.max_model_len,
        }
        for model in gateway.settings.models
        for name in (model.name, *model.aliases)
    ]


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's 404 and 405 (and any other HTTPException) in the API's own error shape."""
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    path = request.url.path
    if status == 404:
        message = f"Not Found: no route {request.method} {path}"
    elif status == 405:
        message = f"Method {request.method} is not allowed on {path}"
    else:
        message = str(exc.detail)
    route = ENGINE_ROUTES.get(path)
    if route is not None and route.errors == "anthropic":
        body = anthropic_error_body(message, status)
    else:
        kind = {404: "NotFoundError", 405: "invalid_request_error"}.get(
            status, "invalid_request_error"
        )
        body = error_body(message, kind, status)
    return JSONResponse(body, status, headers=exc.headers)


async def admin_state(gateway: Gateway) -> dict[str, Any]:
    settings = gateway.settings
    retired = gateway.pool.retired()  # removed by a reload, still serving: draining
    keys = [lane_key(lane.name) for lane in settings.lanes] + [
        endpoint_key(e.cluster, e.url) for e in (*gateway.pool.engines(), *retired)
    ]
    used = await gateway.store.in_use(keys)
    lanes = []
    for lane in settings.lanes:
        lanes.append(
            {
                "name": lane.name,
                "min_prompt_tokens": lane.min_prompt_tokens,
                "max_prompt_tokens": lane.max_prompt_tokens,
                "slots_in_use": used[lane_key(lane.name)],
                "slot_limit": lane.slots.lane,
                "queue_depth": gateway.admission.queue_depth(lane.name),
                "queue_limit": lane.queue.depth,
                "oldest_wait_s": round(gateway.admission.oldest_wait_s(lane.name), 3),
                "clusters": list(lane.clusters),
                "emergency_clusters": list(lane.emergency_clusters),
                **borrowing_state(gateway.admission, lane),
            }
        )
    clusters: list[dict[str, Any]] = []
    for name, cluster in gateway.pool.clusters.items():
        endpoints = []
        for url in cluster.endpoints:
            engine = gateway.pool.engine(name, url)
            endpoints.append(
                {**engine.as_json(time.time()), "slots_in_use": used[endpoint_key(name, url)]}
            )
        clusters.append({"name": name, "kind": cluster.kind, "endpoints": endpoints})
    for engine in retired:
        row = {
            **engine.as_json(time.time()),
            "slots_in_use": used[endpoint_key(engine.cluster, engine.url)],
        }
        found = [c for c in clusters if c["name"] == engine.cluster]
        if found:
            found[0]["endpoints"].append(row)
        else:
            clusters.append({"name": engine.cluster, "kind": engine.kind, "endpoints": [row]})
    state: dict[str, Any] = {
        "policy_version": gateway.pipeline.policy.version,
        "started_at": gateway.started_at,
        "accepting": gateway.pipeline.accepting,
        "in_flight": gateway.pipeline.in_flight,
        "state_backend": settings.state.backend,
        "lanes": lanes,
        "clusters": clusters,
        "decisions": gateway.recorder.snapshot(),
        "prefix_index": gateway.pipeline.prefixes.state(),
    }
    if gateway.group is not None:
        state["worker"] = {"index": gateway.group.index, "pid": os.getpid()}
    return state


async def gateway_state(gateway: Gateway, scope: Scope) -> dict[str, Any]:
    """The admin state of the whole gateway: this worker's merged with its peers'."""
    local = await admin_state(gateway)
    if gateway.peers is None or worker_only(scope):
        return local
    answers = await gateway.peers.ask("GET", "/admin/state")
    peers = [a.response.json() for a in answers if a.response and a.response.status_code == 200]
    return merge_admin_state([local, *peers])


async def gateway_metrics(gateway: Gateway, scope: Scope) -> bytes:
    """Prometheus text for the whole gateway: this worker's series merged with its peers'."""
    local = gateway.metrics.render()
    if gateway.peers is None or worker_only(scope):
        return local
    answers = await gateway.peers.ask("GET", "/metrics")
    texts = [a.response.text for a in answers if a.response and a.response.status_code == 200]
    return merge_metrics([local.decode(), *texts], gateway.peers.group.count)


async def reload_peers(gateway: Gateway, scope: Scope, raw: bytes) -> dict[str, Any]:
    """Pass a reload this worker applied on to every other worker (the same file or body)."""
    if gateway.peers is None or worker_only(scope):
        return {}
    media = header(scope, b"content-type")
    headers = {"content-type": media.decode("latin-1")} if media else {}
    answers = await gateway.peers.ask("POST", "/admin/reload", raw, headers)
    failed = [a.worker for a in answers if not (a.response and a.response.status_code == 200)]
    for answer in answers:
        if answer.worker in failed:
            gateway.log.error(
                "policy.reload_not_passed_on",
                worker=answer.worker,
                status=answer.response.status_code if answer.response else None,
            )
    return {"workers": {"reloaded": 1 + len(answers) - len(failed), "failed": failed}}


async def drain_route(gateway: Gateway, request: Request, *, drain: bool) -> JSONResponse:
    """``{"url": ...}``: drain (or undrain) that endpoint in every cluster listing it, on every
    worker; 404 when no cluster does, 400 for a body without a URL."""
    raw = await request.body()
    try:
        url = orjson.loads(raw).get("url") if raw else None
    except (orjson.JSONDecodeError, AttributeError):
        url = None
    if not isinstance(url, str):
        message = 'the body must be {"url": "<endpoint URL>"}'
        return JSONResponse(error_body(message, "invalid_request_error", 400, "url"), 400)
    done = []
    for name, cluster in gateway.pool.clusters.items():
        if url not in cluster.endpoints:
            continue
        if drain:
            deadline_s = gateway.settings.cluster(name).drain_s
            gateway.drainer.drain(name, url, deadline_s, "POST /admin/engines/drain")
        else:
            gateway.drainer.undrain(name, url)
        done.append({**gateway.pool.engine(name, url).as_json(time.time()), "cluster": name})
    if not done:
        message = f"no cluster has the endpoint {url!r}"
        return JSONResponse(error_body(message, "NotFoundError", 404, "url"), 404)
    if gateway.peers is not None and not worker_only(request.scope):
        path = request.url.path
        await gateway.peers.ask("POST", path, raw, {"content-type": "application/json"})
    return JSONResponse({"endpoints": done})


def add_routes(app: FastAPI, gateway: Gateway) -> None:
    add_dashboard_routes(app, gateway)  # also guards every /admin/* route below
    app.add_exception_handler(HTTPException, http_error)
    add_shadow_routes(app, gateway)
    for path, route in ENGINE_ROUTES.items():
        app.router.routes.append(Route(path, _ProxyRoute(gateway, route), methods=["POST"]))

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        try:
            gateway.pipeline.policy.auth.check(request.headers.get("authorization", "").encode())
        except Unauthorized as exc:
            return JSONResponse(exc.body(), exc.status)
        return JSONResponse({"object": "list", "data": _model_cards(gateway)})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> JSONResponse:
        try:
            gateway.pipeline.policy.auth.check(request.headers.get("authorization", "").encode())
        except Unauthorized as exc:
            return JSONResponse(exc.body(), exc.status)
        for card in _model_cards(gateway):
            if card["id"] == model_id:
                return JSONResponse(card)
        message = f"The model `{model_id}` does not exist."
        return JSONResponse(error_body(message, "NotFoundError", 404, "model"), 404)

    @app.get("/version")
    async def gateway_version() -> dict[str, str]:
        return {"version": _gateway_version()}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        if not gateway.pipeline.accepting:
            return JSONResponse({"ready": False, "why": {"gateway": "draining"}}, status_code=503)
        if not gateway.ready:
            return JSONResponse({"ready": False, "why": gateway.probe.why_not()}, status_code=503)
        lanes = lane_states(gateway.settings.lanes, endpoint_health(gateway.pool))
        down = {
            name: "no routable endpoint in any of its clusters"
            for name, lane in lanes.items()
            if lane["state"] == "down"
        }
        degraded = any(lane["state"] == "degraded" for lane in lanes.values())
        body = {"ready": not down, "degraded": degraded, "lanes": lanes}
        return JSONResponse({**body, "why": down} if down else body, 503 if down else 200)

    @app.post("/admin/probe")
    async def probe_now() -> JSONResponse:
        await gateway.probe.run()
        lanes = {
            name: {"passed": c.passed, "detail": c.detail, "seconds": round(c.seconds, 3)}
            for name, c in gateway.probe.checks.items()
        }
        return JSONResponse(
            {"ready": gateway.ready, "lanes": lanes},
            status_code=200 if all(c.passed for c in gateway.probe.checks.values()) else 503,
        )

    @app.post("/admin/reload")
    async def reload(request: Request) -> JSONResponse:
        """Re-read the config file, or apply the YAML/JSON policy in the body; all or nothing.

        A body must be a JSON or YAML media type (never a form or text/plain, which any web page
        can send cross-site) and at most ``RELOAD_MAX_BYTES``."""
        try:
            raw = await read_body(
                request.scope,
                request.receive,
                RELOAD_MAX_BYTES,
                gateway.settings.server.body_timeout_s,
            )
            if raw.strip():
                require_media_type(request.scope, POLICY_MEDIA_TYPES)
        except GatewayError as exc:
            gateway.log.warning(
                "policy.reload_refused", trigger="admin", status=exc.status, error=exc.message
            )
            return JSONResponse(exc.body(), exc.status, headers={"connection": "close"})
        try:
            if raw.strip():
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ConfigError("the policy in the body is not UTF-8") from exc
                result = await reload_policy(gateway, parse_policy(text, "request body"))
            else:
                result = await reload_policy(gateway)
        except ConfigError as exc:
            gateway.log.warning("policy.reload_failed", trigger="admin", error=str(exc))
            return JSONResponse(error_body(str(exc), "invalid_request_error", 400), 400)
        return JSONResponse(
            {
                "version": result.version,
                "changed": result.changed,
                "restart_required": list(result.restart_required),
                **await reload_peers(gateway, request.scope, raw),
            }
        )

    @app.post("/admin/engines/drain")
    async def drain(request: Request) -> JSONResponse:
        return await drain_route(gateway, request, drain=True)

    @app.post("/admin/engines/undrain")
    async def undrain(request: Request) -> JSONResponse:
        return await drain_route(gateway, request, drain=False)

    @app.get("/admin/state")
    async def state(request: Request) -> dict[str, Any]:
        return await gateway_state(gateway, request.scope)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(
            await gateway_metrics(gateway, request.scope),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )
