"""Slots shared by the worker processes of one host, without Redis: a slot server in the
supervisor (gateway/edge/workers.py) and a ``SlotStore`` client in each worker.

    supervisor: SlotServer(path)  owns HostSlots, the one table of who holds what
    worker i:   HostSlotStore(path, worker=i)  one unix-socket connection, calls multiplexed

Contract:
- ``HostSlots`` is the table, plain data and no I/O: the same rules as the Redis scripts
  (gateway/slots/lua.py): a lane slot and the first candidate endpoint with room, all or
  nothing; a retried acquire reports what the token already holds; ``move`` gives up one
  endpoint slot and takes another in one step; release is exact and idempotent. Waiting places
  keep arrival order across workers as the Redis waiting list does: a waiter goes only while
  fewer other workers' waiters stand ahead of it than there are free slots, and a newcomer
  stands behind every waiter of the other workers.
- Ownership is the connection: every grant and waiting place belongs to the worker connection
  that took it. When that connection ends (the worker exited, crashed or was killed with -9:
  the kernel closes its socket) the server drops all of it at once and logs
  ``slots.reclaimed``. No lease or TTL is needed, and a slot cannot outlive its worker.
- The wire: one JSON object a line each way; a request carries an id, its reply the same id
  (a release or a queue leave carries none and gets no reply). The server handles each line to
  the end before the next (asyncio protocols, no await in between), so each operation is atomic
  across all workers.
- ``HostSlotStore`` bounds every call by ``timeout_s``; a call that cannot be answered (the
  supervisor is gone, or too slow) raises ``StateUnavailable`` (503 + Retry-After), like Redis
  with ``fail_closed``. Losing the connection logs ``slots.host_lost`` and calls ``on_lost``
  (the worker then shuts down: without its supervisor it can admit nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from gateway.core.slots import Limit
from gateway.errors import StateUnavailable
from gateway.observe.log import Logger, get_logger, swallowed
from gateway.observe.metrics import Metrics

RETRY_AFTER_S = 2.0
# A line is one slot operation: a few keys and limits, never near this.
MAX_LINE = 1024 * 1024


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


# -- the table --------------------------------------------------------------------------------


@dataclass
class HostSlots:
    """Who holds which slot and who waits, across every worker. Owners are connection ids."""

    held: dict[str, set[str]] = field(default_factory=dict)
    owned: dict[int, dict[str, set[str]]] = field(default_factory=dict)
    # Lane key -> waiting member -> owner, in arrival order (dicts keep insertion order).
    queues: dict[str, dict[str, int]] = field(default_factory=dict)

    def _take(self, owner: int, token: str, key: str) -> None:
        self.held.setdefault(key, set()).add(token)
        self.owned.setdefault(owner, {}).setdefault(token, set()).add(key)

    def _drop(self, owner: int, token: str, key: str) -> None:
        self.held.get(key, set()).discard(token)
        keys = self.owned.get(owner, {}).get(token)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self.owned[owner][token]

    def _ahead(self, owner: int, lane_key: str, token: str, free: int) -> bool:
        """True when ``free`` or more other workers' waiters stand ahead of ``token``."""
        queue = self.queues.get(lane_key, {})
        ahead = 0
        for member, waiter_owner in queue.items():
            if member == token:
                break
            if waiter_owner != owner:
                ahead += 1
                if ahead >= free:
                    return True
        return False

    def _room(self, limit: Limit, token: str) -> bool:
        """Room under ``limit`` and no other token in any of its guards (borrowing's mutual
        exclusion, gateway/request/borrowing.py), as MemorySlotStore judges it."""
        if any(self.held.get(guard, set()) - {token} for guard in limit.guards):
            return False
        holders = self.held.get(limit.key, set())
        return token in holders or len(holders) < limit.limit

    def acquire(self, owner: int, token: str, lane: Limit, candidates: Sequence[Limit]) -> int:
        """The index of the candidate granted (with the lane slot), or -1."""
        holders = self.held.get(lane.key, set())
        if token in holders:
            for index, candidate in enumerate(candidates):
                if token in self.held.get(candidate.key, ()):
                    return index
            return -1
        free = lane.limit - len(holders)
        if free <= 0 or not self._room(lane, token) or self._ahead(owner, lane.key, token, free):
            return -1
        for index, candidate in enumerate(candidates):
            if self._room(candidate, token):
                self._take(owner, token, lane.key)
                self._take(owner, token, candidate.key)
                self.queues.get(lane.key, {}).pop(token, None)
                return index
        return -1

    def move(self, owner: int, token: str, release: str, candidates: Sequence[Limit]) -> int:
        self._drop(owner, token, release)
        for index, candidate in enumerate(candidates):
            if self._room(candidate, token):
                self._take(owner, token, candidate.key)
                return index
        return -1

    def release(self, owner: int, token: str, keys: Sequence[str]) -> None:
        for key in keys:
            self._drop(owner, token, key)

    def reserve(self, owner: int, token: str, key: str) -> None:
        """A lender's waiter holds ``key`` so that borrowers' guards keep them out; owned by the
        worker's connection like a slot, so a dead worker's reservation goes with it."""
        self._take(owner, token, key)

    def join(self, owner: int, token: str, lane_key: str) -> None:
        self.queues.setdefault(lane_key, {}).setdefault(token, owner)

    def leave(self, token: str, lane_key: str) -> None:
        self.queues.get(lane_key, {}).pop(token, None)

    def in_use(self, keys: Sequence[str]) -> list[int]:
        return [len(self.held.get(key, ())) for key in keys]

    def reclaim(self, owner: int) -> int:
        """Drop everything ``owner`` holds or waits for; the number of tokens it held."""
        tokens = self.owned.pop(owner, {})
        for token, keys in tokens.items():
            for key in keys:
                self.held.get(key, set()).discard(token)
        for queue in self.queues.values():
            for member in [m for m, o in queue.items() if o == owner]:
                del queue[member]
        return len(tokens)

    def handle(self, owner: int, request: dict[str, Any]) -> Any:
        """One wire request against the table; its reply value."""
        op = request["op"]
        if op == "acquire":
            lane = _limit(request["lane"])
            return self.acquire(owner, request["t"], lane, [_limit(c) for c in request["c"]])
        if op == "move":
            return self.move(
                owner, request["t"], request["release"], [_limit(c) for c in request["c"]]
            )
        if op == "reserve":
            self.reserve(owner, request["t"], request["key"])
            return None
        if op == "release":
            self.release(owner, request["t"], request["keys"])
            return None
        if op == "join":
            self.join(owner, request["t"], request["lane_key"])
            return None
        if op == "leave":
            self.leave(request["t"], request["lane_key"])
            return None
        if op == "in_use":
            return self.in_use(request["keys"])
        raise ValueError(f"unknown slot operation {op!r}")


