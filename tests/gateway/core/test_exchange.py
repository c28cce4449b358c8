"""gateway/core/exchange.py: a request's headers read once (``header_map``), and its body read
within its size limit and its deadline (``read_body``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.core.exchange import ClientGone, header, header_map, read_body
from gateway.errors import BadRequest, BodyTooLarge


class _Headers(list[tuple[bytes, bytes]]):
    """A scope's header list that counts how often it is walked."""

    walks = 0

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        self.walks += 1
        return super().__iter__()


def test_headers_are_read_once_a_request_by_lower_case_name_first_value_first() -> None:
    headers = _Headers(
        [(b"Content-Type", b"application/json"), (b"x-a", b"1"), (b"X-A", b"2"), (b"x-b", b"")]
    )
    scope: dict[str, Any] = {"headers": headers}
    assert header(scope, b"content-type") == b"application/json"
    assert header(scope, b"x-a") == b"1"  # the first of a repeated name, as before
    assert header(scope, b"x-b") == b""
    assert header(scope, b"authorization") is None
    assert header_map(scope) == {b"content-type": b"application/json", b"x-a": b"1", b"x-b": b""}
    assert headers.walks == 1
    assert header({}, b"x-a") is None


def _receiver(*messages: dict[str, Any], then_wait: bool = True) -> Any:
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        if queue:
            return queue.pop(0)
        if then_wait:
            await asyncio.sleep(3600)  # a client that stops sending
        return {"type": "http.disconnect"}

    return receive


def _scope(length: int | None = None) -> dict[str, Any]:
    return {"headers": [] if length is None else [(b"content-length", b"%d" % length)]}


async def test_a_body_that_arrives_in_parts_is_joined() -> None:
    receive = _receiver(
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.request", "body": b"cd"},
    )
    assert await read_body(_scope(4), receive, 10, 1.0) == b"abcd"


async def test_a_body_not_received_within_its_deadline_is_refused() -> None:
    receive = _receiver({"type": "http.request", "body": b"ab", "more_body": True})
    started = asyncio.get_running_loop().time()
    with pytest.raises(BadRequest, match=r"request body not received within 0.05s"):
        await read_body(_scope(4), receive, 10, 0.05)
    assert asyncio.get_running_loop().time() - started < 1.0
    await asyncio.sleep(0)  # the task is not left cancelled: it awaits on


async def test_the_deadline_stops_once_the_body_is_read() -> None:
    receive = _receiver({"type": "http.request", "body": b"ab"})
    assert await read_body(_scope(), receive, 10, 0.02) == b"ab"
    await asyncio.sleep(0.06)  # past the deadline: nothing cancels the request now


async def test_a_cancellation_from_outside_passes_through_the_deadline() -> None:
    receive = _receiver({"type": "http.request", "body": b"ab", "more_body": True})
    task = asyncio.create_task(read_body(_scope(4), receive, 10, 5.0))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_the_limits_and_a_disconnect() -> None:
    with pytest.raises(BodyTooLarge, match="request body of 11 bytes exceeds 10 bytes"):
        await read_body(_scope(11), _receiver(), 10, 1.0)
    with pytest.raises(BodyTooLarge, match="request body exceeds 10 bytes"):
        await read_body(_scope(), _receiver({"type": "http.request", "body": b"x" * 11}), 10, 1.0)
    with pytest.raises(BadRequest, match="invalid Content-Length"):
        await read_body({"headers": [(b"content-length", b"-1")]}, _receiver(), 10, 1.0)
    with pytest.raises(ClientGone):
        await read_body(_scope(), _receiver(then_wait=False), 10, 1.0)
