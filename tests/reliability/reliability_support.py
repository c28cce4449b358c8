"""Helpers for the reliability suite: raw-socket clients that reset, timed log capture, state.

- ``RawClient`` speaks just enough HTTP/1.1 over a real socket to send a request, read part of
  the answer and then *reset* the connection (SO_LINGER 0: an RST, as a killed client sends),
  returning the wall time of the reset so that it can be compared with the simulated engine's
  ``closed_wall`` and the gateway's ``route.finished``.
- ``timed_logs()`` captures every structlog event (like ``structlog.testing.capture_logs``) and
  stamps it with the wall time it was logged at.
- ``RecordIndex`` follows simulated engines' request records by request id without rescanning
  them for every client.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import structlog

from engine_pool.sim.records import RequestRecord
from engine_pool.sim.server import SimServer
from tests.support.prom import parse


def chat_body(content: str, *, stream: bool, max_tokens: int | None = None) -> bytes:
    body: dict[str, Any] = {
        "model": "qwen3.6",
        "stream": stream,
        "messages": [{"role": "user", "content": content}],
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return orjson.dumps(body)


def words(count: int, salt: str) -> str:
    """About ``count`` tokens of text that no other request shares (no cache flatters it)."""
    return f"{salt} " + " ".join(f"w{(i * 7919) % 100_003}" for i in range(count // 3))


class RawClient:
    """One request on its own socket, abandoned with a reset whenever the test says."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.received = b""

    @classmethod
    async def send(
        cls, url: str, rid: str, payload: bytes, path: str = "/v1/chat/completions"
    ) -> RawClient:
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}\r\n"
            f"content-type: application/json\r\nx-request-id: {rid}\r\n"
            f"content-length: {len(payload)}\r\n\r\n"
        ).encode()
        writer.write(head + payload)
        await writer.drain()
        return cls(reader, writer)

    async def read_until(self, done: Callable[[bytes], bool], timeout: float = 10.0) -> bytes:
        async with asyncio.timeout(timeout):
            while not done(self.received):
                piece = await self.reader.read(65536)
                if not piece:
                    break
                self.received += piece
        return self.received

    def reset(self) -> float:
        """Close with an RST now; the wall time it happened."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()
        return time.time()


@contextmanager
def timed_logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """Every structlog event logged in the block, with ``at_wall`` (when) and ``log_level``."""
    events: list[MutableMapping[str, Any]] = []

    def keep(_: Any, method: str, event: MutableMapping[str, Any]) -> Any:
        event["at_wall"] = time.time()
        event["log_level"] = method
        events.append(event)
        raise structlog.DropEvent

    before = structlog.get_config()["processors"]
    structlog.configure(processors=[keep])
    try:
        yield events
    finally:
        structlog.configure(processors=before)


def finished(events: Sequence[MutableMapping[str, Any]]) -> dict[str, MutableMapping[str, Any]]:
    """``route.finished`` by request id."""
    return {e["request_id"]: e for e in events if e["event"] == "route.finished"}


class RecordIndex:
    """The latest engine record of each request id, over several simulated engines."""

    def __init__(self, sims: Sequence[SimServer]) -> None:
        self.sims = sims

    def get(self, rid: str) -> RequestRecord | None:
        for sim in self.sims:
            found = sim.requests(rid)
            if found:
                return found[-1]
        return None

    def all(self) -> dict[str, RequestRecord]:
        return {r.request_id: r for sim in self.sims for r in sim.requests()}

    async def arrival(self, rid: str, timeout: float = 10.0) -> RequestRecord:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            record = self.get(rid)
            if record is not None:
                return record
            await asyncio.sleep(0.005)
        raise AssertionError(f"{rid} never reached an engine")


async def admin_state(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    response = await client.get(url + "/admin/state")
    response.raise_for_status()
    state: dict[str, Any] = response.json()
    return state


def held(state: dict[str, Any]) -> int:
    """Everything the gateway still holds: slots, queue places, in-flight requests."""
    lanes = sum(lane["slots_in_use"] + lane["queue_depth"] for lane in state["lanes"])
    endpoints = sum(
        e["slots_in_use"] + e["in_flight"] for c in state["clusters"] for e in c["endpoints"]
    )
    return int(lanes + endpoints + state["in_flight"])


async def slots_metric(client: httpx.AsyncClient, url: str) -> float:
    scrape = parse((await client.get(url + "/metrics")).text)
    return scrape.value("shapegate_slots_in_use")


async def settled(client: httpx.AsyncClient, url: str, within: float = 2.0) -> dict[str, Any]:
    """The admin state once nothing is held any more (or as it is after ``within``)."""
    deadline = time.monotonic() + within
    state = await admin_state(client, url)
    while held(state) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        state = await admin_state(client, url)
    return state
