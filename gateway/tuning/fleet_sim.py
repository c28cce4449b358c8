"""A policy played against simulated clusters, in simulated time: the what-if engine.

``FleetSim(settings, profiles, count_by).run(trace)`` plays every request of a trace through
the gateway's own decisions (``lanes.choose_lane`` on the count, the lane's FIFO queue with its
depth, wait limit and ``on_full``, the lane and per-endpoint slot limits, ``picker`` least
in-flight order) onto engines that run the simulator's own V1 scheduler and cost model
(``engine_pool.sim.scheduler``). It is a discrete-event simulation: no sleeping, no sockets, so
three hours of traffic with minutes-long prefills take seconds, and the same trace and policy
give the same result every time.

``count_by="chars4"`` routes by characters / 4 instead of tokens (the engines still see real
tokens), to show what a character threshold does.

A request longer than its engine's ``max_model_len`` is refused by the engine (vLLM's 400),
which is what happens to JSON-dense prompts a character threshold sends to the fast lane.

What the live path spends outside the engine (``gateway/tuning/fleet_model.py``, ``LiveCosts``):
the gateway's and the HTTP hop's cost per request, measured in wall milliseconds and converted
to the engines' clock by their time scale; the engine stamps the arrival when the request
reaches it, not at trace time; a request holds its slot and in-flight count until the relay of
its last token ends; the picker breaks in-flight ties on each engine's ``waiting`` as last
scraped. ``LiveCosts.none()`` is the engine alone.

Borrowing and priority classes are the live gateway's own pure rules (gateway/request/borrowing.py,
gateway/request/classes.py): a short request may take a lending lane's idle endpoint
(``SimulatedRequest.lender`` names it); a lender's own request waits for borrowers to drain,
reserving the endpoint; each lane's queue goes by class then arrival with the starvation bound.
A trace has no ``max_tokens``: a request's real output length stands in for it (the budget it
declared is at least that).

Prefix caching (``FleetSim(..., prefix=PrefixSim(router))``): each engine holds a prefix cache
and the router picks the endpoint order (gateway/tuning/prefix_routers.py says each router).
With the chain (or the oracle), a lane's ``pause_reads`` applies as the live pipeline applies
it (engine_pool/pause.py): a cached question reaching its engine aborts the reads the rule
names there (the engine keeps their blocks), which hold their slots and reach the engine again
once no pausing question is in flight on it.
The results are gateway/tuning/fleet_result.py's ``SimulatedRequest`` and ``FleetResult``.

What it leaves out, on purpose: health changes and faults (a replay is about policy under load,
not failure).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, cast

from engine_pool.cluster import EngineState, EngineView
from engine_pool.pause import InFlight, PauseRule, Question, is_question, to_pause
from engine_pool.picker import order_endpoints
from engine_pool.sim.prefix_cache import BlockCache
from engine_pool.sim.profile import EngineProfile
from engine_pool.sim.scheduler import Scheduler, StepResult
from gateway.observe.trace import TraceRecord
from gateway.request.borrowing import (
    EndpointUse,
    Loan,
    borrow_room,
    loans_for,
    owner_may_enter,
    to_reserve,
)
from gateway.request.classes import class_lane_limit, next_waiter, passing, rank
from gateway.request.lanes import choose_lane
from gateway.settings import LaneSettings, Settings
from gateway.tuning.fleet_model import LiveCosts
from gateway.tuning.fleet_result import FleetResult, SimulatedRequest
from gateway.tuning.prefix_routers import (
    PrefixSim,
    approximate_index,
    by_affinity,
    by_chain,
    cache_aware,
    capacity_read,
)

CountBy = Literal["tokens", "chars4"]


@dataclass(eq=False, slots=True)
class _Engine:
    cluster: str
    url: str
    scheduler: Scheduler
    # The KV capacity the gateway reads from the engine's ``vllm:cache_config_info``.
    kv_capacity_tokens: int | None
    running: set[str] = field(default_factory=set)
    borrowers: set[str] = field(default_factory=set)
    reserved_by: str | None = None
    reserved_at: float = 0.0
    busy: bool = False
    step: StepResult | None = None
    # ``waiting`` as the gateway's last scrape saw it (None: never scraped, or not modelled).
    scraped_waiting: float | None = None
    # lanes[].pause_reads: the questions in flight that paused requests here, and the requests
    # paused (their slots held), sent again once no such question is in flight.
    pausers: set[str] = field(default_factory=set)
    paused: list[str] = field(default_factory=list)

    def view(self) -> EngineView:
        """The endpoint as the gateway's pool shows it to the chain."""
        return EngineView(
            self.cluster, self.url, EngineState.UP, len(self.running), self.scraped_waiting,
            kv_capacity_tokens=self.kv_capacity_tokens,
        )  # fmt: skip


