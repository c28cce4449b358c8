"""``prefix_index.source: kv_events``: routing by what the engines' own KV events say they hold
(gateway/request/prefix.py ``readers``, engine_pool/kv_events.py), its settings, and the
gateway without the ``kv-events`` extra."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from gateway.count.tokens import TokenCounter
from gateway.observe.metrics import Metrics
from gateway.protocols.openai import ChatPrompt
from gateway.request.prefix import Prefixes, readers
from gateway.settings import ConfigError, parse_settings
from tests.conftest import lanes_config
from tests.support.fake_engine import FakeEngine
from tests.support.servers import serve_asgi
from tests.support.vllm_kv import BlockRemoved, Publisher, stored, wire

BLOCK = 16
MESSAGES = [
    {"role": "system", "content": "You review contracts. " * 30},
    {"role": "user", "content": "What is the notice period?"},
]


def kv_config(a: str, b: str, pa: Publisher, pb: Publisher) -> dict[str, Any]:
    config = lanes_config([a, b], [a])
    config["clusters"][0]["kv_events"] = {
        "endpoints": {
            url: {
                "publisher": f"tcp://127.0.0.1:{p.port}",
                "replay": f"tcp://127.0.0.1:{p.replay_port}",
            }
            for url, p in ((a, pa), (b, pb))
        }
    }
    config["prefix_index"] = {"source": "kv_events", "block_tokens": BLOCK}
    config["lanes"][0]["weights"] = {"prefix": 2.0}
    return config


@contextlib.asynccontextmanager
async def replaying(*publishers: Publisher) -> AsyncIterator[None]:
    async def serve() -> None:
        while True:
            for p in publishers:
                p.serve_replay()
            await asyncio.sleep(0.01)

    task = asyncio.create_task(serve())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for p in publishers:
            p.close()


async def held(url: str, endpoint: str, blocks: int, client: httpx.AsyncClient) -> None:
    sample = f'shapegate_kv_events_blocks{{endpoint="{endpoint}"}} {float(blocks)}'
    for _ in range(250):
        if sample in (await client.get(url + "/metrics")).text:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{endpoint} never reported {blocks} blocks")


async def test_requests_go_where_the_engines_events_say_the_prompt_is_cached(
    gateway_at: Any, counter: TokenCounter
) -> None:
    ids = counter.encode("qwen3.6", counter.render_chat("qwen3.6", ChatPrompt(tuple(MESSAGES))))
    shared = BLOCK * (len(ids) // BLOCK - 1)  # every whole block but the last
    engines = [FakeEngine(), FakeEngine()]
    pa, pb = Publisher(), Publisher()
    async with (
        serve_asgi(engines[0]) as a,
        serve_asgi(engines[1]) as b,
        replaying(pa, pb),
        httpx.AsyncClient() as client,
    ):
        # Engine b held the system prompt before the gateway started (replayed to it).
        blocks = shared // BLOCK
        hashes: list[bytes | int] = [f"b{i}".encode() for i in range(blocks)]
        pb.publish(wire(0, stored(hashes, None, ids[:shared], BLOCK)), send=False)
        async with gateway_at(kv_config(a, b, pa, pb)) as (url, _):
            await held(url, b, blocks, client)
            with capture_logs() as logs:
                for _ in range(3):
                    body = {"model": "qwen3.6", "messages": MESSAGES}
                    r = await client.post(url + "/v1/chat/completions", json=body)
                    assert r.status_code == 200
            decisions = [e for e in logs if e["event"] == "route.decision"]
            # Not the approximate record: the first request already knows b holds its prefix,
            # and the later ones go there too (the gateway records nothing for b itself).
            assert [d["endpoint"] for d in decisions] == [b, b, b]
            assert [d["cached_tokens"] for d in decisions] == [shared] * 3
            # b evicts the blocks, a stores them: the next request follows the events.
            pb.publish(wire(1, stored([b"x"], None, [1] * BLOCK, BLOCK)))
            pb.publish(wire(2, BlockRemoved(hashes, "GPU")))
            pa.publish(wire(0, stored([b"a0"], None, ids[:BLOCK], BLOCK)))
            await held(url, b, 1, client)
            await held(url, a, 1, client)
            with capture_logs() as logs:
                body = {"model": "qwen3.6", "messages": MESSAGES}
                r = await client.post(url + "/v1/chat/completions", json=body)
            (decision,) = [e for e in logs if e["event"] == "route.decision"]
            assert decision["endpoint"] == a and decision["cached_tokens"] == BLOCK


def test_source_kv_events_needs_a_publishing_cluster_and_the_reverse() -> None:
    config = lanes_config(["http://a:1"], ["http://b:1"])
    config["prefix_index"] = {"source": "kv_events"}
    with pytest.raises(ConfigError, match="no cluster sets clusters"):
        parse_settings(config, environ={})
    config = lanes_config(["http://a:1"], ["http://b:1"])
    config["clusters"][0]["kv_events"] = {"port": 5557}
    with pytest.raises(ConfigError, match=r"read only with prefix_index\.source"):
        parse_settings(config, environ={})
    for bad, why in (
        ({"port": 5557, "topic": "x"}, "topic"),
        ({"replay_port": 5558}, "needs port or endpoints"),
        ({"endpoints": {"http://zz:1": {"publisher": "tcp://zz:1"}}}, "unknown"),
        ({"endpoints": {"http://a:1": {"publisher": "http://a:1"}}}, "publisher"),
    ):
        config = lanes_config(["http://a:1"], ["http://b:1"])
        config["clusters"][0]["kv_events"] = bad
        config["prefix_index"] = {"source": "kv_events"}
        with pytest.raises(ConfigError, match=why):
            parse_settings(config, environ={})


def test_readers_per_endpoint_from_port_or_endpoints_and_none_without_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = lanes_config(["http://10.0.0.1:8000", "http://10.0.0.2:8000"], ["http://b:1"])
    config["clusters"][0]["kv_events"] = {
        "port": 5557,
        "replay_port": 5558,
        "endpoints": {"http://10.0.0.2:8000": {"publisher": "tcp://10.0.0.9:6000"}},
    }
    config["prefix_index"] = {"source": "kv_events"}
    settings = parse_settings(config, environ={})
    prefixes = Prefixes(settings.prefix_index, Metrics())
    found = readers(settings, prefixes, Metrics())
    assert [(r.endpoint, r.replay_endpoint) for r in found] == [
        ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"),
        ("tcp://10.0.0.9:6000", None),
    ]
    assert set(prefixes.engines) == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "zmq" else real(name, *a)
    )
    prefixes = Prefixes(settings.prefix_index, Metrics())
    with capture_logs() as logs:
        assert readers(settings, prefixes, Metrics()) == []
    (said,) = [e for e in logs if e["event"] == "kv_events.unavailable"]
    assert said["missing"] == ["zmq"] and said["log_level"] == "error"
    # Without readers the approximate record serves every endpoint.
    assert prefixes.engines == {}
