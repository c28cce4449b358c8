"""Forwarding to an engine and relaying its bytes back, unchanged.

Contract:
- ``Upstream.open(url, body, headers, watch, meanwhile, fresh=False, whole=False)`` sends the
  client's original body bytes (never a re-serialisation) and yields an ``UpstreamResponse``
  once the engine answered with headers; ``meanwhile`` (optional, synchronous) runs once the
  request is written, before the wait for the answer: work that overlaps the engine's instead
  of delaying the request. It raises ``EngineUnreachable`` (502, safe to send elsewhere: the
  engine sent no byte) for a refused, reset or closed connection before any answer byte, with
  ``stale`` set when that connection was a kept-alive one; ``UpstreamError`` (502) for any
  other failure; and ``DeadlineHit`` (504) for a connect, first-byte or total deadline.
  ``fresh=True`` opens a new connection rather than reusing an idle one. ``whole=True`` says
  the engine answers with the whole response at once (a non-streamed request: vLLM sends the
  headers only when generation ends), so the wait for the headers is bounded by the total
  deadline, not the first-byte one.
- Leaving the ``async with`` always closes the upstream response: a response read to its end
  returns its connection to the pool, any other is closed, synchronously (no await, so no
  cancellation can interrupt it): an engine whose client left sees its connection closed and
  aborts the request.
- ``UpstreamResponse.chunks(watch)`` yields the raw body bytes as they arrive (transfer
  encoding removed, nothing else decoded, no buffering): everything received since the last
  chunk in one piece, so a burst of SSE events costs one write to the client, not one each. The
  first chunk is bounded by the first-byte deadline, later ones by the idle one.
  ``read(watch)`` reads a whole body within what is left of the total deadline.
- Only an allowlist of client headers reaches the engine (built in, plus the policy's
  ``routes.forward_headers``); the client's Authorization only if the cluster says so; a
  per-cluster engine key replaces it when set. Hop-by-hop headers never pass in either
  direction.

The HTTP client is ``gateway.upstream.http1`` (httptools over asyncio, a LIFO keep-alive pool), not
httpx: see that module for the profile that chose it. Its pool cannot be poisoned by cancelled
requests (encode/httpcore#1093): taking a connection and owning it happen with no await between.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gateway.core.watchdog import DeadlineHit, Phase, Watch
from gateway.errors import EngineUnreachable, UpstreamError
from gateway.upstream.http1 import (
    Connection,
    ConnectionLost,
    Origin,
    Pool,
    PoolTimeout,
    request_head,
)

FORWARDED_REQUEST_HEADERS = frozenset(
    {"content-type", "accept", "user-agent", "traceparent", "tracestate", "x-request-id"}
)
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
        "date",
        "server",
    }
)
# Admission bounds how many requests reach the pool, so a pool with room hands out a connection
# at once; a request that waited this long fails (502) rather than queueing a second time.
POOL_WAIT_S = 1.0
SPLIT_CACHE_URLS = 1024


def upstream_headers(
    client_headers: Iterable[tuple[bytes, bytes]],
    request_id: str,
    *,
    forward_auth: bool,
    engine_key: str | None,
    extra: frozenset[str] = frozenset(),
    trace: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The headers the engine gets: an allowlist of the client's (the built-in one plus the
    policy's ``routes.forward_headers``), our request id, the key; with tracing on, ``trace``
    (gateway/observe/tracing.py) replaces the client's ``traceparent`` and ``tracestate``."""
    out: dict[str, str] = {}
    for raw_name, raw_value in client_headers:
        name = raw_name.decode("latin-1").lower()
        if (
            name in FORWARDED_REQUEST_HEADERS
            or name in extra
            or (forward_auth and name == "authorization")
        ):
            out[name] = raw_value.decode("latin-1")
    out["x-request-id"] = request_id
    if trace is not None:
        out.pop("tracestate", None)  # kept inside ``trace`` when the traceparent was valid
        out.update(trace)
    if engine_key:
        out["authorization"] = f"Bearer {engine_key}"
    return out


_HOP_BY_HOP_BYTES = frozenset(name.encode() for name in HOP_BY_HOP)


def response_headers(
    engine_headers: Iterable[tuple[bytes, bytes]], extra: Sequence[tuple[bytes, bytes]]
) -> list[tuple[bytes, bytes]]:
    """The engine's response headers (lower-case names) minus hop-by-hop ones, plus ours
    (``extra``: lower-case names, as bytes; each replaces the engine's of that name)."""
    names = {name for name, _ in extra}
    out = [
        (name, value)
        for name, value in engine_headers
        if name not in _HOP_BY_HOP_BYTES and name not in names
    ]
    out += extra
    return out