@dataclass(slots=True)
class _Admitted:
    admitted: float
    cluster: str
    lender: str | None = None
    first_token: float | None = None


@dataclass(eq=False, slots=True)
class _Ticket:
    key: str
    record: TraceRecord
    lane: LaneSettings
    clusters: tuple[str, ...]
    priority: str
    rank: int
    loans: tuple[Loan, ...]
    # The prompt's block keys (PrefixSim, a record with a known prefix), as ints.
    blocks: tuple[int, ...] = ()
    # Prompt tokens the router believed its endpoint had to prefill (PrefixSim), pending on
    # that endpoint until the first token comes back.
    uncached: int = 0
    # Times paused for a cached question (lanes[].pause_reads).
    pauses: int = 0


class FleetSim:
    def __init__(
        self,
        settings: Settings,
        profiles: Mapping[str, EngineProfile],
        count_by: CountBy = "tokens",
        live: LiveCosts | None = None,
        prefix: PrefixSim | None = None,
    ) -> None:
        self.settings = settings
        self.count_by = count_by
        self.live = live or LiveCosts()
        self.prefix = prefix
        self._block = settings.prefix_index.block_tokens
        self._clock = 0.0
        self.index = approximate_index(settings.prefix_index, lambda: self._clock)
        capacity = {c.name: capacity_read(profiles[c.name], c.kind) for c in settings.clusters}
        self.engines: dict[str, list[_Engine]] = {
            c.name: [
                _Engine(c.name, url, self._scheduler(profiles[c.name]), capacity[c.name])
                for url in c.endpoints
            ]
            for c in settings.clusters
        }
        self._max_len = {c.name: profiles[c.name].max_model_len for c in settings.clusters}
        self._queues: dict[str, deque[_Ticket]] = {lane.name: deque() for lane in settings.lanes}
        self._lane_used = dict.fromkeys(self._queues, 0)
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._open: dict[str, _Admitted] = {}
        self._done: list[SimulatedRequest] = []
        self._occupancy: list[tuple[float, str, int]] = []
        self._tickets: dict[str, tuple[_Ticket, _Engine]] = {}
        # cluster -> the lane owning it, for clusters of lanes that lend.
        # Prompt tokens each endpoint has pending to prefill, as the router believes (the
        # gateway's prefill ledger): added at admission, removed at the first token.
        self.pending: dict[str, int] = {}
        # The endpoint URLs the last ``_candidates`` call asked for (the router's order).
        self._asked: frozenset[str] = frozenset()
        self._lender_of = {
            c: lane for lane in settings.lanes if lane.lend is not None for c in lane.clusters
        }
        # Requests paused for a cached question (lanes[].pause_reads), all told.
        self.pauses = 0

    def _scheduler(self, profile: EngineProfile) -> Scheduler:
        limits = profile.scheduler
        if self.prefix is None:
            return Scheduler(limits, profile.costs)
        cache = BlockCache(limits.kv_capacity_tokens // self._block)
        return Scheduler(limits, profile.costs, cache=cache, block_tokens=self._block)

    def _blocks(self, key: str, record: TraceRecord) -> tuple[int, ...]:
        """The prompt's full blocks: the shared prefix's, then the request's own."""
        if self.prefix is None or record.prefix is None or record.prefix_tokens is None:
            return ()
        shared = min(record.prefix_tokens, record.prompt_tokens) // self._block
        total = record.prompt_tokens // self._block
        return tuple(hash((record.prefix, i)) for i in range(shared)) + tuple(
            hash((key, i)) for i in range(total - shared)
        )

    def _routing_count(self, record: TraceRecord) -> int:
        return record.prompt_tokens if self.count_by == "tokens" else record.chars // 4

    def _push(self, at: float, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (at, next(self._seq), kind, payload))

    def run(
        self, trace: Sequence[TraceRecord], progress: Callable[[float], None] | None = None
    ) -> FleetResult:
        admitted = self.live.gateway_times([(r.t, r.prompt_tokens) for r in trace])
        for index, (record, at) in enumerate(zip(trace, admitted, strict=True)):
            self._push(at, "arrive", (f"r{index}", record))
        self._schedule_scrapes()
        clock, handled, total = 0.0, 0, len(trace)
        while self._events:
            clock, _, kind, payload = heapq.heappop(self._events)
            self._clock = clock
            if kind == "arrive":
                key, record = cast(tuple[str, TraceRecord], payload)
                self._arrive(key, record, clock)
                handled += 1
                if progress is not None and handled % 500 == 0:
                    progress(handled / total)
            elif kind == "wake":
                self._admit(cast(str, payload), clock)
            elif kind == "submit":
                self._submit(cast(str, payload), clock)
            elif kind == "release":
                self._release(cast(str, payload), clock)
            elif kind == "scrape":
                self._scrape(cast(str, payload), clock, handled < total)
            else:
                self._step_done(cast(_Engine, payload), clock)
        if progress is not None:
            progress(1.0)
        limits = {lane.name: lane.slots.lane for lane in self.settings.lanes}
        outcomes = tuple(sorted(self._done, key=lambda o: int(o.key[1:])))
        makespan = max((o.finished or o.arrival for o in outcomes), default=0.0)
        return FleetResult(outcomes, tuple(self._occupancy), limits, makespan)

    # -- the live path's costs (fleet_model.LiveCosts) ------------------------------------------

    def _max_wait(self, lane: LaneSettings) -> float:
        """The queue's wait limit is wall time: on the engines' clock it grows as they speed up."""
        return self.live.to_engine(lane.queue.max_wait_s)

    def _schedule_scrapes(self) -> None:
        for lane in self.settings.lanes:
            every = self.live.scrape_every(lane.health.scrape_interval_s)
            if every is not None:
                self._push(0.0, "scrape", lane.name)

    def _scrape(self, lane_name: str, now: float, arrivals_left: bool) -> None:
        """The gateway's load scrape: each of the lane's engines' ``waiting``, as of now."""
        lane = next(lane for lane in self.settings.lanes if lane.name == lane_name)
        for cluster in lane.clusters:
            for engine in self.engines[cluster]:
                engine.scraped_waiting = float(engine.scheduler.snapshot().waiting)
        every = self.live.scrape_every(lane.health.scrape_interval_s)
        if every is not None and (arrivals_left or self._tickets):
            self._push(now + every, "scrape", lane_name)

    def _submit(self, key: str, now: float) -> None:
        """The request reaches its engine, which stamps its arrival now."""
        ticket, engine = self._tickets[key]
        record = ticket.record
        engine.scheduler.add(
            key, record.prompt_tokens, max(1, record.output_tokens), now, ticket.blocks
        )
        pause = ticket.lane.pause_reads
        if pause is not None and ticket.blocks and self._chain():
            self._pause_for(ticket, engine, pause.rule())
        if not engine.busy:
            self._start_step(engine, now)

    def _arrive(self, key: str, record: TraceRecord, now: float) -> None:
        decision = choose_lane(self._routing_count(record), self.settings.lanes, {})
        if decision.lane is None:
            self._reject(key, record, "none", now, "no_lane")
            return
        lane = decision.lane
        queue = self._queues[lane.name]
        classes = self.settings.classes
        priority = self._priority(record)
        loans = loans_for(lane, self.settings.lanes, record.prompt_tokens, record.output_tokens)
        ticket = _Ticket(
            key,
            record,
            lane,
            decision.clusters,
            priority,
            rank(classes, priority),
            loans,
            self._blocks(key, record),
        )
        if queue and (lane.on_full == "reject" or len(queue) >= lane.queue.depth):
            self._reject(key, record, lane.name, now, "lane_full")
            return
        queue.append(ticket)
        self._admit(lane.name, now)
        if ticket in queue and lane.on_full == "reject":
            queue.remove(ticket)
            self._reject(key, record, lane.name, now, "lane_full")

    def _priority(self, record: TraceRecord) -> str:
        """The trace's class for the request, or the policy's default for an unknown one."""
        classes = self.settings.classes
        return record.priority if record.priority in classes.names else classes.default

    def _reject(self, key: str, record: TraceRecord, lane: str, now: float, why: str) -> None:
        self._done.append(
            SimulatedRequest.of(key, record, lane, rejected=why, priority=self._priority(record))
        )

    def _use(self, engine: _Engine) -> EndpointUse:
        owners = len(engine.running) - len(engine.borrowers)
        return EndpointUse(owners, len(engine.borrowers), engine.reserved_by is not None)

    def _candidates(
        self, ticket: _Ticket, now: float, exclude: frozenset[str] = frozenset()
    ) -> list[tuple[_Engine, Loan | None]]:
        """Endpoints with room for the ticket in the router's order: its own lane's, then (mixed
        in by load) the idle endpoints of lanes that lend to it. The chain also sees its own
        lane's full endpoints, as the live chain does (the slot store skips them). ``exclude``:
        endpoints waiters ahead of it hold for (it passes them, ``classes.passing``); the URLs
        it asked for, full or not, are left in ``self._asked``."""
        offers: dict[tuple[str, str], tuple[_Engine, Loan | None]] = {}
        full: set[str] = set()
        sees_full = self._chain()
        for cluster in ticket.clusters:
            for e in self.engines[cluster]:
                owner = self._lender_of.get(cluster)
                rule = owner.lend if owner is not None else None
                mine = e.reserved_by in (None, ticket.key)
                waited = now - e.reserved_at if e.reserved_by == ticket.key else 0.0
                if rule is not None and not (mine and owner_may_enter(rule, self._use(e), waited)):
                    continue
                if self._use(e).owners >= ticket.lane.slots.per_endpoint:
                    if not sees_full:
                        continue
                    full.add(e.url)
                offers[(e.cluster, e.url)] = (e, None)
        for loan in ticket.loans:
            for cluster in loan.clusters:
                for e in self.engines[cluster]:
                    if borrow_room(loan.rule, self._use(e)) > 0 and (
                        (e.cluster, e.url) not in offers or e.url in full
                    ):
                        offers[(e.cluster, e.url)] = (e, loan)
                        full.discard(e.url)
        views = [e.view() for e, _ in offers.values()]
        self.index.learn(views)  # as the live chain's candidates do (gateway/request/endpoints.py)
        ordered = self._order(ticket, views)
        self._asked = frozenset(v.url for v in ordered)
        return [
            offers[(v.cluster, v.url)]
            for v in ordered
            if v.url not in full and v.url not in exclude
        ]

    def _chain(self) -> bool:
        """The router in play is shapegate's chain (the index's or the oracle's): it sees its
        lane's full endpoints, and a lane's ``pause_reads`` applies (the other routers do
        neither)."""
        return self.prefix is not None and self.prefix.router in ("chain", "oracle")

    def _believed(self, ticket: _Ticket) -> dict[str, int]:
        """Blocks of the ticket's prompt each endpoint is believed to hold, by the router in
        play: every engine's real cache for the oracle, the gateway's index otherwise."""
        if self.prefix is not None and self.prefix.router == "oracle":
            cache = {e.url: e.scheduler.cache for c in ticket.clusters for e in self.engines[c]}
            return {url: c.peek(ticket.blocks) for url, c in cache.items() if c is not None}
        return self.index.match(ticket.blocks)

    def _order(self, ticket: _Ticket, views: list[EngineView]) -> list[EngineView]:
        """The endpoint order of the router in play (gateway/tuning/prefix_routers.py)."""
        router = self.prefix.router if self.prefix is not None else "least-loaded"
        if router == "least-loaded" or not ticket.blocks:
            return order_endpoints(views)
        if router == "affinity":
            every = [e.url for c in ticket.clusters for e in self.engines[c]]
            return by_affinity(views, ticket.record.prefix or "", every)
        if router == "cache-aware":
            return cache_aware(views, ticket.blocks, self.index)
        held = self._believed(ticket)
        prompt = ticket.record.prompt_tokens
        return by_chain(views, ticket.lane, prompt, held, self._block, self.index, self.pending)

    def _reserve(self, ticket: _Ticket, now: float) -> None:
        """A lender's own request blocked by borrowers reserves an endpoint and is woken when
        its drain limit runs out (borrowers leaving wake it sooner)."""
        rule = ticket.lane.lend
        if rule is None or any(e.reserved_by == ticket.key for e in self._own(ticket)):
            return
        uses = {e: self._use(e) for e in self._own(ticket) if e.reserved_by is None}
        chosen = to_reserve(uses, ticket.lane.slots.per_endpoint)
        if chosen is not None:
            chosen.reserved_by, chosen.reserved_at = ticket.key, now
            self._push(now + rule.max_drain_s, "wake", ticket.lane.name)

    def _own(self, ticket: _Ticket) -> list[_Engine]:
        return [e for c in ticket.clusters for e in self.engines[c]]

    def _unreserve(self, ticket: _Ticket) -> None:
        for e in self._own(ticket):
            if e.reserved_by == ticket.key:
                e.reserved_by = None

    def _admit(self, lane: str, now: float) -> None:
        queue = self._queues[lane]
        classes = self.settings.classes
        while queue:
            for late in [t for t in queue if now - t.record.t > self._max_wait(t.lane)]:
                queue.remove(late)
                self._unreserve(late)
                self._reject(late.key, late.record, lane, now, "queue_timeout")
            if not queue:
                return
            waiting = [(t.rank, t.record.t) for t in queue]
            ticket = queue[next_waiter(waiting, now, classes.starvation_s)]
            limit = class_lane_limit(classes, ticket.priority, ticket.lane.slots.lane)
            if self._lane_used[lane] >= limit:
                return
            candidates = self._candidates(ticket, now)
            if not candidates:
                self._reserve(ticket, now)
                passed = self._pass(ticket, now)
                if passed is None:
                    return
                ticket, candidates = passed
            queue.remove(ticket)
            self._unreserve(ticket)
            engine, loan = candidates[0]
            record = ticket.record
            if ticket.blocks and self.prefix is not None:
                believed = self._believed(ticket).get(engine.url, 0) * self._block
                ticket.uncached = max(0, record.prompt_tokens - believed)
                self.pending[engine.url] = self.pending.get(engine.url, 0) + ticket.uncached
                self.index.record(ticket.blocks, engine.url)
            if record.prompt_tokens + record.output_tokens > self._max_len[engine.cluster]:
                # The engine answers 400 (context length exceeded), as vLLM does.
                self._reject(ticket.key, record, lane, now, "engine_context_exceeded")
                continue
            engine.running.add(ticket.key)
            if loan is not None:
                engine.borrowers.add(ticket.key)
            self._lane_used[lane] += 1
            self._occupancy.append((now, lane, self._lane_used[lane]))
            lender = loan.lender if loan is not None else None
            self._open[ticket.key] = _Admitted(now, engine.cluster, lender)
            self._tickets[ticket.key] = (ticket, engine)
            self._push(
                now + self.live.to_engine_arrival(record.prompt_tokens), "submit", ticket.key
            )

    def _pass(
        self, head: _Ticket, now: float
    ) -> tuple[_Ticket, list[tuple[_Engine, Loan | None]]] | None:
        """The head found no room: in a lane that holds for homes (``prefix_hold_tokens``, no
        lending), the first waiter behind it (arrival order, at most ``PASS_AHEAD`` places)
        with room outside the endpoints those ahead of it asked for (``classes.passing``),
        as the live admission lets a waiter pass holding ones."""
        lane = head.lane
        if lane.prefix_hold_tokens is None or lane.lend is not None:
            return None
        ahead = [self._asked]
        for ticket in self._queues[lane.name]:
            if ticket is head:
                continue
            exclude = passing(ahead)
            if exclude is None:
                return None
            candidates = self._candidates(ticket, now, exclude)
            if candidates:
                return ticket, candidates
            ahead.append(self._asked)
        return None

    def _start_step(self, engine: _Engine, now: float) -> None:
        step = engine.scheduler.step(now)
        engine.step, engine.busy = step, step is not None
        if step is not None:
            self._push(step.end, "step", engine)

    def _step_done(self, engine: _Engine, now: float) -> None:
        step = engine.step
        assert step is not None
        for key in step.first_tokens:
            self._open[key].first_token = now + self.live.relay()
            ticket, _ = self._tickets[key]
            if ticket.uncached:
                self.pending[engine.url] -= ticket.uncached
        for key in step.finished:
            # In flight until the relay of its last token ends, as the live gateway holds it.
            self._push(now + self.live.relay(), "release", key)
        self._start_step(engine, now)
        for lane in self._queues:
            if self._queues[lane]:
                self._admit(lane, now)

    def _release(self, key: str, now: float) -> None:
        self._finish(key, now)
        for lane in self._queues:
            if self._queues[lane]:
                self._admit(lane, now)

    def _pause_for(self, question: _Ticket, engine: _Engine, rule: PauseRule) -> None:
        """``question`` reached ``engine``: pause the reads the rule names there
        (engine_pool/pause.py), as the live pipeline closes their connections; their slots stay
        held. A question in flight while requests are paused there holds them paused too."""
        asked = Question(question.uncached, question.blocks[0])
        if not is_question(asked, rule):
            return
        # Prefills this step completes have their first token already (the engine would answer
        # them before it saw the connection close).
        stepping = set(engine.step.first_tokens) if engine.step is not None else set()
        in_flight = []
        for key in engine.running:
            if key == question.key or key not in engine.scheduler or key in stepping:
                continue
            ticket, _ = self._tickets[key]
            in_flight.append(
                InFlight(
                    key,
                    ticket.uncached,
                    ticket.blocks[0] if ticket.blocks else None,
                    self._open[key].first_token is not None,
                    ticket.pauses,
                    key in engine.pausers,
                )
            )
        keys = to_pause(asked, in_flight, rule)
        if keys or engine.paused:
            engine.pausers.add(question.key)
        for key in keys:
            engine.scheduler.abort(key)
            self._tickets[key][0].pauses += 1
            engine.paused.append(key)
            self.pauses += 1

    def _resume(self, engine: _Engine, now: float) -> None:
        """No question that paused requests on ``engine`` is in flight: send them again."""
        for key in engine.paused:
            # Sent again as it was: the HTTP hop, not the count (done once, at admission).
            self._push(now + self.live.to_engine(self.live.forward_s), "submit", key)
        engine.paused.clear()

    def _finish(self, key: str, now: float) -> None:
        ticket, engine = self._tickets.pop(key)
        if key in engine.pausers:
            engine.pausers.discard(key)
            if not engine.pausers:
                self._resume(engine, now)
        engine.running.discard(key)
        engine.borrowers.discard(key)
        lane = ticket.lane.name
        self._lane_used[lane] -= 1
        self._occupancy.append((now, lane, self._lane_used[lane]))
        info = self._open.pop(key)
        record = ticket.record
        self._done.append(
            SimulatedRequest.of(
                key,
                record,
                lane,
                cluster=info.cluster,
                admitted=info.admitted,
                first_token=info.first_token if info.first_token is not None else now,
                finished=now,
                lender=info.lender,
                priority=ticket.priority,
                cached_tokens=engine.scheduler.hits.pop(key, 0),
                pauses=ticket.pauses,
            )
        )
