"""shapegate's HTTP/1.1 protocol writes a response's head with its first body bytes
(gateway/edge/http_protocol.py ``CoalescedCycle``), and never holds the head back for a body
that does not follow at once."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gateway.edge.http_protocol import guarded_protocol
from gateway.settings import ServerSettings
from tests.support.servers import serve_asgi

BODY = b'{"answer":"hello"}'


class _Counting:
    """A transport that counts its writes (everything else is the real one's)."""

    def __init__(self, real: Any, writes: list[bytes]) -> None:
        self._real = real
        self._writes = writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._real.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _counting_protocol(writes: list[bytes]) -> type:
    base = guarded_protocol(ServerSettings())

    class Counting(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.transport = _Counting(self.transport, writes)

    return Counting


async def _answer(scope: Any, receive: Any, send: Any, pause_s: float = 0.0) -> None:
    if scope["type"] != "http":
        return
    await receive()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(BODY))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    if pause_s:
        await asyncio.sleep(pause_s)
    await send({"type": "http.response.body", "body": BODY, "more_body": False})


async def _get(url: str, first_read_s: float = 5.0) -> tuple[bytes, float, bytes]:
    """The first bytes read and when (from the send), then the rest of the response."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    sent = time.monotonic()
    first = await asyncio.wait_for(reader.read(65536), first_read_s)
    at = time.monotonic() - sent
    rest = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return first, at, rest


async def test_the_head_and_the_body_go_out_in_one_write() -> None:
    writes: list[bytes] = []
    async with serve_asgi(_answer, http=_counting_protocol(writes)) as url:
        first, _, rest = await _get(url)
    response = first + rest
    assert response.startswith(b"HTTP/1.1 200 OK\r\n") and response.endswith(b"\r\n\r\n" + BODY)
    assert len(writes) == 1 and writes[0] == response


async def test_a_head_whose_body_is_late_is_sent_at_once() -> None:
    writes: list[bytes] = []

    async def late(scope: Any, receive: Any, send: Any) -> None:
        await _answer(scope, receive, send, pause_s=0.5)

    async with serve_asgi(late, http=_counting_protocol(writes)) as url:
        first, at, rest = await _get(url)
    assert first.startswith(b"HTTP/1.1 200 OK\r\n") and first.endswith(b"\r\n\r\n")
    assert at < 0.4  # the head did not wait for the body
    assert rest == BODY and len(writes) == 2
