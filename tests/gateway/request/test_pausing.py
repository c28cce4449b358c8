"""``lanes[].pause_reads`` on the live path (gateway/request/pausing.py): a cached question sent
to an endpoint pauses another document's read there before its first byte; the read keeps its
slot and is sent again, unchanged, to the same endpoint once the question has finished."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
from structlog.testing import capture_logs

from engine_pool.pause import PauseRule
from gateway.core.watchdog import DeadlineHit, Deadlines, Watch
from gateway.count.tokens import TokenCounter
from gateway.observe.log import get_logger
from gateway.observe.metrics import Metrics
from gateway.request.pausing import Pauses, Sent
from gateway.settings import ConfigError, parse_settings
from tests.conftest import lanes_config
from tests.gateway.observe.test_tracing import gateway as traced_gateway
from tests.gateway.observe.test_tracing import traced
from tests.gateway.request.test_slot_accounting import open_request
from tests.support.fake_engine import FakeEngine
from tests.support.prom import parse
from tests.support.servers import serve_asgi
from tests.support.waiting import wait_for

# Two documents of about 5,000 tokens (20 kB), well above the heavy lane's 2,000.
DOC_A = "".join(f"clause {i} of contract alpha binds both parties. " for i in range(450))
DOC_B = "".join(f"section {i} of manual bravo explains the pump. " for i in range(450))
PAUSE = {"question_max_tokens": 512, "read_min_tokens": 1000}


def ask(doc: str, question: str, stream: bool = True, **fake: Any) -> dict[str, Any]:
    return {
        "model": "qwen3.6",
        "stream": stream,
        "messages": [
            {"role": "system", "content": doc},
            {"role": "user", "content": question},
        ],
        "fake": fake,
    }


def config(fast: str, heavy: str, pause: dict[str, Any] | None) -> dict[str, Any]:
    out = lanes_config([fast], [heavy])
    out["lanes"][1]["weights"] = {"load": 1.0, "prefix": 1.0}
    out["lanes"][1]["pause_reads"] = pause
    return out


@asynccontextmanager
async def serving(
    gateway_at: Any, pause: dict[str, Any] | None
) -> AsyncIterator[tuple[FakeEngine, str, httpx.AsyncClient]]:
    """A gateway whose heavy lane (``pause`` its ``pause_reads``) is one fake engine: the
    engine, the gateway's URL and a client."""
    engine, fast = FakeEngine(), FakeEngine()
    async with (
        serve_asgi(engine) as heavy,
        serve_asgi(fast) as small,
        gateway_at(config(small, heavy, pause)) as (url, _),
        httpx.AsyncClient(timeout=30) as client,
    ):
        yield engine, url, client


async def asked_once(client: httpx.AsyncClient, chat: str) -> None:
    """Document A asked once: the heavy endpoint is its home."""
    first = await client.post(chat, json=ask(DOC_A, "Who signs?", stream=False))
    assert first.status_code == 200


async def _read_and_question(
    gateway_at: Any, pause: dict[str, Any] | None, read_fake: dict[str, Any]
) -> tuple[FakeEngine, list[dict[str, Any]], str, dict[str, float], Any]:
    """doc A asked once (its home learns it), then doc B read (``read_fake``), then a second
    question on doc A while the read is under way: the engine, the logs, the read's streamed
    body, when each ended (seconds from the question's start) and the gateway's metrics."""
    async with serving(gateway_at, pause) as (engine, url, client):
        chat = url + "/v1/chat/completions"
        with capture_logs() as logs:
            await asked_once(client, chat)
            ended: dict[str, float] = {}

            async def read() -> str:
                body = ask(DOC_B, "Summarise it.", **read_fake)
                headers = {"x-request-id": "the-read"}
                async with client.stream("POST", chat, json=body, headers=headers) as r:
                    assert r.status_code == 200
                    text = (await r.aread()).decode()
                ended["read"] = time.monotonic()
                return text

            reading = asyncio.create_task(read())
            await wait_for(lambda: "the-read" in engine.seen, 5, what="the read sent")
            started = time.monotonic()
            question = ask(DOC_A, "What is the notice period?", mode="slow_first_byte")
            question["fake"]["delay"] = 0.3
            headers = {"x-request-id": "the-question"}
            answered = await client.post(chat, json=question, headers=headers)
            assert answered.status_code == 200
            ended["question"] = time.monotonic()
            text = await reading
            ended = {k: v - started for k, v in ended.items()}
            metrics = parse((await client.get(url + "/metrics")).text)
    return engine, logs, text, ended, metrics


