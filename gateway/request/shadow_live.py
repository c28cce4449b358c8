"""The shadow policy on live traffic: the pipeline's two calls, and nothing more.

    shadow.start(settings, version)  a validated candidate starts deciding (a fresh report)
    shadow.stop() -> report | None   it stops; its last report
    shadow.observe(record, ...)      after the active decision: the snapshot it saw, kept
    shadow.finished(record)          at the request's end: the shadow decides and is counted

Contract:
- ``observe`` is called by ``Pipeline._route`` right after the active lane decision, with the
  same health map the active decision used; it takes the endpoints' snapshot (the pool's views
  of every cluster the shadow names) and the request's class inputs and prefix keys, then
  returns. ``finished`` is called once the request ended (whatever its outcome): it decides
  from that snapshot with ``request/shadow.py``'s pure ``decide`` and the same count the
  gateway ended with (the exact prompt count, which the gateway finishes while the engine
  works when a bound decided the active lane; else that bound), and adds it to the report,
  and the ``shapegate_shadow_decisions_total{lane, shadow_lane}`` counter (no log line per
  request: the report and the counter are the record; start, stop and promote are logged).
- Nothing of it reaches an engine, takes a slot, waits or raises into the request: every
  exception is logged and counted (``swallowed``, ``where=shadow.observe``/``shadow.finished``,
  ``decision=not_compared``) and the request goes on as if no shadow ran. With no shadow,
  each call is one attribute test.
- A request observed under one shadow and finished under another (a ``start`` or ``stop`` in
  between) is not compared: every compared request was seen and decided by the same policy.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from engine_pool.cluster import EngineView
from engine_pool.registry import EnginePool
from gateway.edge.exchange import Scope, header
from gateway.observe.log import Logger, swallowed
from gateway.observe.metrics import Metrics
from gateway.observe.record import Record
from gateway.request.classes import bearer_digest
from gateway.request.protocol import RoutedRequest, prefix_key
from gateway.request.shadow import Seen, ShadowPolicy, ShadowReport, decide
from gateway.settings import Settings


class _Pending(NamedTuple):
    """What the active decision saw, kept until the request ends (``Seen`` but the count)."""

    max_tokens: int | None
    multipart: bool
    healthy: Mapping[str, bool]
    views: Mapping[str, Sequence[EngineView]]
    key_digest: str | None
    class_header: str | None
    prefixes: Mapping[int, bytes]


class ShadowLive:
    def __init__(self, pool: EnginePool, metrics: Metrics, log: Logger) -> None:
        self.pool = pool
        self.metrics = metrics
        self.log = log
        self.policy: ShadowPolicy | None = None
        self.report = ShadowReport()
        # id(record) -> (the policy that saw it, what it saw but the final count, arrival).
        self._seen: dict[int, tuple[ShadowPolicy, _Pending, float]] = {}

    def start(self, settings: Settings, version: int) -> ShadowPolicy:
        self.policy = ShadowPolicy.of(settings, version)
        self.report = ShadowReport()
        self._seen.clear()
        return self.policy

    def stop(self) -> dict[str, Any] | None:
        if self.policy is None:
            return None
        self.policy = None
        self._seen.clear()
        return self.report.as_json(window=False)

    def observe(
        self,
        record: Record,
        request: RoutedRequest,
        multipart: bool,
        scope: Scope,
        healthy: Mapping[str, bool],
    ) -> None:
        policy = self.policy
        if policy is None:
            return
        try:
            seen = self._snapshot(policy, request, multipart, scope, healthy)
            # Arrival in wall seconds (replicas' windows merge by it), when the request came.
            arrival = time.time() - (time.monotonic() - record.started)
            self._seen[id(record)] = (policy, seen, arrival)
        except Exception as exc:  # noqa: BLE001 - the shadow never fails a live request
            swallowed(
                self.log,
                self.metrics,
                "shadow.observe",
                exc,
                decision="not_compared",
                request_id=record.request_id,
            )

    def _snapshot(
        self,
        policy: ShadowPolicy,
        request: RoutedRequest,
        multipart: bool,
        scope: Scope,
        healthy: Mapping[str, bool],
    ) -> _Pending:
        settings = policy.settings
        prefixes: dict[int, bytes] = {}
        if not multipart and policy.prefix_bytes:
            for size in policy.prefix_bytes:
                key = prefix_key(request.prompt, size)
                if key is not None:
                    prefixes[size] = key
        asked = header(scope, settings.classes.header.encode())
        auth = header(scope, b"authorization")
        return _Pending(
            request.max_tokens,
            multipart,
            # The pipeline's own map, made for this request and never changed after.
            healthy,
            {c: self.pool.views(c) for c in policy.clusters},
            bearer_digest(auth) if auth is not None else None,
            asked.decode("latin-1") if asked is not None else None,
            prefixes,
        )

    def finished(self, record: Record) -> None:
        if not self._seen:
            return
        found = self._seen.pop(id(record), None)
        if found is None:
            return
        policy, seen, arrival = found
        if policy is not self.policy or record.routed is None:
            return
        try:
            self._decide(record, policy, seen, arrival)
        except Exception as exc:  # noqa: BLE001 - the shadow never fails a live request
            swallowed(
                self.log,
                self.metrics,
                "shadow.finished",
                exc,
                decision="not_compared",
                request_id=record.request_id,
            )

    def _decide(
        self, record: Record, policy: ShadowPolicy, pending: _Pending, arrival: float
    ) -> None:
        routed = record.routed
        assert routed is not None
        count = routed.count
        exact = record.prompt_tokens
        tokens = exact if exact is not None else count.tokens
        seen = Seen(
            tokens,
            tokens if count.largest is None else count.largest,
            exact is not None or count.method == "none",
            routed.model,
            *pending,
        )
        decision = decide(policy, seen)
        shape = None
        if exact is not None and record.admitted:
            output = record.output_tokens
            if output is None:
                output = record.output_tokens_estimate
            shape = (
                round(arrival, 3),
                policy.model_names.get(routed.model, routed.model),
                exact,
                count.prompt_bytes,
                output or 0,
                routed.stream,
                routed.priority,
            )
        self.report.add(routed.lane, decision, seen, shape)
        self.metrics.child(self.metrics.shadow_decisions, routed.lane, decision.lane).inc()
