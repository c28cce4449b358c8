"""Slots shared by the worker processes of one host, without Redis: a slot server in the
supervisor (host_server.py, started by gateway/edge/workers.py, over the table in
host_table.py) and, here, the ``SlotStore`` client of each worker; host_wire.py is the wire
between them.

    supervisor: SlotServer(path)  owns HostSlots, the one table of who holds what
    worker i:   HostSlotStore(path, worker=i)  one unix-socket connection, calls multiplexed

Contract:
- Ownership is the connection (host_server.py): when a worker's connection ends, its slots and
  waiting places go back at once; no lease or TTL.
- ``HostSlotStore`` bounds every call by ``timeout_s``; a call that cannot be answered (the
  supervisor is gone, or too slow) raises ``StateUnavailable`` (503 + Retry-After), like Redis
  with ``fail_closed``. Losing the connection logs ``slots.host_lost`` and calls ``on_lost``
  (the worker then shuts down: without its supervisor it can admit nothing).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from gateway.core.slots import Limit
from gateway.errors import StateUnavailable
from gateway.observe.log import Logger, get_logger, swallowed
from gateway.observe.metrics import Metrics
from gateway.slots.host_wire import limit_to_wire, take_lines

RETRY_AFTER_S = 2.0


@dataclass(frozen=True, slots=True)
class WorkerGroup:
    """Where worker ``index`` of ``count`` finds the supervisor's slot server and its peers."""

    index: int
    count: int
    runtime_dir: Path

    @property
    def slot_socket(self) -> Path:
        return self.runtime_dir / "slots.sock"

    def peer_socket(self, index: int) -> Path:
        return self.runtime_dir / f"worker-{index}.sock"

    @property
    def peers(self) -> list[int]:
        return [i for i in range(self.count) if i != self.index]


class HostSlotStore:
    """The ``SlotStore`` of a worker: every operation asks the supervisor's slot server.

    One round trip per acquire or move; release and leaving a queue are sent without waiting
    for an answer (the server applies a connection's lines in order, and should the connection
    drop before, the server reclaims everything it held anyway)."""

    shared = True

    def __init__(
        self,
        path: Path,
        worker: int,
        timeout_s: float = 2.0,
        metrics: Metrics | None = None,
        log: Logger | None = None,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self._path = path
        self._worker = worker
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._log = log or get_logger("slots")
        self._on_lost = on_lost
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._transport: asyncio.Transport | None = None
        self._lock = asyncio.Lock()
        self._lost = False
        self._closing = False
        self._queued: set[str] = set()

    async def connect(self) -> None:
        async with self._lock:
            if self._transport is not None or self._lost:
                return
            loop = asyncio.get_running_loop()
            try:
                transport, _ = await loop.create_unix_connection(
                    lambda: _ClientSide(self), str(self._path)
                )
            except OSError as exc:
                raise _unavailable(f"cannot reach the supervisor's slot server: {exc}") from exc
            self._transport = transport
            self._write({"op": "hello", "worker": self._worker, "pid": os.getpid()})

    def _write(self, message: dict[str, Any]) -> None:
        assert self._transport is not None
        self._transport.write(orjson.dumps(message) + b"\n")

    def _answered(self, reply: dict[str, Any]) -> None:
        future = self._pending.get(reply["i"])
        if future is not None and not future.done():
            future.set_result(reply["r"])

    def _connection_lost(self, why: str) -> None:
        self._lost = True
        if self._closing:
            return
        self._log.error("slots.host_lost", worker=self._worker, why=why)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(_unavailable("the supervisor's slot server went away"))
        if self._on_lost is not None:
            self._on_lost()

    async def _ready(self) -> None:
        if self._lost:
            raise _unavailable("the supervisor's slot server went away")
        if self._transport is None:
            await self.connect()

    async def _call(self, op: str, **fields: Any) -> Any:
        await self._ready()
        ident = next(self._ids)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending[ident] = future
        # A timer, not a cancel scope: this is on every request's path.
        timer = loop.call_later(self._timeout_s, _expire, future, op)
        try:
            self._write({"i": ident, "op": op, **fields})
            return await future
        finally:
            timer.cancel()
            del self._pending[ident]

    async def _send(self, op: str, **fields: Any) -> None:
        await self._ready()
        self._write({"op": op, **fields})

    # -- the protocol ------------------------------------------------------------------------

    async def try_acquire(self, token: str, lane: Limit, candidates: Sequence[Limit]) -> int | None:
        wire = [limit_to_wire(c) for c in candidates]
        index: int = await self._call("acquire", t=token, lane=limit_to_wire(lane), c=wire)
        if index < 0:
            return None
        self._queued.discard(token)  # the server took it off the waiting list
        return index

    async def move(
        self, token: str, lane: Limit, release: str, candidates: Sequence[Limit]
    ) -> int | None:
        wire = [limit_to_wire(c) for c in candidates]
        index: int = await self._call("move", t=token, release=release, c=wire)
        return None if index < 0 else index

    async def reserve(self, token: str, key: str) -> None:
        await self._call("reserve", t=token, key=key)

    async def release(self, token: str, keys: Sequence[str]) -> None:
        await self._send("release", t=token, keys=list(keys))

    @asynccontextmanager
    async def hold(self, token: str, keys: Sequence[str]) -> AsyncIterator[None]:
        # The connection is the lease: nothing to renew while this worker lives.
        yield

    @asynccontextmanager
    async def waiting(
        self, token: str, lane_key: str, rank: int = 0, starved_at: float = math.inf
    ) -> AsyncIterator[None]:
        # One arrival-ordered list per lane: classes order each worker's own queue only.
        await self._send("join", t=token, lane_key=lane_key)
        self._queued.add(token)
        try:
            yield
        finally:
            if token in self._queued:
                self._queued.discard(token)
                try:
                    await self._send("leave", t=token, lane_key=lane_key)
                except StateUnavailable as exc:
                    # The supervisor is gone, and with it the waiting list.
                    swallowed(
                        self._log, self._metrics, "slots_host.leave", exc, decision="list_gone"
                    )

    async def in_use(self, keys: Sequence[str]) -> dict[str, int]:
        counts: list[int] = await self._call("in_use", keys=list(keys))
        return dict(zip(keys, counts, strict=True))

    async def aclose(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.close()


class _ClientSide(asyncio.Protocol):
    def __init__(self, store: HostSlotStore) -> None:
        self._store = store
        self._buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        for line in take_lines(self._buffer, data):
            self._store._answered(orjson.loads(line))

    def connection_lost(self, exc: Exception | None) -> None:
        self._store._connection_lost(f"{type(exc).__name__}: {exc}" if exc else "closed")


def _expire(future: asyncio.Future[Any], op: str) -> None:
    if not future.done():
        future.set_exception(_unavailable(f"the slot server did not answer {op} in time"))


def _unavailable(message: str) -> StateUnavailable:
    return StateUnavailable(message, retry_after_s=RETRY_AFTER_S)
