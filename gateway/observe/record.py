"""Step 9, record: the typed record of one request, plain data (gateway/observe/recorder.py's
``Recorder`` reports it).

Contract:
- ``Record`` is what the gateway keeps about one request while it runs and after: the request's
  shape and the lane decision (``Routed``, set once the lane is decided, with the typed
  ``TokenCount``), the slot ``Grant`` (set once admitted: ``admitted`` is ``grant is not None``),
  the ``Outcome``, the status, and the timings (start, time to first byte, duration; the queue
  wait and the count's time ride on the grant and the count). It never holds prompt text.
- ``Routed.log_fields()`` are the decision's log fields (``route.decision``, ``route.rejected``);
  ``Record.span_attributes()`` the span's (gateway/observe/tracing.py).
- ``Record.as_json()`` is the one JSON view of a record (``/admin/state`` and the dashboard).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine_pool.engine_api import RouteKind
from gateway.core.count import TokenCount
from gateway.core.decision import Decision, Grant, Outcome, Reason
from gateway.core.watchdog import Phase
from gateway.observe.tracing import RequestSpan
from gateway.protocols.openai import RoutedRequest


@dataclass(frozen=True, slots=True)
class Routed:
    """What the lane decision saw and chose; the shape of the request, never its text."""

    model: str
    stream: bool
    body_bytes: int
    max_tokens: int | None
    count: TokenCount
    lane: str  # "none" when no lane takes the prompt
    reason: Reason
    cluster_health: dict[str, bool]
    route: RouteKind  # the engine route (gateway/protocols/routes.py) the request came by
    priority: str | None = None  # its class inside the lane (gateway/request/classes.py)
    lender: str | None = None  # the lane whose engine it borrowed (reason ``borrowed``)

    @classmethod
    def of(
        cls,
        request: RoutedRequest,
        count: TokenCount,
        decision: Decision,
        healthy: dict[str, bool],
        priority: str | None = None,
    ) -> Routed:
        lane = decision.lane
        candidates = (*lane.clusters, *lane.emergency_clusters) if lane else ()
        return cls(
            model=request.model,
            stream=request.stream,
            body_bytes=request.body_bytes,
            max_tokens=request.max_tokens,
            # Without the plan a bound keeps for the exact count: a record never holds text.
            count=count.without_plan(),
            lane=decision.lane_name,
            reason=decision.reason,
            cluster_health={c: healthy.get(c, True) for c in candidates},
            route=request.route,
            priority=priority,
        )

    # The names log_fields() gives, for a record refused before its lane was decided.
    FIELDS = (
        "route",
        "model",
        "stream",
        "body_bytes",
        "prompt_bytes",
        "prompt_tokens",
        "count_method",
        "count_ms",
        "tokenizer",
        "max_tokens",
        "lane",
        "reason",
        "cluster_health",
        "priority",
        "lender",
    )

    def log_fields(self) -> dict[str, Any]:
        count = self.count
        return {
            "route": self.route,
            "model": self.model,
            "stream": self.stream,
            "body_bytes": self.body_bytes,
            "prompt_bytes": count.prompt_bytes,
            # Tokens only when counted exactly; a bound that decided goes by its own name (the
            # exact count, made while the engine works, follows in route.finished).
            **(
                {"prompt_tokens": count.tokens}
                if count.exact is not None
                else {"prompt_tokens_bound": count.tokens}
            ),
            "count_method": count.method,
            "count_ms": round(count.seconds * 1000, 3),
            "tokenizer": count.tokenizer,
            "max_tokens": self.max_tokens,
            "lane": self.lane,
            "reason": self.reason,
            "cluster_health": self.cluster_health,
            "priority": self.priority,
            "lender": self.lender,
        }


@dataclass(slots=True)
class Record:
    """One request, from arrival to its last report."""

    request_id: str
    route: RouteKind
    started: float = field(default_factory=time.monotonic)
    routed: Routed | None = None
    grant: Grant | None = None
    # None while the request runs; the pipeline sets how it ended.
    outcome: Outcome | None = None
    status: int = 0
    ttft_s: float | None = None
    duration_s: float | None = None
    # Our exact prompt count (made while the engine works when the bound decided the lane) and
    # the engine's own usage figures; drift is theirs minus ours.
    prompt_tokens: int | None = None
    engine_prompt_tokens: int | None = None
    count_drift: int | None = None
    output_tokens: int | None = None
    # One token per SSE content event, when the engine reported no usage.
    output_tokens_estimate: int | None = None
    chunks: int = 0
    last_chunk_at: float = 0.0
    # How often it failed over before the engine answered (gateway/request/failover.py).
    retries: int = 0
    # How often its stream moved mid-answer to another engine (gateway/request/migration.py).
    migrations: int = 0
    # How often it was paused before its first byte for a cached question on its endpoint
    # (lanes[].pause_reads, gateway/request/pausing.py).
    pauses: int = 0
    # Why it ended, when not as planned: the error the client was told, the deadline hit.
    error: str | None = None
    deadline: Phase | None = None
    in_ring: bool = False
    # The request's OpenTelemetry span, with tracing on.
    span: RequestSpan | None = None

    @property
    def admitted(self) -> bool:
        return self.grant is not None

    @property
    def finished(self) -> bool:
        return self.duration_s is not None

    @property
    def lane(self) -> str:
        return self.routed.lane if self.routed is not None else "none"

    @property
    def cluster(self) -> str:
        return self.grant.cluster if self.grant is not None else "none"

    def span_attributes(self) -> dict[str, str | bool | int | float | None]:
        """The decision as span attributes: the shape and route of the request, never its text
        (the exact prompt count, and the bound under its own name when the bound decided)."""
        routed, grant = self.routed, self.grant
        count = routed.count if routed is not None else None
        return {
            "shapegate.request_id": self.request_id,
            "shapegate.route": self.route,
            "shapegate.model": routed.model if routed else None,
            "shapegate.stream": routed.stream if routed else None,
            "shapegate.lane": self.lane,
            "shapegate.reason": routed.reason if routed else None,
            "shapegate.cluster": self.cluster,
            "shapegate.endpoint": grant.url if grant else None,
            "shapegate.prompt_tokens": self.prompt_tokens,
            "shapegate.prompt_tokens_bound": count.tokens
            if count and count.exact is None
            else None,
            "shapegate.prompt_bytes": count.prompt_bytes if count else None,
            "shapegate.count_method": count.method if count else None,
            "shapegate.tokenizer": count.tokenizer if count else None,
            "shapegate.queue_wait_s": round(grant.queued_s, 4) if grant else None,
            "shapegate.retries": self.retries,
            "shapegate.outcome": self.outcome,
            "shapegate.ttft_s": None if self.ttft_s is None else round(self.ttft_s, 4),
            "shapegate.output_tokens": self.output_tokens,
            "shapegate.output_tokens_estimate": self.output_tokens_estimate,
            "shapegate.engine_prompt_tokens": self.engine_prompt_tokens,
            "shapegate.deadline": self.deadline,
        }

    def as_json(self) -> dict[str, Any]:
        """Everything the decision log says about the request, plus how it ended so far; the
        same keys for every record (None where a refused request never got that far)."""
        routed = self.routed.log_fields() if self.routed else dict.fromkeys(Routed.FIELDS)
        grant = self.grant
        return {
            "request_id": self.request_id,
            "endpoint_kind": self.route,
            "outcome": self.outcome if self.finished else "in_flight",
            "status": self.status or None,
            **routed,
            "prompt_tokens": self.prompt_tokens
            if self.prompt_tokens is not None
            else routed.get("prompt_tokens"),
            "prompt_tokens_bound": routed.get("prompt_tokens_bound"),
            "cluster": grant.cluster if grant else None,
            "endpoint": grant.url if grant else None,
            "queue_wait_s": round(grant.queued_s, 4) if grant else None,
            "retries": self.retries,
            "migrations": self.migrations,
            "pauses": self.pauses,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 4),
            "duration_s": self.duration_s,
            "output_tokens": self.output_tokens,
            "output_tokens_estimate": self.output_tokens_estimate,
            "engine_prompt_tokens": self.engine_prompt_tokens,
            "count_drift": self.count_drift,
            "deadline": self.deadline,
            "error": self.error,
        }
