"""Prefix affinity: agents reusing a long system prompt land on the engine that cached it."""

from __future__ import annotations

from typing import Any

import httpx

from gateway.protocols.openai import ChatPrompt, CompletionPrompt, prefix_key
from tests.conftest import lanes_config
from tests.support.fake_engine import FakeEngine
from tests.support.servers import serve_asgi


def test_prefix_key_prefers_the_system_prompt() -> None:
    system = ChatPrompt(
        messages=(
            {"role": "system", "content": "You are a tool."},
            {"role": "user", "content": "a"},
        )
    )
    assert prefix_key(system, 4096) == b"You are a tool."
    parts = ChatPrompt(
        messages=({"role": "user", "content": [{"type": "text", "text": "x" * 100}]},)
    )
    assert prefix_key(parts, 16) == b"x" * 16
    assert prefix_key(CompletionPrompt(token_ids=((1, 2, 3),)), 4096) == b"1,2,3"
    assert prefix_key(CompletionPrompt(texts=("",)), 4096) is None


async def test_requests_sharing_a_system_prompt_share_an_engine(gateway_at: Any) -> None:
    engines = [FakeEngine() for _ in range(3)]
    async with (
        serve_asgi(engines[0]) as a,
        serve_asgi(engines[1]) as b,
        serve_asgi(engines[2]) as c,
    ):
        config = lanes_config([a, b, c], [a])
        config["lanes"][0]["prefix_affinity"] = True
        async with gateway_at(config) as (url, _), httpx.AsyncClient() as client:
            for agent in range(6):
                for turn in range(5):
                    body = {
                        "model": "qwen3.6",
                        "messages": [
                            {"role": "system", "content": f"agent {agent} instructions " * 20},
                            {"role": "user", "content": f"turn {turn}"},
                        ],
                    }
                    r = await client.post(url + "/v1/chat/completions", json=body)
                    assert r.status_code == 200
    homes: dict[str, set[int]] = {}
    for index, engine in enumerate(engines):
        for seen in engine.seen.values():
            agent = seen.body.split(b"agent ")[1].split(b" ")[0].decode()
            homes.setdefault(agent, set()).add(index)
    assert all(len(where) == 1 for where in homes.values()), homes
    assert len({next(iter(w)) for w in homes.values()}) > 1  # agents spread over engines
