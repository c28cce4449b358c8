"""The shadow policy on live traffic: the pipeline's two calls, and nothing more.

    shadow.start(settings, version)  a validated candidate starts deciding (a fresh report)
    shadow.stop() -> report | None   it stops; its last report
    shadow.observe(record, ...)      after the active decision: the snapshot the shadow will
                                     decide from
    shadow.finished(record)          at the request's end: queued, decided and counted in batches
    shadow.report                    the report, every queued request counted first

Contract:
- ``observe`` is called by ``Pipeline._route`` right after the active lane decision, with the
  same health map that decision used, before anything else can run. It keeps what the shadow's
  pure ``decide`` (``request/shadow.py``) will read: the pool's endpoints of every cluster the
  shadow routes to as they are at that moment (``pool.views``: fresh lists nothing changes
  after, kept by reference, not copied), the request's class inputs and its prefix as the index
  knew it. When the count already fixes the shadow's figure (an exact count, a multipart route,
  or a free bound below the shadow's ``exact_above``: only its lowest lane and no loan's
  budget) that figure is kept too; otherwise (a bound past the shadow's threshold) the decision
  waits for the exact count the gateway finished while the engine worked (the bound, if the
  count never came: ``by_bound`` in the report).
- ``finished`` is called once the request ended (whatever its outcome). It queues the request;
  the queue is decided and counted as a batch (``flush``) when it holds ``BATCH`` requests,
  when a request finishes ``FLUSH_S`` after the last flush, ``FLUSH_S`` after the first request
  was queued (a timer on the loop, for a quiet gateway), and before anything reads the counts:
  the ``report`` property, ``stop``, ``start`` and a scrape of
  ``shapegate_shadow_decisions_total`` (``metrics.shadow_scrape.before``). What is read is
  therefore always every finished request, exactly. A flush adds each decision to the report
  (with the exact prompt tokens for the ranges and the window) and to
  ``shapegate_shadow_decisions_total{lane, shadow_lane}`` (no log line per request: the report
  and the counter are the record; start, stop and promote are logged).
- ``decide`` is pure: a batch decides once for alike requests. Its answers are kept (at most
  ``MEMO_MAX``, for the running policy) by exactly the inputs it reads (the figure and the
  largest prompt, model, output budget, multipart, health map, every kept endpoint view, class
  inputs); a policy that weighs prefixes or pending prefill reads a per-prompt index view and
  is decided afresh for every request.
- Nothing of it reaches an engine, takes a slot, waits or raises into the request: every
  exception is logged and counted (``swallowed``, ``where=shadow.observe``/``shadow.finished``,
  ``decision=not_compared``) and the request goes on as if no shadow ran. With no shadow,
  each call is one attribute test.
- A request observed under one shadow and finished under another (a ``start`` or ``stop`` in
  between) is not compared: every compared request was seen and decided by the same policy.
"""

from __future__ import annotations

import asyncio
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

# Finished requests decided and counted together; the longest a finished request waits in the
# queue while requests keep coming (seconds); the decisions kept for alike requests.
BATCH = 64
FLUSH_S = 1.0
MEMO_MAX = 4096


class _Inputs(NamedTuple):
    """What the active decision saw, for the shadow's decision (``Seen`` but the count)."""

    model: str
    max_tokens: int | None
    multipart: bool
    healthy: Mapping[str, bool]  # the pipeline's map for this request, never changed after
    views: tuple[list[EngineView], ...]  # the pool's views of ``policy.clusters``, in order
    key_digest: str | None
    class_header: str | None
    prefix: PrefixSeen
    priority: str | None
    pending: Mapping[str, int]


class _Views(Mapping[str, Sequence[EngineView]]):
    """The kept views by cluster name, for ``decide`` (made only when a decision is made)."""

    __slots__ = ("_index", "_views")

    def __init__(self, index: Mapping[str, int], views: tuple[list[EngineView], ...]) -> None:
        self._index, self._views = index, views

    def __getitem__(self, cluster: str) -> Sequence[EngineView]:
        return self._views[self._index[cluster]]

    def get(self, cluster: str, default: object = None) -> Sequence[EngineView]:
        """Every cluster of the policy has its views; any other has none (as the pool's)."""
        at = self._index.get(cluster)
        return () if at is None else self._views[at]

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


