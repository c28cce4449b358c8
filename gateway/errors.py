"""The gateway's exception tree, translated once at the HTTP boundary into OpenAI error bodies.

    GatewayError                      status  type
    ├── BadRequest                    400     invalid_request_error
    │   ├── ModelNotFound             404     NotFoundError
    │   ├── PromptTooLong             400     invalid_request_error (param input_tokens)
    │   ├── BodyTooLarge              413     invalid_request_error
    │   └── UnsupportedMediaType      415     invalid_request_error
    ├── Unauthorized                  401     authentication_error
    ├── Overloaded                    429     rate_limit_error   (lane full, on_full=reject)
    ├── QueueTimeout                  503     service_unavailable (waited max_wait_s)
    ├── NoHealthyCluster              503     service_unavailable
    ├── StateUnavailable              503     service_unavailable (Redis down, fail_closed)
    ├── ShuttingDown                  503     service_unavailable
    └── UpstreamError                 502     upstream_error
        ├── EngineUnreachable         502     upstream_error     (no answer byte: may fail over)
        └── UpstreamTimeout           504     timeout            (a watchdog deadline)

The body shape is vLLM's: ``{"error": {"message", "type", "param", "code"}}`` with ``code``
the integer status. On the Anthropic route (``/v1/messages``) errors take Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}`` with Anthropic's type names, and a stream
ends with an ``event: error``; a Responses stream ends with a Responses ``error`` event
(``error_payload`` and ``stream_error`` choose by shape).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import orjson

from engine_pool import engine_api


class GatewayError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"

    def __init__(
        self, message: str, *, param: str | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.status, self.param)

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"retry-after": str(max(1, round(self.retry_after_s)))}


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class ModelNotFound(BadRequest):
    status = 404
    type = "NotFoundError"


class PromptTooLong(BadRequest):
    status = 400


class BodyTooLarge(BadRequest):
    status = 413


class UnsupportedMediaType(BadRequest):
    status = 415


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"


class Overloaded(GatewayError):
    status = 429
    type = "rate_limit_error"


class QueueTimeout(GatewayError):
    status = 503
    type = "service_unavailable"


class NoHealthyCluster(GatewayError):
    status = 503
    type = "service_unavailable"


class StateUnavailable(GatewayError):
    status = 503
    type = "service_unavailable"


class ShuttingDown(GatewayError):
    status = 503
    type = "service_unavailable"


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"


class EngineUnreachable(UpstreamError):
    """The engine could not be reached, and it sent no byte of an answer: refused, reset, or a
    connection found closed. ``reason`` names which; ``stale`` says the connection was a
    kept-alive one (it may simply have expired), so a fresh one to the same engine may work."""

    def __init__(self, message: str, *, reason: str, stale: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.stale = stale


class UpstreamTimeout(UpstreamError):
    status = 504
    type = "timeout"


def error_body(message: str, type_: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def sse_error(message: str, type_: str, status: int) -> bytes:
    """An error event for a stream whose 200 status is already sent, then ``[DONE]``."""
    payload = orjson.dumps(error_body(message, type_, status))
    return b"data: " + payload + b"\n\ndata: [DONE]\n\n"


ErrorShape = Literal["openai", "anthropic", "responses"]

# Anthropic's error types by HTTP status (docs.anthropic.com/en/api/errors).
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(message: str, status: int) -> dict[str, Any]:
    return engine_api.anthropic_error_body(message, status, ANTHROPIC_TYPES)


def error_payload(exc: GatewayError, shape: ErrorShape) -> bytes:
    """The JSON error body for a response that has not started."""
    if shape == "anthropic":
        return orjson.dumps(anthropic_error_body(exc.message, exc.status))
    return orjson.dumps(exc.body())


def stream_error(exc: GatewayError, shape: ErrorShape) -> bytes:
    """The last bytes of a stream whose 200 status is already sent."""
    if shape == "anthropic":
        data = orjson.dumps(anthropic_error_body(exc.message, exc.status))
        return b"event: error\ndata: " + data + b"\n\n"
    if shape == "responses":
        event = {
            "type": "error",
            "code": exc.type,
            "message": exc.message,
            "param": exc.param,
            "sequence_number": 0,
        }
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"
    return sse_error(exc.message, exc.type, exc.status)
