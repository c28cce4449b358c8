"""The supervisor's slot server (gateway/edge/workers.py starts it): a unix socket every worker
connects to (host.py's ``HostSlotStore``), in front of the one ``HostSlots`` table
(host_table.py).

Contract:
- Ownership is the connection: every grant and waiting place belongs to the worker connection
  that took it. When that connection ends (the worker exited, crashed or was killed with -9:
  the kernel closes its socket) the server drops all of it at once and logs
  ``slots.reclaimed``. No lease or TTL is needed, and a slot cannot outlive its worker.
- The server handles each line (host_wire.py) to the end before the next (asyncio protocols,
  no await in between), so each operation is atomic across all workers. A broken line closes
  that worker's connection, and so gives its slots back.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from pathlib import Path

import orjson

from gateway.observe.log import Logger, get_logger, swallowed
from gateway.slots.host_table import HostSlots
from gateway.slots.host_wire import MAX_LINE, take_lines


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
            for line in take_lines(self._buffer, data):
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