@dataclass(slots=True)
class UpstreamResponse:
    status: int
    headers: list[tuple[bytes, bytes]]
    _conn: Connection

    async def chunks(self, watch: Watch, first: Phase = "first_byte") -> AsyncIterator[bytes]:
        phase = first
        while True:
            chunk = await self._next(watch, phase)
            if not chunk:
                return
            phase = "idle"
            yield chunk

    async def read(self, watch: Watch) -> bytes:
        """The whole body: ``chunks(watch, "total")`` joined, without an async generator (its
        creation, the loop's hook and finalizer, on every non-streamed answer)."""
        parts: list[bytes] = []
        phase: Phase = "total"
        while chunk := await self._next(watch, phase):
            parts.append(chunk)
            phase = "idle"
        return b"".join(parts)

    async def _next(self, watch: Watch, phase: Phase) -> bytes:
        conn = self._conn
        try:
            if conn.has_bytes():
                # Returns at once (no deadline to arm), or raises for a close it already saw.
                return await conn.next_bytes()
            with watch.within(phase):
                return await conn.next_bytes()
        except ConnectionLost as exc:
            raise UpstreamError(f"engine connection failed mid-response: {exc}") from exc


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _unreached(exc: OSError | ConnectionLost, conn: Connection | None) -> EngineUnreachable | None:
    """The failure as ``EngineUnreachable`` when the engine sent no byte of an answer."""
    if conn is not None and conn.answered:
        return None  # a partial answer: the engine may have acted on the request
    if isinstance(exc, ConnectionRefusedError):
        reason = "refused"
    elif isinstance(exc, ConnectionResetError | ConnectionAbortedError):
        reason = "reset"
    elif isinstance(exc, ConnectionLost):
        reason = "closed"
    else:
        reason = "connect_failed"
    stale = conn is not None and conn.reused
    return EngineUnreachable(
        f"engine request failed: {_why(exc)}", reason="stale" if stale else reason, stale=stale
    )


@dataclass(slots=True)
class Opened:
    """``Upstream.open``'s context: a class, not an ``asynccontextmanager`` (its generator, the
    loop's async-generator hook and two ``anext`` a request)."""

    upstream: Upstream
    url: str
    body: bytes
    headers: Mapping[str, str]
    watch: Watch
    meanwhile: Callable[[], None] | None
    fresh: bool
    whole: bool
    conn: Connection | None = None

    async def __aenter__(self) -> UpstreamResponse:
        return await self.upstream._open(self)

    async def __aexit__(self, *exc_info: object) -> None:
        # Synchronous: a cancellation cannot interrupt it.
        conn, self.conn = self.conn, None
        self.upstream._close(conn)


class Upstream:
    """One connection pool for every engine; per-request deadlines come from the watchdog.

    ``max_connections`` bounds the connections to each engine. Admission bounds how many
    requests reach the pool, so a pool with room hands out a connection at once; one that waits
    ``POOL_WAIT_S`` fails the request with ``PoolTimeout`` (502) rather than queueing it twice.
    """

    def __init__(self, max_connections: int = 4096) -> None:
        self._pool = Pool(max_connections=max_connections, pool_timeout_s=POOL_WAIT_S)
        # URL -> (origin, target): a few endpoints times a few routes, split once each rather
        # than by urlsplit on every request (4% of a request's CPU in the overhead profile).
        self._split: dict[str, tuple[Origin, str]] = {}

    def _origin_of(self, url: str) -> tuple[Origin, str]:
        found = self._split.get(url)
        if found is None:
            if len(self._split) >= SPLIT_CACHE_URLS:
                self._split.clear()  # endpoints come and go with reloads: never unbounded
            found = self._split[url] = Origin.of(url)
        return found

    def open(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        watch: Watch,
        meanwhile: Callable[[], None] | None = None,
        *,
        fresh: bool = False,
        whole: bool = False,
    ) -> Opened:
        """``async with upstream.open(...) as response``: the request sent, its answer's status
        and headers read; the connection back to the pool (or closed) on the way out."""
        return Opened(self, url, body, headers, watch, meanwhile, fresh, whole)

    async def _open(self, opened: Opened) -> UpstreamResponse:
        try:
            origin, target = self._origin_of(opened.url)
        except ValueError as exc:
            raise UpstreamError(f"engine request failed: {exc}") from exc
        body, watch = opened.body, opened.watch
        head = request_head("POST", target, origin.authority, opened.headers, len(body))
        conn: Connection | None = None
        # A non-streamed answer's headers come with its last token: the whole decode is the
        # wait for them, which only the total deadline bounds.
        waiting: Phase = "total" if opened.whole else "first_byte"
        try:
            with watch.within(waiting):
                try:
                    conn = await self._pool.request(
                        origin, head, body, watch.deadlines.connect_s, fresh=opened.fresh
                    )
                except TimeoutError as exc:
                    raise DeadlineHit("connect", watch.deadlines.connect_s) from exc
                if opened.meanwhile is not None:
                    opened.meanwhile()  # the request is written: this overlaps the engine's work
                status, response_headers = await conn.headers()
        except (OSError, ConnectionLost) as exc:
            self._close(conn)
            unreached = _unreached(exc, conn)
            if unreached is not None:
                raise unreached from exc
            raise UpstreamError(f"engine request failed: {_why(exc)}") from exc
        except PoolTimeout as exc:
            self._close(conn)
            raise UpstreamError(f"engine request failed: {_why(exc)}") from exc
        except BaseException:
            self._close(conn)
            raise
        opened.conn = conn
        return UpstreamResponse(status, response_headers, conn)

    def _close(self, conn: Connection | None) -> None:
        """Back to the pool if the response was read to its end, else closed: the engine sees
        its client leave. Synchronous, so a cancellation cannot interrupt it."""
        if conn is not None:
            self._pool.release(conn)

    async def aclose(self) -> None:
        self._pool.close()