async def test_a_cached_question_pauses_a_read_which_resumes_on_the_same_endpoint(
    gateway_at: Any,
) -> None:
    """The read (a 5,000-token document, 2 s before its first byte) is paused when the question
    (its document cached there, a few dozen tokens uncached) arrives: its connection to the
    engine is closed at once, unanswered; the question is answered; the read is then sent
    again to the same endpoint and streams its whole answer to the same client, slot held
    throughout and released at the end."""
    read_fake = {"mode": "slow_first_byte", "delay": 2.0}
    engine, logs, text, ended, metrics = await _read_and_question(gateway_at, PAUSE, read_fake)
    attempts = [s for s in engine.history if s.request_id == "the-read"]
    assert len(attempts) == 2
    cut, again = attempts
    assert not cut.completed and cut.closed is not None
    question = engine.seen["the-question"]
    assert cut.closed - question.arrived < 0.2  # closed as the question arrived
    assert again.completed and again.body == cut.body  # sent again unchanged
    assert question.closed is not None and again.arrived >= question.closed
    # The whole answer reached the client once: three chunks, then [DONE].
    assert text.count("data: {") == 3 and text.endswith("data: [DONE]\n\n")
    assert ended["question"] < 1.0 < ended["read"]
    paused = [e for e in logs if e["event"] == "route.paused"]
    assert len(paused) == 1
    assert paused[0]["request_id"] == "the-read" and paused[0]["by"] == "the-question"
    assert paused[0]["lane"] == "heavy" and paused[0]["remaining_tokens"] > 4000
    assert 0 < paused[0]["by_uncached_tokens"] <= 512
    resumed = [e for e in logs if e["event"] == "route.resumed"]
    assert len(resumed) == 1 and resumed[0]["pauses"] == 1 and resumed[0]["paused_s"] >= 0.3
    finished = {e["request_id"]: e for e in logs if e["event"] == "route.finished"}
    assert finished["the-read"]["pauses"] == 1 and finished["the-read"]["outcome"] == "ok"
    assert finished["the-question"]["pauses"] == 0
    assert metrics.value("shapegate_route_paused_total", lane="heavy") == 1
    assert metrics.value("shapegate_slots_in_use") == 0


async def test_without_pause_reads_the_read_runs_through(gateway_at: Any) -> None:
    read_fake = {"mode": "slow_first_byte", "delay": 1.0}
    engine, logs, _, _, metrics = await _read_and_question(gateway_at, None, read_fake)
    assert [s.completed for s in engine.history if s.request_id == "the-read"] == [True]
    assert not [e for e in logs if e["event"] == "route.paused"]
    assert metrics.value("shapegate_route_paused_total") == 0


async def test_a_read_whose_answer_began_is_not_paused(gateway_at: Any) -> None:
    """Its first chunk is out (the engine has prefilled it, the client has bytes): the
    question leaves it alone."""
    read_fake = {"chunks": 3, "gap": 0.5}
    engine, logs, text, _, _ = await _read_and_question(gateway_at, PAUSE, read_fake)
    assert [s.completed for s in engine.history if s.request_id == "the-read"] == [True]
    assert not [e for e in logs if e["event"] == "route.paused"]
    assert text.count("data: {") == 3


async def test_a_paused_requests_client_leaving_frees_its_slot_and_it_is_not_sent_again(
    gateway_at: Any,
) -> None:
    """Paused, the read's client goes away: its slot comes back while the question still runs,
    and it is never sent to the engine again."""
    async with serving(gateway_at, PAUSE) as (engine, url, client):
        chat = url + "/v1/chat/completions"

        async def in_use() -> float:
            scrape = parse((await client.get(url + "/metrics")).text)
            return scrape.value("shapegate_slots_in_use", lane="heavy")

        with capture_logs() as logs:
            await asked_once(client, chat)
            read = ask(DOC_B, "Summarise it.", mode="slow_first_byte", delay=2.0)
            _, writer = await open_request(url, "the-read", orjson.dumps(read))
            await wait_for(lambda: "the-read" in engine.seen, 5, what="the read sent")
            question = ask(DOC_A, "Notice period?", mode="slow_first_byte", delay=1.5)
            asking = asyncio.create_task(client.post(chat, json=question))
            await wait_for(lambda: engine.seen["the-read"].closed, 5, what="the read paused")
            assert await in_use() == 2  # the question's and the paused read's
            writer.close()
            await wait_for(lambda: _one(in_use), 5, what="the paused read's slot back")
            assert not asking.done()
            assert (await asking).status_code == 200
            await wait_for(lambda: _none(in_use), 5, what="every slot back")
            await asyncio.sleep(0.2)
    assert len([s for s in engine.history if s.request_id == "the-read"]) == 1
    assert [e["request_id"] for e in logs if e["event"] == "route.paused"] == ["the-read"]
    assert not [e for e in logs if e["event"] == "route.resumed"]


