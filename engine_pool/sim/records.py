"""What the simulated engine saw of each request: the evidence other test suites assert on.

One ``RequestRecord`` per request the engine accepted, keyed by its request id (the client's
``X-Request-Id`` when it sent one). Times come twice: simulated seconds since the engine started
(``*_s``, what the cost model says) and wall-clock epoch seconds (``*_wall``, comparable across
processes, e.g. "the engine saw every abandoned request closed within a second").

``outcome`` is ``running`` until the request leaves the engine as ``finished`` or ``aborted``
(client disconnect, crash). The log keeps the most recent ``capacity`` records.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Literal

RecordState = Literal["running", "finished", "aborted"]


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    key: str
    route: str  # the engine route's kind (chat, completions, ...)
    prompt_tokens: int
    output_tokens: int
    arrived_s: float
    arrived_wall: float
    first_token_s: float | None = None
    first_token_wall: float | None = None
    finished_s: float | None = None
    finished_wall: float | None = None
    aborted_s: float | None = None
    aborted_wall: float | None = None
    abort_reason: str | None = None
    tokens_generated: int = 0

    @property
    def outcome(self) -> RecordState:
        if self.finished_s is not None:
            return "finished"
        if self.aborted_s is not None:
            return "aborted"
        return "running"

    @property
    def closed_wall(self) -> float | None:
        """When the request left the engine, whichever way."""
        return self.finished_wall if self.finished_wall is not None else self.aborted_wall

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_s is None:
            return None
        return self.first_token_s - self.arrived_s

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["outcome"] = self.outcome
        data["ttft_s"] = self.ttft_s
        return data


class RequestLog:
    def __init__(self, capacity: int = 100_000) -> None:
        self._capacity = capacity
        self._by_key: OrderedDict[str, RequestRecord] = OrderedDict()

    def add(self, record: RequestRecord) -> None:
        self._by_key[record.key] = record
        while len(self._by_key) > self._capacity:
            self._by_key.popitem(last=False)

    def get(self, key: str) -> RequestRecord | None:
        return self._by_key.get(key)

    def find(self, request_id: str | None = None) -> list[RequestRecord]:
        """Records in arrival order, all of them or those with this request id."""
        records = list(self._by_key.values())
        if request_id is None:
            return records
        return [r for r in records if r.request_id == request_id]
