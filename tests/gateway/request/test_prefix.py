"""Prefix-cache-aware routing on the live path: agents keep to the endpoint holding their
prompt's prefix, under concurrency and unequal loads, without hotspotting it."""

from __future__ import annotations

import asyncio
import collections
import random
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from engine_pool.cluster import EngineState, EngineView
from engine_pool.kv_events import Batch, EngineBlocks, Step, Stored
from engine_pool.registry import StateChange
from gateway.edge.services import Gateway
from gateway.observe.metrics import Metrics
from gateway.protocols.openai import ChatPrompt, CompletionPrompt
from gateway.request.prefix import Prefixes, prompt_data
from gateway.settings import PrefixIndexSettings, parse_settings
from tests.conftest import lanes_config
from tests.support.fake_engine import FakeEngine
from tests.support.prom import parse
from tests.support.servers import serve_asgi
from tests.support.waiting import wait_for

AGENTS = 16
TURNS = 12


def _body(agent: int, turn: int, delay: float) -> dict[str, Any]:
    return {
        "model": "qwen3.6",
        "messages": [
            {"role": "system", "content": f"agent {agent} instructions. " * 40},
            {"role": "user", "content": f"turn {turn}"},
        ],
        "fake": {"mode": "slow_first_byte", "delay": delay},
    }


async def _agents(url: str, seed: int) -> None:
    """Every agent at once, each its own pace: unequal think times and request lengths."""
    rng = random.Random(seed)
    paces = [(rng.uniform(0.02, 0.12), rng.uniform(0.0, 0.05)) for _ in range(AGENTS)]

    async def agent(i: int, client: httpx.AsyncClient) -> None:
        work, think = paces[i]
        await asyncio.sleep(i * 0.01)
        for turn in range(TURNS):
            r = await client.post(url + "/v1/chat/completions", json=_body(i, turn, work))
            assert r.status_code == 200, r.text
            await asyncio.sleep(think)

    limits = httpx.Limits(max_connections=AGENTS * 2)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        await asyncio.gather(*(agent(i, client) for i in range(AGENTS)))


def _homes_and_loads(engines: list[FakeEngine]) -> tuple[dict[int, float], list[float]]:
    """Per agent, the share of its requests its most used endpoint took; per endpoint, the
    engine time it was asked for (the sum of its requests' delays)."""
    where: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    loads = [0.0] * len(engines)
    for index, engine in enumerate(engines):
        for seen in engine.seen.values():
            agent = int(seen.body.split(b"agent ")[1].split(b" ")[0])
            where[agent][index] += 1
            loads[index] += float(seen.body.split(b'"delay":')[1].split(b"}")[0])
    homes = {a: c.most_common(1)[0][1] / sum(c.values()) for a, c in where.items()}
    return homes, loads


@pytest.mark.parametrize(
    "weights",
    [
        {"load": 1.0, "prefix": 1.0},
        {"load": 1.0, "prefix": 2.0},
        {"load": 1.0, "prefix": 1.0, "work": 1.0},
    ],
    ids=["load-prefix", "prefix-2", "load-prefix-work"],
)
async def test_agents_keep_to_their_home_endpoint_under_concurrency_without_a_hotspot(
    gateway_at: Any, weights: dict[str, float]
) -> None:
    engines = [FakeEngine() for _ in range(4)]
    async with (
        serve_asgi(engines[0]) as a,
        serve_asgi(engines[1]) as b,
        serve_asgi(engines[2]) as c,
        serve_asgi(engines[3]) as d,
    ):
        config = lanes_config([a, b, c, d], [a])
        config["lanes"][0]["slots"] = {"lane": 64, "per_endpoint": 8}
        config["lanes"][0]["weights"] = weights
        async with gateway_at(config) as (url, _):
            await _agents(url, seed=7)
    homes, loads = _homes_and_loads(engines)
    mean = sum(loads) / len(loads)
    print(f"home share min {min(homes.values()):.2f} mean {sum(homes.values()) / len(homes):.2f}")
    print(f"load max/mean {max(loads) / mean:.2f} ({[round(x, 2) for x in loads]})")
    assert len(homes) == AGENTS
    assert min(homes.values()) >= 0.9, homes
    assert max(loads) <= 1.5 * mean, loads


