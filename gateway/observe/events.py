"""A bounded ring of the events an operator must see on the dashboard, never hidden in a log.

Contract:
- ``EventRing(size)`` keeps the newest ``size`` events and a running total per kind (the totals
  count every event since start, the ring only the newest).
- ``add(kind, where, message, decision, fields)`` records one event: ``kind`` is ``swallowed``
  (an error the gateway handled without raising, fed by ``gateway.observe.log.swallowed``) or
  ``watchdog`` (a deadline hit, fed by the rolling window when a request ends in ``timeout``).
  Fields keep only JSON scalars and strings are cut short, so a caller cannot make the ring
  large or leak a payload into it; callers never pass prompt text.
- ``recent()`` returns the events newest first as plain JSON-ready dicts.

The ring hangs on ``Metrics`` (``metrics.events``) because everything that reports a swallowed
error or a watchdog event already holds the app's ``Metrics``: no new global, no new argument.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_TEXT = 300
RESERVED = frozenset({"at", "kind", "where", "message", "decision"})
Scalar = str | int | float | bool | None


@dataclass(frozen=True, slots=True)
class Event:
    at: float
    kind: str
    where: str
    message: str
    decision: str | None
    fields: tuple[tuple[str, Scalar], ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "kind": self.kind,
            "where": self.where,
            "message": self.message,
            "decision": self.decision,
            "fields": dict(self.fields),
        }


def _scalar(value: Any) -> Scalar:
    if value is None or isinstance(value, bool | int | float):
        return value
    return str(value)[:MAX_TEXT]


class EventRing:
    def __init__(self, size: int = 200) -> None:
        self._events: deque[Event] = deque(maxlen=size)
        self.totals: Counter[str] = Counter()

    def add(
        self,
        kind: str,
        where: str,
        message: str,
        decision: str | None = None,
        fields: Mapping[str, Any] | None = None,
    ) -> None:
        kept = tuple((k, _scalar(v)) for k, v in (fields or {}).items() if k not in RESERVED)
        event = Event(time.time(), kind, where, message[:MAX_TEXT], decision, kept)
        self._events.append(event)
        self.totals[kind] += 1

    def recent(self) -> list[dict[str, Any]]:
        return [event.as_json() for event in reversed(self._events)]

    def __len__(self) -> int:
        return len(self._events)
