"""Priority classes inside a lane (gateway/request/classes.py): the pure rules, the live admission
queue, and the simulation, which share them."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest
import yaml

from engine_pool.cluster import EngineState, EngineView
from gateway.errors import Overloaded
from gateway.observe.log import get_logger
from gateway.observe.metrics import Metrics
from gateway.observe.trace import TraceRecord
from gateway.request import classes as classes_module
from gateway.request.admission import Admission
from gateway.request.classes import (
    PASS_AHEAD,
    DrainMeter,
    UnknownClass,
    bearer_digest,
    class_lane_limit,
    class_of,
    explain,
    next_waiter,
    passing,
    retry_after_s,
)
from gateway.request.slot import Want
from gateway.settings import ClassSettings, ConfigError, LaneSettings, parse_settings
from gateway.shipped import resolve_policy
from gateway.slots.store import MemorySlotStore
from gateway.tuning.fleet_sim import FleetSim
from gateway.tuning.replay import cluster_profiles
from tests.support.waiting import wait_for

GOLD = hashlib.sha256(b"gold-key").hexdigest()
CLASSES = ClassSettings(api_keys={GOLD: "interactive"}, starvation_s=5.0)


def test_a_waiter_passes_only_holding_waiters_and_never_takes_what_they_wait_for() -> None:
    """The head passes nobody; one behind waiters that all tried and hold may try without the
    endpoints they asked for; behind one that has not tried yet, or too far back, it waits."""
    assert passing([]) == frozenset()
    assert passing([frozenset({"a"}), frozenset({"a", "b"})]) == {"a", "b"}
    assert passing([frozenset({"a"}), None]) is None
    assert passing([frozenset()] * PASS_AHEAD) == frozenset()
    assert passing([frozenset()] * (PASS_AHEAD + 1)) is None


def test_the_key_decides_and_the_header_only_lowers() -> None:
    assert bearer_digest(b"Bearer gold-key") == GOLD
    assert class_of(CLASSES, GOLD, None) == "interactive"
    assert class_of(CLASSES, GOLD, "batch") == "batch"
    assert class_of(CLASSES, None, None) == "standard"
    assert class_of(CLASSES, None, "interactive") == "standard"  # cannot raise itself
    assert class_of(CLASSES, None, "Batch ") == "batch"
    with pytest.raises(UnknownClass, match="unknown priority class 'vip'"):
        class_of(CLASSES, None, "vip")


def test_the_queue_goes_by_class_then_arrival_within_the_starvation_bound() -> None:
    waiting = [(2, 0.0), (0, 1.0), (0, 2.0), (1, 0.5)]
    assert next_waiter(waiting, now=3.0, starvation_s=5.0) == 1
    assert next_waiter(waiting, now=5.0, starvation_s=5.0) == 0  # the batch one starved 5 s


def test_reserved_shares_keep_slots_for_higher_classes() -> None:
    classes = ClassSettings(reserved={"interactive": 0.25, "standard": 0.1})
    assert class_lane_limit(classes, "interactive", 100) == 100
    assert class_lane_limit(classes, "standard", 100) == 75
    assert class_lane_limit(classes, "batch", 100) == 65
    assert class_lane_limit(classes, "batch", 1) == 1  # never below one


def test_retry_after_follows_the_measured_drain_rate() -> None:
    meter = DrainMeter(window_s=60)
    for i in range(20):
        meter.granted(100.0 + i * 0.5)  # 2 a second
    rate = meter.rate(110.0)
    assert rate == pytest.approx(2.0, rel=0.1)
    assert retry_after_s(9, rate, ceiling_s=30) == pytest.approx(5.0, rel=0.1)
    assert retry_after_s(1000, rate, ceiling_s=30) == 30
    assert retry_after_s(3, 0.0, ceiling_s=30) == 30  # nothing drained: no promise


@pytest.mark.parametrize(
    ("classes", "message"),
    [
        ({"default": "gold"}, "unknown class 'gold'"),
        ({"reserved": {"interactive": 0.6, "standard": 0.5}}, "add up to 1 or more"),
        ({"api_keys": {"abc": "batch"}}, "not a SHA-256 hex digest"),
    ],
)
def test_the_policy_refuses_bad_classes(classes: dict[str, Any], message: str) -> None:
    raw = yaml.safe_load(resolve_policy("configs/demo.yaml").read_text(encoding="utf-8"))
    raw["classes"] = classes
    with pytest.raises(ConfigError, match=message):
        parse_settings(raw, {})


def test_check_config_explains_the_classes() -> None:
    assert "may only lower" in "\n".join(explain(CLASSES))


# ---- the live admission queue ------------------------------------------------------------

VIEWS = [EngineView("c", "http://a", EngineState.UP, 0)]


def lane(**overrides: Any) -> LaneSettings:
    spec: dict[str, Any] = {
        "name": "fast",
        "max_prompt_tokens": 100,
        "clusters": ["c"],
        "slots": {"lane": 1, "per_endpoint": 1},
        "queue": {"depth": 50, "max_wait_s": 10},
    }
    spec.update(overrides)
    return LaneSettings.model_validate(spec)


async def test_admission_serves_interactive_before_queued_batch_and_bounds_starvation() -> None:
    adm = Admission(MemorySlotStore(), Metrics(), get_logger("test"))
    spec = lane()
    classes = ClassSettings(starvation_s=0.3)
    order: list[str] = []
    release = asyncio.Event()

    async def user(name: str, priority: str, hold: asyncio.Event | None = None) -> None:
        async with adm.slot(spec, lambda: VIEWS, name, want=Want(priority, classes)):
            order.append(name)
            if hold is not None:
                await hold.wait()

    first = asyncio.create_task(user("holder", "standard", release))
    await wait_for(lambda: order == ["holder"], 5)
    tasks = [asyncio.create_task(user(f"b{i}", "batch")) for i in range(3)]
    await wait_for(lambda: adm.queue_depth("fast") == 3, 5)
    tasks.append(asyncio.create_task(user("i0", "interactive")))
    await wait_for(lambda: adm.queue_depth("fast") == 4, 5)
    release.set()
    await asyncio.gather(first, *tasks)
    assert order[:2] == ["holder", "i0"]
    assert order[2:] == ["b0", "b1", "b2"]


async def test_a_full_queue_answers_with_retry_after_from_its_drain_rate() -> None:
    adm = Admission(MemorySlotStore(), Metrics(), get_logger("test"))
    spec = lane(queue={"depth": 0, "max_wait_s": 600})
    for i in range(10):  # ten grants in quick succession: a measured drain rate
        async with adm.slot(spec, lambda: VIEWS, f"t{i}"):
            pass
    async with adm.slot(spec, lambda: VIEWS, "holder"):
        with pytest.raises(Overloaded) as refused:
            async with adm.slot(spec, lambda: VIEWS, "late"):
                pass
    # ~11 grants within the first second: about a tenth of a second, so the floor of 1 s, far
    # below the 600 s ceiling a constant would have used.
    assert refused.value.retry_after_s == 1.0
    assert adm.drain_rate("fast") > 5


# ---- the simulation: an interactive request under a batch flood ----------------------------


def record(t: float, priority: str, tokens: int = 3000, output: int = 40) -> TraceRecord:
    return TraceRecord(
        t=t,
        model="qwen3.6",
        prompt_tokens=tokens,
        prompt_bytes=tokens * 4,
        output_tokens=output,
        priority=priority,
    )


def flood_settings(starvation_s: float = 20) -> Any:
    raw = yaml.safe_load(resolve_policy("configs/demo.yaml").read_text(encoding="utf-8"))
    raw["lanes"][0]["slots"] = {"lane": 16, "per_endpoint": 8}
    raw["lanes"][0]["queue"] = {"depth": 5000, "max_wait_s": 600}
    raw["lanes"][1].pop("lend")
    # Half the fast lane's slots stay free for interactive requests: a batch flood cannot fill
    # the engines' batches, so an interactive request finds one that is not saturated.
    raw["classes"] = {"starvation_s": starvation_s, "reserved": {"interactive": 0.5}}
    return parse_settings(raw, {})


def test_an_interactive_request_under_a_batch_flood_keeps_its_ttft() -> None:
    settings = flood_settings()
    profiles = cluster_profiles(settings)
    probe = record(10.0, "interactive")
    alone = FleetSim(settings, profiles).run([probe]).outcomes[0].ttft
    flood = [record(i * 0.02, "batch") for i in range(600)]  # 12 s of batch at 50/s
    outcomes = FleetSim(settings, profiles).run([*flood, probe]).outcomes
    mixed = next(o for o in outcomes if o.priority == "interactive").ttft
    assert alone is not None and mixed is not None
    assert mixed <= 2 * alone, (mixed, alone)
    waits = [o.queue_wait or 0.0 for o in outcomes if o.priority == "batch"]
    assert max(waits) > 5.0  # the flood did queue: the probe went past it
    assert all(o.rejected is None for o in outcomes)


def test_batch_is_never_starved_past_its_bound_by_an_interactive_flood() -> None:
    flood = [record(i * 0.05, "interactive") for i in range(1200)]  # 60 s at 20/s: saturating
    probe = record(1.0, "batch")

    def batch_wait(starvation_s: float) -> float:
        settings = flood_settings(starvation_s)
        outcomes = FleetSim(settings, cluster_profiles(settings)).run([*flood, probe]).outcomes
        (batch,) = [o for o in outcomes if o.priority == "batch"]
        assert batch.queue_wait is not None
        return batch.queue_wait

    starved = batch_wait(starvation_s=600)  # no effective bound: it waits out the flood
    assert starved > 20
    bounded = batch_wait(starvation_s=5)
    # Let in as soon as a slot frees after the bound (a slot's turn is about a second here).
    assert 5 <= bounded <= 5 + 2.0, (bounded, starved)


def test_with_nothing_reserved_every_class_may_fill_the_lane_without_ranking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_rank(classes: ClassSettings, name: str) -> int:
        raise AssertionError("ranked with nothing reserved")

    monkeypatch.setattr(classes_module, "rank", no_rank)
    for name in ("interactive", "standard", "batch"):
        assert class_lane_limit(ClassSettings(), name, 100) == 100
    assert class_lane_limit(ClassSettings(), "batch", 0) == 1  # never below one
