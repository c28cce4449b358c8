"""What every simulated route shares: the engine's parts, vLLM's error bodies, and the checks a
request passes before the engine sees it (parse, model, dead engine, injected faults).

- ``SimParts``: one engine's profile, scheduler, faults, prompt counter and stored responses.
- ``error(status, message, type_, param, headers, kind=)``: vLLM's error response, in
  Anthropic's shape on ``/v1/messages``.
- ``validate(parts, kind, body)``: the parsed request, or the error response vLLM would
  send (400 unreadable, 404 unknown model, 500 engine dead, injected 500 or 429).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, Response

from engine_pool.engine_api import RouteKind
from engine_pool.sim import wire, wire_apis
from engine_pool.sim.counting import PromptCounter, RequestRejected, SimRequest
from engine_pool.sim.engine import SimEngine
from engine_pool.sim.faults import FaultState
from engine_pool.sim.profile import EngineProfile

STORED_RESPONSES = 10_000


@dataclass(frozen=True, slots=True)
class SimParts:
    profile: EngineProfile
    engine: SimEngine
    faults: FaultState
    counter: PromptCounter
    # Responses this engine stored (vLLM keeps them in its own memory): a follow-up naming one
    # it does not hold is answered 404, as vLLM does. The most recent STORED_RESPONSES are kept.
    stored: OrderedDict[str, None] = field(default_factory=OrderedDict)


def error(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    *,
    kind: RouteKind | None = None,
) -> JSONResponse:
    if kind == "messages":  # vLLM's Anthropic server answers in Anthropic's error shape
        body = wire_apis.anthropic_error_body(message, status)
        return JSONResponse(body, status, headers=headers)
    return JSONResponse(wire.error_body(message, type_, status, param), status, headers=headers)


async def validate(parts: SimParts, kind: RouteKind, body: bytes) -> Response | SimRequest:
    """Parse as vLLM does and roll the fault dice: an error response, or the request."""
    profile, faults = parts.profile, parts.faults
    try:
        routed = parts.counter.read(kind, body)
    except RequestRejected as exc:
        return error(400, exc.message, "BadRequestError", exc.param, kind=kind)
    if routed.model not in profile.served_names:
        message = f"The model `{routed.model}` does not exist."
        return error(404, message, "NotFoundError", "model", kind=kind)
    if faults.spec.dead or parts.engine.failed:
        return error(500, wire.ENGINE_DEAD_MESSAGE, "InternalServerError", kind=kind)
    injected = faults.draw_error()
    if injected == 500:
        return error(500, "injected fault: internal server error", "InternalServerError")
    if injected == 429:
        return error(
            429, "injected fault: too many requests", "RateLimitError", headers={"retry-after": "1"}
        )
    return routed
