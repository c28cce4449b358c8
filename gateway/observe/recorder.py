"""Step 9, record: the one recorder that reports a request (its typed ``Record``:
gateway/observe/record.py).

Contract: ``Recorder`` owns every report about a request, and nothing else writes one:

    decided(record, routed)   the lane is decided: the record joins the ring of recent
                              decisions (the dashboard shows it in flight)
    admitted(record, grant)   one ``route.decision`` event; decision, queue-wait and
                              prompt-token metrics
    moved(record, grant)      the request failed over to another endpoint (its slot moved)
    migrated(record, grant, reason)  its stream moved mid-answer (its slot moved)
    chunk(record, now)        a chunk reached the client: TTFT on the first, ITL after
    refused(record, exc)      the gateway answered with an error: the outcome it means;
                              ``route.rejected`` if the request was never admitted; a
                              watchdog deadline counts in ``shapegate_watchdog_events_total``
    finished(record, status)  one ``route.finished`` event; request, e2e, TTFT and output
                              metrics; the dashboard's rolling window and, for a
                              deadline, its ``watchdog`` event; the trace
    received(record, scope)   with tracing on (gateway/observe/tracing.py): the request's span
    starts attempt(record, url)      the trace headers for one try at an engine (None when off);
                              ``moved`` ends a failed try's span, ``finished`` the rest
    snapshot()                the ring of recent decisions as JSON (``Record.as_json()``)

Log field and metric names are part of the interface (tests, dashboards, alert rules).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine_pool.chain import Ranked
from engine_pool.latency import LatencyBook
from gateway.core.decision import Grant
from gateway.core.watchdog import DeadlineHit
from gateway.errors import GatewayError
from gateway.observe.drift import DriftWatch
from gateway.observe.log import Logger, assembled
from gateway.observe.metrics import Metrics, status_class
from gateway.observe.record import Record, Routed
from gateway.observe.stats import RollingWindow
from gateway.observe.trace import TraceWriter
from gateway.observe.tracing import Tracing

# Outcomes that mark a request's span as an error (a 5xx answer does too; a 4xx does not).
_SPAN_ERRORS = frozenset({"upstream_error", "timeout", "error"})


class Recorder:
    """The decision log, the per-request metrics, the ring of recent decisions, the dashboard's
    rolling window and the trace: every report about a request, in one place."""

    def __init__(
        self,
        metrics: Metrics,
        log: Logger,
        ring_size: int,
        trace_file: str | None = None,
        latency: LatencyBook | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.metrics = metrics
        self.tracing = tracing
        self.latency = latency
        self.log = assembled(log)  # the decision log's two events a request
        self.recent: deque[Record] = deque(maxlen=ring_size)
        self.trace = TraceWriter(Path(trace_file)) if trace_file else None
        self.window = RollingWindow()
        self.drift = DriftWatch(metrics, log)

    def _remember(self, record: Record) -> None:
        if not record.in_ring:
            record.in_ring = True
            self.recent.append(record)

    def received(self, record: Record, scope: Mapping[str, Any]) -> None:
        if self.tracing is not None:
            record.span = self.tracing.request(scope["headers"], scope["method"], scope["path"])

    def attempt(self, record: Record, url: str) -> dict[str, str] | None:
        """The ``traceparent`` (and ``tracestate``) for this try at an engine; None when off."""
        return None if record.span is None else record.span.attempt(url)

    def decided(self, record: Record, routed: Routed) -> None:
        record.routed = routed
        record.prompt_tokens = routed.count.exact  # None while only the bound is known
        self._remember(record)

    def admitted(self, record: Record, grant: Grant, ranked: Ranked | None = None) -> None:
        """``ranked``: the endpoint's place in the chain (engine_pool/chain.py) when it chose:
        its score and the prompt tokens it was believed to hold cached."""
        record.grant = grant
        routed = record.routed
        assert routed is not None, "admitted before the lane was decided"
        if grant.lender is not None:
            routed = record.routed = replace(routed, reason="borrowed", lender=grant.lender)
        self.log.info(
            "route.decision",
            request_id=record.request_id,
            **routed.log_fields(),
            cluster=grant.cluster,
            endpoint=grant.url,
            queue_wait_s=round(grant.queued_s, 4),
            score=None if ranked is None else ranked.score,
            cached_tokens=None if ranked is None else ranked.cached_tokens,
        )
        m = self.metrics
        m.child(m.route_decisions, grant.lane, routed.reason, routed.count.method).inc()
        m.child(m.queue_wait, grant.lane).observe(grant.queued_s)

    def moved(self, record: Record, grant: Grant, reason: str = "unreachable") -> None:
        """The request failed over before any answer byte: its slot is now ``grant``'s (the
        ``route.retry`` event itself is gateway/request/failover.py's)."""
        record.grant = grant
        record.retries += 1
        if record.span is not None:
            record.span.attempt_failed(reason)

    def paused(self, record: Record) -> None:
        """The attempt was paused before its first byte (``lanes[].pause_reads``; the
        ``route.paused`` event itself is gateway/request/pausing.py's): nothing reached the
        client, so the request is as before its first attempt, its slot held."""
        record.pauses += 1
        record.status = 0
        if record.span is not None:
            record.span.attempt_paused()

    def migrated(
        self, record: Record, grant: Grant, reason: str, cause: GatewayError | None = None
    ) -> None:
        """The stream moved mid-answer: its slot is now ``grant``'s (the ``route.migrated``
        event itself is gateway/request/failover.py's). A deadline that cut it (the engine went
        idle past the lane's ``idle_s``) is still a watchdog event, counted and listed with
        the decision ``migrated``: the engine stalled even though the client did not see it."""
        stalled = record.grant
        record.grant = grant
        record.migrations += 1
        if isinstance(cause, DeadlineHit):
            cluster = stalled.cluster if stalled is not None else grant.cluster
            self.metrics.watchdog_events.labels(
                lane=record.lane, cluster=cluster, kind=cause.kind
            ).inc()
            self.metrics.events.add(
                "watchdog",
                "pipeline.deadline",
                cause.message,
                "migrated",
                {
                    "deadline": cause.kind,
                    "lane": record.lane,
                    "cluster": cluster,
                    "endpoint": stalled.url if stalled is not None else None,
                    "request_id": record.request_id,
                },
            )
        if record.span is not None:
            record.span.attempt_failed(reason)

    def engine_counted(self, record: Record, model: str, template: str) -> None:
        """The engine answered: compare its prompt count with ours when both exist."""
        if record.prompt_tokens is None or record.engine_prompt_tokens is None:
            return
        assert record.routed is not None, "answered before the lane was decided"
        record.count_drift = self.drift.observe(
            model=model,
            route=record.route,
            ours=record.prompt_tokens,
            theirs=record.engine_prompt_tokens,
            tokenizer=record.routed.count.tokenizer,
            template=template,
        )

    def chunk(self, record: Record, now: float) -> None:
        if record.chunks == 0:
            record.ttft_s = now - record.started
        elif record.grant is not None:
            m = self.metrics
            m.child(m.itl, record.grant.lane, record.grant.cluster).observe(
                now - record.last_chunk_at
            )
        record.last_chunk_at = now
        record.chunks += 1

    def refused(self, record: Record, exc: GatewayError) -> None:
        record.status = exc.status
        record.error = exc.message
        if isinstance(exc, DeadlineHit):
            record.outcome = "timeout"
            record.deadline = exc.kind
            self.metrics.watchdog_events.labels(
                lane=record.lane, cluster=record.cluster, kind=exc.kind
            ).inc()
        elif record.admitted and exc.status >= 500:
            record.outcome = "upstream_error"
        else:
            record.outcome = "rejected"
        if not record.admitted:
            routed = record.routed.log_fields() if record.routed is not None else {}
            self.log.info(
                "route.rejected",
                request_id=record.request_id,
                status=exc.status,
                **routed,
                error=record.error,
            )
            self._remember(record)

    def finished(self, record: Record, status: int | None) -> None:
        if record.outcome is None:
            record.outcome = "cancelled"
        if status:
            record.status = status
        duration = time.monotonic() - record.started
        record.duration_s = round(duration, 4)
        lane, cluster = record.lane, record.cluster
        self.log.info(
            "route.finished",
            request_id=record.request_id,
            lane=lane,
            cluster=cluster,
            outcome=record.outcome,
            status=record.status,
            ttft_s=None if record.ttft_s is None else round(record.ttft_s, 4),
            duration_s=record.duration_s,
            prompt_tokens=record.prompt_tokens,
            engine_prompt_tokens=record.engine_prompt_tokens,
            count_drift=record.count_drift,
            output_tokens=record.output_tokens,
            output_tokens_estimate=record.output_tokens_estimate,
            chunks=record.chunks,
            retries=record.retries,
            migrations=record.migrations,
            pauses=record.pauses,
            error=record.error,
            deadline=record.deadline,
        )
        m = self.metrics
        m.child(m.requests, lane, cluster, record.outcome, status_class(record.status)).inc()
        if record.grant is not None:
            url = record.grant.url
            m.child(m.e2e, lane, cluster, url).observe(duration)
            if record.ttft_s is not None:
                m.child(m.ttft, lane, cluster, url).observe(record.ttft_s)
            if record.prompt_tokens is not None:
                m.child(m.prompt_tokens, lane).observe(record.prompt_tokens)
            output, source = record.output_tokens, "usage"
            if output is None:
                output, source = record.output_tokens_estimate, "sse_estimate"
            if output is not None:
                m.child(m.output_tokens, lane, source).observe(output)
            per_token = None
            if output and output > 1 and record.chunks > 1 and record.ttft_s is not None:
                per_token = (duration - record.ttft_s) / (output - 1)
                m.child(m.tpot, lane).observe(per_token)
            # Streamed answers only: a non-streamed one's first byte is its last.
            if (
                self.latency is not None
                and record.routed is not None
                and record.routed.stream
                and record.outcome == "ok"
                and record.ttft_s is not None
                and record.prompt_tokens is not None
            ):
                self.latency.observe(
                    cluster, url, record.prompt_tokens, record.ttft_s, per_token, time.monotonic()
                )
            # A trace line holds tokens or nothing: never a bound standing in for them.
            if self.trace is not None and record.routed and record.prompt_tokens is not None:
                routed = record.routed
                self.trace.record(
                    model=routed.model,
                    prompt_tokens=record.prompt_tokens,
                    prompt_bytes=routed.count.prompt_bytes,
                    output_tokens=output or 0,
                    stream=routed.stream,
                )
        admitted = record.grant is not None
        self.window.observe(
            lane,
            record.outcome,
            record.ttft_s if admitted else None,
            duration if admitted else None,
        )
        if record.outcome == "timeout":
            self._watchdog_event(record)
        if record.span is not None:
            failed = record.outcome in _SPAN_ERRORS or record.status >= 500
            record.span.end(
                record.span_attributes(), record.status, record.outcome if failed else None
            )

    def _watchdog_event(self, record: Record) -> None:
        grant = record.grant
        self.metrics.events.add(
            "watchdog",
            "pipeline.deadline",
            record.error or "deadline hit",
            "answered_timeout",
            {
                "deadline": record.deadline,
                "lane": record.lane,
                "cluster": grant.cluster if grant else None,
                "endpoint": grant.url if grant else None,
                "request_id": record.request_id,
            },
        )

    def snapshot(self) -> list[dict[str, Any]]:
        """The recent decisions, newest first, as plain JSON for the admin state."""
        return [r.as_json() for r in reversed(self.recent)]
