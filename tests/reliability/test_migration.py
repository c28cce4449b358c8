"""``kill -9`` of an engine mid-stream: every stream it carried goes on at the other engine.

Two simulated engines (processes of their own) serve one lane; six clients stream answers of
300 tokens (chat and completions, with and without usage). Once the streams are about 50 chunks
in, the engine carrying most of them (at least two) is killed with SIGKILL. Every stream must
end with ``[DONE]`` and no error event, under one response id with one role chunk, and its text
(and usage) must equal the same request's uninterrupted answer from a healthy engine
(gateway/request/migration.py; the sim's output is a function of its context,
engine_pool/sim/text.py).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from engine_pool.sim.wire import output_text
from gateway.edge.app import create_app
from gateway.settings import parse_settings
from tests.conftest import JSON, MODEL, lanes_config
from tests.reliability.reliability_support import held, settled, timed_logs, words
from tests.support.servers import serve_asgi
from tests.support.sim_process import sim_processes

CLIENTS = 7
MAX_TOKENS = 300
KILL_AFTER_CHUNKS = 50


def body_of(n: int) -> dict[str, Any]:
    """Seven requests: four chats (two asking for usage), two completions (one with usage) and
    a completions request whose prompt is token ids (with usage)."""
    if n < 4:
        body: dict[str, Any] = {
            "model": "qwen3.6",
            "messages": [{"role": "user", "content": f"client {n}: tell me a long story"}],
        }
    elif n < 6:
        body = {"model": "qwen3.6", "prompt": f"client {n}: once upon a time"}
    else:
        body = {"model": "qwen3.6", "prompt": [9707, 11, 1879, 0, 13, n]}
    body.update(stream=True, max_tokens=MAX_TOKENS, temperature=0)
    if n % 2 == 0:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class Stream:
    """What one client read: its events in order, as parsed JSON (``[DONE]`` as the string)."""

    events: list[Any] = field(default_factory=list)
    raw: bytes = b""

    @property
    def chunks(self) -> int:
        return self.raw.count(b"data: ")

    def text(self) -> str:
        out = []
        for event in self.events:
            if isinstance(event, dict) and event.get("choices"):
                choice = event["choices"][0]
                piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
                out.append(piece or "")
        return "".join(out)

    def usage(self) -> dict[str, int] | None:
        found = [e["usage"] for e in self.events if isinstance(e, dict) and e.get("usage")]
        return found[-1] if found else None


def parse(raw: bytes) -> list[Any]:
    events: list[Any] = []
    for block in raw.split(b"\n\n"):
        if not block.startswith(b"data: "):
            continue
        data = block[len(b"data: ") :]
        events.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return events


async def read_stream(
    client: httpx.AsyncClient, url: str, rid: str, body: dict[str, Any], into: Stream
) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    headers = {"x-request-id": rid, **JSON}
    async with client.stream("POST", url + path, content=orjson.dumps(body), headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for piece in r.aiter_bytes():
            into.raw += piece
    into.events = parse(into.raw)


async def carried(client: httpx.AsyncClient, sim_url: str, rids: set[str]) -> set[str]:
    """The request ids among ``rids`` that reached this engine."""
    found = (await client.get(sim_url + "/sim/requests")).json()["requests"]
    return {r["request_id"] for r in found} & rids


async def test_kill_9_mid_stream_migrates_every_stream_it_carried() -> None:
    with sim_processes(2, time_scale=1.0) as sims:
        config = lanes_config([s.url for s in sims], ["http://127.0.0.1:9"])
        # The engine's own template, so that our prompt count is the engine's (usage totals).
        tokenizer: dict[str, Any] = {"source": "builtin", "name": "qwen3.6", "chat_template": "hf"}
        config["models"] = [{**MODEL, "tokenizer": tokenizer}]
        settings = parse_settings(config, environ={})
        streams = {f"m{n}": Stream() for n in range(CLIENTS)}
        bodies = {f"m{n}": body_of(n) for n in range(CLIENTS)}
        with timed_logs() as logs:
            async with (
                serve_asgi(create_app(settings)) as url,
                httpx.AsyncClient(timeout=60) as client,
            ):
                tasks = [
                    asyncio.create_task(read_stream(client, url, rid, bodies[rid], streams[rid]))
                    for rid in streams
                ]
                deadline = time.monotonic() + 30
                while min(s.chunks for s in streams.values()) < KILL_AFTER_CHUNKS:
                    assert time.monotonic() < deadline, "the streams never got going"
                    await asyncio.sleep(0.01)
                on = [await carried(client, s.url, set(streams)) for s in sims]
                victim_index = 0 if len(on[0]) >= len(on[1]) else 1
                victim, survivor = sims[victim_index], sims[1 - victim_index]
                cut = on[victim_index]
                assert len(cut) >= 2, on
                chunks_at_kill = {rid: streams[rid].chunks for rid in cut}
                victim.kill()
                await asyncio.gather(*tasks)
                state = await settled(client, url)
                assert held(state) == 0, state
                # The same requests, uninterrupted, from the healthy engine.
                reference = {rid: Stream() for rid in streams}
                await asyncio.gather(
                    *(
                        read_stream(client, survivor.url, f"ref-{rid}", bodies[rid], reference[rid])
                        for rid in streams
                    )
                )
    migrated = [e for e in logs if e["event"] == "route.migrated"]
    finished = {e["request_id"]: e for e in logs if e["event"] == "route.finished"}
    print(
        f"\nkilled the engine carrying {len(cut)} of {CLIENTS} streams at "
        f"{sorted(chunks_at_kill.values())} chunks; migrated: "
        + ", ".join(f"{e['request_id']} after {e['tokens_sent']} tokens" for e in migrated)
    )
    for rid, stream in streams.items():
        events = stream.events
        assert events[-1] == "[DONE]", (rid, stream.raw[-300:])
        assert not [e for e in events if isinstance(e, dict) and "error" in e], rid
        objects = [e for e in events if isinstance(e, dict)]
        assert {e["id"] for e in objects} == {objects[0]["id"]}, rid  # one response id
        assert len({e["created"] for e in objects}) == 1, rid
        roles = [e for e in objects if e["choices"] and "role" in e["choices"][0].get("delta", {})]
        assert len(roles) == (1 if "messages" in bodies[rid] else 0), rid
        expected = reference[rid]
        assert stream.text() == expected.text(), rid
        assert len(expected.text().split()) == MAX_TOKENS
        assert stream.usage() == expected.usage(), rid
        assert finished[rid]["outcome"] == "ok"
        assert finished[rid]["migrations"] == (1 if rid in cut else 0), rid
    assert {e["request_id"] for e in migrated} == cut
    for event in migrated:
        assert event["from"] == victim.url and event["to"] == survivor.url
        assert event["tokens_sent"] >= KILL_AFTER_CHUNKS - 2, event
        assert event["reason"] == "connection_lost", event


MONSTER_WORDS = 57_000  # about 112k tokens of Qwen3.6
MONSTER_OUTPUT = 300


async def test_a_migrated_monster_stalls_for_the_new_engines_prefill_and_no_more() -> None:
    """A 112k-token stream migrated after 40 chunks: the client waits once, for the new engine's
    prefill of the whole prompt plus the text (the sim caches no prefix across engines), about
    the stream's own time to first token; the rest of the stream keeps its pace."""
    with sim_processes(2, profile="h100-heavy", time_scale=0.1) as sims:
        config = lanes_config(["http://127.0.0.1:9"], [s.url for s in sims])
        config["lanes"][1]["timeouts"] = {
            "connect_s": 2,
            "first_byte_s": 30,
            "idle_s": 30,
            "total_s": 120,
        }
        settings = parse_settings(config, environ={})
        body = {
            "model": "qwen3.6",
            "messages": [{"role": "user", "content": words(MONSTER_WORDS, "monster")}],
            "max_tokens": MONSTER_OUTPUT,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        arrivals: list[tuple[float, bytes]] = []
        with timed_logs() as logs:
            async with (
                serve_asgi(create_app(settings)) as url,
                httpx.AsyncClient(timeout=120) as client,
            ):

                async def read() -> None:
                    headers = {"x-request-id": "monster", **JSON}
                    async with client.stream(
                        "POST",
                        url + "/v1/chat/completions",
                        content=orjson.dumps(body),
                        headers=headers,
                    ) as r:
                        assert r.status_code == 200
                        async for piece in r.aiter_raw():
                            arrivals.append((time.monotonic(), piece))

                sent = time.monotonic()
                task = asyncio.create_task(read())
                while sum(p.count(b"data: ") for _, p in arrivals) < 40:
                    assert not task.done(), arrivals
                    await asyncio.sleep(0.005)
                on = [await carried(client, s.url, {"monster"}) for s in sims]
                victim = sims[0] if on[0] else sims[1]
                victim.kill()
                await task
    raw = b"".join(p for _, p in arrivals)
    events = parse(raw)
    stream = Stream(events, raw)
    assert events[-1] == "[DONE]" and not [
        e for e in events if isinstance(e, dict) and "error" in e
    ]
    assert stream.text() == output_text(0, MONSTER_OUTPUT)
    usage = stream.usage()
    assert usage is not None and usage["completion_tokens"] == MONSTER_OUTPUT
    ttft = arrivals[0][0] - sent
    # The stall: the longest silence of the stream (the migration's); the pace: the median gap.
    gaps = sorted(b - a for (a, _), (b, _) in itertools.pairwise(arrivals))
    stall, itl = gaps[-1], gaps[len(gaps) // 2]
    migrated = [e for e in logs if e["event"] == "route.migrated"]
    print(
        f"\nmonster of {usage['prompt_tokens']} prompt tokens migrated after "
        f"{migrated[0]['tokens_sent']} tokens: time to first token {ttft:.2f} s, the "
        f"stream's longest silence (the migration) {stall:.2f} s ({stall / ttft:.2f}x the "
        f"TTFT), median gap between chunks {itl * 1000:.1f} ms (sim engines at time scale 0.1)"
    )
    assert usage["prompt_tokens"] > 100_000
    assert len(migrated) == 1 and migrated[0]["reason"] == "connection_lost"
    # The stall is the new engine's prefill of the whole prompt, which is what the TTFT was.
    assert 0.5 * ttft < stall < 1.5 * ttft + 1.0
