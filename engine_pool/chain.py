"""Endpoint choice as a small chain: filters, then weighted scorers, then an order. Pure.

    rank(views, ask, weights) -> list[Ranked]      best first, each with its score and the
                                                   prefix tokens it is believed to hold

1. Filters drop the endpoints that cannot take the request at all: not routable
   (``scorers/routable.py``), or a context too small for the prompt plus one output token
   (``scorers/fits_context.py``).
2. Each scorer gives every remaining endpoint a score in [0, 1], higher is better:
   ``load`` (``scorers/load.py``: the share of the endpoint's slot limit still free) and
   ``prefix`` (``scorers/prefix.py``: the share of the prompt the endpoint is believed to hold
   cached, from ``engine_pool/prefix_index.py``).
3. An endpoint's score is the weighted sum, the weights being the lane's (``lanes[].weights``).
   Ties go to the fewest in flight, then the fewest blocks held in the prefix index, then the
   fewest waiting in the engine's own queue, then the URL, so with no prefix in play the order
   is plain least-loaded.
4. A prompt no endpoint holds any of, with the prefix weighed, makes a new home: the endpoint
   holding the fewest blocks in the index among those within ``new_home_slack`` (the lane's
   ``new_home_slack``, default ``NEW_HOME_SLACK``, 0.5) of the least used share of slots goes
   first (homes spread by what they hold, as SGLang Model Gateway's cache_aware places a new
   prefix on its smallest tree, but never on a busy one). With a slack of 0 the home is the
   least used endpoint, the fewest blocks breaking ties: in a lane of few slots and long
   prefills, a new document read on an endpoint serving its own cached questions holds their
   next ones (an engine gives a running prefill its step's budget first) for the whole read.
   A prompt held only on full endpoints (``_spill``) makes a second home the same way: the
   endpoints holding none of it are ordered as a new home is, after the full ones (as
   cache_aware, which does not see a full endpoint, places it on its smallest tree).

5. With the lane's ``prefix_hold_tokens`` set, a request waits for a full endpoint holding part
   of its prompt rather than take one with room whose prefill ahead of its first token (the
   prefills pending there, ``Ask.pending``, plus its own uncached part), plus the prefix it
   would prefill a second time, is more than that many tokens larger than the home's: those
   endpoints are dropped (``_hold``), so it waits in its lane's queue.

The slot store takes the first endpoint of this order with room and never re-sorts it
(gateway/request/admission.py). How overlap and load are weighed: with both weights 1, a
request whose prompt is 80% cached on endpoint A stays on A until A's used share of its slots
is 0.8 above another endpoint's (A at 7 of 8 slots, B at 0 of 8 moves it); a full endpoint is
skipped by the store whatever its score. README "Prefix-cache-aware routing" says the same.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from engine_pool.cluster import EngineView
from engine_pool.scorers import fits_context, load, prefix, routable, work
from engine_pool.scorers.ask import Ask

Filter = Callable[[EngineView, Ask], bool]
Scorer = Callable[[Sequence[EngineView], Ask], list[float]]

FILTERS: tuple[Filter, ...] = (routable.keep, fits_context.keep)
SCORERS: dict[str, Scorer] = {"load": load.score, "prefix": prefix.score, "work": work.score}
LEAST_LOADED: dict[str, float] = {"load": 1.0}
# A new prefix's home: among endpoints at most this much busier (share of slots) than the least.
NEW_HOME_SLACK = 0.5

__all__ = ["Ask", "Ranked", "rank"]


class Ranked(NamedTuple):
    """One endpoint in the chain's order (a named tuple: one is made per endpoint per request)."""

    view: EngineView
    score: float
    cached_tokens: int


