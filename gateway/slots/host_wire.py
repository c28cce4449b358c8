"""The host slots' wire, shared by the supervisor's slot server (host_server.py) and each
worker's client (host.py): one JSON object a line each way; a request carries an id, its reply
the same id (a release or a queue leave carries none and gets no reply). A ``Limit`` travels as
``[key, limit]`` or ``[key, limit, guards]``.
"""

from __future__ import annotations

from typing import Any

from gateway.core.slots import Limit

# A line is one slot operation: a few keys and limits, never near this.
MAX_LINE = 1024 * 1024


def limit_from_wire(wire: list[Any]) -> Limit:
    """A ``Limit`` from the wire: ``[key, limit]`` or ``[key, limit, guards]``."""
    return Limit(wire[0], wire[1], tuple(wire[2]) if len(wire) > 2 else ())


def limit_to_wire(limit: Limit) -> list[Any]:
    return (
        [limit.key, limit.limit, list(limit.guards)] if limit.guards else [limit.key, limit.limit]
    )


def take_lines(buffer: bytearray, data: bytes) -> list[bytes]:
    """Append ``data``; take every complete line out of ``buffer``."""
    buffer += data
    if b"\n" not in data:
        return []
    *lines, rest = bytes(buffer).split(b"\n")
    buffer[:] = rest
    return lines
