"""Issue 34, first must-show: ``shapegate demo`` under mixed traffic with a shadow policy whose
fast lane ends at 8,192 tokens. Every request is compared; the disagreements are exactly the
requests of 8,192 to 32,767 tokens; the engines' own request counters moved by exactly the
requests sent (the shadow sent nothing); no slot is left held (the shadow held none)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.gateway.tools.test_demo import free_engine_base
from tests.gateway.tools.test_demo_restart import after, printed_block, start_demo
from tests.support.prom import parse
from tests.support.servers import free_port

SHADOW_FAST_ENDS = 8192
# Words of one token each: small prompts, prompts the shadow moves to heavy, and monsters.
WORDS = [300, 800, 2000, 4000, 6000, 8000] * 2 + [8500, 12000, 20000, 26000, 32000] + [40000, 60000]


def prompt(words: int) -> dict[str, Any]:
    return {
        "model": "qwen3.6",
        "messages": [{"role": "user", "content": " ".join("lane" for _ in range(words))}],
        "max_tokens": 4,
        "stream": True,
    }


def engine_requests(engines: list[str]) -> float:
    """The chat requests every engine answered, by its own counter."""
    total = 0.0
    for url in engines:
        scrape = parse(httpx.get(url + "/metrics", timeout=10).text)
        total += scrape.value("http_requests_total", handler="/v1/chat/completions")
    return total


def slots(url: str) -> dict[str, int]:
    state = httpx.get(url + "/admin/state", timeout=10).json()
    lanes = {lane["name"]: lane["slots_in_use"] for lane in state["lanes"]}
    endpoints = {e["url"]: e["slots_in_use"] for c in state["clusters"] for e in c["endpoints"]}
    return lanes | endpoints


async def send_all(url: str) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10)) as client:

        async def one(words: int) -> httpx.Response:
            answer = await client.post(url + "/v1/chat/completions", json=prompt(words))
            assert answer.status_code == 200, answer.text
            return answer

        return list(await asyncio.gather(*(one(n) for n in WORDS)))


def test_the_demo_with_a_shadow_policy_compares_every_request_and_sends_nothing(
    tmp_path: Path,
) -> None:
    base, port = free_engine_base(), free_port()
    url = f"http://127.0.0.1:{port}"
    engines = [f"http://127.0.0.1:{base + k}" for k in (1, 2, 11, 12)]
    demo = start_demo(port, base, tmp_path / "demo.log")
    try:
        lines = printed_block(demo, tmp_path / "demo.log")
        policy = yaml.safe_load(Path(after(lines, "  policy ")).read_text())
        policy["lanes"][0]["max_prompt_tokens"] = SHADOW_FAST_ENDS
        policy["lanes"][1]["min_prompt_tokens"] = SHADOW_FAST_ENDS
        started = httpx.post(
            url + "/admin/shadow",
            content=yaml.safe_dump(policy),
            headers={"content-type": "application/yaml", "x-shapegate-admin": "1"},
            timeout=30,
        )
        assert started.status_code == 200, started.text
        counted_before, slots_before = engine_requests(engines), slots(url)
        answers = asyncio.run(send_all(url))
        counted_after, slots_after = engine_requests(engines), slots(url)
        report = httpx.get(url + "/admin/shadow", timeout=30).json()
    finally:
        demo.send_signal(signal.SIGINT)
        try:
            demo.wait(timeout=60)
        except subprocess.TimeoutExpired:
            demo.kill()
            demo.wait(timeout=30)
    tokens = [int(a.headers["x-shapegate-prompt-tokens"]) for a in answers]
    moved = [t for t in tokens if SHADOW_FAST_ENDS <= t < 32768]
    assert len(moved) == 5
    assert report["compared"] == len(WORDS)
    assert report["disagreements"] == [
        {
            "active": "fast",
            "shadow": "heavy",
            "requests": len(moved),
            "min_tokens": min(moved),
            "max_tokens": max(moved),
        }
    ]
    assert report["agreed"] == len(WORDS) - len(moved)
    assert counted_after - counted_before == len(WORDS)
    assert slots_before == slots_after
    assert set(slots_after.values()) == {0}