async def test_a_paused_attempt_is_an_event_on_the_requests_span(counter: TokenCounter) -> None:
    """With tracing on, the read's span shows its first try, its pause and its second try at
    the same endpoint, and ends ok."""
    engine, fast = FakeEngine(), FakeEngine()
    async with serve_asgi(engine) as heavy, serve_asgi(fast) as small:
        app, memory = traced(config(small, heavy, PAUSE), counter)
        async with traced_gateway(app) as (url, client):
            chat = url + "/v1/chat/completions"
            await asked_once(client, chat)
            read = ask(DOC_B, "Summarise it.", mode="slow_first_byte", delay=1.0)
            reading = asyncio.create_task(
                client.post(chat, json=read, headers={"x-request-id": "the-read"})
            )
            await wait_for(lambda: "the-read" in engine.seen, 5, what="the read sent")
            question = ask(DOC_A, "Notice period?", mode="slow_first_byte", delay=0.2)
            assert (await client.post(chat, json=question)).status_code == 200
            assert (await reading).status_code == 200
    spans = memory.get_finished_spans()
    (span,) = [s for s in spans if (s.attributes or {}).get("shapegate.request_id") == "the-read"]
    events = [(e.name, dict(e.attributes or {})) for e in span.events]
    assert events == [
        ("engine.attempt", {"shapegate.endpoint": heavy, "shapegate.attempt": 1}),
        ("engine.paused", {"shapegate.attempt": 1}),
        ("engine.attempt", {"shapegate.endpoint": heavy, "shapegate.attempt": 2}),
    ]
    assert (span.attributes or {})["shapegate.outcome"] == "ok"


async def test_a_read_sent_while_others_are_paused_does_not_hold_them(gateway_at: Any) -> None:
    """The read of doc B is paused for a question on doc A (1 s before its first byte); a new
    document's read comes meanwhile (its prompt all uncached: no question). It pauses nothing
    and holds nothing: the paused read is sent again once the question ends, while the new read
    still runs."""
    async with serving(gateway_at, PAUSE) as (engine, url, client):
        chat = url + "/v1/chat/completions"
        with capture_logs() as logs:
            await asked_once(client, chat)

            async def post(rid: str, body: dict[str, Any]) -> httpx.Response:
                return await client.post(chat, json=body, headers={"x-request-id": rid})

            slow = {"mode": "slow_first_byte"}
            read = asyncio.create_task(post("read", ask(DOC_B, "Summarise.", **slow, delay=2.0)))
            await wait_for(lambda: "read" in engine.seen, 5, what="the read sent")
            question = asyncio.create_task(
                post("question", ask(DOC_A, "Notice?", **slow, delay=1.0))
            )
            await wait_for(lambda: engine.seen["read"].closed, 5, what="the read paused")
            other = ask(DOC_B.replace("manual", "guide"), "Summarise.", **slow, delay=3.0)
            new = asyncio.create_task(post("new", other))
            for task in (question, read, new):
                assert (await task).status_code == 200
    question_done, new_done = engine.seen["question"].closed, engine.seen["new"].closed
    assert question_done is not None and new_done is not None
    resent = [s for s in engine.history if s.request_id == "read"][1]
    assert question_done <= resent.arrived < new_done
    assert [e["request_id"] for e in logs if e["event"] == "route.paused"] == ["read"]


async def _one(in_use: Any) -> bool:
    return bool(await in_use() == 1)


async def _none(in_use: Any) -> bool:
    return bool(await in_use() == 0)


def test_pause_reads_needs_a_lane_that_weighs_prefix() -> None:
    """Without ``weights.prefix`` a lane does not hash its prompts, so no request would know
    what it has left to prefill: the knob would do nothing, and is refused."""
    bad = lanes_config(["http://a"], ["http://b"])
    bad["lanes"][1]["pause_reads"] = {}
    with pytest.raises(ConfigError, match="pause_reads"):
        parse_settings(bad, environ={})
    bad["lanes"][1]["weights"] = {"prefix": 1.0}
    assert parse_settings(bad, environ={}).lane("heavy").pause_reads is not None


