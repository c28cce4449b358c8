"""Read a ``shapegate`` process's log file: its structlog JSON lines, other lines skipped."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import orjson


def log_events(log: Path, name: str | None = None) -> list[dict[str, Any]]:
    """Every JSON event line of ``log`` (only those whose ``event`` is ``name`` when given)."""
    out = []
    for line in log.read_bytes().splitlines():
        with contextlib.suppress(orjson.JSONDecodeError):
            event = orjson.loads(line)
            if isinstance(event, dict) and (name is None or event.get("event") == name):
                out.append(event)
    return out
