"""A candidate policy deciding beside the active one: pure decisions and their report.

    ShadowPolicy.of(settings, version)            a validated policy, ready to decide
    decide(policy, seen) -> ShadowDecision        what it would do with one live request
    decide_now(policy, ...) -> ShadowDecision | None
                                                  the same decision, the common case only:
                                                  None where ``decide`` must run
    ShadowReport.add(active_lane, decision, ...)  the report, one request at a time
    merge_reports(reports) -> dict                several workers' or replicas' reports as one

Contract:
- ``Seen`` is what the active decision saw, as plain data: the same count (the exact prompt
  count when the gateway has it, else the figure the active lane was decided by), the same
  health map and the same snapshot of the endpoints (state, in-flight, waiting, context), the
  request's output budget, class header and API key digest. ``decide`` runs the same pure
  functions the pipeline runs on it (``request/lanes.py`` ``lane_tokens``/``choose_lane``,
  ``request/classes.py`` ``class_of``, ``engine_pool/capability.py`` ``holding``/``refusal``,
  ``engine_pool/chain.py`` ``rank`` (the lane's weights, the prefix index as the request saw
  it), ``request/borrowing.py`` ``loans_for``/
  ``borrow_room``) and returns the lane, the reason, the class, the endpoint the chain would
  pick (the first ordered endpoint with room in the snapshot), the lane it would borrow from,
  and why it would reject the request (``unknown_model``, ``prompt_too_long``,
  ``no_healthy_cluster``, ``context_too_small``, ``unknown_class``, ``overloaded``:
  ``on_full: reject`` and no room).
- ``decide_now`` is ``decide`` for a single prompt whose lane's clusters are all healthy and
  whose lane's chain is plain least-loaded (its weights neither prefix nor work, finite, no
  hold) over a snapshot with no NaN figure, when the answer needs no loan: with one slot limit
  for every endpoint of a cluster (the lane's), the chain's load score falls as the in-flight
  count grows, so its order (score, in-flight, held blocks: none without a prefix, engine
  queue, URL, first on a tie) is (in-flight, engine queue, URL), and the first endpoint of that
  order with room is the least of those with room: one pass over the endpoints, no ``Ask``, no
  ranking, no sort. It reads the endpoints of the lane's serving clusters only (``views_of``).
  Anywhere else it answers None (the caller runs ``decide``); where it answers, its answer is
  ``decide``'s (tests/gateway/request/test_shadow.py compares them on random snapshots).
- Room is read from the snapshot's gateway in-flight counts against the shadow's endpoint
  limits (slow start included): the shadow holds no slot, so its view of a lane's room is the
  endpoints' load, not the slot store's leases (a lane limit below the sum of its endpoints'
  is therefore not seen). A request with no room anywhere would wait (``endpoint`` None);
  it would borrow when its lane has no room and a lender's endpoint runs none of the lender's
  own requests (the snapshot counts every request as the lender's: borrowing is then seen
  only on an idle lender endpoint, never overstated).
- ``ShadowReport`` counts what the two policies did: requests compared, agreement by lane,
  disagreements by (active lane, shadow lane) with the range of prompt tokens, what the shadow
  would reject (by reason) and borrow (by lender), the endpoints it would pick, and the live
  window's trace (shapes only, ``observe/trace.py`` ``TraceRecord``; arrival in wall seconds, at
  most ``window`` requests) that ``tuning/shadow_effect.py`` replays under both policies.
- ``merge_reports`` adds the counts, widens the ranges and joins the windows in time order; it
  is how ``GET /admin/shadow`` answers for several workers (``edge/peers.py``) or replicas.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from engine_pool.capability import holding, refusal
from engine_pool.chain import Ask, rank
from engine_pool.cluster import EngineState, EngineView
from engine_pool.outlier import ramped_limit
from engine_pool.picker import order_endpoints
from gateway.core.decision import Reason
from gateway.observe.trace import TraceRecord
from gateway.request.borrowing import EndpointUse, borrow_room, loans_for
from gateway.request.classes import UnknownClass, class_of
from gateway.request.lanes import (
    choose_lane,
    choose_named_lane,
    endpoint_limit,
    exact_count_above,
    lane_tokens,
)
from gateway.request.prefix import NOTHING
from gateway.request.prefix import Seen as PrefixSeen
from gateway.settings import LaneSettings, Settings, served_models

_DOWN = EngineState.DOWN  # not routable (a module name: an enum class's lookup is ~70 ns)
WINDOW = 10_000  # requests of the live window kept for the predicted effect
PICKS_MAX = 4096  # ``ShadowPolicy.picks``: lanes x classes x endpoints, emptied past this
Shape = tuple[float, str, int, int, int, bool, str | None]
SHAPE_FIELDS = (
    "t",
    "model",
    "prompt_tokens",
    "prompt_bytes",
    "output_tokens",
    "stream",
    "priority",
)


@dataclass(frozen=True, slots=True)
class _LanePlan:
    """What ``decide`` reads of one shadow lane on every request, computed once: its chain
    weights, whether it looks at the prompt's prefix or pending prefill, and per cluster the
    endpoint slot limit with the chain's ``Ask`` for a request the lane does not look at the
    prefix of (the same for every such request: no prefix, no pending prefill). Every
    configured cluster has one: a lane routes only to configured clusters (settings)."""

    weights: Mapping[str, float]
    weighs: bool
    clusters: Mapping[str, tuple[int, Ask]]
    # Plain least-loaded (``decide_now`` decides for it): not ``weighs``, a finite load weight.
    least_loaded: bool = False

    @classmethod
    def of(
        cls, lane: LaneSettings, lanes: Sequence[LaneSettings], clusters: Sequence[str]
    ) -> _LanePlan:
        weighs = bool(lane.weights.prefix or lane.weights.work) or (
            lane.prefix_hold_tokens is not None
        )
        plain = {}
        for c in clusters:
            limit = endpoint_limit(lanes, lane, c)
            plain[c] = (
                limit,
                Ask(
                    tokens=NOTHING.tokens,
                    cached=NOTHING.cached,
                    held=NOTHING.held,
                    limit_of=_fixed(limit),
                ),
            )
        least_loaded = not weighs and math.isfinite(lane.weights.load)
        return cls(lane.weights.as_map(), weighs, plain, least_loaded)


@dataclass(frozen=True, slots=True)
class ShadowPolicy:
    """A validated candidate policy and what deciding with it needs, computed once."""

    settings: Settings
    version: int
    served: Mapping[str, frozenset[str]]
    # Every name and alias -> the model's name; whether a lane weighs prefix overlap or prefill
    # work, or holds for a home (then the live request's prefix is looked up in the index for
    # it, as ``Prefixes.look_for`` does for an active lane).
    model_names: Mapping[str, str] = field(default_factory=dict)
    weighs_prefix: bool = False
    clusters: tuple[str, ...] = ()
    # Below this figure a free bound fixes the shadow's decision as an exact count would
    # (``request/pipeline.py`` ``Policy.exact_above``, for this policy).
    exact_above: int = 0
    # Its priority classes are the active policy's: the active class is the shadow's too.
    classes_as_active: bool = False
    started_at: float = field(default_factory=time.time)
    # Each lane's plan, by name (``_LanePlan``).
    plans: Mapping[str, _LanePlan] = field(default_factory=dict)
    # For ``decide_now``: the top lane's ceiling (``lane_tokens``), each lane's range with it and
    # its plan in policy order (``lane_for``), and whether any lane lends.
    top: int = 0
    ranges: tuple[tuple[int, int, LaneSettings, _LanePlan], ...] = ()
    lends: bool = False
    # ``decide_now``'s picks made so far, by (lane, class, endpoint): one decision object for
    # each (making a named tuple costs several lookups of one). At most ``PICKS_MAX``.
    picks: dict[tuple[str, str, str], ShadowDecision] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def of(cls, settings: Settings, version: int, active: Settings | None = None) -> ShadowPolicy:
        lanes = settings.lanes
        clusters = tuple(c.name for c in settings.clusters)
        plans = {lane.name: _LanePlan.of(lane, lanes, clusters) for lane in lanes}
        return cls(
            settings,
            version,
            {c: frozenset(served_models(settings, c)) for c in clusters},
            {
                name: model.name
                for model in settings.models
                for name in (model.name, *model.aliases)
            },
            any(plan.weighs for plan in plans.values()),
            clusters,
            min(
                [
                    exact_count_above(lanes),
                    *(lane.lend.max_prompt_tokens for lane in lanes if lane.lend is not None),
                ]
            ),
            active is not None and active.classes == settings.classes,
            plans=plans,
            top=max(lane.max_prompt_tokens for lane in lanes),
            ranges=tuple(
                (lane.min_prompt_tokens, lane.max_prompt_tokens, lane, plans[lane.name])
                for lane in lanes
            ),
            lends=any(lane.lend is not None for lane in lanes),
        )


class Seen(NamedTuple):
    """One live request as the active decision saw it (no text: the prefix keys are hashes).
    A named tuple, not a frozen dataclass: one is made for every live request."""

    tokens: int  # the exact count when known, else the figure the active lane was decided by
    longest: int  # a batch's largest prompt (``tokens`` for a single one)
    exact: bool
    model: str  # as the request named it (a name or an alias)
    max_tokens: int | None
    multipart: bool
    healthy: Mapping[str, bool]
    views: Mapping[str, Sequence[EngineView]]  # cluster -> its endpoints, at decision time
    key_digest: str | None = None
    class_header: str | None = None
    # The prompt's prefix as the live index knew it at the decision (gateway/request/prefix.py),
    # for a shadow lane that weighs prefix overlap.
    prefix: PrefixSeen = NOTHING
    # The class ``class_of`` gave the active decision, when the shadow's classes are the active
    # ones (the same function of the same inputs: taken, not computed again).
    priority: str | None = None
    # The prefill each endpoint had pending at the decision (engine_pool/prefill_ledger.py), for
    # a shadow lane that weighs work or holds for a home.
    pending: Mapping[str, int] = {}


class ShadowDecision(NamedTuple):
    lane: str  # "none": no lane takes it
    reason: Reason
    priority: str | None
    endpoint: str | None  # the endpoint the chain would pick; None: it would wait, or reject
    lender: str | None  # the lane whose idle engine it would borrow
    rejected: str | None  # why the shadow would refuse it

    @property
    def verdict(self) -> str:
        """Reject, borrow, pick or wait, in one word (log field)."""
        if self.rejected is not None:
            return "reject"
        if self.lender is not None:
            return "borrow"
        return "pick" if self.endpoint is not None else "wait"


def decide(policy: ShadowPolicy, seen: Seen) -> ShadowDecision:
    settings = policy.settings
    lanes = settings.lanes
    if seen.multipart:
        decision = choose_named_lane(settings.multipart_lane, lanes, seen.healthy)
    else:
        decision = choose_lane(lane_tokens(seen.tokens, seen.longest, lanes), lanes, seen.healthy)
    lane, reason = decision.lane, decision.reason
    name = decision.lane_name
    model = policy.model_names.get(seen.model)  # by name or alias, as the shadow names it
    if model is None:
        return ShadowDecision(name, reason, None, None, None, "unknown_model")
    if lane is None:
        return ShadowDecision(name, reason, None, None, None, "prompt_too_long")
    if not decision.clusters:
        return ShadowDecision(name, reason, None, None, None, "no_healthy_cluster")
    priority = seen.priority
    if priority is None:
        try:
            priority = class_of(settings.classes, seen.key_digest, seen.class_header)
        except UnknownClass:
            return ShadowDecision(name, reason, None, None, None, "unknown_class")
    served, views_of = policy.served, seen.views
    serving = [(c, views_of.get(c, ())) for c in decision.clusters if model in served.get(c, ())]
    need = seen.longest + 1
    every = serving[0][1] if len(serving) == 1 else [v for _, vs in serving for v in vs]
    if refusal(every, need) is not None:
        return ShadowDecision(name, reason, priority, None, None, "context_too_small")
    plan = policy.plans[name]
    for cluster, views in serving:
        limit, ask = plan.clusters[cluster]
        if plan.weighs:  # the prefix as the live index knew it, the prefill pending then
            prefix = seen.prefix
            ask = Ask(
                tokens=prefix.tokens,
                cached=prefix.cached,
                held=prefix.held,
                limit_of=ask.limit_of,
                pending=seen.pending,
            )
        # With the lane's hold, an endpoint with room that would prefill more than the full
        # home is dropped: the request would wait, as the active chain's does. Room is the
        # endpoint's in-flight count under its (slow-start) limit.
        for ranked in rank(
            holding(views, need), ask, plan.weights, lane.prefix_hold_tokens, lane.new_home_slack
        ):
            view = ranked.view
            if view.in_flight < ramped_limit(limit, view.ramp):
                return ShadowDecision(name, reason, priority, view.url, None, None)
    lender = _lender(policy, lane, seen, model) if reason == "in_range" else None
    if lender is not None:
        return ShadowDecision(name, reason, priority, lender[1], lender[0], None)
    rejected = "overloaded" if lane.on_full == "reject" else None
    return ShadowDecision(name, reason, priority, None, None, rejected)


def decide_now(
    policy: ShadowPolicy,
    tokens: int,
    longest: int,
    model_name: str,
    healthy: Mapping[str, bool],
    views_of: Callable[[str], Sequence[EngineView]],
    priority: str | None,
) -> ShadowDecision | None:
    """``decide(policy, Seen(tokens, longest, ..., multipart=False, ...))`` where the common
    case allows (module docstring), None elsewhere. ``views_of(cluster)``: its endpoints;
    ``priority``: the request's class (``class_for``), None when its inputs name no class."""
    # ``lane_tokens`` and ``lane_for``, from the ranges kept at ``ShadowPolicy.of``.
    top = policy.top
    figure = tokens if longest >= top or tokens < top else top - 1
    for low, high, lane, plan in policy.ranges:  # noqa: B007 - read after the loop
        if low <= figure < high:
            break
    else:
        missing = policy.model_names.get(model_name) is None
        return ShadowDecision(
            "none", "no_lane", None, None, None, "unknown_model" if missing else "prompt_too_long"
        )
    clusters = lane.clusters
    for c in clusters:  # ``_serving``: every primary healthy, or ``decide`` runs
        if not healthy.get(c, True):
            return None
    if not plan.least_loaded:
        return None
    model = policy.model_names.get(model_name)
    if model is None:
        return ShadowDecision(lane.name, "in_range", None, None, None, "unknown_model")
    if not clusters:
        return ShadowDecision(lane.name, "in_range", None, None, None, "no_healthy_cluster")
    if priority is None:
        return ShadowDecision(lane.name, "in_range", None, None, None, "unknown_class")
    return _least_loaded(policy, lane, plan, model, longest + 1, views_of, priority)


