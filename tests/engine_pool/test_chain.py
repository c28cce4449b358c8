"""The endpoint chain: filters, weighted scorers, and how prefix overlap is weighed against load."""

from __future__ import annotations

import pytest

from engine_pool.chain import Ask, rank
from engine_pool.cluster import EngineState, EngineView

BOTH = {"load": 1.0, "prefix": 1.0}


def view(
    url: str, in_flight: int = 0, state: EngineState = EngineState.UP, context: int | None = None
) -> EngineView:
    return EngineView("c", url, state, in_flight, context_tokens=context)


def urls(views: list[EngineView], ask: Ask, weights: dict[str, float] = BOTH) -> list[str]:
    return [r.view.url for r in rank(views, ask, weights)]


def test_filters_drop_down_endpoints_and_contexts_too_small() -> None:
    views = [view("a", state=EngineState.DOWN), view("b", context=1000), view("c", context=5000)]
    assert urls(views, Ask(need=2000)) == ["c"]
    assert urls(views, Ask()) == ["b", "c"]  # need 0: no context check


def test_overlap_holds_a_request_until_load_outweighs_it() -> None:
    """Both weights 1, 80% of the prompt cached on A, slot limit 8: A keeps the request while
    its used share of slots is less than 0.8 above B's, and loses it past that."""
    cached = {"a": 800}
    for a_load, b_load, first in [(0, 0, "a"), (6, 0, "a"), (6, 1, "a"), (7, 0, "b"), (8, 1, "b")]:
        ask = Ask(tokens=1000, cached=cached, limit_of=lambda v: 8)
        got = urls([view("a", a_load), view("b", b_load)], ask)[0]
        assert got == first, (a_load, b_load)


def test_without_a_prefix_weight_the_order_is_least_loaded() -> None:
    views = [view("a", 3), view("b", 1), view("c", 1)]
    ask = Ask(tokens=1000, cached={"a": 1000}, limit_of=lambda v: 8)
    assert urls(views, ask, {"load": 1.0, "prefix": 0.0}) == ["b", "c", "a"]
    assert urls(views, ask) == ["a", "b", "c"]


def test_the_ranking_carries_each_endpoints_score_and_cached_tokens() -> None:
    ask = Ask(tokens=1000, cached={"a": 500}, limit_of=lambda v: 4)
    ranked = rank([view("a", 2), view("b", 0)], ask, BOTH)
    assert [(r.view.url, r.score, r.cached_tokens) for r in ranked] == [
        ("b", 1.0, 0),
        ("a", 1.0, 500),
    ]  # a tie: fewer in flight first


def test_a_prefix_held_nowhere_makes_its_home_where_least_is_held_unless_that_is_busy() -> None:
    """Within half the slots of the least used endpoint, the one holding fewest blocks goes
    first; a busier one is passed over; with no prefix weight the held blocks do not matter."""
    views = [view("a", 0), view("b", 2), view("c", 6)]
    held = {"a": 900, "b": 10, "c": 0}
    ask = Ask(tokens=1000, held=held, limit_of=lambda v: 8)
    assert urls(views, ask)[0] == "b"  # 2 of 8 used: within 0.5 of a's 0; c (6 of 8) is not
    assert urls(views, ask, {"load": 1.0, "prefix": 0.0})[0] == "a"
    cached = Ask(tokens=1000, cached={"a": 100}, held=held, limit_of=lambda v: 8)
    assert urls(views, cached)[0] == "a"  # a prompt held somewhere is not a new home


def test_prefix_hold_tokens_waits_for_a_full_home_unless_it_is_busy_prefilling() -> None:
    """Home a is full (4 of 4) and holds 90% of the prompt; b has room and holds none. With
    ``hold_tokens`` 0, b is dropped while its prefill ahead (pending + 1,000) exceeds a's
    (pending + 100): the request waits for a. A home with a 300k-token prefill pending is not
    waited for; neither is one with no prefix of the prompt; without the knob b stays."""
    views = [view("a", 4), view("b", 1)]

    def ask(pending: dict[str, int], cached: dict[str, int] | None = None) -> Ask:
        cached = {"a": 900} if cached is None else cached
        return Ask(tokens=1000, cached=cached, limit_of=lambda v: 4, pending=pending)

    def order(a: Ask, hold: int | None) -> list[str]:
        return [r.view.url for r in rank(views, a, BOTH, hold)]

    assert order(ask({"a": 500}), 0) == ["a"]
    assert order(ask({"a": 500}), 2000) == ["a", "b"]  # b's extra prefill within the hold
    assert order(ask({"a": 300_000}), 0) == ["a", "b"]
    assert order(ask({"a": 500}, cached={}), 0) == ["b", "a"]
    assert order(ask({"a": 500}), None) == ["a", "b"]


