"""Forwarding to an engine and relaying its bytes back, unchanged.

Contract:
- ``Upstream.open(url, body, headers, watch)`` sends the client's original body bytes (never a
  re-serialisation) and yields an ``UpstreamResponse`` once the engine answered with headers. It
  raises ``UpstreamError`` (502) for a refused, reset or otherwise failed connection and
  ``DeadlineHit`` (504) for a connect or first-byte deadline.
- Leaving the ``async with`` always closes the upstream response, shielded from cancellation and
  bounded in time: an engine whose client left sees its connection closed and aborts the request.
- ``UpstreamResponse.chunks(watch)`` yields the raw bytes as they arrive (no decoding, no
  buffering), bounding the first chunk by the first-byte deadline and later ones by the idle one.
- Only an allowlist of client headers reaches the engine; the client's Authorization only if the
  cluster says so; a per-cluster engine key replaces it when set. Hop-by-hop headers never pass
  in either direction.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import httpx

from gateway.errors import UpstreamError
from gateway.log import Logger, swallowed
from gateway.metrics import Metrics
from gateway.watchdog import DeadlineHit, Watch

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
CLOSE_TIMEOUT_S = 2.0


def upstream_headers(
    client_headers: Iterable[tuple[bytes, bytes]],
    request_id: str,
    *,
    forward_auth: bool,
    engine_key: str | None,
) -> dict[str, str]:
    """The headers the engine gets: an allowlist of the client's, our request id, the key."""
    out: dict[str, str] = {}
    for raw_name, raw_value in client_headers:
        name = raw_name.decode("latin-1").lower()
        if name in FORWARDED_REQUEST_HEADERS or (forward_auth and name == "authorization"):
            out[name] = raw_value.decode("latin-1")
    out["x-request-id"] = request_id
    if engine_key:
        out["authorization"] = f"Bearer {engine_key}"
    return out


def response_headers(
    engine_headers: httpx.Headers, extra: Mapping[str, str]
) -> list[tuple[bytes, bytes]]:
    """The engine's response headers minus hop-by-hop ones, plus ours."""
    out = [
        (name.encode("latin-1"), value.encode("latin-1"))
        for name, value in engine_headers.multi_items()
        if name.lower() not in HOP_BY_HOP and name.lower() not in extra
    ]
    out.extend((name.encode("latin-1"), value.encode("latin-1")) for name, value in extra.items())
    return out


@dataclass(slots=True)
class UpstreamResponse:
    status: int
    headers: httpx.Headers
    _response: httpx.Response

    async def chunks(self, watch: Watch) -> AsyncIterator[bytes]:
        stream = self._response.aiter_raw()
        phase: str = "first_byte"
        while True:
            try:
                with watch.within("first_byte" if phase == "first_byte" else "idle"):
                    chunk = await anext(stream)
            except StopAsyncIteration:
                return
            except httpx.HTTPError as exc:
                raise UpstreamError(f"engine connection failed mid-response: {_why(exc)}") from exc
            phase = "idle"
            if chunk:
                yield chunk

    async def read(self, watch: Watch) -> bytes:
        parts = [chunk async for chunk in self.chunks(watch)]
        return b"".join(parts)


def _why(exc: httpx.HTTPError) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class Upstream:
    """One pooled HTTP client for every engine; per-request deadlines come from the watchdog."""

    def __init__(self, metrics: Metrics, log: Logger, max_connections: int = 4096) -> None:
        self._metrics = metrics
        self._log = log
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=512,
                keepalive_expiry=30.0,
            ),
            # Reads are bounded by the watchdog, which knows the lane; httpx's own are off.
            timeout=httpx.Timeout(None, connect=10.0, pool=30.0),
            follow_redirects=False,
        )

    @asynccontextmanager
    async def open(
        self, url: str, body: bytes, headers: Mapping[str, str], watch: Watch
    ) -> AsyncIterator[UpstreamResponse]:
        request = self._client.build_request(
            "POST",
            url,
            content=body,
            headers=headers,
            timeout=httpx.Timeout(None, connect=watch.deadlines.connect_s, pool=30.0),
        )
        try:
            with watch.within("first_byte"):
                response = await self._client.send(request, stream=True)
        except httpx.ConnectTimeout as exc:
            raise DeadlineHit("connect", watch.deadlines.connect_s) from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(f"engine request failed: {_why(exc)}") from exc
        try:
            yield UpstreamResponse(response.status_code, response.headers, response)
        finally:
            await self._close(response, url)

    async def _close(self, response: httpx.Response, url: str) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT_S) as scope:
            try:
                await response.aclose()
            except httpx.HTTPError as exc:
                swallowed(
                    self._log,
                    self._metrics,
                    "proxy.close",
                    exc,
                    decision="connection_dropped",
                    url=url,
                )
        if scope.cancelled_caught:
            self._log.warning("upstream.close_timeout", url=url, seconds=CLOSE_TIMEOUT_S)

    async def aclose(self) -> None:
        await self._client.aclose()
