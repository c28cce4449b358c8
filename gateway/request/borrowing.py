"""Borrowing between lanes: pure rules over plain data, shared by the live gateway
(gateway/request/admission.py) and the what-if replay (gateway/tuning/fleet_sim.py).

A lane whose policy says ``lend: {to: [fast], ...}`` lends its endpoints' idle capacity to the
lanes named there. The rules, each one function below:

- ``loans_for(lane, lanes, prompt_tokens, max_tokens)``: the lenders a request of ``lane`` may
  borrow from. Only short requests borrow: a prompt below the lender's ``max_prompt_tokens``
  and a declared ``max_tokens`` within its ``max_tokens`` (no ``max_tokens``: no loan, the
  budget would be unbounded). The settings refuse a lane lending to a lane of longer prompts,
  so a monster never enters a fast engine.
- ``borrow_room(rule, use)``: how many more borrowers an endpoint takes: none while a request
  of the lender's own lane runs there or is reserved to wait for it; otherwise up to the rule's
  ``per_endpoint``.
- ``owner_may_enter(rule, use, waited_s)``: the lender's own request enters an endpoint only
  once its borrowers have drained, or after waiting ``max_drain_s`` (then beside them: the
  engine queues it behind them, and the wait is bounded whatever a borrower does).
- ``to_reserve(uses)``: the lender's queue head that could enter nowhere because borrowers hold
  the endpoints reserves the one with the fewest borrowers; no new borrower enters it.
- ``merge_loans(own, lent)``: where the lent endpoints go among a request's own, which stay in
  the endpoint chain's order: each before the first own endpoint with more requests in flight.

Borrowing is decided when a slot is granted, never earlier: a borrower waits in its own lane's
queue, so one that is still queued when the lender reserves the endpoint simply is no longer
offered it (it stays in, or is granted from, its own lane's queue).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from engine_pool.cluster import EngineView
from gateway.core.slots import Limit
from gateway.settings import LaneSettings, LendSettings

K = TypeVar("K", bound=Hashable)
# An endpoint the store may take: its view, its slot limit, and the lender when it is lent.
Offer = tuple[EngineView, Limit, str | None]


@dataclass(frozen=True, slots=True)
class Loan:
    """A lane that would lend to a request: its name, its clusters, its rule."""

    lender: str
    clusters: tuple[str, ...]
    rule: LendSettings


@dataclass(frozen=True, slots=True)
class EndpointUse:
    """One endpoint of a lending lane as the rules see it."""

    owners: int  # requests that are not borrowers (the lender's own) holding it
    borrowers: int
    reserved: bool = False  # a request of the lender's lane waits for this endpoint


def short_enough(rule: LendSettings, prompt_tokens: int, max_tokens: int | None) -> bool:
    return (
        max_tokens is not None
        and prompt_tokens < rule.max_prompt_tokens
        and max_tokens <= rule.max_tokens
    )


def loans_for(
    lane: LaneSettings,
    lanes: Sequence[LaneSettings],
    prompt_tokens: int,
    max_tokens: int | None,
) -> tuple[Loan, ...]:
    """The lenders a request of ``lane`` may borrow from, in policy order."""
    return tuple(
        Loan(other.name, other.clusters, other.lend)
        for other in lanes
        if other.lend is not None
        and lane.name in other.lend.to
        and short_enough(other.lend, prompt_tokens, max_tokens)
    )


def borrow_room(rule: LendSettings, use: EndpointUse) -> int:
    if use.owners > 0 or use.reserved:
        return 0
    return max(0, rule.per_endpoint - use.borrowers)


def owner_may_enter(rule: LendSettings, use: EndpointUse, waited_s: float) -> bool:
    return use.borrowers == 0 or waited_s >= rule.max_drain_s


def to_reserve(uses: Mapping[K, EndpointUse], owner_limit: int) -> K | None:
    """The endpoint a blocked owner waits for: of those with borrowers and room for one more
    owner, the one with the fewest borrowers (first in order on a tie); None when no endpoint
    is held up by borrowers (then reserving would only stop lending for nothing)."""
    blocked = [
        (use.borrowers, index, key)
        for index, (key, use) in enumerate(uses.items())
        if use.borrowers > 0 and use.owners < owner_limit
    ]
    return min(blocked)[2] if blocked else None


def merge_loans(own: Sequence[Offer], lent: Sequence[Offer]) -> list[Offer]:
    """The own endpoints in the chain's order, exactly as given (engine_pool/chain.py ranked
    them: load and prefix overlap; never re-sorted here), with each lent endpoint placed
    before the first own endpoint that has more requests in flight (an idle lender's engine is
    tried before a busy own one; own first on a tie)."""
    out: list[Offer] = []
    waiting = sorted(lent, key=lambda offer: offer[0].in_flight)
    for offer in own:
        while waiting and waiting[0][0].in_flight < offer[0].in_flight:
            out.append(waiting.pop(0))
        out.append(offer)
    return out + waiting


def explain(lane: LaneSettings) -> list[str]:
    """The lane's lending rule in words (``shapegate check-config``)."""
    rule = lane.lend
    if rule is None:
        return []
    return [
        f"    lends idle engines to {', '.join(rule.to)}: while none of {lane.name}'s own "
        f"requests runs on or waits for an engine, it takes up to {rule.per_endpoint} of "
        f"their requests with a prompt under {rule.max_prompt_tokens} tokens and max_tokens "
        f"at most {rule.max_tokens} (no max_tokens: never borrows)",
        f"    a {lane.name} request finding borrowers on every engine reserves the one with "
        f"the fewest (no new borrower enters) and waits for them at most {rule.max_drain_s:g}s",
    ]
