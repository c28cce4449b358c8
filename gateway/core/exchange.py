"""One HTTP exchange with a client, at the raw ASGI level.

The proxy routes are plain ASGI so that the request can be held from admission to its last byte
in one function, with the client's disconnect visible in every phase:

- ``read_body`` reads the body within the size limit as it arrives (the excess is never
  buffered) and within the body deadline; a disconnect while reading raises ``ClientGone``.
- ``require_media_type`` refuses a body whose ``Content-Type`` is not one the route reads (415):
  the JSON routes take ``application/json`` only, as vLLM does (parameters such as
  ``charset`` allowed; a missing header refused, because a page can POST a body without one, or
  as ``text/plain``, to any site without a CORS preflight).
- ``watch_disconnect`` waits for ``http.disconnect`` after the body and cancels the request's
  scope: a queued request leaves its queue, a forwarded one closes its upstream connection.
  (Starlette's BaseHTTPMiddleware would hide this message; the app uses none.) Where the server
  offers ``DISCONNECT_HOOK`` in the scope's ``extensions`` (shapegate's own HTTP protocol,
  gateway/edge/http_protocol.py), the same callback is registered with the connection instead:
  no task a request.
- ``Outbound`` sends the response once: ``error`` chooses a JSON body before the response
  started, and an SSE error event (then ``[DONE]`` for OpenAI streams) once a stream is under
  way, in the route's error shape (OpenAI, Anthropic or Responses).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gateway.core.cancel import CancelScope
from gateway.errors import (
    BadRequest,
    BodyTooLarge,
    ErrorShape,
    GatewayError,
    UnsupportedMediaType,
    error_payload,
    stream_error,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


# scope["extensions"][DISCONNECT_HOOK](callback) -> unwatch: ``callback()`` runs once if the
# client's connection is lost before the response completed; ``unwatch()`` stops that.
DISCONNECT_HOOK = "shapegate.on_disconnect"


def disconnect_hook(
    scope: Scope,
) -> Callable[[Callable[[], None]], Callable[[], None]] | None:
    extensions = scope.get("extensions")
    return None if extensions is None else extensions.get(DISCONNECT_HOOK)


class ClientGone(Exception):
    """The client disconnected before the request was complete."""


# Where ``header_map`` keeps a request's headers by name, in its scope (a dict per request).
HEADER_MAP = "shapegate.header_map"


def header_map(scope: Scope) -> dict[bytes, bytes]:
    """The request's headers by lower-case name (the first of a repeated name), read from the
    scope's list once a request and kept in the scope: a proxied request asks for six (its id,
    authorization twice, content type and length, priority class), which were six scans of the
    list, each lowering every name it passed."""
    found: dict[bytes, bytes] | None = scope.get(HEADER_MAP)
    if found is None:
        found = {}
        for key, value in scope.get("headers", ()):
            name = key.lower()
            if name not in found:
                found[name] = value if type(value) is bytes else bytes(value)
        scope[HEADER_MAP] = found
    return found


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case), None when absent."""
    return header_map(scope).get(name)


JSON = frozenset({"application/json"})


def media_type(value: bytes | None) -> str | None:
    """The media type of a Content-Type value, lower case, parameters dropped."""
    if value is None:
        return None
    return value.split(b";", 1)[0].strip().decode("latin-1").lower()


def require_media_type(scope: Scope, accepted: frozenset[str] = JSON) -> None:
    """Raise ``UnsupportedMediaType`` unless the request's Content-Type is one of ``accepted``."""
    given = media_type(header(scope, b"content-type"))
    if given not in accepted:
        shown = "no Content-Type" if given is None else f"Content-Type {given[:100]!r}"
        raise UnsupportedMediaType(
            f"Unsupported Media Type: {shown}; this route accepts {', '.join(sorted(accepted))}"
        )


async def read_body(
    scope: Scope,
    receive: Receive,
    limit: int,
    timeout_s: float,
    loop: asyncio.AbstractEventLoop | None = None,
) -> bytes:
    declared = header(scope, b"content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest("invalid Content-Length header")
        if int(declared) > limit:
            raise BodyTooLarge(f"request body of {int(declared)} bytes exceeds {limit} bytes")
    parts: list[bytes] = []
    size = 0
    # Our cancel scope (gateway/core/cancel.py): asyncio's own cancellation, as
    # ``asyncio.timeout`` does it, without its state machine; this runs on every request.
    # ``loop``: the running one when the caller holds it (no getpid call to find it).
    with CancelScope(deadline_s=timeout_s, loop=loop):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"request body exceeds {limit} bytes")
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)
    # Only the deadline ends the scope without a return or an exception.
    raise BadRequest(f"request body not received within {timeout_s:g}s")


async def watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


class Outbound:
    def __init__(self, send: Send, shape: ErrorShape = "openai") -> None:
        self._send = send
        self.shape = shape
        self.started = False
        self.streaming = False
        self.status = 0
        self.finished = False

    async def start(
        self, status: int, headers: list[tuple[bytes, bytes]], *, streaming: bool
    ) -> None:
        self.started, self.streaming, self.status = True, streaming, status
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, chunk: bytes, *, more: bool) -> None:
        await self._send({"type": "http.response.body", "body": chunk, "more_body": more})
        if not more:
            self.finished = True

    async def error(self, exc: GatewayError, headers: list[tuple[bytes, bytes]]) -> None:
        """Tell the client what went wrong, in whatever form the response still allows."""
        if self.finished:
            return
        if not self.started:
            payload = error_payload(exc, self.shape)
            extra = [(k.encode(), v.encode()) for k, v in exc.headers().items()]
            if isinstance(exc, BodyTooLarge | UnsupportedMediaType):
                # The rest of the body is never read: close rather than drain it for keep-alive.
                extra.append((b"connection", b"close"))
            await self.start(
                exc.status,
                [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    *headers,
                    *extra,
                ],
                streaming=False,
            )
            self.status = exc.status
            await self.body(payload, more=False)
        elif self.streaming:
            await self.body(stream_error(exc, self.shape), more=False)
        else:
            await self.body(b"", more=False)