def rank(
    views: Sequence[EngineView],
    ask: Ask,
    weights: Mapping[str, float] = LEAST_LOADED,
    hold_tokens: int | None = None,
    new_home_slack: float = NEW_HOME_SLACK,
) -> list[Ranked]:
    # Run by the active path and by a shadow policy on every request: plain loops, no copies.
    kept: Sequence[EngineView] = views
    for keep in FILTERS:  # each filter over what the ones before it kept
        kept = [v for v in kept if keep(v, ask)]
    totals: list[float] | None = None
    for name, weight in weights.items():
        if weight:
            scores = SCORERS[name](kept, ask)
            if totals is None:
                totals = [weight * s for s in scores]
            else:
                totals = [t + weight * s for t, s in zip(totals, scores, strict=True)]
    if totals is None:
        totals = [0.0] * len(kept)
    cached = ask.cached
    ranked = [
        Ranked(v, round(t, 6), cached.get(v.url, 0)) for v, t in zip(kept, totals, strict=True)
    ]
    held = ask.held
    if len(ranked) > 1:
        ranked.sort(
            key=lambda r: (
                -r.score,
                r.view.in_flight,
                held.get(r.view.url, 0),
                r.view.waiting or 0.0,
                r.view.url,
            )
        )
    if weights.get("prefix") and held:
        if not any(r.cached_tokens for r in ranked):
            return _new_home(ranked, ask, new_home_slack)
        ranked = _spill(ranked, ask, new_home_slack)
    if hold_tokens is not None:
        return _hold(ranked, ask, hold_tokens)
    return ranked


def _hold(ranked: list[Ranked], ask: Ask, hold_tokens: int) -> list[Ranked]:
    """Wait for a full endpoint holding part of the prompt rather than take one with room whose
    prefill ahead of the first token (``Ask.work``: its pending prefills plus this request's
    uncached part), plus the prefix it would prefill a second time (what the full home holds
    and it does not), is more than ``hold_tokens`` above the home's work: those endpoints are
    dropped, so the slot store finds none free and the request waits in its lane's queue for
    the full one. The second prefill is charged twice because the fleet pays it twice: an engine
    re-reading a 250k-token document the home holds (or is reading now) takes that engine from
    every request behind, and the copy crowds its cache. A home busy prefilling other prompts
    has that work counted, so one that will not free sooner than a copy would is not waited
    for."""
    if ask.limit_of is None:
        return ranked
    limit_of = ask.limit_of
    full = [r for r in ranked if r.cached_tokens and r.view.in_flight >= limit_of(r.view)]
    if not full:
        return ranked
    home = min(full, key=lambda r: ask.work(r.view))
    floor = ask.work(home.view) + hold_tokens
    kept = {r.view.url for r in full}
    return [
        r
        for r in ranked
        if r.view.url in kept
        or ask.work(r.view) + max(0, home.cached_tokens - r.cached_tokens) <= floor
    ]


def _spill(ranked: list[Ranked], ask: Ask, slack: float) -> list[Ranked]:
    """Every endpoint holding part of the prompt is full: the request will make a second home,
    so the others are ordered as a new home is (``_new_home``: the fewest blocks held among
    those within ``slack`` of the least used), after the full ones (the slot store skips them;
    ``_hold`` may still keep the request waiting for one)."""
    limit_of = ask.limit_of
    if limit_of is None:
        return ranked
    homes = [r for r in ranked if r.cached_tokens]
    if any(r.view.in_flight < limit_of(r.view) for r in homes):
        return ranked
    rest = [r for r in ranked if not r.cached_tokens]
    if len(rest) < 2:
        return ranked
    return [*homes, *_new_home(rest, ask, slack)]


def _new_home(ranked: list[Ranked], ask: Ask, slack: float) -> list[Ranked]:
    """A prefix held nowhere makes a new home: the endpoint holding the fewest blocks among
    those within ``slack`` of the least used share of slots goes first, so homes
    spread by what they hold (the work their prefixes bring) without one going to a busy
    endpoint; the rest keep the chain's order."""
    free = load.score([r.view for r in ranked], ask)
    best = max(free, default=0.0)
    eligible = [r for r, f in zip(ranked, free, strict=True) if f >= best - slack]
    if not eligible:
        return ranked
    home = min(eligible, key=lambda r: ask.held.get(r.view.url, 0))
    return [home, *(r for r in ranked if r is not home)]