RULE = PauseRule(question_max_tokens=512, read_min_tokens=1000, max_pauses=3)


def _watch(total_s: float = 30.0) -> Watch:
    return Watch(Deadlines(connect_s=1, first_byte_s=30, idle_s=30, total_s=total_s))


async def _held(pauses: Pauses, sent: Sent) -> bool:
    """Run one attempt for ``sent`` that waits until cancelled: whether a pause cancelled it."""
    with pauses.attempt(sent, asyncio.get_running_loop()) as attempt:
        await asyncio.sleep(30)
    return attempt.paused


async def test_the_registry_pauses_resumes_and_forgets() -> None:
    """A question pauses a read's attempt; a second question arriving while it is paused holds
    it too; the read goes on when the last of them leaves; every entry is forgotten as its
    request ends, so the registry is as large as what is in flight."""
    pauses = Pauses(get_logger("test"), Metrics())
    read = pauses.sent("r", "read", "heavy", "http://e", 5000, 2)
    attempt = asyncio.create_task(_held(pauses, read))
    await asyncio.sleep(0)
    one = pauses.sent("q1", "question-1", "heavy", "http://e", 100, 1)
    assert pauses.ask(one, RULE) == ["r"]
    assert await attempt is True and read.pauses == 1 and pauses.paused("http://e") == ["r"]
    waiting = asyncio.create_task(pauses.resumed(read, _watch()))
    two = pauses.sent("q2", "question-2", "heavy", "http://e", 100, 1)
    assert pauses.ask(two, RULE) == [] and two.pausing  # nothing new, but it holds the read
    pauses.left(one)
    await asyncio.sleep(0.05)
    assert not waiting.done()
    pauses.left(two)
    assert await asyncio.wait_for(waiting, 1) >= 0.0
    assert pauses.paused("http://e") == [] and len(pauses) == 1
    pauses.left(read)
    assert len(pauses) == 0


async def test_a_paused_request_that_ends_is_not_resumed_and_is_forgotten() -> None:
    pauses = Pauses(get_logger("test"), Metrics())
    read = pauses.sent("r", "read", "heavy", "http://e", 5000, 2)
    attempt = asyncio.create_task(_held(pauses, read))
    await asyncio.sleep(0)
    question = pauses.sent("q", "question", "heavy", "http://e", 100, 1)
    assert pauses.ask(question, RULE) == ["r"] and await attempt
    pauses.left(read)  # its client left while paused
    assert pauses.paused("http://e") == []
    pauses.left(question)
    assert len(pauses) == 0 and read.resume is not None and not read.resume.is_set()


async def test_a_paused_request_waits_no_longer_than_its_total_deadline() -> None:
    pauses = Pauses(get_logger("test"), Metrics())
    read = pauses.sent("r", "read", "heavy", "http://e", 5000, 2)
    attempt = asyncio.create_task(_held(pauses, read))
    await asyncio.sleep(0)
    pauses.ask(pauses.sent("q", "question", "heavy", "http://e", 100, 1), RULE)
    assert await attempt
    with pytest.raises(DeadlineHit) as hit:
        await pauses.resumed(read, _watch(total_s=0.1))
    assert hit.value.kind == "total"


async def test_a_request_sent_elsewhere_leaves_its_old_endpoint() -> None:
    """A failover or a migration: the entry moves, keeping its pauses and whether it began."""
    pauses = Pauses(get_logger("test"), Metrics())
    read = pauses.sent("r", "read", "heavy", "http://a", 5000, 2)
    read.pauses, read.started = 2, True
    moved = pauses.sent("r", "read", "heavy", "http://b", 4000, 2, read)
    assert len(pauses) == 1 and moved.url == "http://b"
    assert moved.pauses == 2 and moved.started
    pauses.left(read)  # the old entry is gone already: nothing to do
    assert len(pauses) == 1
    pauses.left(moved)
    assert len(pauses) == 0


async def test_a_request_between_attempts_is_not_paused() -> None:
    """Only a request whose attempt is under way can be paused (the decision cancels it)."""
    pauses = Pauses(get_logger("test"), Metrics())
    pauses.sent("r", "read", "heavy", "http://e", 5000, 2)
    question = pauses.sent("q", "question", "heavy", "http://e", 100, 1)
    assert pauses.ask(question, RULE) == [] and not question.pausing