def _limit(wire: list[Any]) -> Limit:
    """A ``Limit`` from the wire: ``[key, limit]`` or ``[key, limit, guards]``."""
    return Limit(wire[0], wire[1], tuple(wire[2]) if len(wire) > 2 else ())


def _wire(limit: Limit) -> list[Any]:
    return (
        [limit.key, limit.limit, list(limit.guards)] if limit.guards else [limit.key, limit.limit]
    )


# -- the server (in the supervisor) -------------------------------------------------------------


class SlotServer:
    """The supervisor's slot server on a unix socket (``start``, then it serves in the loop)."""

    def __init__(self, path: Path, log: Logger | None = None) -> None:
        self.path = path
        self.table = HostSlots()
        self.log = log or get_logger("slots")
        self._ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(
            lambda: _ServerSide(self, next(self._ids)), str(self.path)
        )
        os.chmod(self.path, 0o600)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(OSError):  # already gone with the runtime dir
                self.path.unlink()


def _lines(buffer: bytearray, data: bytes) -> list[bytes]:
    """Append ``data``; take every complete line out of ``buffer``."""
    buffer += data
    if b"\n" not in data:
        return []
    *lines, rest = bytes(buffer).split(b"\n")
    buffer[:] = rest
    return lines


class _ServerSide(asyncio.Protocol):
    """One worker's connection: each line handled to the end as it arrives (data_received
    never awaits), so every operation is atomic across workers; replies go in one write."""

    def __init__(self, server: SlotServer, owner: int) -> None:
        self._server = server
        self._owner = owner
        self._worker: int | None = None
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        assert self._transport is not None
        replies = []
        try:
            for line in _lines(self._buffer, data):
                request = orjson.loads(line)
                if request["op"] == "hello":
                    self._worker = request.get("worker")
                    self._server.log.info(
                        "slots.worker_connected", worker=self._worker, pid=request.get("pid")
                    )
                    continue
                result = self._server.table.handle(self._owner, request)
                if "i" in request:  # releases and leaves expect no answer
                    replies.append(orjson.dumps({"i": request["i"], "r": result}))
            if len(self._buffer) > MAX_LINE:
                raise ValueError(f"a line longer than {MAX_LINE} bytes")
        except (ValueError, KeyError, TypeError) as exc:
            # A broken line: the worker is confused; its slots go back now (connection_lost).
            swallowed(self._server.log, None, "slots_host.line", exc, decision="reclaim_slots")
            self._transport.close()
            return
        if replies:
            self._transport.write(b"\n".join(replies) + b"\n")

    def connection_lost(self, exc: Exception | None) -> None:
        tokens = self._server.table.reclaim(self._owner)
        self._server.log.info("slots.reclaimed", worker=self._worker, tokens=tokens)


# -- the client (in each worker) ---------------------------------------------------------------


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
        wire = [_wire(c) for c in candidates]
        index: int = await self._call("acquire", t=token, lane=_wire(lane), c=wire)
        if index < 0:
            return None
        self._queued.discard(token)  # the server took it off the waiting list
        return index

    async def move(
        self, token: str, lane: Limit, release: str, candidates: Sequence[Limit]
    ) -> int | None:
        wire = [_wire(c) for c in candidates]
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
        for line in _lines(self._buffer, data):
            self._store._answered(orjson.loads(line))

    def connection_lost(self, exc: Exception | None) -> None:
        self._store._connection_lost(f"{type(exc).__name__}: {exc}" if exc else "closed")


def _expire(future: asyncio.Future[Any], op: str) -> None:
    if not future.done():
        future.set_exception(_unavailable(f"the slot server did not answer {op} in time"))


def _unavailable(message: str) -> StateUnavailable:
    return StateUnavailable(message, retry_after_s=RETRY_AFTER_S)
