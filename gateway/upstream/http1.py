"""A lean HTTP/1.1 client for the engines: asyncio protocol, httptools parser, LIFO keep-alive pool.

Why not httpx: profiled at 100-500 requests/s through the gateway, httpx + httpcore + h11 +
anyio's socket streams were about half of the gateway's CPU per request, httpcore's pool scans
every connection (polling each socket) on every request, so its cost grows with the pool, and a
streamed response is relayed one HTTP chunk at a time (100 SSE chunks: 100 parser events, 100
cancel scopes, 100 writes to the client). Here the parser is C, the pool is a stack, and the
bytes that arrived together are handed over together.

Contract:
- ``Origin.of(url)`` splits a URL into its origin and the request target; ``request_head(...)``
  renders the request line and headers.
- ``Pool.request(origin, head, body, connect_s)`` writes one request (``head`` from
  ``request_head``, ``body`` the original bytes) on an idle keep-alive connection to that
  origin, or a new one (connect bounded by ``connect_s``: ``TimeoutError``; refused or reset:
  ``OSError``). It returns the ``Connection`` that now belongs to the caller alone: no await
  separates taking a connection from owning it, so a cancelled request cannot leave a
  connection neither idle nor closed (the failure of encode/httpcore#1093).
- ``Connection.headers()`` waits for the status line and headers; ``Connection.next_bytes()``
  returns every body byte received so far (de-chunked), waiting only when there is none;
  ``b""`` at the end of the body; ``ConnectionLost`` if the engine dropped the connection first.
- ``Pool.release(conn)`` takes it back: to the idle stack if its response was read to the end,
  framed by Content-Length or chunked encoding, not a 5xx, and both sides allow keep-alive;
  else the connection is closed (the engine sees the client leave and aborts the request). An
  engine that failed (5xx, a protocol error) may close the socket a moment later without
  saying so: such a connection is never reused. Never raises, never awaits.
- ``Pool.request(..., fresh=True)`` never takes an idle connection. ``Connection.reused`` says
  the request went out on a kept-alive one, ``Connection.answered`` that a response byte came.
- Idle connections older than ``keepalive_s`` (below uvicorn's 5 s default) are closed rather
  than reused, and a connection the engine closed is never handed out. ``max_connections`` per
  origin bounds the pool; past it a request waits up to ``pool_timeout_s``, then ``PoolTimeout``.
- At most once per ``keepalive_s``, a request first sweeps every origin, not only its own:
  idle connections past keep-alive or closed are closed, and an origin with no connection open,
  none connecting and no request waiting is forgotten. An engine taken out of routing (a
  reload, a DNS answer without it) is never asked again, so without the sweep its idle sockets
  stayed open (forever, to a host gone without a FIN) and its entry stayed in the pool for the
  gateway's life. The sweep is synchronous, O(origins + idle connections), and runs before the
  request takes a connection; a request looks its origin up again after every wait, so one
  woken from a forgotten origin's queue never connects into an entry the pool no longer holds.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import urlsplit

import httptools

# The most response body kept unread before the engine's socket stops being read (back pressure).
HIGH_WATER = 1 << 20


class ConnectionLost(Exception):
    """The engine closed or reset the connection before the response was complete."""


class PoolTimeout(Exception):
    """Every connection to the origin was busy for longer than the pool timeout."""


@dataclass(frozen=True, slots=True)
class Origin:
    scheme: str
    host: str
    port: int

    @classmethod
    def of(cls, url: str) -> tuple[Origin, str]:
        """The origin and the request target (path and query) of an absolute URL."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an absolute http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(parts.scheme, parts.hostname, port), target

    @property
    def authority(self) -> str:
        default = 443 if self.scheme == "https" else 80
        return self.host if self.port == default else f"{self.host}:{self.port}"


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection; one exchange at a time."""

    def __init__(self, pool: _OriginPool, loop: asyncio.AbstractEventLoop) -> None:
        self._pool = pool
        # Its loop, for the futures it waits on: in Python 3.11 every ``get_running_loop`` is a
        # getpid system call (one a request, at the response's head).
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self.lost = False
        # The current request went out on a kept-alive connection (not a new one).
        self.reused = False
        self._reset_exchange()

    def _reset_exchange(self) -> None:
        self.status = 0
        self.response_headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = True
        self.complete = False
        self._headers_done = False
        self._body = bytearray()
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._framed = False  # content-length or chunked: the end of the body is known
        self.answered = False  # a byte of the response arrived

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only duck-typed alike.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.answered = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._lose()
        except httptools.HttpParserError:
            self._lose()
        if (
            len(self._body) > HIGH_WATER
            and not self._paused
            and not self.lost
            and self.transport is not None
        ):
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._headers_done and not self.complete and not self._framed:
            self.complete = True  # a body delimited by the end of the connection
        self._lose()

    def _lose(self) -> None:
        if not self.lost:
            self.lost = True
            self._pool.forget(self)
            if self.transport is not None:
                self.transport.close()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered in (b"content-length", b"transfer-encoding"):
            self._framed = True
        self.response_headers.append((lowered, value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()
        self._headers_done = True

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.complete = True

    # the caller's side
    def send(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        self._reset_exchange()
        self._parser = httptools.HttpResponseParser(self)
        self.transport.writelines((head, body))

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def headers(self) -> tuple[int, list[tuple[bytes, bytes]]]:
        while not self._headers_done:
            if self.lost:
                raise ConnectionLost("engine closed the connection before answering")
            await self._wait()
        return self.status, self.response_headers

    def has_bytes(self) -> bool:
        """Whether ``next_bytes`` would return without waiting."""
        return bool(self._body) or self.complete or self.lost

    async def next_bytes(self) -> bytes:
        """Every body byte received so far; b"" once the body is complete."""
        while True:
            if self._body:
                out = bytes(self._body)
                self._body.clear()
                if self._paused and self.transport is not None and not self.lost:
                    self._paused = False
                    self.transport.resume_reading()
                return out
            if self.complete:
                return b""
            if self.lost:
                raise ConnectionLost("engine closed the connection mid-response")
            await self._wait()

    @property
    def reusable(self) -> bool:
        return (
            self.complete
            and self.keep_alive
            and self._framed
            and self.status < 500
            and not self.lost
            and not self._body
            and self.transport is not None
            and not self.transport.is_closing()
        )

    def close(self) -> None:
        self._lose()


@dataclass(slots=True)
class _OriginPool:
    origin: Origin
    idle: deque[Connection] = field(default_factory=deque)
    open: set[Connection] = field(default_factory=set)
    connecting: int = 0
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)

    def forget(self, conn: Connection) -> None:
        self.open.discard(conn)
        if conn in self.idle:  # else it belonged to a request
            self.idle.remove(conn)
        self.wake_one()

    def wake_one(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


class Pool:
    def __init__(
        self,
        max_connections: int = 4096,
        keepalive_s: float = 4.0,
        pool_timeout_s: float = 30.0,
    ) -> None:
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self.pool_timeout_s = pool_timeout_s
        self._origins: dict[Origin, _OriginPool] = {}
        self._ssl: ssl.SSLContext | None = None
        self.closed = False
        self._sweep_at = time.monotonic() + keepalive_s

    def _pool(self, origin: Origin) -> _OriginPool:
        pool = self._origins.get(origin)
        if pool is None:
            pool = self._origins[origin] = _OriginPool(origin)
        return pool

    def _idle(self, pool: _OriginPool) -> Connection | None:
        oldest = time.monotonic() - self.keepalive_s
        while pool.idle:
            conn = pool.idle.pop()  # the most recently used: warm, least likely closed
            if _stale(conn, oldest):
                conn.close()
                continue
            return conn
        return None

    def _sweep(self, now: float) -> None:
        """Close every origin's stale idle connections; forget the origins left with nothing."""
        self._sweep_at = now + self.keepalive_s
        oldest = now - self.keepalive_s
        for origin, pool in list(self._origins.items()):
            if pool.idle:
                # Rebuilt rather than removed from: ``forget`` scans the deque for each closed
                # connection, and the stale ones, the oldest, come first, before any is kept.
                idle, pool.idle = pool.idle, deque()
                for conn in idle:
                    if _stale(conn, oldest):
                        conn.close()
                    else:
                        pool.idle.append(conn)
            # A waiter done (timed out, cancelled) stays queued until ``wake_one`` passes it.
            if not pool.open and not pool.connecting and all(w.done() for w in pool.waiters):
                del self._origins[origin]

    async def request(
        self, origin: Origin, head: bytes, body: bytes, connect_s: float, *, fresh: bool = False
    ) -> Connection:
        """Send the request; the returned connection is the caller's until ``release``."""
        now = time.monotonic()
        if now >= self._sweep_at:
            self._sweep(now)
        deadline = now + self.pool_timeout_s
        while True:
            # Again after each wait: the sweep may have forgotten the origin meanwhile.
            pool = self._pool(origin)
            conn = None if fresh else self._idle(pool)
            if conn is not None:
                conn.send(head, body)
                conn.reused = True
                return conn
            if len(pool.open) + pool.connecting < self.max_connections:
                break
            waiter = asyncio.get_running_loop().create_future()
            pool.waiters.append(waiter)
            try:
                async with asyncio.timeout_at(
                    asyncio.get_running_loop().time() + deadline - time.monotonic()
                ):
                    await waiter
            except TimeoutError:
                raise PoolTimeout(
                    f"all {self.max_connections} connections to {origin.authority} busy for "
                    f"{self.pool_timeout_s:g}s"
                ) from None
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    pool.wake_one()  # woken, then cancelled: hand the free place on
                raise
            finally:
                if not waiter.done():
                    waiter.cancel()
        conn = await self._connect(pool, connect_s)
        conn.send(head, body)
        conn.reused = False
        return conn

    async def _connect(self, pool: _OriginPool, connect_s: float) -> Connection:
        loop = asyncio.get_running_loop()
        origin = pool.origin
        context = None
        if origin.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        pool.connecting += 1
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(
                    lambda: Connection(pool, loop), origin.host, origin.port, ssl=context
                )
        except BaseException:
            pool.wake_one()  # the place this connection would have taken is free again
            raise
        finally:
            pool.connecting -= 1
        if conn.lost:  # closed before we got it: never count it as open
            raise ConnectionLost("engine closed the connection as it opened")
        pool.open.add(conn)
        return conn

    def release(self, conn: Connection) -> None:
        if conn.reusable and not self.closed:
            conn.idle_since = time.monotonic()
            conn._pool.idle.append(conn)
            conn._pool.wake_one()
        else:
            conn.close()

    def close(self) -> None:
        self.closed = True
        for pool in self._origins.values():
            for conn in list(pool.open):
                conn.close()
            pool.idle.clear()


def _stale(conn: Connection, oldest: float) -> bool:
    """An idle connection not to hand out: closed, idle since before ``oldest``, or unfit."""
    return conn.lost or conn.idle_since < oldest or not conn.reusable


def request_head(
    method: str, target: str, authority: str, headers: Mapping[str, str], size: int
) -> bytes:
    """The request line and headers; the caller's header values were read from a client request
    (no CR or LF can be in them: the HTTP server that parsed them refuses those)."""
    lines = [f"{method} {target} HTTP/1.1", f"host: {authority}", f"content-length: {size}"]
    lines.extend(f"{name}: {value}" for name, value in headers.items())
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