def test_prefix_hold_tokens_charges_a_second_prefill_of_what_the_home_holds() -> None:
    """A follow-up on a 250k-token document whose home a is full and still reading it for the
    first question (250k pending): b is idle and would get the first token as soon (250,100
    tokens ahead against a's 250,100), but only by reading the document a second time, which
    the fleet pays twice; so with ``hold_tokens`` 0 the request waits for a. A home with two
    new documents pending (600k) would take longer than the copy, so b is kept; a hold of
    250k tokens lets the copy through too."""
    views = [view("a", 4), view("b", 0)]

    def order(pending: int, hold: int) -> list[str]:
        ask = Ask(
            tokens=250_100, cached={"a": 250_000}, limit_of=lambda v: 4, pending={"a": pending}
        )
        return [r.view.url for r in rank(views, ask, BOTH, hold)]

    assert order(250_000, 0) == ["a"]
    assert order(600_000, 0) == ["b", "a"]  # a tie on score: fewer in flight first
    assert order(250_000, 250_000) == ["b", "a"]


def test_the_work_scorer_weighs_the_prefill_ahead_not_the_requests_in_flight() -> None:
    """Home a holds 90% of a 30k-token prompt and is busy (3 of 4 slots) with cached
    follow-ups: 1,808 tokens pending; b is idle. By work alone a scores 1 (4,808 tokens ahead,
    plus the 8,192-token floor) and b 0.34 (13,000 / 38,192): a stays first. With a 300k-token
    prefill pending on a, b goes first."""
    views = [view("a", 3), view("b", 0)]
    work = {"load": 0.0, "prefix": 0.0, "work": 1.0}

    def ask(pending: int) -> Ask:
        return Ask(
            tokens=30_000, cached={"a": 27_000}, limit_of=lambda v: 4, pending={"a": pending}
        )

    ranked = rank(views, ask(1_808), work)
    assert [(r.view.url, r.score) for r in ranked] == [("a", 1.0), ("b", 0.340385)]
    assert urls(views, ask(1_808), {"load": 1.0, "prefix": 0.0})[0] == "b"  # by slots alone
    assert urls(views, ask(300_000), work)[0] == "b"


def test_an_ask_is_an_immutable_named_tuple_with_read_only_empty_defaults() -> None:
    """One a request: a named tuple (no frozen dataclass's ``object.__setattr__`` a field);
    its default mappings are one shared empty mapping, which nobody can fill."""
    ask, other = Ask(), Ask(tokens=5)
    assert isinstance(ask, tuple) and ask.cached is other.cached and ask.work(view("http://a")) == 0
    with pytest.raises(AttributeError):
        ask.tokens = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        ask.cached["http://a"] = 1  # type: ignore[index]


def test_new_home_slack_zero_puts_a_new_prefix_on_the_least_used_endpoint() -> None:
    """The lane's ``new_home_slack``: at 0.5 (the default) a new prefix goes to b, holding least
    and one slot of four busier than a; at 0 it goes to the least used a (the fewest blocks
    breaking a tie), so a long new prefill does not land where cached questions are running."""
    views = [view("a", 0), view("b", 1)]
    held = {"a": 900, "b": 10}
    ask = Ask(tokens=1000, held=held, limit_of=lambda v: 4)
    assert rank(views, ask, BOTH)[0].view.url == "b"
    assert rank(views, ask, BOTH, None, 0.0)[0].view.url == "a"
    tie = [view("a", 1), view("b", 1), view("c", 2)]
    assert rank(tie, ask, BOTH, None, 0.0)[0].view.url == "b"


def test_a_prompt_whose_homes_are_full_makes_a_second_home_where_least_is_held() -> None:
    """Its only home a is full (8 of 8): the others are ordered as a new home is, the fewest
    blocks first among those within the slack of the least used (c, though busier than b);
    with room on a the order is the weighted one (a first, then the least loaded b)."""
    held = {"a": 500, "b": 900, "c": 10}
    ask = Ask(tokens=1000, cached={"a": 900}, held=held, limit_of=lambda v: 8)
    full = [view("a", 8), view("b", 1), view("c", 3)]
    assert [r.view.url for r in rank(full, ask, BOTH)] == ["a", "c", "b"]
    room = [view("a", 7), view("b", 1), view("c", 3)]
    assert [r.view.url for r in rank(room, ask, BOTH)] == ["a", "b", "c"]
    assert [r.view.url for r in rank(full, ask, BOTH, None, 0.0)] == ["a", "b", "c"]
