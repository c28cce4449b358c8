"""shapegate's HTTP/1.1 protocol writes a response's head with its first body bytes
(gateway/edge/http_protocol.py ``CoalescedCycle``), and never holds the head back for a body
that does not follow at once. Its scope offers ``DISCONNECT_HOOK``: a callback the connection's
loss calls while the response is incomplete (``WatchedCycle``), never after it completed or once
unwatched; a finished exchange is freed by reference counting (no cyclic garbage a request)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from typing import Any

from gateway.core.exchange import DISCONNECT_HOOK, disconnect_hook
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


def _watching(calls: list[str], *, answer: bool, unwatch: bool = False) -> Any:
    """An app that reads the body, watches for the disconnect (``calls`` gets "gone" when the
    hook fires), then answers at once (``answer``) or waits for the disconnect up to 5 s."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        hook = disconnect_hook(scope)
        assert hook is not None, f"no {DISCONNECT_HOOK} in the scope"
        gone = asyncio.Event()

        def left() -> None:
            calls.append("gone")
            gone.set()

        stop = hook(left)
        if unwatch:
            stop()
        if answer:
            headers = [(b"content-length", b"%d" % len(BODY))]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": BODY, "more_body": False})
            return
        calls.append("waiting")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(gone.wait(), 5)
        calls.append("done")

    return app


async def _post_and_leave(url: str, *, read: bool) -> None:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
    if read:
        await asyncio.wait_for(reader.readuntil(BODY), 5)
    else:
        await asyncio.sleep(0.2)  # the app is waiting
    writer.transport.abort()


async def test_a_lost_connection_calls_the_disconnect_hook_once() -> None:
    calls: list[str] = []
    async with serve_asgi(
        _watching(calls, answer=False), http=guarded_protocol(ServerSettings())
    ) as url:
        await _post_and_leave(url, read=False)
        for _ in range(100):
            if "done" in calls:
                break
            await asyncio.sleep(0.02)
    assert calls == ["waiting", "gone", "done"]


async def test_the_hook_is_not_called_after_the_response_or_once_unwatched() -> None:
    calls: list[str] = []
    async with serve_asgi(
        _watching(calls, answer=True), http=guarded_protocol(ServerSettings())
    ) as url:
        await _post_and_leave(url, read=True)
        await asyncio.sleep(0.2)
    assert calls == []  # answered, then the client left: nothing to cancel
    async with serve_asgi(
        _watching(calls, answer=False, unwatch=True), http=guarded_protocol(ServerSettings())
    ) as url:
        await _post_and_leave(url, read=False)
        for _ in range(50):
            if "done" in calls:
                break
            await asyncio.sleep(0.02)
    assert calls == ["waiting"]  # unwatched: the loss is not reported


HEADS = {
    "mixed-case names": (200, [(b"Content-Type", b"application/json"), (b"Content-Length", b"4")]),
    "no length": (200, [(b"content-type", b"text/event-stream"), (b"x-a", b"1")]),
    "connection close": (200, [(b"content-length", b"4"), (b"Connection", b"Keep-Alive, Close")]),
    "chunked named": (200, [(b"Transfer-Encoding", b"Chunked"), (b"x-b", b"")]),
    "no content": (204, [(b"x-c", b"2")]),
    "bad value": (200, [(b"x-ok", b"1"), (b"content-length", b"4"), (b"x-bad", b"a\nb")]),
    "bad name": (200, [(b"x bad", b"1"), (b"x-ok", b"a\nb")]),
}


async def test_the_head_is_the_one_uvicorn_writes() -> None:
    """``CoalescedCycle`` builds the head itself: byte for byte uvicorn's (lower-case names,
    the framing it derives from them, ``connection: close``), and a bad header name or value
    ends the answer as uvicorn's own check does."""

    def app_for(status: int, headers: list[tuple[bytes, bytes]]) -> Any:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return
            await receive()
            await send({"type": "http.response.start", "status": status, "headers": headers})
            body = b"" if status == 204 else b"ab"
            await send({"type": "http.response.body", "body": body, "more_body": True})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        return app

    async def raw(app: Any, http: Any) -> bytes:
        async with serve_asgi(app, http=http) as url:
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            data = b""
            with contextlib.suppress(TimeoutError):
                while chunk := await asyncio.wait_for(reader.read(65536), 0.5):
                    data += chunk
            writer.close()
        return b"\r\n".join(line for line in data.split(b"\r\n") if not line.startswith(b"date:"))

    ours_protocol = guarded_protocol(ServerSettings())
    for case, (status, headers) in HEADS.items():
        app = app_for(status, headers)
        ours, theirs = await raw(app, ours_protocol), await raw(app, "httptools")
        assert ours == theirs, case
        if case.startswith("bad"):
            assert ours == b"", case  # closed without a response, as uvicorn does
        else:
            assert ours.startswith(b"HTTP/1.1 %d" % status), case


async def test_a_finished_request_leaves_no_cyclic_garbage() -> None:
    """The hook in the scope reaches its cycle weakly: a bound method of the cycle there made
    cycle -> scope -> extensions -> hook -> cycle, so each request's cycle, scope, event and
    headers waited for the cyclic collector (about 9 objects a request) instead of being freed
    when the request ended."""
    requests = 50

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        hook = disconnect_hook(scope)
        assert hook is not None
        unwatch = hook(lambda: None)  # as the pipeline does: watch, answer, unwatch
        headers = [(b"content-length", b"%d" % len(BODY))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": BODY, "more_body": False})
        unwatch()

    async with serve_asgi(app, http=guarded_protocol(ServerSettings())) as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        request = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"
        writer.write(request)
        await asyncio.wait_for(reader.readuntil(BODY), 5)  # warm: the first request's caches
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(requests):
                writer.write(request)
                await asyncio.wait_for(reader.readuntil(BODY), 5)
            gc.collect()
            cycles = [o for o in gc.garbage if type(o).__name__.endswith("Cycle")]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        writer.close()
    assert cycles == []


async def test_a_response_does_not_ask_for_the_running_loop(monkeypatch: Any) -> None:
    """The cycle holds its connection's loop: in Python 3.11 ``get_running_loop`` is a getpid
    system call."""
    async with serve_asgi(_answer, http=guarded_protocol(ServerSettings())) as url:
        asked: list[None] = []
        real = asyncio.get_running_loop

        def counting() -> asyncio.AbstractEventLoop:
            asked.append(None)
            return real()

        monkeypatch.setattr("gateway.edge.http_protocol.asyncio.get_running_loop", counting)
        first, _, rest = await _get(url)
        monkeypatch.undo()
    assert (first + rest).endswith(BODY)
    assert asked == []