def class_for(
    policy: ShadowPolicy, key_digest: str | None, class_header: str | None, priority: str | None
) -> str | None:
    """The class ``decide`` gives a request (``priority``: the active one's, when the classes
    are the same), None where ``class_of`` refuses its inputs (``unknown_class``)."""
    if priority is not None:
        return priority
    try:
        return class_of(policy.settings.classes, key_digest, class_header)
    except UnknownClass:
        return None


def _least_loaded(
    policy: ShadowPolicy,
    lane: LaneSettings,
    plan: _LanePlan,
    model: str,
    need: int,
    views_of: Callable[[str], Sequence[EngineView]],
    priority: str,
) -> ShadowDecision | None:
    """``decide_now``'s endpoint: one pass over the serving clusters' endpoints, in order. The
    first cluster with an endpoint with room answers (one with room holds the prompt: no
    refusal); with none, ``refusal``: some endpoint is routable and none routable holds it."""
    served, limits = policy.served, plan.clusters
    routable = holder = False
    for cluster in lane.clusters:
        if model not in served.get(cluster, ()):
            continue
        limit = limits[cluster][0]
        room = limit if limit > 1 else 1  # ``ramped_limit`` at a full ramp
        best: EngineView | None = None
        best_in, best_waiting, best_url = 0, 0.0, ""
        for v in views_of(cluster):
            if v.state is _DOWN:  # ``EngineState.routable``
                continue
            routable = True
            context = v.context_tokens
            if context is not None and need > context:
                continue
            holder = True
            waiting = v.waiting or 0.0
            if waiting != waiting:  # noqa: PLR0124 - NaN: the chain's sort has no order to match
                return None
            ramp = v.ramp
            if ramp >= 1.0:
                if v.in_flight >= room:
                    continue
            elif ramp != ramp:  # noqa: PLR0124 - NaN
                return None
            elif v.in_flight >= ramped_limit(limit, ramp):
                continue
            in_flight, url = v.in_flight, v.url
            if (
                best is None
                or in_flight < best_in
                or (
                    in_flight == best_in
                    and (waiting < best_waiting or (waiting == best_waiting and url < best_url))
                )
            ):
                best, best_in, best_waiting, best_url = v, in_flight, waiting, url
        if best is not None:
            picks = policy.picks
            key = (lane.name, priority, best_url)
            found = picks.get(key)
            if found is None:
                if len(picks) >= PICKS_MAX:
                    picks.clear()
                found = ShadowDecision(lane.name, "in_range", priority, best_url, None, None)
                picks[key] = found
            return found
    if routable and not holder:
        return ShadowDecision(lane.name, "in_range", priority, None, None, "context_too_small")
    if policy.lends:  # ``_lender``: ``decide`` looks for one
        return None
    rejected = "overloaded" if lane.on_full == "reject" else None
    return ShadowDecision(lane.name, "in_range", priority, None, None, rejected)


