"""gateway.upstream.http1: the engines' HTTP/1.1 client and its keep-alive pool, on real loopback
sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from gateway.upstream import http1
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


async def test_a_sweep_closes_an_idle_connection_to_an_origin_no_longer_asked_and_forgets_it() -> (
    None
):
    """An engine taken out of routing (a reload, a DNS answer without it) is never asked again;
    one gone without a FIN never closes its side. Traffic to another engine, once keep-alive has
    passed, closes the idle connection (the host sees EOF) and the pool forgets the origin."""
    closed = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()  # never closes its side: b"" only when the gateway closes
        closed.set()

    async with server(silent) as (gone_url, _), server(keep_alive_echo) as (live_url, _):
        pool = Pool(keepalive_s=0.2)
        gone, live = Origin.of(gone_url)[0], Origin.of(live_url)[0]
        assert await exchange(pool, gone_url, b"{}") == b"ok"
        assert await exchange(pool, live_url, b"a") == b"a"
        assert set(pool._origins) == {gone, live}
        await asyncio.sleep(0.3)
        assert await exchange(pool, live_url, b"b") == b"b"
        await asyncio.wait_for(closed.wait(), 2)
        assert set(pool._origins) == {live}
        pool.close()


class Clock:
    """``time`` for gateway.upstream.http1: a monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


async def test_the_sweep_runs_at_most_once_per_keepalive(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(http1, "time", clock)
    async with server(keep_alive_echo) as (url, accepted):
        pool = Pool(keepalive_s=4.0)
        sweeps: list[float] = []
        sweep = pool._sweep

        def counted(now: float) -> None:
            sweeps.append(now)
            sweep(now)

        monkeypatch.setattr(pool, "_sweep", counted)
        for _ in range(20):  # within the first keep-alive: no sweep
            await exchange(pool, url, b"x")
        assert sweeps == []
        clock.now += 4.0
        for _ in range(20):  # the first sweeps, the other 19 are within its keep-alive
            await exchange(pool, url, b"x")
        clock.now += 3.9
        for _ in range(20):
            await exchange(pool, url, b"x")
        assert sweeps == [1004.0]
        clock.now += 0.1
        await exchange(pool, url, b"x")
        assert sweeps == [1004.0, 1008.0]
        # The connection in use each time was fresh: every sweep left it to be reused.
        assert len(accepted) == 1
        pool.close()


async def test_a_sweep_leaves_an_origin_with_a_request_on_it_or_waiting_for_it() -> None:
    answer = asyncio.Event()

    async def on_cue(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader) is not None:
            await answer.wait()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    async with server(on_cue) as (url, accepted), server(keep_alive_echo) as (other_url, _):
        pool = Pool(max_connections=1, keepalive_s=0.1, pool_timeout_s=5.0)
        origin, target = Origin.of(url)
        head = request_head("POST", target, origin.authority, {}, 2)
        held = await pool.request(origin, head, b"{}", 2.0)
        waiting = asyncio.create_task(exchange(pool, url, b"{}"))
        await asyncio.sleep(0.2)
        entry = pool._origins[origin]
        assert len(entry.waiters) == 1
        assert await exchange(pool, other_url, b"a") == b"a"  # sweeps
        assert pool._origins[origin] is entry
        answer.set()
        assert (await held.headers())[0] == 200
        while await held.next_bytes():
            pass
        pool.release(held)
        assert await asyncio.wait_for(waiting, 2) == b"ok"  # on the held connection, reused
        assert len(accepted) == 1
        await asyncio.sleep(0.2)
        assert await exchange(pool, other_url, b"b") == b"b"  # sweeps: the origin is idle
        assert origin not in pool._origins
        assert await exchange(pool, url, b"{}") == b"ok"  # a new connection after the sweep
        assert len(accepted) == 2
        pool.close()


async def test_a_request_woken_from_a_forgotten_origins_queue_connects_into_the_pool() -> None:
    """Woken (its origin's one connection lost), the request resumes after a sweep forgot the
    origin: its connection goes into the pool's current entry, so it is kept for reuse and
    ``close`` closes it (in a forgotten entry no sweep nor close would ever find it)."""
    seen_eof: list[int] = []

    async def echo_until_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await keep_alive_echo(reader, writer)
        seen_eof.append(1)

    async with server(echo_until_eof) as (url, accepted):
        pool = Pool(max_connections=1, pool_timeout_s=5.0)
        origin, target = Origin.of(url)
        head = request_head("POST", target, origin.authority, {}, 2)
        held = await pool.request(origin, head, b"{}", 2.0)
        waiting = asyncio.create_task(exchange(pool, url, b"{}"))
        await asyncio.sleep(0.05)
        held.close()  # wakes the waiting request, which resumes on the loop's next turn
        pool._sweep(http1.time.monotonic())  # before it does: the origin has nothing left
        assert origin not in pool._origins
        assert await asyncio.wait_for(waiting, 2) == b"{}"
        assert len(pool._origins[origin].idle) == 1
        pool.close()
        for _ in range(100):
            if len(seen_eof) == 2:
                break
            await asyncio.sleep(0.02)
        assert len(accepted) == 2
        assert len(seen_eof) == 2
