"""Every figure named tokens is tokens: header, logs, histogram and captured trace carry the exact
count (equal to the engine's usage), and the free byte bound goes only by its own name."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from structlog.testing import capture_logs

from engine_pool.sim.server import run_sim
from gateway.core.count import TokenCount
from gateway.count.tokens import TokenCounter
from gateway.count.usage import (
    TAIL_MAX,
    EngineUsage,
    ExactCount,
    engine_usage,
    sse_events,
    trim_tail,
)
from gateway.observe.trace import read_trace
from gateway.protocols.openai import parse_request
from gateway.tools.sim_support import RegistryCounter
from tests.conftest import chat, lanes_config
from tests.support.prom import parse

# ChatML renders this as 15 Qwen3.6 tokens; its UTF-8 bound is 75.
QUESTION = "What is the capital of France?"


def test_the_question_is_15_tokens_and_its_bound_is_not(counter: TokenCounter) -> None:
    prompt = parse_request("chat", orjson.dumps(chat(QUESTION))).prompt
    assert counter.count_sync("qwen3.6", prompt, exact_above=0).tokens == 15
    bound = counter.count_sync("qwen3.6", prompt, exact_above=2000)
    assert bound.method == "bound" and bound.exact is None and bound.tokens > 60


async def test_a_15_token_prompt_reports_15_in_header_log_histogram_and_trace(
    counter: TokenCounter, gateway_at: Any, tmp_path: Path
) -> None:
    trace = tmp_path / "live.jsonl"
    async with run_sim(
        "h100-fast", time_scale=0.05, counter=RegistryCounter(counter, "qwen3.6")
    ) as sim:
        config = lanes_config([sim.url], [sim.url], state={"trace_file": str(trace)})
        async with gateway_at(config) as (url, _), httpx.AsyncClient(base_url=url) as client:
            with capture_logs() as logs:
                r = await client.post("/v1/chat/completions", json=chat(QUESTION, max_tokens=4))
            metrics = parse((await client.get("/metrics")).text)
    assert r.status_code == 200, r.text
    engine_says = r.json()["usage"]["prompt_tokens"]
    assert engine_says == 15
    assert r.headers["x-shapegate-prompt-tokens"] == "15"
    assert int(r.headers["x-shapegate-prompt-tokens-bound"]) > 15
    decision = next(e for e in logs if e["event"] == "route.decision")
    finished = next(e for e in logs if e["event"] == "route.finished")
    assert decision["count_method"] == "bound" and "prompt_tokens" not in decision
    assert decision["prompt_tokens_bound"] == int(r.headers["x-shapegate-prompt-tokens-bound"])
    assert finished["prompt_tokens"] == 15 and finished["engine_prompt_tokens"] == 15
    assert finished["count_drift"] == 0
    assert metrics.value("shapegate_prompt_tokens_sum", lane="fast") == 15
    assert metrics.value("shapegate_prompt_tokens_count", lane="fast") == 1
    assert metrics.value("shapegate_count_drift_tokens_bucket", le="0.0") == 1
    assert metrics.value("shapegate_count_drift_tokens_bucket", le="-1.0") == 0
    assert [(t.prompt_tokens, t.output_tokens) for t in read_trace(trace)] == [(15, 4)]
    assert not [e for e in logs if e["event"] == "count.drift"]


async def test_a_stream_without_usage_gets_an_output_estimate_named_so(
    counter: TokenCounter, gateway_at: Any
) -> None:
    async with run_sim(
        "h100-fast", time_scale=0.05, counter=RegistryCounter(counter, "qwen3.6")
    ) as sim:
        config = lanes_config([sim.url], [sim.url])
        async with gateway_at(config) as (url, _), httpx.AsyncClient(base_url=url) as client:
            with capture_logs() as logs:
                r = await client.post(
                    "/v1/chat/completions", json=chat(QUESTION, max_tokens=6, stream=True)
                )
            metrics = parse((await client.get("/metrics")).text)
    assert r.status_code == 200 and r.headers["x-shapegate-prompt-tokens"] == "15"
    finished = next(e for e in logs if e["event"] == "route.finished")
    assert finished["output_tokens"] is None and finished["output_tokens_estimate"] == 6
    assert finished["prompt_tokens"] == 15 and finished["engine_prompt_tokens"] is None
    assert metrics.value("shapegate_output_tokens_sum", lane="fast", source="sse_estimate") == 6
    assert metrics.value("shapegate_output_tokens_count", source="usage") == 0


async def test_a_counted_prompt_reports_the_same_count_everywhere(
    counter: TokenCounter, gateway_at: Any
) -> None:
    # Above the bound's reach the count that decides is exact already: no bound header then.
    async with run_sim(
        "h100-fast", time_scale=0.05, counter=RegistryCounter(counter, "qwen3.6")
    ) as sim:
        config = lanes_config([sim.url], [sim.url], threshold=20)
        async with gateway_at(config) as (url, _), httpx.AsyncClient(base_url=url) as client:
            with capture_logs() as logs:
                r = await client.post("/v1/chat/completions", json=chat(QUESTION, max_tokens=2))
    assert r.status_code == 200
    assert r.headers["x-shapegate-prompt-tokens"] == "15"
    assert "x-shapegate-prompt-tokens-bound" not in r.headers
    decision = next(e for e in logs if e["event"] == "route.decision")
    assert decision["prompt_tokens"] == 15 and decision["count_method"] in ("exact", "cache")
    assert "prompt_tokens_bound" not in decision


def test_engine_usage_reads_json_bodies_and_the_last_sse_usage_event() -> None:
    body = b'{"choices":[],"usage":{"prompt_tokens":15,"completion_tokens":4,"total_tokens":19}}'
    assert engine_usage(body).prompt_tokens == 15 and engine_usage(body).completion_tokens == 4
    stream = (
        b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert (engine_usage(stream).prompt_tokens, engine_usage(stream).completion_tokens) == (9, 1)
    assert engine_usage(b'data: {"choices":[]}\n\n').prompt_tokens is None
    assert sse_events(stream) == 2


def sse(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def test_engine_usage_reads_responses_and_messages_usage() -> None:
    """Defect 5: Responses and Messages report input_tokens/output_tokens, JSON and streamed."""
    responses = {
        "object": "response",
        "output": [],
        "usage": {
            "input_tokens": 21,
            "output_tokens": 5,
            "input_tokens_details": {"cached_tokens": 0},
            "total_tokens": 26,
        },
    }
    assert engine_usage(orjson.dumps(responses)) == EngineUsage(21, 5)
    # The final event carries the whole answer; the relay's tail may have lost its start.
    long_text = 'word, "quoted" {brace} ' * 2000
    completed = {
        **responses,
        "output": [{"type": "message", "content": [{"type": "output_text", "text": long_text}]}],
    }
    stream = (
        sse(
            "response.created",
            {"type": "response.created", "response": {**responses, "usage": None}},
        )
        + sse("response.output_text.delta", {"type": "response.output_text.delta", "delta": "hi"})
        + sse("response.completed", {"type": "response.completed", "response": completed})
    )
    assert engine_usage(stream) == EngineUsage(21, 5)
    assert engine_usage(stream[-TAIL_MAX:]) == EngineUsage(21, 5)

    message = {"type": "message", "content": [], "usage": {"input_tokens": 30, "output_tokens": 7}}
    assert engine_usage(orjson.dumps(message)) == EngineUsage(30, 7)
    start = {
        "type": "message_start",
        "message": {**message, "usage": {"input_tokens": 30, "output_tokens": 0}},
    }
    delta = {"type": "text_delta", "text": "ok"}
    anthropic = (
        sse("message_start", start)
        + sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
        + sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn"},
                "usage": {"input_tokens": 30, "output_tokens": 7},
            },
        )
        + sse("message_stop", {"type": "message_stop"})
    )
    assert engine_usage(anthropic) == EngineUsage(30, 7)
    # Anthropic's own shape: output only on message_delta, input on message_start, cached input
    # counted apart (and added back: the prompt is all of it).
    start["message"]["usage"] = {
        "input_tokens": 4,
        "cache_read_input_tokens": 26,
        "output_tokens": 1,
    }
    anthropic = sse("message_start", start) + sse(
        "message_delta", {"type": "message_delta", "delta": {}, "usage": {"output_tokens": 7}}
    )
    assert engine_usage(anthropic) == EngineUsage(30, 7)


async def test_exact_count_finishes_meanwhile_or_at_the_latest_when_settled(
    counter: TokenCounter,
) -> None:
    prompt = parse_request("chat", orjson.dumps(chat(QUESTION))).prompt
    bound = await counter.count("qwen3.6", prompt, exact_above=2000)
    overlapped = ExactCount(counter, bound)
    assert (overlapped.bound, overlapped.decided_by) == (bound.tokens, bound.tokens)
    overlapped.meanwhile()  # what the proxy calls once the request is written
    assert await overlapped.tokens(5.0) == 15
    # A request that never reached its engine (refused, say) still reports tokens.
    assert ExactCount(counter, bound).settle() == 15
    exact = await counter.count("qwen3.6", prompt, exact_above=0)
    assert ExactCount(counter, exact).bound is None and ExactCount(counter, exact).settle() == 15


def test_events_are_counted_once_across_tail_trims() -> None:
    stream = b"".join(b'data: {"choices":[{"delta":{"content":"%d"}}]}\n\n' % i for i in range(900))
    tail, events = b"", 0
    for at in range(0, len(stream), 37):  # odd chunk sizes cut events anywhere
        tail += stream[at : at + 37]
        if len(tail) > TAIL_MAX:
            tail, passed = trim_tail(tail)
            events += passed
    assert len(tail) <= TAIL_MAX and tail == stream[-len(tail) :]
    assert events + sse_events(tail) == 900


class CongestedCounter:
    """A counter whose worker is busy: nothing inline, the exact count takes a while."""

    def __init__(self, result: TokenCount, delay_s: float) -> None:
        self.result, self.delay_s = result, delay_s

    def start_exact(self, count: TokenCount) -> object:
        return object()  # what is left for the worker

    async def finish(self, step: object) -> TokenCount:
        await asyncio.sleep(self.delay_s)
        return self.result


async def test_a_congested_counter_never_holds_the_headers_past_the_wait(
    counter: TokenCounter,
) -> None:
    prompt = parse_request("chat", orjson.dumps(chat(QUESTION))).prompt
    bound = await counter.count("qwen3.6", prompt, exact_above=2000)
    exact = await counter.count("qwen3.6", prompt, exact_above=0)
    slow = ExactCount(CongestedCounter(exact, 0.5), bound)  # type: ignore[arg-type]
    slow.meanwhile()
    started = time.monotonic()
    assert await slow.tokens(0.05) is None  # the header goes without it
    assert time.monotonic() - started < 0.3
    await asyncio.sleep(0.6)
    assert slow.settle() == 15  # finished meanwhile: the log and metrics still get tokens
    late = ExactCount(CongestedCounter(exact, 5.0), bound)  # type: ignore[arg-type]
    late.meanwhile()
    assert late.settle() is None and late.error is None  # abandoned, never a bound as tokens


def test_the_usage_parse_agrees_with_brace_matching_on_awkward_objects() -> None:
    # The fast read parses up to a closing brace; each of these needs more than one try
    # (nested objects, braces inside strings) or the byte loop (more closing braces than tries).
    deep = b'{"a":' * 5 + b"1" + b"}" * 5
    cases = {
        b'{"usage": {"prompt_tokens": 7, "completion_tokens": 3}}': EngineUsage(7, 3),
        b'{"usage":{"prompt_tokens":7,"details":{"x":{"y":1}},"completion_tokens":3}}': (
            EngineUsage(7, 3)
        ),
        b'{"usage":{"note":"a } and a \\" { inside","prompt_tokens":7,"completion_tokens":3}}': (
            EngineUsage(7, 3)
        ),
        b'{"usage":{"z":' + deep + b',"prompt_tokens":7,"completion_tokens":3}}': (
            EngineUsage(7, 3)
        ),
        b'{"usage":{"prompt_tokens":7,"completion_tokens":3': EngineUsage(None, None),
        b'{"usage":{"prompt_tokens":x}}': EngineUsage(None, None),
        b'{"usage": null}': EngineUsage(None, None),
    }
    for payload, expected in cases.items():
        assert engine_usage(payload) == expected, payload
