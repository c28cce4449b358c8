"""gateway.upstream.http1: the engines' HTTP/1.1 client and its keep-alive pool, on real loopback
sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from gateway.upstream.http1 import ConnectionLost, Origin, Pool, PoolTimeout, request_head

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback server; yields its URL and a list that grows by one per accepted connection."""
    accepted: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        except ConnectionError:
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1/chat/completions", accepted
    finally:
        srv.close()
        await srv.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return None
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return await reader.readexactly(length)


async def keep_alive_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers each request with its own body, keep-alive."""
    while True:
        try:
            body = await read_request(reader)
        except asyncio.IncompleteReadError:
            return
        if body is None:
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()


async def exchange(pool: Pool, url: str, body: bytes) -> bytes:
    origin, target = Origin.of(url)
    conn = await pool.request(
        origin, request_head("POST", target, origin.authority, {}, len(body)), body, 2.0
    )
    try:
        status, _ = await conn.headers()
        assert status == 200
        parts = []
        while chunk := await conn.next_bytes():
            parts.append(chunk)
        return b"".join(parts)
    finally:
        pool.release(conn)


async def test_a_response_read_to_its_end_leaves_its_connection_for_the_next_request() -> None:
    async with server(keep_alive_echo) as (url, accepted):
        pool = Pool()
        for i in range(20):
            assert await exchange(pool, url, b"x" * i + b"!") == b"x" * i + b"!"
        pool.close()
    assert len(accepted) == 1


@pytest.mark.parametrize(
    ("answer", "reused"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", True),
        (b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 2\r\n\r\nno", False),
        (b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n", False),
    ],
)
async def test_only_a_framed_answer_below_500_leaves_its_connection_for_reuse(
    answer: bytes, reused: bool
) -> None:
    """An engine that failed (5xx) may close the socket a moment later without saying so: its
    connection is closed, never pooled; the next request goes out on a new one."""

    async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader) is not None:
            writer.write(answer)
            await writer.drain()

    async with server(answer_each) as (url, accepted):
        pool = Pool()
        origin, target = Origin.of(url)
        for i in range(3):
            head = request_head("POST", target, origin.authority, {}, 2)
            conn = await pool.request(origin, head, b"{}", 2.0)
            await conn.headers()
            while await conn.next_bytes():
                pass
            assert conn.reused is (reused and i > 0)
            pool.release(conn)
        pool.close()
    assert len(accepted) == (1 if reused else 3)


async def test_an_unread_response_closes_its_connection_so_the_engine_sees_the_client_leave() -> (
    None
):
    closed = asyncio.Event()

    async def slow_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await reader.read()  # returns b"" when the gateway closes the connection
        closed.set()

    async with server(slow_stream) as (url, _):
        pool = Pool()
        origin, target = Origin.of(url)
        conn = await pool.request(
            origin, request_head("POST", target, origin.authority, {}, 2), b"{}", 2.0
        )
        await conn.headers()
        assert await conn.next_bytes() == b"hello"
        pool.release(conn)  # mid-stream: the client left
        await asyncio.wait_for(closed.wait(), 2)
        pool.close()


async def test_an_engine_dropping_the_connection_mid_body_is_an_error_not_an_end() -> None:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()

    async with server(drop) as (url, _):
        pool = Pool()
        with pytest.raises(ConnectionLost):
            await exchange(pool, url, b"{}")
        pool.close()


async def test_a_full_pool_waits_then_fails_with_pool_timeout_and_frees_on_release() -> None:
    async with server(keep_alive_echo) as (url, _):
        pool = Pool(max_connections=1, pool_timeout_s=0.2)
        origin, target = Origin.of(url)
        head = request_head("POST", target, origin.authority, {}, 2)
        held = await pool.request(origin, head, b"{}", 2.0)
        with pytest.raises(PoolTimeout):
            await pool.request(origin, head, b"{}", 2.0)
        waiting = asyncio.create_task(exchange(pool, url, b"ok"))
        await asyncio.sleep(0.05)
        await held.headers()
        while await held.next_bytes():
            pass
        pool.release(held)
        assert await asyncio.wait_for(waiting, 1) == b"ok"
        pool.close()


async def test_a_request_cancelled_while_waiting_leaves_nothing_behind_in_the_pool() -> None:
    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()

    async with server(never) as (url, _):
        pool = Pool(max_connections=2, pool_timeout_s=0.5)
        origin, target = Origin.of(url)
        head = request_head("POST", target, origin.authority, {}, 2)

        async def one() -> None:
            conn = await pool.request(origin, head, b"{}", 2.0)
            try:
                await conn.headers()
            finally:
                pool.release(conn)

        for _ in range(50):  # cancelled at every stage: connecting, sent, waiting
            tasks = [asyncio.create_task(one()) for _ in range(2)]
            await asyncio.sleep(0.001)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        # Every cancelled request gave its connection back (closed): the pool has room again.
        await asyncio.sleep(0.05)
        conn = await asyncio.wait_for(pool.request(origin, head, b"{}", 2.0), 1)
        pool.release(conn)
        pool.close()


def test_request_head_carries_host_length_and_the_given_headers_only() -> None:
    head = request_head(
        "POST",
        "/v1/completions",
        "engine:8000",
        {"x-request-id": "r1", "authorization": "Bearer k"},
        12,
    )
    assert head == (
        b"POST /v1/completions HTTP/1.1\r\nhost: engine:8000\r\ncontent-length: 12\r\n"
        b"x-request-id: r1\r\nauthorization: Bearer k\r\n\r\n"
    )
    assert Origin.of("https://engine.example/v1/x?y=1") == (
        Origin("https", "engine.example", 443),
        "/v1/x?y=1",
    )
