"""A shadow policy on live traffic (gateway/request/shadow_live.py, edge/shadow_routes.py): it
decides on every request from the same count and snapshot, nothing of it reaches an engine or
holds a slot, its failures never reach a client, and promotion is a reload that keeps the old
policy as the shadow."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import httpx
import orjson
import pytest
import yaml

import gateway.request.shadow_live as shadow_live
from gateway.edge.app import create_app
from gateway.request.shadow import Seen, ShadowDecision, ShadowPolicy, decide
from gateway.request.shadow_live import ShadowLive
from gateway.settings import parse_settings
from gateway.tuning.fleet_model import LiveCosts
from tests.conftest import ADMIN, JSON, lanes_config
from tests.support.fake_engine import FakeEngine
from tests.support.prom import parse
from tests.support.servers import serve_asgi

ACTIVE_AT = 20_000  # the active policy's fast lane ends here
SHADOW_AT = 1_000  # the shadow's
# Words of one token each (~5 bytes): under 20,000 bytes the free bound decides the active lane
# (no exact count before it), so the shadow must take the exact count made while the engine
# works; above, the active lane is counted exactly first.
WORDS = (200, 600, 1500, 3000, 3500, 5000, 12000, 30000)


def config(fast: str, heavy: str, threshold: int) -> dict[str, Any]:
    out = lanes_config([fast], [heavy], threshold=threshold)
    out["clusters"][0]["sim_profile"] = "h100-fast"
    out["clusters"][1]["sim_profile"] = "h100-heavy"
    return out


def prompt(words: int) -> dict[str, Any]:
    text = " ".join("lane" for _ in range(words))
    return {
        "model": "qwen3.6",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "stream": True,
    }


async def send_all(client: httpx.AsyncClient, url: str) -> list[httpx.Response]:
    async def one(words: int) -> httpx.Response:
        answer = await client.post(url + "/v1/chat/completions", json=prompt(words), headers=JSON)
        assert answer.status_code == 200, answer.text
        return answer

    return list(await asyncio.gather(*(one(n) for n in WORDS)))


def tokens_of(answer: httpx.Response) -> int:
    return int(answer.headers["x-shapegate-prompt-tokens"])


async def slots_in_use(client: httpx.AsyncClient, url: str) -> dict[str, int]:
    state = (await client.get(url + "/admin/state")).json()
    return {lane["name"]: lane["slots_in_use"] for lane in state["lanes"]}


async def start_shadow(client: httpx.AsyncClient, url: str, policy: dict[str, Any]) -> Any:
    answer = await client.post(url + "/admin/shadow", content=yaml.safe_dump(policy), headers=ADMIN)
    assert answer.status_code == 200, answer.text
    return answer.json()


async def test_the_shadow_decides_every_request_and_touches_no_engine_and_no_slot(
    gateway_at: Any,
) -> None:
    fast, heavy = FakeEngine(), FakeEngine()
    async with serve_asgi(fast) as fast_url, serve_asgi(heavy) as heavy_url:
        active = config(fast_url, heavy_url, ACTIVE_AT)
        async with gateway_at(active) as (url, _), httpx.AsyncClient(timeout=30) as client:
            started = await start_shadow(client, url, config(fast_url, heavy_url, SHADOW_AT))
            assert started["shadow"]["lanes"][0]["max"] == SHADOW_AT
            assert "lanes[fast].max_prompt_tokens" in started["changed"]
            before = await slots_in_use(client, url)
            answers = await send_all(client, url)
            report = (await client.get(url + "/admin/shadow")).json()
            after = await slots_in_use(client, url)
            metrics = (await client.get(url + "/metrics")).text

    sent = len(WORDS)
    tokens = [tokens_of(a) for a in answers]
    # The active decision is unaffected: the active policy's lanes.
    assert [a.headers["x-shapegate-lane"] for a in answers] == [
        "fast" if t < ACTIVE_AT else "heavy" for t in tokens
    ]
    moved = [t for t in tokens if SHADOW_AT <= t < ACTIVE_AT]
    assert len(moved) >= 5  # 3 of them decided by the free bound for the active policy
    assert report["running"] is True
    assert report["compared"] == sent
    assert report["by_bound"] == 0  # every shadow decision had the exact count
    assert report["agreed_by_lane"] == {"fast": sent - len(moved) - 1, "heavy": 1}
    assert report["disagreements"] == [
        {
            "active": "fast",
            "shadow": "heavy",
            "requests": len(moved),
            "min_tokens": min(moved),
            "max_tokens": max(moved),
        }
    ]
    assert report["would_reject"] == {}
    assert sum(report["endpoints"].values()) == sent
    # Nothing of the shadow reached an engine or held a slot.
    assert len(fast.seen) + len(heavy.seen) == sent
    assert before == after == {"fast": 0, "heavy": 0}
    counted = parse(metrics).value(
        "shapegate_shadow_decisions_total", lane="fast", shadow_lane="heavy"
    )
    assert counted == len(moved)


@pytest.mark.parametrize(
    ("broken_part", "where"),
    [("decide", None), ("views", "shadow.observe")],
)
async def test_a_failing_shadow_is_logged_and_counted_and_the_request_is_served(
    counter: Any, monkeypatch: pytest.MonkeyPatch, broken_part: str, where: str | None
) -> None:
    def broken(*_: Any) -> Any:
        raise RuntimeError("shadow bug")

    fast, heavy = FakeEngine(), FakeEngine()
    async with serve_asgi(fast) as fast_url, serve_asgi(heavy) as heavy_url:
        active = config(fast_url, heavy_url, ACTIVE_AT)
        app = create_app(parse_settings(active, environ={}), counter)
        # Every decision (``decide_now`` at the decision for a final count; both in the batch,
        # after the request, for a bound), or the snapshot (at the decision): the pool as the
        # shadow reads it, the active path's own left whole.
        if broken_part == "decide":
            monkeypatch.setattr(shadow_live, "decide", broken)
            monkeypatch.setattr(shadow_live, "decide_now", broken)
        else:
            monkeypatch.setattr(app.gateway.pipeline.shadow, "pool", SimpleNamespace(views=broken))
        async with serve_asgi(app) as url, httpx.AsyncClient(timeout=30) as client:
            await start_shadow(client, url, config(fast_url, heavy_url, SHADOW_AT))
            await send_all(client, url)
            report = (await client.get(url + "/admin/shadow")).json()
            metrics = (await client.get(url + "/metrics")).text
    assert report["compared"] == 0
    # Logged and counted once a request, where it failed, and every request served.
    scrape = parse(metrics)
    swallowed = {
        part: scrape.value("shapegate_swallowed_errors_total", where=part)
        for part in ("shadow.observe", "shadow.finished")
    }
    assert sum(swallowed.values()) == len(WORDS)
    if where is None:  # final counts failed at the decision, bounds in the batch
        assert swallowed["shadow.observe"] > 0
        assert swallowed["shadow.finished"] > 0
    else:
        assert swallowed[where] == len(WORDS)
    assert len(fast.seen) + len(heavy.seen) == len(WORDS)


async def test_a_shadow_is_validated_as_a_reload_and_guarded_as_admin(gateway_at: Any) -> None:
    fast, heavy = FakeEngine(), FakeEngine()
    async with serve_asgi(fast) as fast_url, serve_asgi(heavy) as heavy_url:
        active = config(fast_url, heavy_url, ACTIVE_AT)
        async with gateway_at(active) as (url, _), httpx.AsyncClient(timeout=30) as client:
            gap = config(fast_url, heavy_url, SHADOW_AT)
            gap["lanes"][1]["min_prompt_tokens"] = SHADOW_AT + 10
            refused = await client.post(
                url + "/admin/shadow", content=yaml.safe_dump(gap), headers=ADMIN
            )
            other_model = config(fast_url, heavy_url, SHADOW_AT)
            other_model["models"] = [{**other_model["models"][0], "name": "other"}]
            for lane in other_model["lanes"]:
                lane.pop("models", None)
            models = await client.post(
                url + "/admin/shadow", content=yaml.safe_dump(other_model), headers=ADMIN
            )
            empty = await client.post(url + "/admin/shadow", content=b"", headers=ADMIN)
            body = orjson.dumps(config(fast_url, heavy_url, SHADOW_AT))
            unguarded = await client.post(url + "/admin/shadow", content=body, headers=JSON)
            form = await client.post(
                url + "/admin/shadow",
                content=body,
                headers={"content-type": "text/plain", "x-shapegate-admin": "1"},
            )
            report = (await client.get(url + "/admin/shadow")).json()
    assert refused.status_code == 400
    assert "request body:" in refused.json()["error"]["message"]
    assert "gap" in refused.json()["error"]["message"]
    assert models.status_code == 400
    assert "with the same tokenizer (not so: other;" in models.json()["error"]["message"]
    assert empty.status_code == 400
    assert unguarded.status_code == 403
    assert form.status_code == 415
    assert report["running"] is False


async def test_promote_applies_the_shadow_as_a_reload_and_keeps_the_old_policy_as_shadow(
    gateway_at: Any,
) -> None:
    fast, heavy = FakeEngine(), FakeEngine()
    mid = prompt(5000)
    async with serve_asgi(fast) as fast_url, serve_asgi(heavy) as heavy_url:
        active = config(fast_url, heavy_url, ACTIVE_AT)
        async with gateway_at(active) as (url, _), httpx.AsyncClient(timeout=30) as client:

            async def lane() -> str:
                answer = await client.post(url + "/v1/chat/completions", json=mid, headers=JSON)
                return answer.headers["x-shapegate-lane"]

            nothing = await client.post(url + "/admin/shadow/promote", headers=ADMIN)
            await start_shadow(client, url, config(fast_url, heavy_url, SHADOW_AT))
            before = await lane()
            promoted = await client.post(url + "/admin/shadow/promote", headers=ADMIN)
            after = await lane()
            shadow = (await client.get(url + "/admin/shadow")).json()
            state = (await client.get(url + "/admin/state")).json()
            rolled = await client.post(url + "/admin/shadow/promote", headers=ADMIN)
            back = await lane()
            stopped = await client.delete(url + "/admin/shadow", headers=ADMIN)
            await lane()
            gone = (await client.get(url + "/admin/shadow")).json()
    assert nothing.status_code == 400
    assert (before, after, back) == ("fast", "heavy", "fast")
    assert promoted.status_code == 200, promoted.text
    assert promoted.json()["changed"]["lanes[fast].max_prompt_tokens"]["new"] == SHADOW_AT
    assert state["policy_version"] == promoted.json()["version"] == 2
    # The replaced policy is the shadow now, and it disagrees on the request sent after.
    assert shadow["shadow"]["lanes"][0]["max"] == ACTIVE_AT
    assert shadow["compared"] == 1
    assert shadow["disagreements"][0]["active"] == "heavy"
    assert rolled.json()["version"] == 3
    assert stopped.json()["stopped"] is True
    assert stopped.json()["report"]["compared"] == 1
    assert gone["running"] is False
    assert gone["compared"] == 1  # the last report stays readable; nothing new was compared


async def test_the_predicted_effect_replays_the_live_window_under_both_policies(
    gateway_at: Any,
) -> None:
    fast, heavy = FakeEngine(), FakeEngine()
    async with serve_asgi(fast) as fast_url, serve_asgi(heavy) as heavy_url:
        active = config(fast_url, heavy_url, ACTIVE_AT)
        async with gateway_at(active) as (url, _), httpx.AsyncClient(timeout=30) as client:
            await start_shadow(client, url, config(fast_url, heavy_url, SHADOW_AT))
            answers = await send_all(client, url)
            found = await client.get(url + "/admin/shadow?effect=1&time_scale=0.5&window=1")
            bad = await client.get(url + "/admin/shadow?effect=1&time_scale=0")
    assert found.status_code == 200, found.text
    report = found.json()
    effect = report["predicted_effect"]
    assert effect["requests"] == len(report["window"]) == len(WORDS)
    assert sorted(r["prompt_tokens"] for r in report["window"]) == sorted(
        tokens_of(a) for a in answers
    )
    defaults = LiveCosts(time_scale=0.5)
    assert effect["calibration"]["time_scale"] == 0.5
    assert effect["calibration"]["gateway_ms"] == defaults.gateway_s * 1000
    assert "bench fidelity" in effect["calibration"]["source"]
    moved = sum(1 for a in answers if SHADOW_AT <= tokens_of(a) < ACTIVE_AT)
    in_heavy = {
        policy: effect[policy]["small_ttft_by_lane"].get("heavy", {}).get("requests", 0)
        for policy in ("active", "shadow")
    }
    assert in_heavy == {"active": 1, "shadow": 1 + moved}
    heavy_peak = effect["shadow"]["peak_slots"]["heavy"]
    assert heavy_peak["peak"] > effect["active"]["peak_slots"]["heavy"]["peak"]
    assert bad.status_code == 400


async def test_a_shadow_weighing_prefixes_decides_with_the_engines_kv_events_too(
    gateway_at: Any,
) -> None:
    """With ``prefix_index.source: kv_events`` the index hashes the prompt's token ids, made
    with the request's model: the shadow looks the prefix up with that model too (it once
    looked it up with none, and every observation failed as not compared). Its home-holding
    lane is looked up as well."""
    fast, heavy = FakeEngine(), FakeEngine()
    async with serve_asgi(fast) as fast_url, serve_asgi(heavy) as heavy_url:
        active = config(fast_url, heavy_url, ACTIVE_AT)
        active["clusters"][0]["kv_events"] = {"port": 1, "replay_port": 2}  # nothing publishes
        active["prefix_index"] = {"source": "kv_events"}
        candidate = config(fast_url, heavy_url, SHADOW_AT)
        candidate["clusters"][0]["kv_events"] = {"port": 1, "replay_port": 2}
        candidate["prefix_index"] = {"source": "kv_events"}
        candidate["lanes"][0]["weights"] = {"load": 1, "prefix": 1}
        candidate["lanes"][1]["prefix_hold_tokens"] = 0
        async with gateway_at(active) as (url, _), httpx.AsyncClient(timeout=30) as client:
            await start_shadow(client, url, candidate)
            await send_all(client, url)
            report = (await client.get(url + "/admin/shadow")).json()
            metrics = (await client.get(url + "/metrics")).text
    assert report["compared"] == len(WORDS)
    assert parse(metrics).value("shapegate_swallowed_errors_total", where="shadow.observe") in (
        None,
        0,
    )


# -- batches, flushes and the memo -------------------------------------------------------------


@asynccontextmanager
async def shadowed(counter: Any) -> AsyncIterator[tuple[str, ShadowLive, httpx.AsyncClient]]:
    """A gateway with the shadow (its fast lane ending at ``SHADOW_AT``) running; its URL, its
    shadow and a client."""
    fast, heavy = FakeEngine(), FakeEngine()
    async with serve_asgi(fast) as fast_url, serve_asgi(heavy) as heavy_url:
        app = create_app(
            parse_settings(config(fast_url, heavy_url, ACTIVE_AT), environ={}), counter
        )
        async with serve_asgi(app) as url, httpx.AsyncClient(timeout=30) as client:
            await start_shadow(client, url, config(fast_url, heavy_url, SHADOW_AT))
            yield url, app.gateway.pipeline.shadow, client


async def send(client: httpx.AsyncClient, url: str, words: int, n: int) -> None:
    for _ in range(n):
        answer = await client.post(url + "/v1/chat/completions", json=prompt(words), headers=JSON)
        assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("reader", ["report", "scrape", "stop"])
async def test_every_read_of_the_counts_flushes_the_queued_requests_first(
    counter: Any, monkeypatch: pytest.MonkeyPatch, reader: str
) -> None:
    """Fewer requests than a batch, no timer in the test's time: the report, a scrape and the
    stop's last report each count them all (each fails without its own flush)."""
    monkeypatch.setattr(shadow_live, "FLUSH_S", 3600.0)
    async with shadowed(counter) as (url, shadow, client):
        await send(client, url, 200, 5)
        await send(client, url, 3000, 3)
        assert shadow._report.compared == 0  # queued, not yet decided
        if reader == "report":
            report = (await client.get(url + "/admin/shadow")).json()
            assert report["compared"] == 8
            assert report["disagreements"][0]["requests"] == 3
        elif reader == "scrape":
            scrape = parse((await client.get(url + "/metrics")).text)
            assert scrape.value("shapegate_shadow_decisions_total") == 8
            assert scrape.value("shapegate_shadow_decisions_total", shadow_lane="heavy") == 3
        else:
            stopped = (await client.delete(url + "/admin/shadow", headers=ADMIN)).json()
            assert stopped["report"]["compared"] == 8


