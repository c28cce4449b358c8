"""Engines and clusters as plain data.

An ``Engine`` is one endpoint (a base URL) of a cluster: its routable state, the evidence for it,
its load as last read from the engine's own metrics, and the gateway's in-flight count. The pool
(registry.py) owns the mutable records; everything handed to decisions is a frozen ``EngineView``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, NamedTuple

from engine_pool.outlier import ramp

EngineKind = Literal["vllm", "sglang"]


class EngineState(StrEnum):
    UP = "up"
    # Probes time out but the engine still makes progress: routable, alerting.
    SLOW = "slow"
    DOWN = "down"

    @property
    def routable(self) -> bool:
        # The module's alias, not ``EngineState.DOWN``: an enum class's attribute lookup
        # costs ~70 ns, and the request path asks this of every endpoint, more than once.
        return self is not _DOWN


_DOWN = EngineState.DOWN


@dataclass(slots=True)
class Engine:
    cluster: str
    url: str
    kind: EngineKind
    state: EngineState = EngineState.UP
    evidence: str = "not probed yet"
    changed_at: float = 0.0
    in_flight: int = 0
    # Load from the engine's /metrics; None until first scraped.
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    load_at: float | None = None
    # From the requests it served (latency.py): TTFT p95 and, when it is an outlier among its
    # cluster's peers, why. Reported, never a reason to stop routing to it.
    ttft_p95: float | None = None
    slow: str | None = None
    slow_since: float | None = None
    # Passive health: consecutive failures seen by real requests (engine_pool/outlier.py).
    connect_failures: int = 0
    errors_5xx: int = 0
    # Slow start: monotonic time the endpoint joined or came back, until fully ramped.
    warming_since: float | None = None
    warming_s: float = 0.0
    # What the engine reports it holds (GET /v1/models, vllm:cache_config_info; see
    # engine_pool/capability.py): served names, max_model_len and the context in tokens, None
    # until read. ``capability_read``: a read was tried (answered or not) since it joined.
    served: tuple[str, ...] | None = None
    max_model_len: int | None = None
    context_tokens: int | None = None
    # The KV cache's size in tokens (vllm:cache_config_info), None where not exported: the
    # approximate prefix index bounds what it believes the endpoint holds to it.
    kv_capacity_tokens: int | None = None
    capability_read: bool = False
    # Why the engine cannot serve its lanes (it still takes the requests it can hold).
    misconfigured: str | None = None
    misconfigured_since: float | None = None
    # Draining (registry.py ``drain``): no new requests; in flight ones finish, or past the
    # deadline are cancelled (the gateway migrates their streams). Since: wall time.
    draining: bool = False
    draining_since: float | None = None
    drain_reason: str | None = None

    def as_json(self, now: float) -> dict[str, Any]:
        """The endpoint as the admin state and the dashboard show it."""
        slow = self.slow is not None and self.state is EngineState.UP
        # Routable but short of its lanes: misconfigured (before slow: it needs an operator).
        wrong = self.misconfigured is not None and self.state.routable
        state, evidence, since = self.state.value, self.evidence, self.changed_at
        if self.draining:  # out of routing by an operator or a reload: said first
            state, evidence = "draining", f"{self.drain_reason}; {self.in_flight} in flight"
            since = self.draining_since or since
        elif wrong and self.misconfigured is not None:
            state, evidence = "misconfigured", self.misconfigured
            since = self.misconfigured_since or since
        elif slow and self.slow is not None:
            # Up by its probes but an outlier in the requests it serves: slow, with evidence.
            state, evidence, since = EngineState.SLOW.value, self.slow, self.slow_since or since
        return {
            "url": self.url,
            "state": state,
            "evidence": evidence,
            "since": since or None,
            "probe_evidence": self.evidence,
            "slow_evidence": self.slow,
            "misconfigured_evidence": self.misconfigured,
            "served_models": None if self.served is None else list(self.served),
            "max_model_len": self.max_model_len,
            "context_tokens": self.context_tokens,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "ttft_p95_s": None if self.ttft_p95 is None else round(self.ttft_p95, 4),
            "in_flight": self.in_flight,
            "running": self.running,
            "waiting": self.waiting,
            "kv_usage": self.kv_usage,
            "load_age_s": None if self.load_at is None else round(max(0.0, now - self.load_at), 1),
            "connect_failures": self.connect_failures,
            "errors_5xx": self.errors_5xx,
            "slow_start": self._slow_start(),
            "draining": self.draining,
        }

    def _slow_start(self) -> dict[str, float] | None:
        share = ramp(self.warming_since, self.warming_s, time.monotonic())
        return None if share >= 1.0 else {"window_s": self.warming_s, "share": round(share, 3)}


class EngineView(NamedTuple):
    """One endpoint as a decision sees it. A named tuple, not a frozen dataclass: the request
    path makes several a request (the pool's views), and a frozen dataclass's ``__init__``
    sets each field through ``object.__setattr__`` (0.8 against 0.3 us for seven fields)."""

    cluster: str
    url: str
    state: EngineState
    in_flight: int
    waiting: float | None = None
    # Slow start: the share of its slot limit the endpoint may use now (engine_pool/outlier.py).
    ramp: float = 1.0
    # The prompt plus output tokens the engine holds (engine_pool/capability.py); None: unknown.
    context_tokens: int | None = None
    # Its KV cache in tokens (vllm:cache_config_info); None: not exported, or not read yet.
    kv_capacity_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Cluster:
    name: str
    kind: EngineKind
    endpoints: tuple[str, ...]
    models: tuple[str, ...] = field(default=())
    slow_start_s: float = 0.0
    # Endpoints that join later (found by discovery) start DOWN: no traffic before a probe
    # passed, then the slow start.
    probe_first: bool = False
