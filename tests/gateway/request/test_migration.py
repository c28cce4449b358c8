"""Mid-stream migration (gateway/request/migration.py): the refusals, the continuation's body,
pure (the relay's splice: test_relay.py); then through real sockets, two simulated engines of
which the first cuts its streams after some chunks (the ``drop_after_chunks`` fault):
``lanes[].migrate``'s ``enabled`` and ``max_migrations``, and the refusals named in the log."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
from structlog.testing import capture_logs

from engine_pool.sim.server import SimServer, run_sim
from gateway.count.tokens import TokenCounter
from gateway.request.migration import (
    SoFar,
    asking_ids,
    by_text,
    cannot_migrate,
    continuation,
)
from gateway.tools.sim_support import RegistryCounter
from tests.conftest import JSON, GatewayFactory, lanes_config
from tests.support.prom import parse

SO_FAR = SoFar(" lorem ipsum", 2, True, False, None)


@pytest.mark.parametrize(
    ("kind", "stream", "data", "reason"),
    [
        ("chat", True, {"messages": [], "n": 2}, "n"),
        ("chat", True, {"messages": [], "logprobs": True}, "logprobs"),
        ("completions", True, {"prompt": "x", "logprobs": 2}, "logprobs"),
        (
            "chat",
            True,
            {"messages": [], "response_format": {"type": "json_schema"}},
            "structured_output",
        ),
        ("chat", True, {"messages": [], "structured_outputs": {"json": {}}}, "structured_output"),
        ("chat", True, {"messages": [], "tools": [{}], "tool_choice": "required"}, "tool_choice"),
        ("completions", True, {"prompt": "x", "echo": True}, "echo"),
        ("completions", True, {"prompt": ["a", "b"]}, "prompt_not_text"),
        ("completions", True, {"prompt": [[1, 2], [3]]}, "prompt_not_text"),
        ("completions", True, {"prompt": []}, "prompt_not_text"),
        ("completions", True, {"prompt": [1, 2]}, "no_token_ids"),
        ("chat", False, {"messages": []}, "not_streamed"),
        ("responses", True, {"input": "x"}, "route"),
        ("messages", True, {"messages": []}, "route"),
        ("chat", True, {"messages": [], "tools": [{}], "tool_choice": "auto"}, None),
        ("completions", True, {"prompt": "x"}, None),
    ],
)
def test_what_cannot_migrate_is_named(
    kind: Any, stream: bool, data: dict[str, Any], reason: str | None
) -> None:
    assert cannot_migrate(kind, stream, data, SO_FAR) == reason


def test_an_answer_with_a_tool_call_or_finished_is_not_migrated() -> None:
    data: dict[str, Any] = {"messages": []}
    assert cannot_migrate("chat", True, data, SoFar("", 3, True, False, "tool_call")) == "tool_call"
    assert cannot_migrate("chat", True, data, SoFar("x", 3, True, True, None)) == "finished"


def test_a_chat_continues_as_the_assistant_message_with_a_smaller_budget() -> None:
    data = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    body = orjson.loads(continuation("chat", data, SO_FAR, 100).body)
    assert body["messages"][-1] == {"role": "assistant", "content": " lorem ipsum"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 8
    # A client's own continued assistant message is extended, not followed by another.
    data = {
        "messages": [{"role": "assistant", "content": "Once"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_completion_tokens": 5,
        "min_tokens": 1,
    }
    body = orjson.loads(continuation("chat", data, SO_FAR, 100).body)
    assert body["messages"] == [{"role": "assistant", "content": "Once lorem ipsum"}]
    assert body["max_completion_tokens"] == 3 and body["min_tokens"] == 0
    # Nothing relayed but the role: the request as it was.
    nothing = SoFar("", 0, True, False, None)
    assert orjson.loads(
        continuation("chat", {"messages": [], "max_tokens": 4}, nothing, 100).body
    ) == {
        "messages": [],
        "max_tokens": 4,
    }


def test_a_completion_continues_as_the_prompt_plus_its_text() -> None:
    body = orjson.loads(continuation("completions", {"prompt": "The river"}, SO_FAR, 100).body)
    assert body == {"prompt": "The river lorem ipsum", "max_tokens": 14}  # vLLM's default 16


IDS = SoFar(" lorem ipsum", 2, True, False, None, [7, 8, 9], [1000, 1001])


def test_an_answer_continues_from_its_token_ids_as_a_completion_of_the_exact_context() -> None:
    data = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 10,
        "temperature": 0,
        "tools": [],
        "stream": True,
        "min_tokens": 5,
    }
    following = continuation("chat", data, IDS, 100)
    assert (following.path, following.by) == ("/v1/completions", "token_ids")
    assert orjson.loads(following.body) == {
        "model": "m",
        "temperature": 0,
        "stream": True,
        "min_tokens": 3,
        "prompt": [7, 8, 9, 1000, 1001],
        "max_tokens": 8,
    }
    # No max_tokens: what vLLM's chat default would have left (the context's 5 of 100).
    chat = {"messages": [], "stream": True}
    assert orjson.loads(continuation("chat", chat, IDS, 100).body)["max_tokens"] == 95
    # ... and unknown: from the text, said.
    assert continuation("chat", chat, IDS, None).by == "text:max_model_len"
    body = orjson.loads(continuation("completions", {"prompt": "x"}, IDS, 100).body)
    assert body == {"prompt": [7, 8, 9, 1000, 1001], "max_tokens": 14}


@pytest.mark.parametrize(
    ("kind", "data", "so_far", "engine", "why"),
    [
        ("chat", {"messages": []}, IDS, "vllm", None),
        ("chat", {"messages": []}, IDS, "sglang", "engine"),
        ("chat", {"messages": []}, SO_FAR, "vllm", "no_token_ids"),
        ("chat", {"messages": [], "tools": [{}]}, IDS, "vllm", "tools"),
        ("chat", {"messages": [], "tools": [{}], "tool_choice": "none"}, IDS, "vllm", None),
        ("completions", {"prompt": "x"}, IDS, "vllm", None),
    ],
)
def test_what_continues_from_the_text_is_named(
    kind: Any, data: dict[str, Any], so_far: SoFar, engine: str, why: str | None
) -> None:
    assert by_text(kind, data, so_far, engine) == why
    if why is not None:
        following = continuation(kind, data, so_far, 100, why)
        assert (following.path, following.by) == (None, f"text:{why}")
        assert orjson.loads(following.body)["messages"][-1]["content"] == " lorem ipsum"


def test_a_token_id_prompt_continues_from_the_ids_on_any_engine() -> None:
    data = {"prompt": [7, 8, 9], "max_tokens": 10, "stream": True}
    assert cannot_migrate("completions", True, data, IDS) is None
    assert cannot_migrate("completions", True, data, SO_FAR) == "no_token_ids"
    for engine in ("vllm", "sglang"):  # the continuation is a token-id prompt, as the client's
        why = by_text("completions", data, IDS, engine)
        assert why is None
        following = continuation("completions", data, IDS, 100, why)
        assert following.by == "token_ids"
        body = orjson.loads(following.body)
        assert body == {"prompt": [7, 8, 9, 1000, 1001], "max_tokens": 8, "stream": True}


def test_the_token_ids_are_asked_for_first_so_a_clients_own_field_wins() -> None:
    assert asking_ids(b' {"a":1}') == b' {"return_token_ids":true,"a":1}'
    assert orjson.loads(asking_ids(b'{"return_token_ids":false}'))["return_token_ids"] is False


@asynccontextmanager
async def two_sims(
    counter: TokenCounter, drop_first: int, drop_second: int | None = None
) -> AsyncIterator[tuple[SimServer, SimServer]]:
    shared = RegistryCounter(counter, "qwen3.6")
    async with (
        run_sim("h100-fast", time_scale=0.05, counter=shared, seed=1) as a,
        run_sim("h100-fast", time_scale=0.05, counter=shared, seed=2) as b,
    ):
        await a.set_faults({"drop_after_chunks": drop_first})
        if drop_second is not None:
            await b.set_faults({"drop_after_chunks": drop_second})
        yield a, b


def config_for(a: SimServer, b: SimServer, **migrate: Any) -> dict[str, Any]:
    """The fast lane over two clusters, ``a``'s first: every request starts at ``a``."""
    config = lanes_config([a.url], ["http://127.0.0.1:9"])
    config["clusters"].append({"name": "spare", "endpoints": [b.url]})
    config["lanes"][0]["clusters"] = ["fast", "spare"]
    config["lanes"][0]["migrate"] = migrate
    config["lanes"][0]["health"] = {"interval_s": 60, "timeout_s": 5, "up_after_successes": 2}
    return config


