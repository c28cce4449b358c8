"""What a replay's simulation gives back (gateway/tuning/fleet_sim.py's ``FleetSim.run``).

``SimulatedRequest``: one request's outcome, in simulated time: its lane, endpoint, arrival,
admission, first token and end (or why it was refused), its class, the lender whose engine it
borrowed and the prompt tokens found cached; ``ttft``, ``e2e`` and ``queue_wait`` from them.
``FleetResult``: every outcome, each lane's slot occupancy at every change, the lanes' slot
limits and the makespan. The reports (replay.py, live_replay.py, shadow_effect.py) read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.observe.trace import TraceRecord


@dataclass(frozen=True, slots=True)
class SimulatedRequest:
    key: str
    prompt_tokens: int
    output_tokens: int
    lane: str
    arrival: float
    cluster: str | None = None
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    rejected: str | None = None
    # The lane whose engine served the request when it borrowed one; its priority class.
    lender: str | None = None
    priority: str = "standard"
    # Prompt tokens the engine found in its prefix cache (PrefixSim only).
    cached_tokens: int = 0
    # Times it was paused for a cached question on its engine (lanes[].pause_reads).
    pauses: int = 0

    @classmethod
    def of(cls, key: str, record: TraceRecord, lane: str, **rest: Any) -> SimulatedRequest:
        """The outcome of trace ``record`` in ``lane``: its shape and arrival, then ``rest``."""
        return cls(key, record.prompt_tokens, record.output_tokens, lane, record.t, **rest)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def queue_wait(self) -> float | None:
        return None if self.admitted is None else self.admitted - self.arrival


@dataclass(frozen=True, slots=True)
class FleetResult:
    outcomes: tuple[SimulatedRequest, ...]
    # (time, lane, slots in use) at every change.
    occupancy: tuple[tuple[float, str, int], ...]
    limits: dict[str, int]
    makespan: float
