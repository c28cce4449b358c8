"""The shadow policy's admin routes: try a candidate on live traffic, then promote it.

    POST   /admin/shadow           a policy in the body (YAML or JSON) starts deciding beside
                                   the active one; validated as ``POST /admin/reload`` does
                                   (``config_check.parse_policy``, then ``reload``'s
                                   ``effective_settings``: discovered endpoints kept,
                                   restart-only keys at their running values); an invalid
                                   one is a 400 and changes nothing
    GET    /admin/shadow           the report (``request/shadow.py``); ``?effect=1`` adds the
                                   predicted effect (``tuning/shadow_effect.py``) over the live
                                   window, ``&time_scale=S`` the engines' clock (default 1),
                                   ``&window=1`` the window's shapes
    DELETE /admin/shadow           stop; the last report
    POST   /admin/shadow/promote   apply the shadow as a reload (``reload.reload_policy``); the
                                   policy it replaced becomes the shadow, so a rollback is one call

Contract:
- Behind the admin guard like every ``/admin`` path (``edge/admin/guard.py``): a state
  change needs the bearer token or ``X-Shapegate-Admin``.
- The shadow decides from the count the active policy's tokenizers make, so each of its
  ``models`` must be an active one with the same ``tokenizer`` (a 400 says which is not);
  aliases and ``max_model_len`` may differ. A reload is what changes tokenizers.
- With ``serve --workers N``, each worker decides on its own traffic: a start, stop or promote
  is passed on to every worker (``edge/peers.py``) and the report merges every worker's
  (``shadow.merge_reports``); the predicted effect replays the merged window. Replicas are
  merged by asking each (``merge_reports`` over their ``?window=1`` answers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gateway.config_check import CheckedPolicy, Marks, parse_policy
from gateway.core.exchange import header, read_body, require_media_type
from gateway.edge.peers import worker_only
from gateway.edge.reload import diff_settings, effective_settings, reload_policy
from gateway.errors import GatewayError, error_body
from gateway.request.shadow import merge_reports, window_trace
from gateway.settings import ConfigError, Settings
from gateway.tuning.fleet_model import LiveCosts
from gateway.tuning.shadow_effect import predict_effect

if TYPE_CHECKING:
    from gateway.edge.services import Gateway

POLICY_MAX_BYTES = 1024 * 1024
POLICY_MEDIA_TYPES = frozenset(
    {"application/json", "application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml"}
)


def _lanes(settings: Settings) -> list[dict[str, Any]]:
    return [
        {"name": lane.name, "min": lane.min_prompt_tokens, "max": lane.max_prompt_tokens}
        for lane in settings.lanes
    ]


def _refused(exc: GatewayError | ConfigError) -> JSONResponse:
    if isinstance(exc, GatewayError):
        return JSONResponse(exc.body(), exc.status, headers={"connection": "close"})
    return JSONResponse(error_body(str(exc), "invalid_request_error", 400), 400)


def _bad(message: str) -> JSONResponse:
    return JSONResponse(error_body(message, "invalid_request_error", 400), 400)


class ShadowRoutes:
    """The four routes over one gateway; ``candidate`` is the shadow's policy as validated,
    kept for promotion."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.candidate: CheckedPolicy | None = None

    def start(self, checked: CheckedPolicy) -> dict[str, Any]:
        gateway = self.gateway
        active = gateway.pipeline.policy.settings
        settings = effective_settings(gateway, checked.settings)
        counted_otherwise = [
            m.name
            for m in settings.models
            if (same := active.model(m.name)) is None or same.tokenizer != m.tokenizer
        ]
        if counted_otherwise:
            raise ConfigError(
                "the shadow decides from the active policy's count: each of its models must be "
                "one of the active policy's, with the same tokenizer (not so: "
                f"{', '.join(counted_otherwise)}; a reload changes models)"
            )
        shadow = gateway.pipeline.shadow.start(
            settings, gateway.pipeline.policy.version + 1, active
        )
        self.candidate = checked
        changed = diff_settings(active, settings)
        gateway.log.info("shadow.started", version=shadow.version, changed=changed)
        return {
            "shadow": {"version": shadow.version, "lanes": _lanes(settings)},
            "changed": changed,
        }

    async def passed_on(
        self, request: Request, method: str, path: str, raw: bytes = b""
    ) -> dict[str, Any]:
        """The same call to every other worker (each decides on its own traffic)."""
        gateway = self.gateway
        if gateway.peers is None or worker_only(request.scope):
            return {}
        media = header(request.scope, b"content-type")
        headers = {"content-type": media.decode("latin-1")} if media else {}
        answers = await gateway.peers.ask(method, path, raw, headers)
        failed = [a.worker for a in answers if not (a.response and a.response.status_code == 200)]
        for worker in failed:
            gateway.log.error("shadow.not_passed_on", worker=worker, path=path, method=method)
        return {"workers": {"applied": 1 + len(answers) - len(failed), "failed": failed}}

    async def post(self, request: Request) -> JSONResponse:
        gateway = self.gateway
        try:
            raw = await read_body(
                request.scope,
                request.receive,
                POLICY_MAX_BYTES,
                gateway.settings.server.body_timeout_s,
            )
            if not raw.strip():
                raise ConfigError("POST /admin/shadow needs a policy in the body (YAML or JSON)")
            require_media_type(request.scope, POLICY_MEDIA_TYPES)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError("the policy in the body is not UTF-8") from exc
            answer = self.start(parse_policy(text, "request body"))
        except (GatewayError, ConfigError) as exc:
            gateway.log.warning("shadow.refused", error=str(exc))
            return _refused(exc)
        return JSONResponse(answer | await self.passed_on(request, "POST", "/admin/shadow", raw))

    async def report(self, request: Request) -> dict[str, Any]:
        gateway = self.gateway
        shadow = gateway.pipeline.shadow
        params = request.query_params
        local: dict[str, Any] = shadow.report.as_json(window=True)
        reports = [local]
        if gateway.peers is not None and not worker_only(request.scope):
            answers = await gateway.peers.ask("GET", "/admin/shadow?window=1")
            reports += [
                a.response.json() for a in answers if a.response and a.response.status_code == 200
            ]
        merged = merge_reports(reports) if len(reports) > 1 else local
        policy = shadow.policy
        merged["running"] = policy is not None
        if policy is not None:
            merged["shadow"] = {"version": policy.version, "lanes": _lanes(policy.settings)}
            merged["since"] = policy.started_at
            if params.get("effect") in ("1", "true"):
                costs = LiveCosts(time_scale=float(params.get("time_scale", "1")))
                trace = window_trace(merged["window"])
                active = gateway.pipeline.policy.settings
                merged["predicted_effect"] = await anyio.to_thread.run_sync(
                    lambda: predict_effect(active, policy.settings, trace, costs)
                )
        if params.get("window") not in ("1", "true"):
            merged.pop("window", None)
        return merged

    async def get(self, request: Request) -> JSONResponse:
        try:
            return JSONResponse(await self.report(request))
        except ValueError as exc:  # a bad time_scale, a cluster fleet_sim cannot simulate
            return _bad(str(exc))

    async def delete(self, request: Request) -> JSONResponse:
        last = self.gateway.pipeline.shadow.stop()
        self.candidate = None
        self.gateway.log.info("shadow.stopped", compared=None if last is None else last["compared"])
        return JSONResponse(
            {"stopped": last is not None, "report": last}
            | await self.passed_on(request, "DELETE", "/admin/shadow")
        )

    async def promote(self, request: Request) -> JSONResponse:
        gateway = self.gateway
        checked = self.candidate
        if checked is None or gateway.pipeline.shadow.policy is None:
            return _bad("no shadow policy to promote (POST /admin/shadow starts one)")
        old = gateway.pipeline.policy.settings
        try:
            result = await reload_policy(gateway, checked)
        except ConfigError as exc:
            gateway.log.warning("shadow.promote_failed", error=str(exc))
            return _refused(exc)
        # The policy it replaced decides beside it now: one more promote rolls back.
        rolled = self.start(CheckedPolicy(old, Marks("the policy promote replaced")))
        gateway.log.info("shadow.promoted", version=result.version)
        return JSONResponse(
            {
                "version": result.version,
                "changed": result.changed,
                "restart_required": list(result.restart_required),
                "shadow": rolled["shadow"],
            }
            | await self.passed_on(request, "POST", "/admin/shadow/promote")
        )


def add_shadow_routes(app: FastAPI, gateway: Gateway) -> None:
    routes = ShadowRoutes(gateway)
    app.add_api_route("/admin/shadow", routes.post, methods=["POST"])
    app.add_api_route("/admin/shadow", routes.get, methods=["GET"])
    app.add_api_route("/admin/shadow", routes.delete, methods=["DELETE"])
    app.add_api_route("/admin/shadow/promote", routes.promote, methods=["POST"])