# Kept from ``observe`` to ``finished``: the policy, the figure when already final (tokens,
# longest) and the inputs.
_Kept = tuple[ShadowPolicy, tuple[int, int] | None, _Inputs]
# Queued from ``finished`` to the flush: the figure when final, the inputs, the finished record.
_Done = tuple[tuple[int, int] | None, _Inputs, Record]
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
        self._report = ShadowReport()
        self._kept: dict[int, _Kept] = {}  # by id(record)
        self._queue: list[_Done] = []
        self._flushed = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self._memo: dict[tuple[Any, ...], ShadowDecision] = {}
        self._index: Mapping[str, int] = {}
        # A scrape counts every finished request: the queue is flushed first.
        metrics.shadow_scrape.before = self.flush

    @property
    def report(self) -> ShadowReport:
        """The report, with every finished request counted."""
        self.flush()
        return self._report

    def start(self, settings: Settings, version: int, active: Settings) -> ShadowPolicy:
        self.flush()  # the last requests of a running shadow count in its own metric
        self.policy = ShadowPolicy.of(settings, version, active)
        self._index = {c: i for i, c in enumerate(self.policy.clusters)}
        self._report = ShadowReport()
        self._kept.clear()
        self._memo.clear()
        return self.policy

    def stop(self) -> dict[str, Any] | None:
        if self.policy is None:
            return None
        self.flush()
        self.policy = None
        self._kept.clear()
        self._memo.clear()
        return self._report.as_json(window=False)

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
            count = record.routed.count
            # The figure is final for this policy when exact, or a bound that can only mean its
            # lowest lane and no loan's budget; else the decision takes the exact count, at the
            # end, with the views as they are now.
            final = multipart or count.exact is not None or count.tokens < policy.exact_above
            prefix, pending = NOTHING, _NONE_PENDING
            if not multipart and policy.weighs_prefix and self.prefixes is not None:
                prefix = self.prefixes.look(request.prompt, model)
                pending = dict(self.prefixes.ledger.pending)  # as it is now, not at the end
            if policy.classes_as_active:
                digest = asked = None
                priority = record.routed.priority
            else:
                auth = header(scope, b"authorization")
                digest = bearer_digest(auth) if auth is not None else None
                given = header(scope, policy.settings.classes.header.encode())
                asked = given.decode("latin-1") if given is not None else None
                priority = None
            views = self.pool.views
            inputs = _Inputs(
                request.model,
                request.max_tokens,
                multipart,
                healthy,
                tuple(map(views, policy.clusters)),
                digest,
                asked,
                prefix,
                priority,
                pending,
            )
            figure = (count.tokens, count.longest) if final else None
            self._kept[id(record)] = (policy, figure, inputs)
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
        queue = self._queue
        # The record is final now: read at the flush.
        queue.append((found[1], found[2], record))
        if len(queue) >= BATCH or time.monotonic() - self._flushed >= FLUSH_S:
            self.flush()
        elif self._timer is None:
            self._arm()

    def _arm(self) -> None:
        """A flush ``FLUSH_S`` from now, for a gateway that goes quiet with requests queued."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called off a loop (a test): the readers' flushes remain
            return
        self._timer = loop.call_later(FLUSH_S, self.flush)

    def flush(self) -> None:
        """Decide and count every queued request (cheap when the queue is empty)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._flushed = time.monotonic()
        queue = self._queue
        policy = self.policy
        if not queue or policy is None:
            queue.clear()
            return
        self._queue = []
        # Wall seconds at a monotonic zero: a request's arrival in wall seconds (replicas'
        # windows merge by it) from when it started.
        wall = time.time() - self._flushed
        names, trace, decided = policy.model_names, self._report.trace, self._decide
        # Requests of one active lane decided alike, counted at once: their prompt tokens.
        alike: dict[tuple[str, ShadowDecision, bool], list[int]] = {}
        for figure, inputs, record in queue:
            try:
                routed = record.routed
                assert routed is not None  # finished queues only routed requests
                count = routed.count
                exact = record.prompt_tokens
                if exact is not None:
                    tokens, known = exact, True
                else:
                    tokens, known = count.tokens, count.method == "none"
                if figure is None:
                    largest = count.largest
                    longest = tokens if largest is None else largest
                    decision = decided(policy, tokens, longest, known, inputs)
                else:
                    decision = decided(policy, figure[0], figure[1], True, inputs)
                if exact is not None and record.admitted:
                    output = record.output_tokens
                    if output is None:
                        output = record.output_tokens_estimate
                    trace.append(
                        (
                            round(wall + record.started, 3),
                            names.get(routed.model, routed.model),
                            exact,
                            count.prompt_bytes,
                            output or 0,
                            routed.stream,
                            routed.priority,
                        )
                    )
                group = (routed.lane, decision, known)
                found = alike.get(group)
                if found is None:
                    alike[group] = [tokens]
                else:
                    found.append(tokens)
            except Exception as exc:  # noqa: BLE001 - the shadow never fails a live request
                swallowed(
                    self.log,
                    self.metrics,
                    "shadow.finished",
                    exc,
                    decision="not_compared",
                    request_id=record.request_id,
                )
        pairs = self.metrics.shadow_decisions
        for (lane, decision, known), prompts in alike.items():
            self._report.add_alike(lane, decision, prompts, known)
            pair = (lane, decision.lane)
            pairs[pair] = pairs.get(pair, 0) + len(prompts)

    def _decide(
        self, policy: ShadowPolicy, tokens: int, longest: int, exact: bool, inputs: _Inputs
    ) -> ShadowDecision:
        """``decide`` once for alike inputs: the memo's key is what it reads."""
        key: tuple[Any, ...] | None = None
        if not policy.weighs_prefix:
            # Seen.exact is not read by ``decide``; prefix and pending are NOTHING and {}.
            key = (
                tokens,
                longest,
                inputs.model,
                inputs.max_tokens,
                inputs.multipart,
                tuple(inputs.healthy.items()),
                tuple(map(tuple, inputs.views)),
                inputs.key_digest,
                inputs.class_header,
                inputs.priority,
            )
            found = self._memo.get(key)
            if found is not None:
                return found
        seen = Seen(
            tokens,
            longest,
            exact,
            inputs.model,
            inputs.max_tokens,
            inputs.multipart,
            inputs.healthy,
            _Views(self._index, inputs.views),
            inputs.key_digest,
            inputs.class_header,
            inputs.prefix,
            inputs.priority,
            inputs.pending,
        )
        decision = decide(policy, seen)
        if key is not None:
            if len(self._memo) >= MEMO_MAX:
                self._memo.clear()
            self._memo[key] = decision
        return decision