async def stream(url: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> bytes:
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(url + path, content=orjson.dumps(body), headers=JSON)
        assert r.status_code == 200
        return r.content


def text_of(raw: bytes) -> str:
    out = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: {") and b'"choices":[{' in block:
            choice = orjson.loads(block[6:])["choices"][0]
            out.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
    return "".join(out)


BODY = {
    "model": "qwen3.6",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 40,
    "stream": True,
}


async def test_a_cut_stream_migrates_by_default_and_not_when_disabled(
    gateway_at: GatewayFactory, counter: TokenCounter
) -> None:
    async with two_sims(counter, drop_first=10) as (a, b):
        whole = text_of(await stream(b.url, BODY))
        for enabled in (True, False):
            async with gateway_at(config_for(a, b, enabled=enabled)) as (url, _):
                with capture_logs() as logs:
                    raw = await stream(url, BODY)
                    async with httpx.AsyncClient() as client:
                        metrics = parse((await client.get(url + "/metrics")).text)
            events = {e["event"]: e for e in logs}
            if enabled:
                assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
                assert text_of(raw) == whole
                assert events["route.migrated"]["continued"] == "token_ids"
                assert events["route.migrated"]["reason"] == "connection_lost"
                assert events["route.migrated"]["tokens_sent"] == 9  # the role is chunk 1
                assert events["route.finished"]["migrations"] == 1
                outcome = "migrated"
            else:
                assert b'"error"' in raw and "route.migrated" not in events
                assert events["route.migration_refused"]["reason"] == "disabled"
                assert events["route.finished"]["migrations"] == 0
                outcome = "refused"
            assert metrics.value("shapegate_migrations_total", lane="fast", outcome=outcome) == 1


async def test_max_migrations_bounds_how_often_a_stream_moves(
    gateway_at: GatewayFactory, counter: TokenCounter
) -> None:
    async with (
        two_sims(counter, drop_first=10, drop_second=10) as (a, b),
        gateway_at(config_for(a, b, max_migrations=1)) as (url, _),
    ):
        with capture_logs() as logs:
            raw = await stream(url, BODY)
    assert b'"error"' in raw
    assert [e["event"] for e in logs if "migrat" in e["event"]] == [
        "route.migrated",
        "route.migration_refused",
    ]
    assert [e["reason"] for e in logs if e["event"] == "route.migration_refused"] == [
        "max_migrations"
    ]


@pytest.mark.parametrize(
    ("path", "extra", "reason"),
    [
        ("/v1/chat/completions", {"n": 2}, "n"),
        ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
        ("/v1/responses", {}, "route"),
    ],
)
async def test_a_stream_that_cannot_migrate_ends_as_before_with_its_reason_logged(
    gateway_at: GatewayFactory, counter: TokenCounter, path: str, extra: dict[str, Any], reason: str
) -> None:
    if path == "/v1/responses":
        body: dict[str, Any] = {"model": "qwen3.6", "input": "hi", "stream": True}
    else:
        body = {**BODY, **extra}
    async with (
        two_sims(counter, drop_first=10) as (a, b),
        gateway_at(config_for(a, b)) as (url, _),
        httpx.AsyncClient(timeout=30) as client,
    ):
        with capture_logs() as logs:
            r = await client.post(url + path, content=orjson.dumps(body), headers=JSON)
    assert b"error" in r.content
    refused = [e for e in logs if e["event"] == "route.migration_refused"]
    assert [e["reason"] for e in refused] == [reason]
    assert not [e for e in logs if e["event"] == "route.migrated"]


def token_ids_of(raw: bytes) -> tuple[list[Any], list[int]]:
    """The prompt token ids (every event's that carries them) and the answer's, in order."""
    prompts: list[Any] = []
    ids: list[int] = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: {"):
            event = orjson.loads(block[6:])
            choices = event.get("choices") or [{}]
            for where in (event, choices[0]):
                if where.get("prompt_token_ids") is not None:
                    prompts.append(where["prompt_token_ids"])
            ids += choices[0].get("token_ids") or []
    return prompts, ids


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", BODY),
        ("/v1/completions", {"model": "qwen3.6", "prompt": "hi", "max_tokens": 40, "stream": True}),
    ],
)
@pytest.mark.parametrize("client_asks", [None, True, False])
async def test_a_migrated_stream_continues_from_its_token_ids_in_the_clients_shape(
    gateway_at: GatewayFactory,
    counter: TokenCounter,
    path: str,
    body: dict[str, Any],
    client_asks: bool | None,
) -> None:
    """From the ids unless the client turned them off (then from the text, named); the ids
    reach the client only when it asked, then all of them, the prompt's once."""
    if client_asks is not None:
        body = {**body, "return_token_ids": client_asks}
    async with two_sims(counter, drop_first=10) as (a, b):
        whole = await stream(b.url, body, path)
        async with gateway_at(config_for(a, b)) as (url, _):
            with capture_logs() as logs:
                raw = await stream(url, body, path)
    migrated = [e for e in logs if e["event"] == "route.migrated"]
    assert [e["continued"] for e in migrated] == [
        "text:no_token_ids" if client_asks is False else "token_ids"
    ]
    assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
    assert text_of(raw) == text_of(whole)
    objects = {orjson.loads(e[6:])["object"] for e in raw.split(b"\n\n") if e[6:7] == b"{"}
    assert objects == {"chat.completion.chunk" if "chat" in path else "text_completion"}
    assert token_ids_of(raw) == token_ids_of(whole)
    if client_asks is not True:
        assert token_ids_of(raw) == ([], [])


async def test_a_replayed_stream_is_the_uninterrupted_one_and_named(
    gateway_at: GatewayFactory, counter: TokenCounter
) -> None:
    body = {**BODY, "stream_options": {"include_usage": True}}
    async with two_sims(counter, drop_first=10) as (a, b):
        whole = await stream(b.url, body)
        for replay_max_tokens, continued in ((9, "replay"), (8, "token_ids")):
            config = config_for(a, b, replay_max_tokens=replay_max_tokens)
            async with gateway_at(config) as (url, _):
                with capture_logs() as logs:
                    raw = await stream(url, body)
            migrated = [e for e in logs if e["event"] == "route.migrated"]
            assert [(e["continued"], e["tokens_sent"]) for e in migrated] == [(continued, 9)]
            assert text_of(raw) == text_of(whole) and b'"error"' not in raw
            usage = [orjson.loads(e[6:])["usage"] for e in raw.split(b"\n\n") if b'"usage"' in e]
            assert usage[-1]["completion_tokens"] == 40
            assert raw.count(b'"role"') == 1


async def test_a_chat_with_tools_continues_from_its_text_without_asking_for_ids(
    gateway_at: GatewayFactory, counter: TokenCounter
) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {**BODY, "tools": [tool], "tool_choice": "auto"}
    async with two_sims(counter, drop_first=10) as (a, b):
        whole = await stream(b.url, body)
        async with gateway_at(config_for(a, b)) as (url, _):
            with capture_logs() as logs:
                raw = await stream(url, body)
    migrated = [e for e in logs if e["event"] == "route.migrated"]
    # Not asked: the first engine's chunks carried none, so the ids are not there at all.
    assert [e["continued"] for e in migrated] == ["text:no_token_ids"]
    assert text_of(raw) == text_of(whole)
