"""The shadow policy on live traffic: the pipeline's two calls, and nothing more.

    shadow.start(settings, version)  a validated candidate starts deciding (a fresh report)
    shadow.stop() -> report | None   it stops; its last report
    shadow.observe(record, ...)      after the active decision: the common case decided, else
                                     the snapshot the shadow will decide from
    shadow.finished(record)          at the request's end: queued, decided and counted in batches
    shadow.report                    the report, every queued request counted first

Contract:
- ``observe`` is called by ``Pipeline._route`` right after the active lane decision, with the
  same health map that decision used, before anything else can run. When the count fixes the
  shadow's figure (below) and the request is not multipart, ``decide_now``
  (``request/shadow.py``: the common case, the same answer as ``decide``) decides it there,
  from that health map and the pool's endpoints of its lane's clusters as they are then, and
  only the decision is kept (no snapshot, no memo: deciding is cheaper than a key). Where
  ``decide_now`` does not decide, ``observe`` keeps what the shadow's
  pure ``decide`` (``request/shadow.py``) will read, as one plain tuple made once: the request's
  model, output budget and multipart, the health map's items, the pool's endpoints of every
  cluster the shadow routes to as they are at that moment (``pool.views``, as tuples), the
  request's class inputs; and, for a policy that weighs them, its prefix as the index knew it
  and the pending prefill. When the count already fixes the shadow's figure (an exact count, a
  multipart route, or a free bound below the shadow's ``exact_above``: only its lowest lane and
  no loan's budget) that figure is kept too, and with it the memo's key is complete: an alike
  request already decided takes its decision there, by one lookup, and nothing is decided for
  it later. Otherwise (a bound past the shadow's threshold) the decision waits for the exact
  count the gateway finished while the engine worked (the bound, if the count never came:
  ``by_bound`` in the report).
- ``finished`` is called once the request ended (whatever its outcome). It queues the request;
  the queue is decided and counted as a batch (``flush``) when it holds ``BATCH`` requests,
  ``FLUSH_S`` after its first request was queued (a timer on the loop), and before anything
  reads the counts: the ``report`` property, ``stop``, ``start`` and a scrape of
  ``shapegate_shadow_decisions_total`` (``metrics.shadow_scrape.before``). What is read is
  therefore always every finished request, exactly. A flush adds each decision to the report
  (with the exact prompt tokens for the ranges and the window) and to
  ``shapegate_shadow_decisions_total{lane, shadow_lane}`` (no log line per request: the report
  and the counter are the record; start, stop and promote are logged).
- ``decide`` is pure: it runs once for alike requests (the flush tries ``decide_now`` first,
  for a figure that came with the exact count). Its answers are kept (at most
  ``MEMO_MAX``, for the running policy) by exactly the inputs it reads (the figure and the
  largest prompt, model, output budget, multipart, health map, every kept endpoint view, class
  inputs); a policy that weighs prefixes or pending prefill reads a per-prompt index view and
  is decided afresh for every request. The key holds exact counts and in-flight figures, so on
  varied or concurrent traffic it hits less: ``MEMO_MAX = 0`` keeps nothing, the cost of a
  memo that never hits (``bench shadow --instructions --memo-miss``; its small requests are
  the common case, decided by ``decide_now`` with or without a memo).
- Nothing of it reaches an engine, takes a slot, waits or raises into the request: every
  exception is logged and counted (``swallowed``, ``where=shadow.observe``/``shadow.finished``,
  ``decision=not_compared``) and the request goes on as if no shadow ran. With no shadow,
  each call is one attribute test.
- A request observed under one shadow and finished under another (a ``start`` or ``stop`` in
  between, each of which forgets what was observed) is not compared: every compared request
  was seen and decided by the same policy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

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
from gateway.request.shadow import (
    Seen,
    ShadowDecision,
    ShadowPolicy,
    ShadowReport,
    class_for,
    decide,
    decide_now,
)
from gateway.settings import Settings

# Finished requests decided and counted together; the decisions kept for alike requests (read
# when a ShadowLive is made: 0 keeps none, so every request is decided afresh, the cost of a
# memo that never hits, ``bench shadow --instructions --memo-miss``).
BATCH = 64
FLUSH_S = 1.0
MEMO_MAX = 4096

# What ``decide`` reads of a request but its figure and prefix, as one hashable tuple made once,
# at ``observe``: with the figure it is the memo's key (``_Key``). Plain tuples, not a named
# tuple: one is made for every live request, and a named tuple's constructor is a Python call.
_Plain = tuple[
    str,  # model, as the request named it
    int | None,  # max_tokens
    bool,  # multipart
    tuple[tuple[str, bool], ...],  # the pipeline's health map, as items
    tuple[tuple[EngineView, ...], ...],  # the pool's views of ``policy.clusters``, in order
    str | None,  # API key digest
    str | None,  # class header
    str | None,  # the active class, when the shadow's classes are the active ones
]
_Figure = tuple[int, int]  # tokens, longest
_Key = tuple[_Figure, _Plain]
# The prompt's prefix as the index knew it and the pending prefill then: only for a policy that
# weighs them (decided afresh every time, no memo); None for any other.
_Extra = tuple[PrefixSeen, Mapping[str, int]] | None
# Kept from ``observe`` to the flush: the decision when the memo already had it (then nothing
# else but the record), else the figure when final, the inputs and the prefix; the record (read
# at the flush, when it is final).
_Kept = tuple[ShadowDecision | None, _Figure | None, _Plain | None, _Extra, Record]
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
        self._queue: list[_Kept] = []
        self._timer: asyncio.TimerHandle | None = None
        self._memo: dict[_Key, ShadowDecision] = {}
        self._memo_max = MEMO_MAX
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
        self._report = ShadowReport()
        # What was observed under the last policy is never compared (nor its memo read).
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
        if policy is None:
            return
        routed = record.routed
        if routed is None:
            return
        try:
            count = routed.count
            if policy.classes_as_active:
                digest = asked = None
                priority = routed.priority
            else:
                auth = header(scope, b"authorization")
                digest = bearer_digest(auth) if auth is not None else None
                given = header(scope, policy.settings.classes.header.encode())
                asked = given.decode("latin-1") if given is not None else None
                priority = None
            # The figure is final for this policy when exact (any method but a bound: the
            # count's ``exact``, read here without its property call), a multipart route, or a
            # bound that can only mean its lowest lane and no loan's budget; else the decision
            # takes the exact count at the flush, with the views as they are now.
            figure: _Figure | None = None
            tokens = count.tokens
            if multipart or count.method != "bound" or tokens < policy.exact_above:
                largest = count.largest
                figure = (tokens, tokens if largest is None else largest)
                if not multipart:  # the common case decided now, from the live views
                    decision = decide_now(
                        policy,
                        tokens,
                        figure[1],
                        request.model,
                        healthy,
                        self.pool.views,
                        priority
                        if priority is not None
                        else class_for(policy, digest, asked, priority),
                    )
                    if decision is not None:
                        self._kept[id(record)] = (decision, None, None, None, record)
                        return
            plain = (
                request.model,
                request.max_tokens,
                multipart,
                tuple(healthy.items()),
                tuple(map(tuple, map(self.pool.views, policy.clusters))),
                digest,
                asked,
                priority,
            )
            extra: _Extra = None
            if policy.weighs_prefix:
                extra = (NOTHING, _NONE_PENDING)
                if not multipart and self.prefixes is not None:
                    # The pending prefill as it is now, not at the end.
                    extra = (
                        self.prefixes.look(request.prompt, model),
                        dict(self.prefixes.ledger.pending),
                    )
            # A final figure makes the memo's key now: an alike request's decision is taken
            # here, once.
            decision = None
            if figure is not None and extra is None:
                decision = self._memo.get((figure, plain))
                if decision is not None:  # the inputs go now: fewer objects live a batch
                    self._kept[id(record)] = (decision, None, None, None, record)
                    return
            self._kept[id(record)] = (decision, figure, plain, extra, record)
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
        kept = self._kept
        if not kept:
            return
        # Found only when observed under the running policy: ``start`` and ``stop`` clear it.
        found = kept.pop(id(record), None)
        if found is None:
            return
        queue = self._queue
        queue.append(found)
        if len(queue) >= BATCH:
            self.flush()
        elif self._timer is None:
            self._arm()

    def _arm(self) -> None:
        """A flush ``FLUSH_S`` from now: the queue's first request waits at most that long,
        however slowly the next ones come."""
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
        queue = self._queue
        if not queue:
            return
        self._queue = []
        policy = self.policy
        if policy is None:  # not reached: ``stop`` flushes first and clears what is kept
            return
        # Wall seconds at a monotonic zero: a request's arrival in wall seconds (replicas'
        # windows merge by it) from when it started.
        wall = time.time() - time.monotonic()
        names, trace, decided = policy.model_names, self._report.trace, self._decide
        # Requests of one active lane decided alike, counted at once: their prompt tokens.
        alike: dict[tuple[str, ShadowDecision, bool], list[int]] = {}
        for memoized, figure, plain, extra, record in queue:
            try:
                routed = record.routed
                assert routed is not None  # observe keeps only routed requests
                count = routed.count
                exact = record.prompt_tokens
                if exact is not None:
                    tokens, known = exact, True
                else:
                    tokens, known = count.tokens, count.method == "none"
                decision = memoized
                if decision is None:
                    assert plain is not None  # kept whenever the decision was not
                    if figure is None:
                        largest = count.largest
                        longest = tokens if largest is None else largest
                        decision = decided(policy, (tokens, longest), known, plain, extra)
                    else:
                        decision = decided(policy, figure, True, plain, extra)
                if exact is not None and record.grant is not None:  # ``admitted``
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
        self, policy: ShadowPolicy, figure: _Figure, exact: bool, plain: _Plain, extra: _Extra
    ) -> ShadowDecision:
        """The common case by ``decide_now``; else ``decide`` once for alike inputs: the memo's
        key is what it reads (``Seen.exact`` is not read). A policy weighing prefixes
        (``extra``) is decided afresh."""
        healthy = dict(plain[3])
        views = dict(zip(policy.clusters, plain[4], strict=True))
        if extra is None and not plain[2]:
            now = decide_now(
                policy,
                figure[0],
                figure[1],
                plain[0],
                healthy,
                lambda cluster: views.get(cluster, ()),
                class_for(policy, plain[5], plain[6], plain[7]),
            )
            if now is not None:
                return now
        key: _Key | None = None
        if extra is None:
            key = (figure, plain)
            found = self._memo.get(key)
            if found is not None:
                return found
        prefix, pending = (NOTHING, _NONE_PENDING) if extra is None else extra
        seen = Seen(
            figure[0],
            figure[1],
            exact,
            plain[0],
            plain[1],
            plain[2],
            healthy,
            views,
            plain[5],
            plain[6],
            prefix,
            plain[7],
            pending,
        )
        decision = decide(policy, seen)
        if key is not None and self._memo_max > 0:
            if len(self._memo) >= self._memo_max:
                self._memo.clear()
            self._memo[key] = decision
        return decision
