"""The shadow's pure decisions (gateway/request/shadow.py): the same functions the pipeline
runs, over the same count and snapshot, and the report they add up to."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gateway.request.shadow as shadow_module
from engine_pool.cluster import EngineState, EngineView
from gateway.request.prefix import Seen as PrefixSeen
from gateway.request.shadow import (
    Seen,
    ShadowDecision,
    ShadowPolicy,
    ShadowReport,
    class_for,
    decide,
    decide_now,
    merge_reports,
    window_trace,
)
from gateway.settings import parse_settings
from tests.conftest import lanes_config

FAST = ("http://f1", "http://f2")
HEAVY = ("http://h1", "http://h2")


def policy(threshold: int = 8192, **lane_changes: Any) -> ShadowPolicy:
    config = lanes_config(list(FAST), list(HEAVY), threshold=threshold)
    for index, changes in lane_changes.items():
        config["lanes"][int(index[-1])].update(changes)
    return ShadowPolicy.of(parse_settings(config, environ={}), version=2)


def views(
    in_flight: dict[str, int] | None = None,
    down: tuple[str, ...] = (),
    context: int | None = None,
) -> dict[str, tuple[EngineView, ...]]:
    loads = in_flight or {}

    def view(cluster: str, url: str) -> EngineView:
        state = EngineState.DOWN if url in down else EngineState.UP
        return EngineView(cluster, url, state, loads.get(url, 0), context_tokens=context)

    return {
        "fast": tuple(view("fast", u) for u in FAST),
        "heavy": tuple(view("heavy", u) for u in HEAVY),
    }


def seen(tokens: int, **changes: Any) -> Seen:
    fields: dict[str, Any] = {
        "tokens": tokens,
        "longest": tokens,
        "exact": True,
        "model": "qwen3.6",
        "max_tokens": 64,
        "multipart": False,
        "healthy": {"fast": True, "heavy": True},
        "views": views(),
    }
    return Seen(**(fields | changes))


def test_the_lane_comes_from_the_shadow_ranges_and_the_endpoint_from_the_picker() -> None:
    shadow = policy(threshold=8192)
    assert decide(shadow, seen(8191)).lane == "fast"
    moved = decide(shadow, seen(8192))
    assert (moved.lane, moved.reason, moved.rejected) == ("heavy", "in_range", None)
    # Least in-flight first, as engine_pool/picker.py orders them.
    busy = decide(shadow, seen(100, views=views({"http://f1": 3, "http://f2": 1})))
    assert busy.endpoint == "http://f2"
    assert busy.verdict == "pick"
    assert busy.priority == "standard"


def test_what_the_shadow_would_reject_and_why() -> None:
    shadow = policy(threshold=8192)
    assert decide(shadow, seen(2_000_000)).rejected == "prompt_too_long"
    no_heavy = seen(50_000, healthy={"fast": True, "heavy": False})
    assert decide(shadow, no_heavy).rejected == "no_healthy_cluster"
    small_engines = seen(50_000, views=views(context=32_768))
    assert decide(shadow, small_engines).rejected == "context_too_small"
    assert decide(shadow, seen(10, class_header="nope")).rejected == "unknown_class"
    assert decide(shadow, seen(10, model="other")).rejected == "unknown_model"
    full = {u: 32 for u in FAST}
    rejecting = policy(threshold=8192, lane0={"on_full": "reject"})
    assert decide(rejecting, seen(10, views=views(full))).rejected == "overloaded"
    waits = decide(shadow, seen(10, views=views(full)))
    assert (waits.rejected, waits.endpoint, waits.verdict) == (None, None, "wait")


def test_a_short_request_borrows_an_idle_lender_engine_when_its_lane_has_no_room() -> None:
    lend = {"to": ["fast"], "max_prompt_tokens": 4096, "max_tokens": 128, "per_endpoint": 2}
    shadow = policy(threshold=8192, lane1={"lend": lend})
    full = {u: 32 for u in FAST} | {"http://h1": 1}
    borrowed = decide(shadow, seen(100, views=views(full)))
    assert (borrowed.lender, borrowed.endpoint, borrowed.verdict) == (
        "heavy",
        "http://h2",
        "borrow",
    )
    # Too long a prompt, or no max_tokens: no loan.
    assert decide(shadow, seen(5000, views=views(full))).lender is None
    assert decide(shadow, seen(100, views=views(full), max_tokens=None)).lender is None


def test_the_report_counts_agreement_by_lane_and_disagreements_with_their_token_ranges() -> None:
    shadow = policy(threshold=8192)
    report = ShadowReport()
    for tokens, active in ((100, "fast"), (9000, "fast"), (30000, "fast"), (50000, "heavy")):
        report.add(active, decide(shadow, seen(tokens)), tokens, True, None)
    out = report.as_json()
    assert out["compared"] == 4
    assert out["agreed_by_lane"] == {"fast": 1, "heavy": 1}
    assert out["disagreements"] == [
        {
            "active": "fast",
            "shadow": "heavy",
            "requests": 2,
            "min_tokens": 9000,
            "max_tokens": 30000,
        }
    ]
    report.add("fast", decide(shadow, seen(2_000_000)), 2_000_000, True, None)
    assert report.as_json()["would_reject"] == {"prompt_too_long": 1}


def test_reports_of_several_workers_merge_into_one() -> None:
    shadow = policy(threshold=8192)
    one, two = ShadowReport(), ShadowReport()
    first = (100.0, "qwen3.6", 9000, 1, 3, True, None)
    second = (99.5, "qwen3.6", 20000, 1, 3, True, None)
    one.add("fast", decide(shadow, seen(9000)), 9000, True, first)
    two.add("fast", decide(shadow, seen(20000)), 20000, True, second)
    two.add("fast", decide(shadow, seen(10)), 10, True, None)
    merged = merge_reports([one.as_json(), two.as_json()])
    assert merged["compared"] == 3
    assert merged["agreed_by_lane"] == {"fast": 1}
    assert merged["disagreements"] == [
        {
            "active": "fast",
            "shadow": "heavy",
            "requests": 2,
            "min_tokens": 9000,
            "max_tokens": 20000,
        }
    ]
    trace = window_trace(merged["window"])
    assert [(r.t, r.prompt_tokens) for r in trace] == [(0.0, 20000), (0.5, 9000)]


def test_a_shadow_lane_that_holds_for_its_home_would_wait_as_the_active_chain_does() -> None:
    """A heavy lane holding for the endpoint with the document cached (``prefix_hold_tokens``):
    with that home full and the other endpoint free but cold, the shadow picks no endpoint (the
    request would wait in the queue); without the hold it takes the cold one."""
    document = PrefixSeen(
        hashes=(1, 2), tokens=200_000, cached={"http://h1": 199_936}, held={"http://h1": 2}
    )
    full_home = views({"http://h1": 4})  # the heavy lane's 4 slots an endpoint, all taken
    asked = seen(200_000, views=full_home, prefix=document)
    weighs = {"weights": {"load": 1, "prefix": 1}}
    holding_lane = decide(policy(lane1={**weighs, "prefix_hold_tokens": 0}), asked)
    assert (holding_lane.lane, holding_lane.endpoint, holding_lane.rejected) == (
        "heavy",
        None,
        None,
    )
    assert holding_lane.verdict == "wait"
    assert decide(policy(lane1=weighs), asked).endpoint == "http://h2"

    # Work already pending on the home (other documents being prefilled there) is counted,
    # against the cold endpoint's read plus the second copy it makes (engine_pool/chain.py
    # ``_hold``): 300k pending is still waited for (200k + 199,936 more), 450k is not.
    def pending(tokens: int) -> Seen:
        return seen(200_000, views=full_home, prefix=document, pending={"http://h1": tokens})

    holding = policy(lane1={**weighs, "prefix_hold_tokens": 0})
    assert decide(holding, pending(300_000)).endpoint is None
    assert decide(holding, pending(450_000)).endpoint == "http://h2"
    # The policy looks prefixes up for a lane that only holds, as the active pipeline does.
    assert policy(lane1={"prefix_hold_tokens": 0}).weighs_prefix
    assert not policy().weighs_prefix


# ``decide_now`` against ``decide``: policies that exercise each way out of the common case
# (a lane weighing prefixes, one lending, emergency clusters) and each of its steps (a slot
# limit of 1 and of 2, a load weight of 0 and of 0.5, a lane rejecting when full).
NOW_POLICIES = (
    policy(),
    policy(threshold=100, lane0={"slots": {"lane": 4, "per_endpoint": 2}}),
    policy(lane0={"slots": {"lane": 2, "per_endpoint": 1}, "on_full": "reject"}),
    policy(lane0={"weights": {"load": 0}}, lane1={"weights": {"load": 0.5}}),
    policy(lane0={"weights": {"load": 1, "prefix": 1}}),
    policy(lane1={"lend": {"to": ["fast"], "max_prompt_tokens": 4096, "per_endpoint": 2}}),
    policy(lane0={"emergency_clusters": ["heavy"]}),
)
NAN = float("nan")
# A third endpoint of each cluster whose URL sorts first though it comes last (the URL tie-break).
URLS = {"fast": (*FAST, "http://f0"), "heavy": (*HEAVY, "http://h0")}


@st.composite
def snapshots(draw: st.DrawFn) -> dict[str, tuple[EngineView, ...]]:
    out = {}
    for cluster, urls in URLS.items():
        count = draw(st.sampled_from([0, 1, 2, 3, 3]))
        out[cluster] = tuple(
            EngineView(
                cluster,
                url,
                draw(st.sampled_from(list(EngineState))),
                draw(st.one_of(st.integers(0, 3), st.integers(0, 34))),
                draw(st.sampled_from([None, 0.0, 1.0, 2.5, NAN])),
                draw(st.sampled_from([1.0, 1.0, 0.5, 0.1, 1.5])),
                draw(st.sampled_from([None, None, 100, 5000, 50_000])),
            )
            for url in urls[:count]
        )
    return out


def test_decide_now_decides_as_decide_wherever_it_answers() -> None:
    answered: list[ShadowDecision] = []
    among_several = []

    @settings(max_examples=2000, deadline=None)
    @given(
        shadow=st.sampled_from(NOW_POLICIES),
        tokens=st.one_of(st.integers(0, 12_000), st.integers(0, 2_000_000)),
        share=st.one_of(st.just(1.0), st.floats(0, 1)),  # the largest prompt's share of them
        model=st.sampled_from(["qwen3.6", "Qwen/Qwen3.6-35B-A3B", "other"]),
        max_tokens=st.sampled_from([None, 64, 10_000]),
        healthy=st.fixed_dictionaries({}, optional={"fast": st.booleans(), "heavy": st.booleans()}),
        snapshot=snapshots(),
        digest=st.sampled_from([None, "k"]),
        header=st.sampled_from([None, "", " Batch ", "interactive", "nope"]),
        priority=st.sampled_from([None, None, "standard"]),
    )
    def check(
        shadow: ShadowPolicy,
        tokens: int,
        share: float,
        model: str,
        max_tokens: int | None,
        healthy: dict[str, bool],
        snapshot: dict[str, tuple[EngineView, ...]],
        digest: str | None,
        header: str | None,
        priority: str | None,
    ) -> None:
        longest = int(tokens * share)
        now = decide_now(
            shadow,
            tokens,
            longest,
            model,
            healthy,
            lambda cluster: snapshot.get(cluster, ()),
            class_for(shadow, digest, header, priority),
        )
        if now is None:
            return
        reference = Seen(
            tokens,
            longest,
            True,
            model,
            max_tokens,
            False,
            healthy,
            snapshot,
            key_digest=digest,
            class_header=header,
            priority=priority,
        )
        assert now == decide(shadow, reference)
        answered.append(now)
        cluster = "fast" if now.endpoint in URLS["fast"] else "heavy"
        if now.endpoint is not None and len(snapshot[cluster]) > 1:
            among_several.append(now)

    check()
    # It answers the common case: picks among several endpoints, waits, rejects.
    assert len(among_several) > 50
    assert {d.verdict for d in answered} == {"pick", "wait", "reject"}
    assert {d.rejected for d in answered} >= {
        "prompt_too_long",
        "unknown_model",
        "context_too_small",
        "unknown_class",
        "overloaded",
    }


def test_decide_now_leaves_to_decide_what_it_does_not_decide() -> None:
    """None, so ``decide`` runs: a multipart-free request whose lane weighs prefixes, a lane
    with an unhealthy primary, a full lane when a lane lends, a NaN queue figure."""
    quiet = views()
    weighing, lending, emergency = NOW_POLICIES[4], NOW_POLICIES[5], NOW_POLICIES[6]
    full = views({u: 32 for u in FAST})

    def now(shadow: ShadowPolicy, healthy: dict[str, bool], snapshot: Any) -> Any:
        return decide_now(shadow, 10, 10, "qwen3.6", healthy, snapshot.get, "standard")

    assert now(weighing, {}, quiet) is None
    assert now(emergency, {"fast": False}, quiet) is None
    assert now(lending, {}, full) is None
    assert now(lending, {}, quiet) is not None  # room: no loan looked for
    odd = {"fast": (quiet["fast"][0]._replace(waiting=NAN),), "heavy": ()}
    assert now(policy(), {}, odd) is None
    assert now(policy(), {}, quiet) == decide(policy(), seen(10))


def test_decide_now_keeps_one_decision_a_pick_and_at_most_picks_max(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Alike picks are one object (``ShadowPolicy.picks``); past ``PICKS_MAX`` the picks are
    forgotten, never the decisions changed."""
    shadow = policy()

    def now(snapshot: Any, priority: str = "standard") -> Any:
        return decide_now(shadow, 10, 10, "qwen3.6", {}, snapshot.get, priority)

    to_f2 = views({"http://f1": 3})
    assert now(to_f2) is now(to_f2)
    assert now(to_f2).endpoint == "http://f2"
    assert len(shadow.picks) == 1
    monkeypatch.setattr(shadow_module, "PICKS_MAX", 2)
    assert now(views()).endpoint == "http://f1"
    assert now(to_f2, "batch") == decide(shadow, seen(10, views=to_f2, priority="batch"))
    assert len(shadow.picks) == 1  # full at the third: emptied, then the third kept