async def test_without_prefix_weight_requests_spread_by_load(gateway_at: Any) -> None:
    """``weights.prefix: 0`` (the default) is plain least-loaded: the same agents scatter."""
    engines = [FakeEngine() for _ in range(4)]
    async with (
        serve_asgi(engines[0]) as a,
        serve_asgi(engines[1]) as b,
        serve_asgi(engines[2]) as c,
        serve_asgi(engines[3]) as d,
    ):
        config = lanes_config([a, b, c, d], [a])
        config["lanes"][0]["slots"] = {"lane": 64, "per_endpoint": 8}
        async with gateway_at(config) as (url, _):
            await _agents(url, seed=7)
    homes, _ = _homes_and_loads(engines)
    assert sum(homes.values()) / len(homes) < 0.8, homes


def test_prompt_data_is_the_prompt_in_order() -> None:
    chat = ChatPrompt(
        messages=({"role": "system", "content": "s"}, {"role": "user", "content": "u"})
    )
    data, ids = prompt_data(chat)
    assert not ids and data.index(b'"s"') < data.index(b'"u"')
    assert prompt_data(CompletionPrompt(token_ids=((1, 2),))) == (b"\x01\0\0\0\x02\0\0\0", True)
    assert prompt_data(CompletionPrompt(texts=("abc",))) == (b"abc", False)


def test_a_shared_prefix_is_found_up_to_its_last_whole_block() -> None:
    settings = PrefixIndexSettings(block_tokens=4, bytes_per_token=1)
    prefixes = Prefixes(settings, Metrics())
    first = prefixes.look(CompletionPrompt(texts=("abcdefgh" + "12345678",)))
    assert first.cached == {} and first.tokens == 16 and len(first.hashes) == 4
    prefixes.sent(first, "http://a")
    later = prefixes.look(CompletionPrompt(texts=("abcdefgh" + "1234xxxx",)))
    assert later.cached == {"http://a": 12}
    other = prefixes.look(CompletionPrompt(texts=("zbcdefgh12345678",)))
    assert other.cached == {}


def test_an_endpoint_that_went_down_is_forgotten_and_said(counter: Any) -> None:
    """A down engine may restart with an empty cache: believing it still holds a prefix sends
    the follow-ups to a cold home. Wired from the engine events the gateway builds (the monitor's
    and failover's, and a reloaded monitor's)."""
    settings = parse_settings(lanes_config(["http://a", "http://b"], ["http://c"]), environ={})
    gateway = Gateway.build(settings, counter)
    prefixes = gateway.pipeline.prefixes
    prompt = CompletionPrompt(texts=("abcdefgh" * 64,))
    for url in ("http://a", "http://b"):
        prefixes.sent(prefixes.look(prompt), url)
    assert set(prefixes.look(prompt).cached) == {"http://a", "http://b"}
    with capture_logs() as logs:
        gateway.monitor._on_event(  # what the health monitor reports
            StateChange("fast", "http://a", EngineState.UP, EngineState.DOWN, "refused")
        )
        gateway.monitor._on_event(
            StateChange("fast", "http://b", EngineState.UP, EngineState.SLOW, "probe 3s")
        )
    assert set(prefixes.look(prompt).cached) == {"http://b"}  # slow is still its cache
    [event] = [e for e in logs if e["event"] == "prefix_index.forgotten"]
    assert event["endpoint"] == "http://a" and event["reason"] == "engine_down"
    assert event["blocks"] > 0
    gateway.adopt(settings)  # a reload's monitor, and failover's ejections, tell it too
    for on_event in (gateway.monitor._on_event, gateway.pipeline.failover._on_change):
        prefixes.sent(prefixes.look(prompt), "http://b")
        on_event(StateChange("fast", "http://b", EngineState.UP, EngineState.DOWN, "ejected"))
        assert prefixes.look(prompt).cached == {}
    assert gateway.metrics.registry.get_sample_value("shapegate_prefix_index_blocks") == 0


