"""Count drift: a policy whose template is not the engine's is caught by the first requests."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from engine_pool.sim.profile import load_profile
from engine_pool.sim.server import run_sim
from gateway.count.drift import DriftWatch
from gateway.count.tokens import TokenCounter
from gateway.observe.log import get_logger
from gateway.observe.metrics import Metrics
from gateway.settings import parse_settings
from gateway.tools.sim_support import RegistryCounter
from tests.conftest import MODEL, chat, lanes_config
from tests.support.prom import parse

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
