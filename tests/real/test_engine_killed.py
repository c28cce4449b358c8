"""``kill -9`` of one real vLLM (its whole process group: API server, engine core, workers)
while it serves: the gateway marks it down, every client gets an answer in the API's shape (an
error, or the emergency cluster's answer after failover), no slot is left held, and new requests
of its lane are served by the emergency cluster. Nothing is restarted: this file runs last
(tests/real/conftest.py moves it there)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx

from tests.real.engines import MODEL, Real
from tests.support.prom import parse
from tests.support.waiting import wait_for

LOAD = 6


def chat(stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Keep going."}],
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": stream,
    }


async def one(client: httpx.AsyncClient, url: str, stream: bool) -> tuple[int, str]:
    try:
        answer = await client.post(url + "/v1/chat/completions", json=chat(stream))
    except httpx.HTTPError as exc:  # a stream cut without its closing event
        return -1, f"{type(exc).__name__}: {exc}"
    return answer.status_code, answer.text


def in_api_shape(status: int, text: str) -> str | None:
    """Why this answer is not one the OpenAI SDK understands; None when it is."""
    if status == 200:
        if text.lstrip().startswith("{"):
            return None if json.loads(text)["object"] == "chat.completion" else text[:200]
        events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return f"a stream without its [DONE]: {text[-200:]}"
        for event in events[:-1]:
            body = json.loads(event)
            if "error" in body and not {"message", "type", "code"} <= set(body["error"]):
                return f"an error event without its fields: {event}"
        return None
    if status < 0:
        return text
    error = json.loads(text).get("error")
    if not isinstance(error, dict) or not {"message", "type", "code"} <= set(error):
        return f"{status} not in the API's error shape: {text[:200]}"
    return None


async def test_kill_9_of_a_vllm_under_load(real: Real) -> None:
    victim = real.fast
    async with httpx.AsyncClient(timeout=120) as client:

        async def running() -> float:
            answer = await client.get(victim.url + "/metrics")
            return parse(answer.text).value("vllm:num_requests_running")

        load = [asyncio.create_task(one(client, real.gateway.url, i % 2 == 0)) for i in range(LOAD)]
        await wait_for(
            lambda: _at_least(running, 3), 60, interval=0.1, what="the load running in vLLM"
        )
        assert real.gateway.state()["lanes"][0]["slots_in_use"] >= 3
        killed_at = time.monotonic()
        victim.kill_group()
        results = await asyncio.gather(*load)
        answered_s = time.monotonic() - killed_at

        def marked_down() -> bool:
            (endpoint,) = next(c for c in real.gateway.state()["clusters"] if c["name"] == "fast")[
                "endpoints"
            ]
            return endpoint["state"] == "down"

        await wait_for(marked_down, 10, interval=0.1, what="the killed engine marked down")
        down_s = time.monotonic() - killed_at

        def idle() -> bool:
            state = real.gateway.state()
            return state["in_flight"] == 0 and all(x["slots_in_use"] == 0 for x in state["lanes"])

        await wait_for(idle, 10, interval=0.1, what="every slot released")
        after = await client.post(
            real.gateway.url + "/v1/chat/completions", json={**chat(False), "max_tokens": 4}
        )
    print(
        f"\nkill -9 under load: {len(results)} clients answered within {answered_s:.1f}s "
        f"(statuses {sorted(s for s, _ in results)}), engine down after {down_s:.1f}s"
    )
    bad = [(s, why) for s, text in results if (why := in_api_shape(s, text))]
    assert not bad, bad
    # The non-streamed requests had sent nothing yet: they moved to the emergency cluster.
    moved = [e for e in real.gateway.events("route.retry") if e.get("from") == victim.url]
    assert moved, "no request failed over from the killed engine"
    assert after.status_code == 200, after.text
    assert after.headers["x-shapegate-cluster"] == "heavy"
    # The whole group is gone: no engine core left holding memory and cores.
    assert victim.proc is not None
    victim.proc.wait(10)  # reaped: a zombie would still count as a member of the group
    await wait_for(lambda: not _group_alive(victim.proc.pid), 10, what="the process group gone")


async def _at_least(running: Any, n: int) -> bool:
    return bool(await running() >= n)


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is left in the group: whoever reaps the engine's
    orphans (PID 1 in a container may not), a zombie holds no memory and no core."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we read
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def test_the_engine_going_down_is_logged_as_a_warning(real: Real) -> None:
    """An operator's alerting reads warnings: a real engine lost must not be an info line."""
    downs = [e for e in real.gateway.events("engine.state_changed") if e.get("new") == "down"]
    assert downs, "no engine.state_changed to down in the gateway's log"
    assert {e["level"] for e in downs} == {"warning"}, downs
