"""uvicorn's httptools protocol with the limits uvicorn lacks at the connection level.

- A deadline for receiving a request's headers (``server.header_timeout_s``), armed when the
  connection opens and again after each response on a keep-alive connection: a slowloris
  client sending a byte at a time is answered 408 and closed at the deadline, instead of
  holding a connection (and a file descriptor) forever. uvicorn has no such deadline.
- A cap on the bytes of the request line and headers (``server.max_header_bytes``): 431.
- Malformed requests (a CR or LF inside a header, a bad request line) are answered 400 in the
  OpenAI error shape rather than uvicorn's plain text.
- A response's head is written with its first body bytes, in one write (``CoalescedCycle``).
- The client's disconnect is a callback, not a task: the scope's extensions carry
  ``DISCONNECT_HOOK`` (gateway/core/exchange.py), which registers a function the connection's
  loss calls while the response is incomplete (``WatchedCycle``). A request then needs no task
  of its own blocked in ``receive()`` to learn that its client left.
- HTTP/1.0 clients never get ``Transfer-Encoding: chunked`` (RFC 9112 section 6.1: they cannot
  read it). uvicorn's httptools protocol adds chunked framing to every response without a
  Content-Length, whatever the request's version; for a 1.0 request a response without one (a
  stream) is sent close-delimited instead: no framing header, the body as it comes, the
  connection closed after the last byte. Responses with a Content-Length are unchanged.

``guarded_protocol(settings)`` returns the class uvicorn is configured with.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from gateway.core.exchange import DISCONNECT_HOOK
from gateway.errors import error_body
from gateway.settings import ServerSettings

REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class WatchedCycle(RequestResponseCycle):
    """A cycle a callback can watch for its client's disconnect (``DISCONNECT_HOOK``)."""

    _on_disconnect: Callable[[], None] | None = None

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` once if the connection is lost before the response completes;
        returns the function that stops watching."""
        if self.disconnected:
            callback()
            return _nothing
        self._on_disconnect = callback
        # As receive() does while it waits: read on, so an end of stream (the client leaving)
        # is seen even where a pipelined request paused reading.
        self.flow.resume_reading()
        return self._unwatch

    def _unwatch(self) -> None:
        self._on_disconnect = None

    def disconnected_now(self) -> None:
        """The protocol lost the connection (uvicorn marked us ``disconnected``)."""
        callback, self._on_disconnect = self._on_disconnect, None
        if callback is not None:
            callback()


def _nothing() -> None:
    return None


class _Hook:
    """The scope's ``DISCONNECT_HOOK``: ``WatchedCycle.watch`` of its cycle, reached through a
    weak reference. The cycle holds the scope; a bound method in the scope would hold the cycle
    back (cycle -> scope -> extensions -> hook -> cycle), so every finished request (its cycle,
    scope, event, deque, headers: about 9 objects) would wait for the cyclic collector, which
    then ran about once every 10 requests. Weakly held, a finished exchange is freed by
    reference counting. A cycle already gone has nothing left to watch."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: WatchedCycle) -> None:
        self._cycle = weakref.ref(cycle)

    def __call__(self, callback: Callable[[], None]) -> Callable[[], None]:
        cycle = self._cycle()
        return _nothing if cycle is None else cycle.watch(callback)


class Http10Cycle(WatchedCycle):
    """A request/response cycle for an HTTP/1.0 request: close-delimited when no length is set.

    ``keep_alive`` is already false for 1.0 (uvicorn answers ``connection: close``)."""

    close_delimited = False

    async def send(self, message: Any) -> None:
        if message["type"] == "http.response.start" and not self.response_started:
            headers = list(message.get("headers", []))
            if not any(name.lower() == b"content-length" for name, _ in headers):
                # Framed by closing: no chunked coding, whoever asked for it. A decided
                # (false) chunked_encoding keeps uvicorn from adding the header; the body
                # is then written below as it comes.
                self.close_delimited = True
                self.chunked_encoding = False
                kept = [(n, v) for n, v in headers if n.lower() != b"transfer-encoding"]
                message = {**message, "headers": kept}
        if (
            self.close_delimited
            and message["type"] == "http.response.body"
            and not self.response_complete
            and not self.disconnected
        ):
            if self.flow.write_paused:
                await self.flow.drain()
            body = message.get("body", b"")
            if body and self.scope["method"] != "HEAD":
                self.transport.write(body)
            if not message.get("more_body", False):
                self.response_complete = True
                self.message_event.set()
                self.transport.close()
                self.on_response()
            return
        await super().send(message)


class _Gathered:
    """The transport as a cycle's ``send`` sees it while the response head is held back: writes
    are gathered, ``flush`` writes them as one."""

    __slots__ = ("parts", "real")

    def __init__(self, real: asyncio.Transport) -> None:
        self.real = real
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def flush(self) -> None:
        if self.parts:
            data, self.parts = b"".join(self.parts), []
            if not self.real.is_closing():
                self.real.write(data)

    def close(self) -> None:
        self.flush()
        self.real.close()

    def is_closing(self) -> bool:
        return self.real.is_closing()


class CoalescedCycle(WatchedCycle):
    """An HTTP/1.1 request/response cycle whose response head goes out with the first body
    bytes, in one write (one ``send`` system call, one segment on the wire) instead of two:
    the gateway's answers send their head and body back to back (a whole JSON answer, or an
    SSE stream's first chunk). The head is never held past the event loop's current turn: a
    body that does not follow at once (an app that sends its head, then waits) finds it sent.
    uvicorn builds the body as before (``send`` runs unchanged against ``_Gathered``); the head
    is ``_head``'s, the bytes uvicorn's ``send`` writes, built with two pattern searches in all
    where uvicorn makes two a header (a sixth of a JSON request's calls were that loop's)."""

    _held: _Gathered | None = None
    _flush_handle: asyncio.Handle | None = None
    # The connection's loop (the protocol sets it): in Python 3.11 ``get_running_loop`` is a
    # getpid system call, once a response otherwise.
    _loop: asyncio.AbstractEventLoop | None = None

    async def send(self, message: Any) -> None:
        real = self.transport
        held = self._held
        if held is None:
            if message["type"] != "http.response.start" or self.response_started:
                await super().send(message)
                return
            if self.access_log or self.flow.write_paused or self.disconnected:
                held = _Gathered(real)  # uvicorn's own path: its access log, its drain
                self.transport = held  # type: ignore[assignment]
                try:
                    await super().send(message)
                finally:
                    self.transport = real
            else:
                held = _Gathered(real)
                held.parts.append(self._head(message))
            if held.parts:
                self._held = held
                loop = self._loop or asyncio.get_running_loop()
                self._flush_handle = loop.call_soon(self._flush)
            return
        self.transport = held  # type: ignore[assignment]
        try:
            await super().send(message)
        finally:
            self.transport = real
            self._flush()

    def _head(self, message: Any) -> bytes:
        """The status line and headers of ``message`` (``http.response.start``) as uvicorn's
        ``send`` writes them, its state set as it sets it (no access log, not paused, not
        disconnected: the caller checked). A character class matches the concatenation of the
        names (or values) exactly where it matches one of them; on a match uvicorn's own loop
        raises its error for the first bad header."""
        self.response_started = True
        self.waiting_for_100_continue = False
        status_code = message["status"]
        headers = self.default_headers + list(message.get("headers", []))
        names = b"".join([name for name, _ in headers])
        if HEADER_RE.search(names) or HEADER_VALUE_RE.search(b"".join([v for _, v in headers])):
            for name, value in headers:
                if HEADER_RE.search(name):
                    raise RuntimeError("Invalid HTTP header name.")
                if HEADER_VALUE_RE.search(value):
                    raise RuntimeError("Invalid HTTP header value.")
        lower = names.lower() != names  # uvicorn writes every name in lower case
        content = [STATUS_LINE[status_code]]
        has_connection_close = False
        for name, value in headers:
            if lower:
                name = name.lower()  # noqa: PLW2901 - as uvicorn
            if name == b"content-length" and self.chunked_encoding is None:
                self.expected_content_length = int(value.decode())
                self.chunked_encoding = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.expected_content_length = 0
                self.chunked_encoding = True
            elif name == b"connection":
                connection = [token.lower().strip() for token in value.split(b",")]
                if b"close" in connection:
                    self.keep_alive = False
                    has_connection_close = True
            content += (name, b": ", value, b"\r\n")
        if not self.keep_alive and not has_connection_close:
            content.append(b"connection: close\r\n")
        if (
            self.chunked_encoding is None
            and self.scope["method"] != "HEAD"
            and status_code not in (204, 304)
        ):
            self.chunked_encoding = True  # neither content-length nor transfer-encoding set
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        return b"".join(content)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if held is not None:
            held.flush()


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 * 1024

    _header_timer: asyncio.TimerHandle | None = None
    _header_bytes: int = 0
    _refused: bool = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._header_bytes = 0
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        self._refuse(408, f"request headers not received within {self.header_timeout_s:g}s")

    def _refuse(self, status: int, message: str) -> None:
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        payload = orjson.dumps(error_body(message, "invalid_request_error", status))
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, REASONS[status], len(payload)) + payload
        )
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        # ``_count`` inline: a call less a header.
        self._header_bytes += len(name) + len(value) + 4
        if self._header_bytes > self.max_header_bytes:
            self._refuse(431, f"request line and headers exceed {self.max_header_bytes} bytes")
        super().on_header(name, value)

    def _count(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self.max_header_bytes:
            self._refuse(431, f"request line and headers exceed {self.max_header_bytes} bytes")

    def on_headers_complete(self) -> None:
        self._disarm()
        if self._refused:
            return
        super().on_headers_complete()
        cycle = self.cycle
        if type(cycle) is RequestResponseCycle:
            # The cycle's task has not run yet; the subclasses only change how it sends and
            # let a callback watch for the disconnect.
            http10 = self.scope.get("http_version") == "1.0"
            if http10:
                cycle.__class__ = Http10Cycle
            else:
                cycle.__class__ = CoalescedCycle
                cycle._loop = self.loop  # type: ignore[attr-defined]
            self.scope["extensions"] = {DISCONNECT_HOOK: _Hook(cycle)}  # type: ignore[arg-type, dict-item]

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
        cycle = self.cycle
        if cycle is not None and cycle.disconnected and isinstance(cycle, WatchedCycle):
            cycle.disconnected_now()

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, f"malformed HTTP request: {msg}")


def guarded_protocol(server: ServerSettings) -> type[GuardedHttpToolsProtocol]:
    return type(
        "ShapegateHttpProtocol",
        (GuardedHttpToolsProtocol,),
        {
            "header_timeout_s": server.header_timeout_s,
            "max_header_bytes": server.max_header_bytes,
        },
    )