def _fixed(limit: int) -> Callable[[EngineView], int]:
    """Every endpoint's slot limit is the cluster's, for the lane (the chain's load scorer)."""
    return lambda view: limit


def _lender(
    policy: ShadowPolicy, lane: LaneSettings, seen: Seen, model: str
) -> tuple[str, str] | None:
    """The first lender endpoint that would take this request, as (lender, url)."""
    for loan in loans_for(lane, policy.settings.lanes, seen.tokens, seen.max_tokens):
        for cluster in loan.clusters:
            if model not in policy.served.get(cluster, ()):
                continue
            for view in order_endpoints(seen.views.get(cluster, ())):
                if borrow_room(loan.rule, EndpointUse(owners=view.in_flight, borrowers=0)) > 0:
                    return loan.lender, view.url
    return None


@dataclass(slots=True)
class _Range:
    requests: int = 0
    min_tokens: int | None = None
    max_tokens: int | None = None

    def add(self, tokens: Sequence[int]) -> None:
        low, high = min(tokens), max(tokens)
        self.requests += len(tokens)
        self.min_tokens = low if self.min_tokens is None else min(self.min_tokens, low)
        self.max_tokens = high if self.max_tokens is None else max(self.max_tokens, high)


class ShadowReport:
    """What the shadow would have done with the live traffic since it started."""

    def __init__(self, window: int = WINDOW) -> None:
        self.compared = 0
        self.by_bound = 0  # decided from a bound (the exact count never came)
        self.agreed: dict[str, int] = {}
        self.disagreed: dict[tuple[str, str], _Range] = {}
        self.rejected: dict[str, int] = {}
        self.borrowed: dict[str, int] = {}
        self.endpoints: dict[str, int] = {}
        # (t, model, prompt_tokens, prompt_bytes, output_tokens, stream, priority): a
        # ``TraceRecord``'s fields, made into records only when the report is read.
        self.trace: deque[Shape] = deque(maxlen=window)

    def add(
        self,
        active_lane: str,
        decision: ShadowDecision,
        tokens: int,
        exact: bool,
        shape: Shape | None,
    ) -> None:
        self.add_alike(active_lane, decision, [tokens], exact)
        if shape is not None:
            self.trace.append(shape)

    def add_alike(
        self, active_lane: str, decision: ShadowDecision, tokens: Sequence[int], exact: bool
    ) -> None:
        """Requests of one active lane the shadow decided alike (``tokens``: each one's prompt
        tokens), counted at once (``request/shadow_live.py`` adds a batch this way); their
        shapes go to ``trace`` directly."""
        n = len(tokens)
        self.compared += n
        if not exact:
            self.by_bound += n
        if decision.lane == active_lane:
            self.agreed[active_lane] = self.agreed.get(active_lane, 0) + n
        else:
            self.disagreed.setdefault((active_lane, decision.lane), _Range()).add(tokens)
        if decision.rejected is not None:
            self.rejected[decision.rejected] = self.rejected.get(decision.rejected, 0) + n
        if decision.lender is not None:
            self.borrowed[decision.lender] = self.borrowed.get(decision.lender, 0) + n
        if decision.endpoint is not None:
            self.endpoints[decision.endpoint] = self.endpoints.get(decision.endpoint, 0) + n

    def as_json(self, window: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "compared": self.compared,
            "by_bound": self.by_bound,
            "agreed": sum(self.agreed.values()),
            "agreed_by_lane": dict(self.agreed),
            "disagreements": [
                {"active": a, "shadow": s, **asdict(r)}
                for (a, s), r in sorted(self.disagreed.items())
            ],
            "would_reject": dict(self.rejected),
            "would_borrow": dict(self.borrowed),
            "endpoints": dict(self.endpoints),
        }
        if window:
            out["window"] = [dict(zip(SHAPE_FIELDS, shape, strict=True)) for shape in self.trace]
        return out


