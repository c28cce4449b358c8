"""Count drift: a policy whose template is not the engine's is caught by the first requests."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from structlog.testing import capture_logs

from engine_pool.sim.profile import load_profile
from engine_pool.sim.server import run_sim
from gateway.count.tokens import TokenCounter
from gateway.observe.drift import DriftWatch
from gateway.observe.log import get_logger
from gateway.observe.metrics import Metrics
from gateway.protocols.messages import parse_messages
from gateway.protocols.responses import parse_responses
from gateway.settings import parse_settings
from gateway.tools.sim_support import RegistryCounter
from tests.conftest import MODEL, chat, lanes_config
from tests.support.fake_engine import FakeEngine
from tests.support.prom import parse
from tests.support.servers import serve_asgi

QUESTION = "What is the capital of France?"  # ChatML: 15 tokens; Qwen3.6's template: 17


@pytest.fixture(scope="module")
def qwen_template_counter() -> Iterator[RegistryCounter]:
    """The engine's side: Qwen3.6's own chat template (what vLLM renders), not ChatML."""
    model = copy.deepcopy(MODEL)
    model["tokenizer"]["chat_template"] = "hf"
    config = lanes_config(["http://x"], ["http://y"], models=[model])
    counter = TokenCounter.from_settings(parse_settings(config, environ={}))
    yield RegistryCounter(counter, "qwen3.6")
    counter.close()


async def test_chatml_policy_against_qwen_template_engine_records_drift_2_and_one_warning(
    qwen_template_counter: RegistryCounter, gateway_at: Any
) -> None:
    profile = load_profile("h100-fast").model_copy(
        update={"tokenizer": {"source": "builtin", "name": "qwen3.6", "chat_template": "hf"}}
    )
    async with run_sim(profile, time_scale=0.05, counter=qwen_template_counter) as sim:
        config = lanes_config([sim.url], [sim.url])  # the policy says chat_template: chatml
        async with gateway_at(config) as (url, _), httpx.AsyncClient(base_url=url) as client:
            with capture_logs() as logs:
                replies = [
                    await client.post("/v1/chat/completions", json=chat(QUESTION, max_tokens=2))
                    for _ in range(3)
                ]
            metrics = parse((await client.get("/metrics")).text)
            state = (await client.get("/admin/dashboard.json")).json()
    assert [r.json()["usage"]["prompt_tokens"] for r in replies] == [17, 17, 17]
    assert {r.headers["x-shapegate-prompt-tokens"] for r in replies} == {"15"}
    labels = {"model": "qwen3.6", "route": "chat"}
    assert metrics.value("shapegate_count_drift_tokens_count", **labels) == 3
    # (No _sum: a histogram with negative buckets exposes none.)
    assert metrics.value("shapegate_count_drift_tokens_bucket", le="1.0", **labels) == 0
    assert metrics.value("shapegate_count_drift_tokens_bucket", le="2.0", **labels) == 3
    warnings = [e for e in logs if e["event"] == "count.drift"]
    assert len(warnings) == 1
    (line,) = warnings
    assert line["log_level"] == "warning"
    assert (line["ours"], line["theirs"], line["drift"]) == (15, 17, 2)
    assert line["template"] == "chatml" and line["route"] == "chat"
    assert line["model"] == "qwen3.6" and line["tokenizer"]
    (badge,) = state["count_drift"]
    assert (badge["compared"], badge["drifted"], badge["last_drift"]) == (3, 3, 2)


def test_drift_warnings_are_rate_limited_per_model_and_route() -> None:
    now = [0.0]
    watch = DriftWatch(Metrics(), get_logger("test"), warn_every_s=60, clock=lambda: now[0])
    args = {"model": "m", "tokenizer": "t", "template": "chatml"}
    with capture_logs() as logs:
        for second in range(0, 150, 10):
            now[0] = second
            watch.observe(route="chat", ours=10, theirs=12, **args)
        watch.observe(route="completions", ours=5, theirs=4, **args)
        watch.observe(route="chat", ours=10, theirs=10, **args)
    lines = [e for e in logs if e["event"] == "count.drift"]
    assert [(e["route"], e["unlogged_since_last"]) for e in lines] == [
        ("chat", 0),
        ("chat", 5),
        ("chat", 5),
        ("completions", 0),
    ]
    chat_badge = next(b for b in watch.as_json() if b["route"] == "chat")
    assert (chat_badge["compared"], chat_badge["drifted"]) == (16, 15)


async def test_responses_and_messages_usage_feeds_drift_and_output_tokens(
    counter: TokenCounter, gateway_at: Any
) -> None:
    """Defect 5: /v1/responses and /v1/messages report input_tokens/output_tokens (in the body,
    in response.completed, in message_start/message_delta); the gateway reads them for the
    drift check and the output-token figures, streamed or not."""
    responses = {"model": "qwen3.6", "input": QUESTION, "max_output_tokens": 3}
    messages = {
        "model": "qwen3.6",
        "max_tokens": 3,
        "messages": [{"role": "user", "content": QUESTION}],
    }
    ours = {
        name: counter.count_sync("qwen3.6", routed.prompt).tokens
        for name, routed in (
            ("responses", parse_responses(orjson.dumps(responses))),
            ("messages", parse_messages(orjson.dumps(messages))),
        )
    }

    def usage_body(prompt: int) -> dict[str, Any]:
        return {
            "object": "response",
            "output": [],
            "usage": {"input_tokens": prompt, "output_tokens": 3},
        }

    def anthropic_events(prompt: int) -> list[str]:
        start = {
            "type": "message_start",
            "message": {
                "type": "message",
                "content": [],
                "usage": {"input_tokens": prompt, "output_tokens": 0},
            },
        }
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens"},
            "usage": {"input_tokens": prompt, "output_tokens": 3},
        }
        return [
            f"event: message_start\ndata: {json.dumps(start)}\n\n",
            f"event: message_delta\ndata: {json.dumps(delta)}\n\n",
            'event: message_stop\ndata: {"type": "message_stop"}\n\n',
        ]

    engine = FakeEngine()
    async with (
        serve_asgi(engine) as engine_url,
        gateway_at(lanes_config([engine_url], [engine_url])) as (url, _),
        httpx.AsyncClient(base_url=url) as client,
    ):
        with capture_logs() as logs:
            sent = [
                (
                    "/v1/responses",
                    {**responses, "fake": {"payload": usage_body(ours["responses"])}},
                ),
                (
                    "/v1/messages",
                    {
                        **messages,
                        "stream": True,
                        "fake": {"events": anthropic_events(ours["messages"])},
                    },
                ),
                # An engine that counts 2 more than we do: drift, on the messages route.
                (
                    "/v1/messages",
                    {
                        **messages,
                        "fake": {
                            "payload": {
                                "type": "message",
                                "usage": {"input_tokens": ours["messages"] + 2, "output_tokens": 3},
                            }
                        },
                    },
                ),
            ]
            for path, body in sent:
                reply = await client.post(path, json=body)
                assert reply.status_code == 200, reply.text
    finished = [e for e in logs if e["event"] == "route.finished"]
    assert [(e["engine_prompt_tokens"], e["output_tokens"]) for e in finished] == [
        (ours["responses"], 3),
        (ours["messages"], 3),
        (ours["messages"] + 2, 3),
    ]
    assert [e["count_drift"] for e in finished] == [0, 0, 2]
    (drift,) = [e for e in logs if e["event"] == "count.drift"]
    assert (drift["route"], drift["ours"], drift["theirs"]) == (
        "messages",
        ours["messages"],
        ours["messages"] + 2,
    )
