"""gateway.request.read.read_request: the body read as its route reads it, checked as vLLM
0.32 checks it before any slot is taken."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.errors import BadRequest
from gateway.protocols.routes import ENGINE_ROUTES
from gateway.request.read import read_request
from gateway.settings import parse_settings
from tests.conftest import MODEL, lanes_config

CONTEXT = 8192
SETTINGS = parse_settings(
    lanes_config(["http://x"], ["http://y"], models=[{**MODEL, "max_model_len": CONTEXT}]),
    environ={},
)
SCOPE: dict[str, Any] = {"type": "http", "headers": []}
CHAT = {"model": "qwen3.6", "messages": [{"role": "user", "content": "hi"}]}


def read(path: str, body: dict[str, Any]) -> Any:
    return read_request(ENGINE_ROUTES[path], SCOPE, json.dumps(body).encode(), SETTINGS)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", CHAT, "max_tokens"),
        ("/v1/chat/completions", CHAT, "max_completion_tokens"),
        ("/v1/completions", {"model": "qwen3.6", "prompt": "hi"}, "max_tokens"),
        ("/v1/responses", {"model": "qwen3.6", "input": "hi"}, "max_output_tokens"),
    ],
)
def test_a_budget_of_the_whole_context_is_accepted_one_more_is_vllms_400(
    path: str, body: dict[str, Any], field: str
) -> None:
    """Defect 6: vLLM 0.32 accepts max_tokens == max_model_len (and shortens the output to the
    context the prompt leaves); only a budget above the context is its 400."""
    request, _ = read(path, {**body, field: CONTEXT})
    assert request.max_tokens == CONTEXT

    with pytest.raises(BadRequest) as refused:
        read(path, {**body, field: CONTEXT + 1})
    assert refused.value.param == field
    assert str(refused.value) == (
        f"{field}={CONTEXT + 1} cannot be greater than max_model_len={CONTEXT}. "
        f"Please request fewer output tokens. (parameter={field}, value={CONTEXT + 1})"
    )


def test_messages_budget_is_named_as_vllm_names_it() -> None:
    """vLLM's /v1/messages passes max_tokens on as max_completion_tokens, and names that."""
    body = {"model": "qwen3.6", "max_tokens": CONTEXT + 1, "messages": [CHAT["messages"][0]]}
    with pytest.raises(BadRequest) as refused:
        read("/v1/messages", body)
    assert refused.value.param == "max_completion_tokens"
    assert read("/v1/messages", {**body, "max_tokens": CONTEXT})[0].max_tokens == CONTEXT
