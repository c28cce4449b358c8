"""An open-loop and a closed-loop HTTP/1.1 load generator, on raw asyncio sockets.

Used by ``shapegate bench overhead``, ``memory`` and ``workers`` against the fixed upstream
(upstream.py); neither goes through any HTTP library of the gateway's, so the gateway is the
only thing measured twice.

- ``open_loop(host, port, path, body, rate, seconds)`` sends requests on a fixed schedule,
  ``rate`` a second, whether or not earlier ones finished (open loop: queueing in the server
  shows up as latency, not as a lower send rate). A request due when no keep-alive connection
  is idle opens a new one (up to ``MAX_CONNECTIONS``; past that it waits, which shows as
  ``lag``). Per request it records the schedule lag (send time minus due time, the generator's
  own lateness), the time to the first response byte and to the last, both from the send, and
  the status; a refused, reset or timed-out request, or any status but 200, is an error.
- ``closed_loop(host, port, path, body, connections, seconds)``: ``connections`` keep-alive
  connections, each sending its next request as soon as the last answer ended, for ``seconds``:
  the throughput a server sustains (requests/s), and its latencies at that concurrency.
The generator's own ceiling is measured by pointing it at the upstream directly at rising rates
(``overhead`` does and reports it).
"""

from __future__ import annotations

import asyncio
import math
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import httptools

# open_loop: how long it waits for the last response, its connection ceiling, and the
# keep-alive connections it opens before the first request is due.
TIMEOUT_S = 10.0
MAX_CONNECTIONS = 512
WARM_CONNECTIONS = 16


@dataclass(slots=True)
class LoadResult:
    """Per-request samples of one open-loop run (seconds)."""

    rate: float
    seconds: float
    sent: int = 0
    ok: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    lag: list[float] = field(default_factory=list)
    ttfb: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    elapsed: float = 0.0
    connections: int = 0

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1

    def answered(self, status: int, sent_at: float, first_at: float, done: float) -> None:
        """One response: its times if it was a 200, else an error of its status."""
        if status == 200:
            self.ok += 1
            self.ttfb.append(first_at - sent_at)
            self.total.append(done - sent_at)
        else:
            self.error(f"status_{status}")


class _Client(asyncio.Protocol):
    """One keep-alive client connection; one request at a time."""

    def __init__(self, gen: _Generator) -> None:
        self._gen = gen
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.sent_at = 0.0
        self.first_at = 0.0
        self.busy = False
        self.keep_alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def send(self, request: bytes) -> None:
        assert self.transport is not None
        self.busy = True
        self.first_at = 0.0
        self.sent_at = time.perf_counter()
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        if self.busy and not self.first_at:
            self.first_at = time.perf_counter()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self._fail("bad_response")
            assert self.transport is not None
            self.transport.close()

    def on_headers_complete(self) -> None:
        self.keep_alive = self._parser.should_keep_alive()

    def on_message_complete(self) -> None:
        done = time.perf_counter()
        self.busy = False
        self._gen.finished(self, self._parser.get_status_code(), done)

    def _fail(self, kind: str) -> None:
        if self.busy:
            self.busy = False
            self._gen.failed(self, kind)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail("reset" if exc else "closed")
        self._gen.lost(self)


class _Generator:
    def __init__(
        self, host: str, port: int, requests: Sequence[bytes], max_connections: int
    ) -> None:
        self.host, self.port, self.requests = host, port, requests
        self.max_connections = max_connections
        self.idle: deque[_Client] = deque()
        self.pending: deque[tuple[float, bytes]] = deque()
        self.open = 0
        self.in_flight: dict[_Client, float] = {}
        self.result: LoadResult | None = None
        self.outstanding = 0
        self.scheduled = False  # every request of the run was submitted
        self.all_done = asyncio.Event()

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        self.open += 1
        try:
            _, client = await loop.create_connection(lambda: _Client(self), self.host, self.port)
        except OSError:
            self.open -= 1
            if self.pending and self.result is not None:
                self.pending.popleft()
                self._settle(None, "connect_failed")
            return
        sock = client.transport.get_extra_info("socket") if client.transport else None
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.result is not None:
            self.result.connections = max(self.result.connections, self.open)
        self._ready(client)

    def _ready(self, client: _Client) -> None:
        if self.pending:
            self._send(client, *self.pending.popleft())
        else:
            self.idle.append(client)

    def _send(self, client: _Client, due: float, request: bytes) -> None:
        client.send(request)
        self.in_flight[client] = due
        if self.result is not None:
            self.result.lag.append(client.sent_at - due)

    def submit(self, due: float) -> None:
        assert self.result is not None
        request = self.requests[self.result.sent % len(self.requests)]
        self.result.sent += 1
        self.outstanding += 1
        while self.idle:
            client = self.idle.popleft()
            if client.transport is not None and not client.transport.is_closing():
                self._send(client, due, request)
                return
        self.pending.append((due, request))
        if self.open < self.max_connections:
            asyncio.get_running_loop().create_task(self.connect())

    def finished(self, client: _Client, status: int, done: float) -> None:
        self.in_flight.pop(client, None)
        if self.result is not None:
            self.result.answered(status, client.sent_at, client.first_at, done)
        self._settle_count()
        if client.keep_alive and client.transport is not None:
            self._ready(client)
        elif client.transport is not None:
            client.transport.close()

    def failed(self, client: _Client, kind: str) -> None:
        self.in_flight.pop(client, None)
        self._settle(client, kind)

    def _settle(self, client: _Client | None, kind: str) -> None:
        if self.result is not None:
            self.result.error(kind)
        self._settle_count()

    def _settle_count(self) -> None:
        self.outstanding -= 1
        if self.scheduled and self.outstanding <= 0:
            self.all_done.set()

    def lost(self, client: _Client) -> None:
        self.open -= 1
        if client in self.idle:
            self.idle.remove(client)
        if self.pending and self.open < self.max_connections:
            asyncio.get_running_loop().create_task(self.connect())

    def close(self) -> None:
        for client in [*self.idle, *self.in_flight]:
            if client.transport is not None:
                client.transport.close()