def merge_reports(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Several reports (``ShadowReport.as_json``) as one: counts added, ranges widened, the
    windows joined in time order."""

    def add_up(key: str) -> dict[str, int]:
        total: dict[str, int] = {}
        for report in reports:
            for name, n in report.get(key, {}).items():
                total[name] = total.get(name, 0) + n
        return total

    ranges: dict[tuple[str, str], _Range] = {}
    for report in reports:
        for row in report.get("disagreements", ()):
            found = ranges.setdefault((row["active"], row["shadow"]), _Range())
            found.requests += row["requests"]
            for pick, key in ((min, "min_tokens"), (max, "max_tokens")):
                mine, theirs = getattr(found, key), row[key]
                setattr(found, key, theirs if mine is None else pick(mine, theirs))
    window = sorted(
        (row for report in reports for row in report.get("window", ())), key=lambda r: r["t"]
    )
    return {
        "compared": sum(r.get("compared", 0) for r in reports),
        "by_bound": sum(r.get("by_bound", 0) for r in reports),
        "agreed": sum(r.get("agreed", 0) for r in reports),
        "agreed_by_lane": add_up("agreed_by_lane"),
        "disagreements": [
            {"active": a, "shadow": s, **asdict(r)} for (a, s), r in sorted(ranges.items())
        ],
        "would_reject": add_up("would_reject"),
        "would_borrow": add_up("would_borrow"),
        "endpoints": add_up("endpoints"),
        "window": window,
    }


def window_trace(rows: Sequence[Mapping[str, Any]]) -> list[TraceRecord]:
    """A report's window as a trace starting at 0 (arrival times were wall seconds)."""
    if not rows:
        return []
    origin = min(row["t"] for row in rows)
    return sorted(
        (TraceRecord(**{**row, "t": round(row["t"] - origin, 3)}) for row in rows),
        key=lambda r: r.t,
    )