def test_a_restarted_engine_is_forgotten_and_its_kv_events_read_again_from_0() -> None:
    """A restart empties the engine's cache whether or not it ever went down: the approximate
    record of what was sent there is dropped, and an engine publishing KV events has its
    blocks cleared and its next batch read as the new process's first (a gap to replay from
    sequence 0); the other endpoints keep theirs."""
    metrics = Metrics()
    prefixes = Prefixes(PrefixIndexSettings(block_tokens=2, bytes_per_token=1), metrics)
    prompt = CompletionPrompt(texts=("abcdefgh" * 4,))
    for url in ("http://a", "http://b"):
        prefixes.sent(prefixes.look(prompt), url)
    kv = prefixes.engines.setdefault("http://k", EngineBlocks("http://k"))
    kv.apply(Batch(0, 1.0, (Stored((b"h1",), None, (1, 2), 2),)))
    kv.apply(Batch(1, 2.0, (Stored((b"h2",), b"h1", (3, 4), 2),)))
    assert kv.blocks == 2 and kv.next_seq == 2
    with capture_logs() as logs:
        prefixes.engine_restarted("http://a")
        prefixes.engine_restarted("http://k")
    assert set(prefixes.look(prompt).cached) == {"http://b"}
    assert kv.blocks == 0 and kv.next_seq is None and kv.rebuilds == 1
    # The new process's batch 5 first: 0-4 are asked of the replay socket.
    assert kv.apply(Batch(5, 3.0, ())) is Step.GAP
    assert [(e["endpoint"], e["reason"], e["blocks"], e["kv_events"]) for e in logs] == [
        ("http://a", "engine_restarted", 16, False),
        ("http://k", "engine_restarted", 2, True),
    ]
    assert metrics.registry.get_sample_value("shapegate_prefix_index_blocks") == 16
    blocks = {"endpoint": "http://k"}
    assert metrics.registry.get_sample_value("shapegate_kv_events_blocks", blocks) == 0


def test_the_index_keeps_at_most_max_blocks_and_exports_its_size() -> None:
    metrics = Metrics()
    prefixes = Prefixes(
        PrefixIndexSettings(block_tokens=2, bytes_per_token=1, max_blocks=5), metrics
    )
    for i in range(10):
        prefixes.sent(prefixes.look(CompletionPrompt(texts=(f"{i:04d}" * 4,))), "http://a")
    assert prefixes.index.blocks == 5
    assert metrics.registry.get_sample_value("shapegate_prefix_index_blocks") == 5
    state = prefixes.state()
    assert (state["entries"], state["bound"]) == (5, 5)
    assert state["evicted"] == prefixes.index.evicted > 0
    assert state["endpoints"] == {
        "http://a": {"source": "approximate", "blocks": 5, "capacity_blocks": None}
    }
    assert state["lag_s"] is None  # no engine publishes KV events here


def test_the_state_shows_each_kv_events_engines_blocks_and_lag() -> None:
    prefixes = Prefixes(PrefixIndexSettings(source="kv_events", block_tokens=2), Metrics())
    blocks = prefixes.engines.setdefault("http://k", EngineBlocks("http://k"))
    stored = Stored((b"h1", b"h2"), None, (1, 2, 3, 4), 2)
    blocks.apply(Batch(0, 100.0, (stored,)), clock=lambda: 100.25)
    state = prefixes.state()
    assert state["endpoints"]["http://k"] == {
        "source": "kv_events",
        "blocks": 2,
        "lag_s": 0.25,
        "rebuilds": 0,
    }
    assert state["lag_s"] == 0.25 and state["source"] == "kv_events"


def test_a_smaller_kv_capacity_shrinks_the_record_and_its_gauge_at_once() -> None:
    """An engine that reports a smaller KV cache (a restart with another --gpu-memory-utilization)
    bounds its record at once, and the exported size follows without waiting for a send."""
    metrics = Metrics()
    prefixes = Prefixes(
        PrefixIndexSettings(block_tokens=2, bytes_per_token=1, max_blocks=100), metrics
    )
    for i in range(10):
        prefixes.sent(prefixes.look(CompletionPrompt(texts=(f"{i:04d}" * 4,))), "http://a")
    assert prefixes.index.held_by("http://a") > 8
    assert metrics.registry.get_sample_value("shapegate_prefix_index_blocks") == (
        prefixes.index.blocks
    )
    view = EngineView("fast", "http://a", EngineState.UP, 0, kv_capacity_tokens=2 * 8)
    prefixes.learn([view])
    assert prefixes.index.held_by("http://a") == 8
    assert metrics.registry.get_sample_value("shapegate_prefix_index_blocks") == 8


async def test_route_decision_carries_the_chosen_endpoints_score_and_cached_tokens(
    gateway_at: Any,
) -> None:
    engines = [FakeEngine() for _ in range(2)]
    async with serve_asgi(engines[0]) as a, serve_asgi(engines[1]) as b:
        config = lanes_config([a, b], [a])
        config["lanes"][0]["weights"] = {"prefix": 2.0}
        config["prefix_index"] = {"block_tokens": 8}
        async with gateway_at(config) as (url, _), httpx.AsyncClient() as client:
            with capture_logs() as logs:
                for turn in range(2):
                    r = await client.post(url + "/v1/chat/completions", json=_body(3, turn, 0.0))
                    assert r.status_code == 200
    first, second = [e for e in logs if e["event"] == "route.decision"]
    assert first["cached_tokens"] == 0 and first["score"] == 1.0  # idle, nothing cached
    assert second["endpoint"] == first["endpoint"]
    # The system prompt (about 1,000 bytes, 4 a token) in whole blocks of 8 tokens.
    assert 200 <= second["cached_tokens"] <= 260
    assert second["score"] > 2.0 * 0.8


async def _third_turn_endpoint(gateway_at: Any, hold: int | None) -> tuple[str, str]:
    """Agent 3's first turn makes its home; its second holds the home's only slot for 0.5 s;
    its third comes meanwhile: the endpoints of the second and the third."""
    engines = [FakeEngine() for _ in range(2)]
    async with serve_asgi(engines[0]) as a, serve_asgi(engines[1]) as b:
        config = lanes_config([a, b], [a])
        config["lanes"][0]["slots"] = {"lane": 2, "per_endpoint": 1}
        config["lanes"][0]["weights"] = {"load": 1.0, "prefix": 1.0}
        config["lanes"][0]["prefix_hold_tokens"] = hold
        config["prefix_index"] = {"block_tokens": 8}
        async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=10) as client:
            with capture_logs() as logs:
                chat = url + "/v1/chat/completions"
                assert (await client.post(chat, json=_body(3, 0, 0.0))).status_code == 200
                second = asyncio.create_task(client.post(chat, json=_body(3, 1, 0.5)))
                await asyncio.sleep(0.15)
                third = await client.post(chat, json=_body(3, 2, 0.0))
                assert third.status_code == 200 and (await second).status_code == 200
    decisions = [e for e in logs if e["event"] == "route.decision"]
    return decisions[1]["endpoint"], decisions[2]["endpoint"]


async def test_a_request_waits_for_its_full_home_with_prefix_hold_tokens(
    gateway_at: Any,
) -> None:
    """``prefix_hold_tokens: 0``: the home is full but has only the second turn's short tail to
    prefill (the prefill ledger), the idle endpoint would prefill the whole system prompt: the
    third turn waits for the home. Without the knob it takes the idle endpoint at once."""
    second, third = await _third_turn_endpoint(gateway_at, 0)
    assert third == second
    second, third = await _third_turn_endpoint(gateway_at, None)
    assert third != second


async def test_a_streamed_answers_first_chunk_ends_its_pending_prefill(gateway_at: Any) -> None:
    """The prefill ledger forgets a request at its answer's first chunk, not its end. Turn 1
    brings a long new tail (about 500 uncached tokens) to the home and then streams slowly;
    turn 2 comes once turn 1's first chunk is back: the home has nothing left to prefill, so
    with ``prefix_hold_tokens: 0`` turn 2 waits for it rather than prefill the whole system
    prompt (about 250 tokens) on the idle endpoint."""
    engines = [FakeEngine() for _ in range(2)]
    async with serve_asgi(engines[0]) as a, serve_asgi(engines[1]) as b:
        config = lanes_config([a, b], [a])
        config["lanes"][0]["slots"] = {"lane": 2, "per_endpoint": 1}
        config["lanes"][0]["weights"] = {"load": 1.0, "prefix": 1.0}
        config["lanes"][0]["prefix_hold_tokens"] = 0
        config["prefix_index"] = {"block_tokens": 8}
        async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=10) as client:
            chat = url + "/v1/chat/completions"
            with capture_logs() as logs:
                assert (await client.post(chat, json=_body(3, 0, 0.0))).status_code == 200
                long = _body(3, 1, 0.0)
                long["messages"][1]["content"] = "a long new question " * 100
                long["stream"] = True
                long["fake"] = {"chunks": 4, "gap": 0.3}
                async with client.stream("POST", chat, json=long) as streamed:
                    chunks = streamed.aiter_raw()
                    assert (await anext(chunks)).startswith(b"data:")
                    third = await client.post(chat, json=_body(3, 2, 0.0))
                    assert third.status_code == 200
                    async for _ in chunks:
                        pass
    decisions = [e["endpoint"] for e in logs if e["event"] == "route.decision"]
    assert decisions[0] == decisions[1] == decisions[2], decisions


async def test_an_endpoints_record_is_bounded_by_the_kv_cache_its_engine_reports(
    gateway_at: Any,
) -> None:
    """An engine reporting a KV cache of 64 blocks of 8 tokens (``vllm:cache_config_info``):
    once the gateway has read it, its record of what that engine holds never passes 64 blocks
    however many system prompts it is sent (12 of about 28 blocks each), the most recent kept,
    as the engine's own prefix cache keeps them."""
    engine = FakeEngine()
    engine.cache_config = (8, 64)
    async with serve_asgi(engine) as a:
        config = lanes_config([a], [a])
        config["lanes"][0]["weights"] = {"prefix": 1.0}
        config["lanes"][0]["health"] = {"interval_s": 0.1, "scrape_interval_s": 0.05}
        config["prefix_index"] = {"block_tokens": 8}
        async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=10) as client:

            async def capacity() -> int | None:
                state = (await client.get(url + "/admin/state")).json()
                fast = next(c for c in state["clusters"] if c["name"] == "fast")
                return fast["endpoints"][0].get("kv_capacity_tokens")

            assert await wait_for(capacity, 5, what="the engine's KV capacity read") == 512
            chat = url + "/v1/chat/completions"
            for agent in range(12):
                assert (await client.post(chat, json=_body(agent, 0, 0.0))).status_code == 200
                held = parse((await client.get(url + "/metrics")).text)
                assert held.value("shapegate_prefix_index_blocks") <= 64
            assert held.value("shapegate_prefix_index_blocks") >= 56  # full, not emptied
            index = (await client.get(url + "/admin/state")).json()["prefix_index"]
            assert index["endpoints"][a]["capacity_blocks"] == 64
            assert index["entries"] == index["endpoints"][a]["blocks"] >= 56
            assert index["bound"] == 250_000 and index["overflowed"] > 0
            with capture_logs() as logs:
                assert (await client.post(chat, json=_body(11, 1, 0.0))).status_code == 200
                assert (await client.post(chat, json=_body(0, 1, 0.0))).status_code == 200
    latest, first = [e["cached_tokens"] for e in logs if e["event"] == "route.decision"]
    # The latest prompt still held; the first evicted, but for the block every prompt shares.
    assert latest >= 200 and first == 8