def http_request(host: str, port: int, path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def open_loop(
    host: str,
    port: int,
    path: str,
    body: bytes | Sequence[bytes],
    rate: float,
    seconds: float,
) -> LoadResult:
    """Send ``rate * seconds`` requests on a fixed schedule; wait for all (up to ``TIMEOUT_S``).

    ``body`` is one request body, or a list of them sent in turn (request i gets body i)."""
    bodies = [body] if isinstance(body, bytes) else body
    requests = [http_request(host, port, path, one) for one in bodies]
    gen = _Generator(host, port, requests, MAX_CONNECTIONS)
    await asyncio.gather(*(gen.connect() for _ in range(WARM_CONNECTIONS)))
    result = gen.result = LoadResult(rate=rate, seconds=seconds, connections=gen.open)
    count = max(1, round(rate * seconds))
    interval = 1.0 / rate
    clock = time.perf_counter
    start = clock() + 0.01
    for i in range(count):
        due = start + i * interval
        delay = due - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        gen.submit(due)
    gen.scheduled = True
    if gen.outstanding <= 0:
        gen.all_done.set()
    try:
        await asyncio.wait_for(gen.all_done.wait(), TIMEOUT_S)
    except TimeoutError:
        for _ in range(gen.outstanding):
            result.error("timeout")
    result.elapsed = clock() - start
    gen.close()
    await asyncio.sleep(0)
    return result


class _LoopClient(asyncio.Protocol):
    """One closed-loop connection: the next request goes out as the last answer ends."""

    def __init__(self, request: bytes, result: LoadResult, stop_at: float) -> None:
        self._request, self._result, self._stop_at = request, result, stop_at
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._sent_at = 0.0
        self._first_at = 0.0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send()

    def _send(self) -> None:
        assert self._transport is not None
        self._result.sent += 1
        self._first_at = 0.0
        self._sent_at = time.perf_counter()
        self._transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        if not self._first_at:
            self._first_at = time.perf_counter()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self._result.error("bad_response")
            self._finish()

    def on_message_complete(self) -> None:
        now = time.perf_counter()
        status = self._parser.get_status_code()
        self._result.answered(status, self._sent_at, self._first_at, now)
        if now < self._stop_at and self._parser.should_keep_alive():
            self._send()
        else:
            self._finish()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self._result.error("reset" if exc else "closed")
            self.done.set_result(None)

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)
        if self._transport is not None:
            self._transport.close()


async def closed_loop(
    host: str, port: int, path: str, body: bytes, connections: int, seconds: float
) -> LoadResult:
    """``connections`` connections sending back to back for ``seconds``; ``rate`` in the result
    is the achieved throughput (answered requests a second)."""
    loop = asyncio.get_running_loop()
    request = http_request(host, port, path, body)
    result = LoadResult(rate=0.0, seconds=seconds, connections=connections)
    start = time.perf_counter()
    stop_at = start + seconds
    clients = []
    for _ in range(connections):
        try:
            _, client = await loop.create_connection(
                lambda: _LoopClient(request, result, stop_at), host, port
            )
        except OSError:
            result.error("connect_failed")
            continue
        clients.append(client)
    try:
        await asyncio.wait_for(asyncio.gather(*(c.done for c in clients)), seconds + TIMEOUT_S)
    except TimeoutError:
        result.error("timeout")
    result.elapsed = time.perf_counter() - start
    result.rate = round(result.ok / result.elapsed, 1) if result.elapsed else 0.0
    for client in clients:
        client._finish()
    await asyncio.sleep(0)
    return result


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def new_event_loop() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's loop factory where installed (the gateway's own choice), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory
