"""The shadow policy on live traffic: the pipeline's two calls, and nothing more.

    shadow.start(settings, version)  a validated candidate starts deciding (a fresh report)
    shadow.stop() -> report | None   it stops; its last report
    shadow.observe(record, ...)      after the active decision: the shadow decides (or keeps
                                     the snapshot until the exact count is known)
    shadow.finished(record)          at the request's end: the decision is counted

Contract:
- ``observe`` is called by ``Pipeline._route`` right after the active lane decision, with the
  same health map that decision used, before anything else can run. When the count already
  fixes the shadow's figure (an exact count, a multipart route, or a free bound below the
  shadow's ``exact_above``: only its lowest lane and no loan's budget), the shadow decides there
  and then with ``request/shadow.py``'s pure ``decide``, reading the pool's endpoints of the
  clusters it needs at that same moment. Otherwise (a bound past the shadow's threshold) it
  keeps a snapshot of every cluster's endpoints, the request's class inputs and its prefix as
  the index knew it, and decides in ``finished`` from that snapshot and the exact count the
  gateway finished while the engine worked (the bound, if the count never came: ``by_bound``
  in the report).
- ``finished`` is called once the request ended (whatever its outcome): the decision is added
  to the report (with the exact prompt tokens for the ranges and the window) and to
  ``shapegate_shadow_decisions_total{lane, shadow_lane}`` (no log line per request: the report
  and the counter are the record; start, stop and promote are logged).
- Nothing of it reaches an engine, takes a slot, waits or raises into the request: every
  exception is logged and counted (``swallowed``, ``where=shadow.observe``/``shadow.finished``,
  ``decision=not_compared``) and the request goes on as if no shadow ran. With no shadow,
  each call is one attribute test.
- A request observed under one shadow and finished under another (a ``start`` or ``stop`` in
  between) is not compared: every compared request was seen and decided by the same policy.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from engine_pool.cluster import EngineView
from engine_pool.registry import EnginePool
from gateway.core.exchange import Scope, header
from gateway.observe.log import Logger, swallowed
from gateway.observe.metrics import Metrics
from gateway.observe.record import Record
from gateway.protocols.openai import RoutedRequest
from gateway.request.classes import bearer_digest
from gateway.request.prefix import NOTHING, Prefixes
from gateway.request.prefix import Seen as PrefixSeen
from gateway.request.shadow import Seen, ShadowDecision, ShadowPolicy, ShadowReport, decide
from gateway.settings import Settings


class _Pending(NamedTuple):
    """What the active decision saw, for a shadow decision that waits for the exact count
    (``Seen`` but the count)."""

    max_tokens: int | None
    multipart: bool
    healthy: Mapping[str, bool]
    views: Mapping[str, Sequence[EngineView]]
    key_digest: str | None
    class_header: str | None
    prefix: PrefixSeen
    priority: str | None
    pending: Mapping[str, int]


class _LiveViews(Mapping[str, Sequence[EngineView]]):
    """The pool's endpoints of a cluster, read when the decision asks (it asks at once, in the
    same step as the active decision: the same snapshot) and only for the clusters it needs."""

    __slots__ = ("_pool",)

    def __init__(self, pool: EnginePool) -> None:
        self._pool = pool

    def __getitem__(self, cluster: str) -> Sequence[EngineView]:
        return self._pool.views(cluster)

    def get(self, cluster: str, default: object = None) -> Sequence[EngineView]:
        """``Mapping.get`` without its try/except and second call: every cluster has its
        endpoints (none for an unknown one), so ``default`` is never the answer."""
        return self._pool.views(cluster)

    def __iter__(self) -> Iterator[str]:
        return iter(self._pool.clusters)

    def __len__(self) -> int:
        return len(self._pool.clusters)


# Kept from ``observe`` to ``finished``: the policy, and either the decision already made or
# what a decision waiting for the exact count needs.
_Kept = tuple[ShadowPolicy, ShadowDecision | None, _Pending | None]
_NONE_PENDING: Mapping[str, int] = {}


class ShadowLive:
    def __init__(
        self, pool: EnginePool, metrics: Metrics, log: Logger, prefixes: Prefixes | None = None
    ) -> None:
        self.pool = pool
        # The live prefix index, read only (the shadow records nothing in it).
        self.prefixes = prefixes
        self.metrics = metrics
        self.log = log
        self.policy: ShadowPolicy | None = None
        self.report = ShadowReport()
        self._kept: dict[int, _Kept] = {}  # by id(record)
        self._live = _LiveViews(pool)

    def start(self, settings: Settings, version: int, active: Settings) -> ShadowPolicy:
        self.policy = ShadowPolicy.of(settings, version, active)
        self.report = ShadowReport()
        self._kept.clear()
        return self.policy

    def stop(self) -> dict[str, Any] | None:
        if self.policy is None:
            return None
        self.policy = None
        self._kept.clear()
        return self.report.as_json(window=False)

    def observe(
        self,
        record: Record,
        request: RoutedRequest,
        multipart: bool,
        scope: Scope,
        healthy: Mapping[str, bool],
        model: str = "",
    ) -> None:
        """``model``: the live request's model by its name (the tokenizer the prefix index's
        exact hashes are made with, kv_events mode)."""
        policy = self.policy
        if policy is None or record.routed is None:
            return
        try:
            routed = record.routed
            count = routed.count
            # The figure is final for this policy when exact, or a bound that can only mean its
            # lowest lane and no loan's budget: decide now, from the live snapshot; else decide
            # on the exact count, at the end, from the views as they were now.
            final = multipart or count.exact is not None or count.tokens < policy.exact_above
            prefix, pending = NOTHING, _NONE_PENDING
            if not multipart and policy.weighs_prefix and self.prefixes is not None:
                prefix = self.prefixes.look(request.prompt, model)
                pending = dict(self.prefixes.ledger.pending)  # as it is now, not at the end
            if policy.classes_as_active:
                digest = asked = None
            else:
                auth = header(scope, b"authorization")
                digest = bearer_digest(auth) if auth is not None else None
                given = header(scope, policy.settings.classes.header.encode())
                asked = given.decode("latin-1") if given is not None else None
            priority = routed.priority if policy.classes_as_active else None
            # The pipeline's own health map, made for this request and never changed after.
            if final:
                seen = Seen(
                    count.tokens,
                    count.longest,
                    True,
                    request.model,
                    request.max_tokens,
                    multipart,
                    healthy,
                    self._live,
                    digest,
                    asked,
                    prefix,
                    priority,
                    pending,
                )
                self._kept[id(record)] = (policy, decide(policy, seen), None)
            else:
                views = {c: self.pool.views(c) for c in policy.clusters}
                kept = _Pending(
                    request.max_tokens,
                    multipart,
                    healthy,
                    views,
                    digest,
                    asked,
                    prefix,
                    priority,
                    pending,
                )
                self._kept[id(record)] = (policy, None, kept)
        except Exception as exc:  # noqa: BLE001 - the shadow never fails a live request
            swallowed(
                self.log,
                self.metrics,
                "shadow.observe",
                exc,
                decision="not_compared",
                request_id=record.request_id,
            )

    def finished(self, record: Record) -> None:
        if not self._kept:
            return
        found = self._kept.pop(id(record), None)
        if found is None:
            return
        if found[0] is not self.policy or record.routed is None:
            return
        try:
            self._count(record, *found)
        except Exception as exc:  # noqa: BLE001 - the shadow never fails a live request
            swallowed(
                self.log,
                self.metrics,
                "shadow.finished",
                exc,
                decision="not_compared",
                request_id=record.request_id,
            )

    def _count(
        self,
        record: Record,
        policy: ShadowPolicy,
        decision: ShadowDecision | None,
        kept: _Pending | None,
    ) -> None:
        routed = record.routed
        assert routed is not None
        count = routed.count
        exact = record.prompt_tokens
        tokens = exact if exact is not None else count.tokens
        known = exact is not None or count.method == "none"
        if decision is None:
            assert kept is not None
            longest = tokens if count.largest is None else count.largest
            decision = decide(policy, Seen(tokens, longest, known, routed.model, *kept))
        shape = None
        if exact is not None and record.admitted:
            output = record.output_tokens
            if output is None:
                output = record.output_tokens_estimate
            # Arrival in wall seconds (replicas' windows merge by it), when the request came.
            arrival = time.time() - (time.monotonic() - record.started)
            shape = (
                round(arrival, 3),
                policy.model_names.get(routed.model, routed.model),
                exact,
                count.prompt_bytes,
                output or 0,
                routed.stream,
                routed.priority,
            )
        self.report.add(routed.lane, decision, tokens, known, shape)
        pairs, pair = self.metrics.shadow_decisions, (routed.lane, decision.lane)
        pairs[pair] = pairs.get(pair, 0) + 1
