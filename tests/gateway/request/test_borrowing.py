"""Borrowing: the pure rules (gateway/request/borrowing.py), the policy's validation of ``lend``,
and the rules at work in the what-if simulation (gateway/tuning/fleet_sim.py), which the live
admission shares."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from engine_pool.cluster import EngineState, EngineView
from gateway.core.slots import Limit
from gateway.observe.trace import TraceRecord
from gateway.request.borrowing import (
    EndpointUse,
    Offer,
    borrow_room,
    explain,
    loans_for,
    merge_loans,
    owner_may_enter,
    short_enough,
    to_reserve,
)
from gateway.settings import ConfigError, LendSettings, Settings, parse_settings
from gateway.shipped import resolve_policy
from gateway.tuning.fleet_result import SimulatedRequest
from gateway.tuning.fleet_sim import FleetSim
from gateway.tuning.replay import cluster_profiles, simulate

RULE = LendSettings(to=("fast",), max_prompt_tokens=8192, max_tokens=128, per_endpoint=4)


def demo_raw() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(
        resolve_policy("configs/demo.yaml").read_text(encoding="utf-8")
    )
    return data


def test_only_short_requests_with_a_declared_budget_borrow() -> None:
    assert short_enough(RULE, 8191, 128)
    assert not short_enough(RULE, 8192, 128)
    assert not short_enough(RULE, 100, 129)
    assert not short_enough(RULE, 100, None)  # no max_tokens: an unbounded budget


def test_loans_come_only_from_lanes_that_lend_to_this_one() -> None:
    settings = parse_settings(demo_raw(), {})
    fast, heavy = settings.lane("fast"), settings.lane("heavy")
    (loan,) = loans_for(fast, settings.lanes, 1000, 64)
    assert (loan.lender, loan.clusters) == ("heavy", ("heavy",))
    assert loans_for(heavy, settings.lanes, 1000, 64) == ()  # the fast lane lends nothing
    assert loans_for(fast, settings.lanes, 20_000, 64) == ()


def test_an_endpoint_lends_only_while_its_own_lane_is_away() -> None:
    assert borrow_room(RULE, EndpointUse(owners=0, borrowers=1)) == 3
    assert borrow_room(RULE, EndpointUse(owners=1, borrowers=0)) == 0
    assert borrow_room(RULE, EndpointUse(owners=0, borrowers=0, reserved=True)) == 0
    assert borrow_room(RULE, EndpointUse(owners=0, borrowers=4)) == 0


def test_the_owner_waits_for_borrowers_at_most_max_drain_s() -> None:
    busy = EndpointUse(owners=0, borrowers=2, reserved=True)
    assert not owner_may_enter(RULE, busy, waited_s=RULE.max_drain_s - 0.1)
    assert owner_may_enter(RULE, busy, waited_s=RULE.max_drain_s)
    assert owner_may_enter(RULE, EndpointUse(owners=1, borrowers=0), waited_s=0)


def test_a_blocked_owner_reserves_the_endpoint_with_fewest_borrowers() -> None:
    uses = {
        "a": EndpointUse(owners=0, borrowers=3),
        "b": EndpointUse(owners=0, borrowers=1),
        "c": EndpointUse(owners=4, borrowers=0),
    }
    assert to_reserve(uses, owner_limit=4) == "b"
    # Full of owners, nothing to drain: reserving would stop lending for nothing.
    assert to_reserve({"c": uses["c"]}, owner_limit=4) is None


def test_the_chains_order_is_kept_and_lent_endpoints_go_before_busier_own_ones() -> None:
    def offer(url: str, in_flight: int, lender: str | None = None) -> Offer:
        return (EngineView("c", url, EngineState.UP, in_flight), Limit(url, 8), lender)

    # The chain put a (busier, holding the prefix) before b: admission keeps that order.
    own = [offer("a", 5), offer("b", 1)]
    assert [o[0].url for o in merge_loans(own, [])] == ["a", "b"]
    lent = [offer("x", 3, "heavy"), offer("y", 0, "heavy")]
    assert [o[0].url for o in merge_loans(own, lent)] == ["y", "x", "a", "b"]
    assert [o[0].url for o in merge_loans([offer("a", 0)], [offer("y", 0, "h")])] == ["a", "y"]


@pytest.mark.parametrize(
    ("lend", "message"),
    [
        ({"to": ["nowhere"]}, "unknown lane 'nowhere'"),
        ({"to": ["heavy"]}, "cannot lend to itself"),
        ({"to": ["fast"], "max_prompt_tokens": 40_000}, "budget must fit"),
    ],
)
def test_the_policy_refuses_lending_that_breaks_the_rules(
    lend: dict[str, Any], message: str
) -> None:
    raw = demo_raw()
    raw["lanes"][1]["lend"] = lend
    with pytest.raises(ConfigError, match=message):
        parse_settings(raw, {})


def test_the_fast_lane_never_lends_to_the_heavy_lane() -> None:
    raw = demo_raw()
    raw["lanes"][0]["lend"] = {"to": ["heavy"], "max_prompt_tokens": 1000}
    with pytest.raises(ConfigError, match="may lend only to lanes of shorter prompts"):
        parse_settings(raw, {})


def test_guards_make_borrowers_and_the_lenders_own_requests_exclude_each_other() -> None:
    import asyncio

    from gateway.core.slots import Limit
    from gateway.slots.store import MemorySlotStore

    async def scenario() -> None:
        store = MemorySlotStore()
        lane = Limit("lane:x", 10)
        borrower = Limit("borrow:h", 4, guards=("ep:h", "reserve:h"))
        owner = Limit("ep:h", 4, guards=("borrow:h",))
        assert await store.try_acquire("b1", lane, [borrower]) == 0
        assert await store.try_acquire("m1", lane, [owner]) is None  # a borrower is there
        await store.reserve("m1", "reserve:h")
        assert await store.try_acquire("b2", lane, [borrower]) is None  # reserved
        await store.release("b1", ["lane:x", "borrow:h"])
        assert await store.try_acquire("m1", lane, [owner]) == 0
        await store.release("m1", ["reserve:h"])
        assert await store.try_acquire("b2", lane, [borrower]) is None  # the owner runs

    asyncio.run(scenario())


def test_check_config_explains_the_lending_rule() -> None:
    text = "\n".join(explain(parse_settings(demo_raw(), {}).lane("heavy")))
    assert "lends idle engines to fast" in text and "at most 10s" in text


# ---- the rules at work in the simulation -------------------------------------------------


def one_heavy_engine(**lend: Any) -> Settings:
    raw = demo_raw()
    raw["clusters"][1]["endpoints"] = ["http://127.0.0.1:9201"]
    raw["lanes"][1]["slots"] = {"lane": 4, "per_endpoint": 4}
    raw["lanes"][1]["lend"].update(lend)
    return parse_settings(raw, {})


def small(t: float, tokens: int = 2000, output: int = 100) -> TraceRecord:
    return TraceRecord(
        t=t, model="qwen3.6", prompt_tokens=tokens, prompt_bytes=tokens * 4, output_tokens=output
    )


def run(settings: Settings, trace: list[TraceRecord]) -> list[SimulatedRequest]:
    return list(FleetSim(settings, cluster_profiles(settings)).run(trace).outcomes)


def test_a_monster_starts_only_after_the_borrowers_on_its_engine_drained() -> None:
    settings = one_heavy_engine()
    burst = [small(i * 0.01) for i in range(80)]  # fills the fast engines: some borrow
    monster = TraceRecord(
        t=0.5, model="qwen3.6", prompt_tokens=200_000, prompt_bytes=800_000, output_tokens=10
    )
    outcomes = run(settings, [*burst, monster])
    big = next(o for o in outcomes if o.prompt_tokens == 200_000)
    borrowers = [o for o in outcomes if o.lender == "heavy"]
    assert borrowers, "the burst should have borrowed the idle heavy engine"
    assert big.admitted is not None and big.finished is not None
    before = [o for o in borrowers if o.admitted is not None and o.admitted < big.admitted]
    assert before and all(o.finished is not None and o.finished <= big.admitted for o in before)
    # No borrower entered while the monster waited or ran.
    assert not [o for o in borrowers if big.arrival <= (o.admitted or 0) < big.finished]
    assert big.admitted - big.arrival <= settings.lane("heavy").lend.max_drain_s  # type: ignore[union-attr]
    assert big.cluster == "heavy"


def test_a_monster_waits_no_longer_than_max_drain_s_for_slow_borrowers() -> None:
    settings = one_heavy_engine(max_tokens=2000, max_drain_s=2.0)
    burst = [small(i * 0.01, output=1500) for i in range(80)]  # borrowers decode ~1 min
    monster = TraceRecord(
        t=1.0, model="qwen3.6", prompt_tokens=200_000, prompt_bytes=800_000, output_tokens=10
    )
    outcomes = run(settings, [*burst, monster])
    big = next(o for o in outcomes if o.prompt_tokens == 200_000)
    assert any(o.lender == "heavy" for o in outcomes)
    assert big.admitted is not None
    assert big.admitted - big.arrival == pytest.approx(2.0, abs=0.05)


def test_the_shipped_policy_never_puts_a_monster_on_a_fast_engine() -> None:
    from gateway.observe.trace import synthesize

    settings = parse_settings(demo_raw(), {})
    report = simulate(
        "demo", settings, synthesize("production-burst", 2), cluster_profiles(settings)
    )
    assert report.summary["large_on_light_engines"] == 0
    assert report.summary["borrowing"]["share"] > 0.05
    assert set(report.summary["borrowing"]["by_lender"]) == {"heavy"}