async def test_a_full_batch_is_counted_at_once_and_a_quiet_gateway_within_flush_s(
    counter: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shadow_live, "BATCH", 4)
    monkeypatch.setattr(shadow_live, "FLUSH_S", 0.2)
    async with shadowed(counter) as (url, shadow, client):
        await send(client, url, 200, 6)
        assert shadow._report.compared == 4  # one batch; two wait (read nothing: no flush)
        await asyncio.sleep(0.6)  # the timer armed by the fifth
        assert shadow._report.compared == 6


async def test_the_common_case_is_decided_when_seen_and_keeps_no_snapshot_nor_memo(
    counter: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A final figure, healthy clusters, least-loaded lanes: ``decide_now`` decides at
    ``observe`` (only the decision is kept); a bound past the shadow's threshold waits for the
    exact count and is decided by ``decide_now`` at the flush. ``decide`` runs for neither,
    the memo stays empty, and the report is the one ``decide`` gives (the tests above)."""
    monkeypatch.setattr(shadow_live, "FLUSH_S", 3600.0)
    calls: list[int] = []

    def counted(policy: ShadowPolicy, seen: Seen) -> ShadowDecision:
        calls.append(seen.tokens)
        return decide(policy, seen)

    monkeypatch.setattr(shadow_live, "decide", counted)
    async with shadowed(counter) as (url, shadow, client):
        await send(client, url, 100, 3)  # a free bound under the shadow's threshold: final
        kept = list(shadow._queue)
        assert len(kept) == 3
        assert all(k[0] is not None and k[0].lane == "fast" and k[2] is None for k in kept)
        await send(client, url, 3000, 2)  # a bound past it: the snapshot waits for the count
        assert all(k[0] is None and k[2] is not None for k in shadow._queue[3:])
        report = shadow.report
        assert report.compared == 5
        assert report.agreed == {"fast": 3}
        assert sum(r.requests for r in report.disagreed.values()) == 2
    assert calls == []
    assert shadow._memo == {}


def _never_now(*_: Any) -> None:
    """``decide_now`` declining every request: each goes to ``decide`` and its memo (a policy
    ``decide_now`` does not decide for: a lane that lends, an unhealthy cluster...)."""
    return None


async def test_alike_requests_are_decided_once_and_a_new_policy_decides_afresh(
    counter: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def counted(policy: ShadowPolicy, seen: Seen) -> ShadowDecision:
        calls.append(seen.tokens)
        return decide(policy, seen)

    monkeypatch.setattr(shadow_live, "decide", counted)
    monkeypatch.setattr(shadow_live, "decide_now", _never_now)
    async with shadowed(counter) as (url, shadow, client):
        await send(client, url, 200, 10)
        await send(client, url, 3000, 10)
        report = (await client.get(url + "/admin/shadow")).json()
        # One request at a time: the same figure, health and idle endpoints each time.
        assert len(calls) == 2 and calls[0] < SHADOW_AT <= calls[1]
        assert report["compared"] == 20
        assert report["agreed_by_lane"] == {"fast": 10}
        assert report["disagreements"][0]["requests"] == 10
        assert sum(report["endpoints"].values()) == 20
        policy = shadow.policy
        assert policy is not None
        shadow.start(policy.settings, policy.version + 1, policy.settings)
        await send(client, url, 200, 3)
        assert (await client.get(url + "/admin/shadow")).json()["compared"] == 3
        assert len(calls) == 3


async def test_the_memo_tells_a_full_endpoint_from_an_idle_one(
    counter: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same request against the same endpoints, but one of them full: the views are in the
    memo's key, so the second is not answered from the first's decision."""
    monkeypatch.setattr(shadow_live, "decide_now", _never_now)
    settings = parse_settings(config("http://a", "http://b", ACTIVE_AT), environ={})
    app = create_app(settings, counter)
    shadow = app.gateway.pipeline.shadow
    policy = shadow.start(settings, 1, settings)
    views = tuple(tuple(app.gateway.pool.views(c)) for c in policy.clusters)
    full = tuple(tuple(v._replace(in_flight=10**6) for v in vs) for vs in views)
    health = (("fast", True), ("heavy", True))
    plain = ("qwen3.6", 8, False, health, views, None, None, None)
    first = shadow._decide(policy, (100, 100), True, plain, None)
    second = shadow._decide(policy, (100, 100), True, (*plain[:4], full, *plain[5:]), None)
    again = shadow._decide(policy, (100, 100), True, plain, None)
    assert first.endpoint == "http://a" and second.endpoint is None
    assert again is first
    assert len(shadow._memo) == 2


async def test_an_alike_request_takes_its_decision_when_seen_and_none_is_made_at_the_flush(
    counter: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A final figure makes the memo's key at ``observe``: once the memo holds the decision, a
    later alike request is kept with it and the flush decides nothing for it (without the
    lookup at ``observe``, each would go through ``_decide`` at the flush)."""
    monkeypatch.setattr(shadow_live, "FLUSH_S", 3600.0)
    monkeypatch.setattr(shadow_live, "decide_now", _never_now)
    small = 100  # words: a free bound under the shadow's threshold, so the figure is final
    async with shadowed(counter) as (url, shadow, client):
        calls: list[int] = []
        deciding = shadow._decide

        def counted(*args: Any) -> ShadowDecision:
            calls.append(1)
            return deciding(*args)

        monkeypatch.setattr(shadow, "_decide", counted)
        await send(client, url, small, 3)
        assert shadow.report.compared == 3
        assert len(calls) == 3  # the memo was empty when they were seen
        assert len(shadow._memo) == 1
        await send(client, url, small, 5)
        kept = list(shadow._queue)
        assert len(kept) == 5 and all(k[0] is not None for k in kept)
        assert all(k[2] is None for k in kept)  # nor are its inputs kept
        report = shadow.report
        assert report.compared == 8 and report.agreed == {"fast": 8}
        assert len(calls) == 3


async def test_with_no_memo_every_request_is_decided_afresh_and_counted_alike(
    counter: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``MEMO_MAX = 0`` (the cost of a memo that never hits, ``bench shadow --instructions
    --memo-miss``): the same report, every request decided by ``decide``."""
    calls: list[int] = []

    def counted(policy: ShadowPolicy, seen: Seen) -> ShadowDecision:
        calls.append(seen.tokens)
        return decide(policy, seen)

    monkeypatch.setattr(shadow_live, "decide", counted)
    monkeypatch.setattr(shadow_live, "decide_now", _never_now)
    monkeypatch.setattr(shadow_live, "MEMO_MAX", 0)
    async with shadowed(counter) as (url, shadow, client):
        await send(client, url, 200, 6)
        await send(client, url, 3000, 4)
        report = (await client.get(url + "/admin/shadow")).json()
        assert shadow._memo == {}
    assert len(calls) == 10
    assert report["compared"] == 10
    assert report["agreed_by_lane"] == {"fast": 6}
    assert report["disagreements"][0]["requests"] == 4


async def test_a_request_seen_by_one_shadow_and_finished_under_the_next_is_not_compared(
    counter: Any,
) -> None:
    """``start`` forgets what the last policy saw: a request in flight across it is compared
    by neither (the next policy's report starts at zero)."""
    async with shadowed(counter) as (url, shadow, client):
        slow = prompt(200) | {"fake": {"mode": "slow_first_byte", "delay": 0.5}}
        sent = asyncio.create_task(
            client.post(url + "/v1/chat/completions", json=slow, headers=JSON)
        )
        while not shadow._kept:
            await asyncio.sleep(0.01)
        policy = shadow.policy
        assert policy is not None
        shadow.start(policy.settings, policy.version + 1, policy.settings)
        assert (await sent).status_code == 200
        assert shadow.report.compared == 0
        await send(client, url, 200, 1)
        assert shadow.report.compared == 1
