"""The decisions' vocabulary: what the lane decision chose, what admission granted, how a
request ended. Plain frozen data every folder may import (gateway/request/lanes.py decides a
Decision, gateway/request/admission.py grants a Grant, gateway/observe/record.py records an
Outcome).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from gateway.settings import LaneSettings

Reason = Literal[
    "in_range",
    "primary_unhealthy",
    "no_lane",
    "no_healthy_cluster",
    "response_affinity",
    # Granted on another lane's idle engine (gateway/request/borrowing.py); set at admission.
    "borrowed",
]


class Decision(NamedTuple):
    """The lane decision (a named tuple, not a frozen dataclass: made once a request, twice
    with a shadow policy, and ~3x cheaper to make)."""

    lane: LaneSettings | None
    # Clusters to use, in preference order: the primaries that are healthy, or the emergencies.
    clusters: tuple[str, ...]
    reason: Reason

    @property
    def lane_name(self) -> str:
        return self.lane.name if self.lane is not None else "none"


class Grant(NamedTuple):
    """The slots admission granted (a named tuple, not a frozen dataclass, as ``Decision``:
    made once a request, and a frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__``)."""

    token: str
    lane: str
    cluster: str
    url: str
    keys: tuple[str, ...]
    queued_s: float
    # The lane whose idle engine this request borrowed (decision reason ``borrowed``).
    lender: str | None = None


# How a request ended (gateway/request/pipeline.py's docstring says what each means).
Outcome = Literal[
    "ok", "upstream_error", "timeout", "client_disconnect", "rejected", "error", "cancelled"
]
