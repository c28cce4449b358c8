"""vLLM's own refusals reach the client unchanged, and where the gateway refuses first it does
so in vLLM's shape. ``max_tokens`` equal to the model's context is served as vLLM serves it:
the output shortened to the context left (defect 6)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.real.engines import MAX_MODEL_LEN, MODEL, Real

HELLO = [{"role": "user", "content": "hello"}]
# Requests vLLM refuses with 400; the gateway forwards each (nothing it checks is wrong).
REFUSED = {
    "chat-temperature": ("/v1/chat/completions", {"messages": HELLO, "temperature": -1}),
    "chat-top-p": ("/v1/chat/completions", {"messages": HELLO, "top_p": 2}),
    "chat-top-logprobs": (
        "/v1/chat/completions",
        {"messages": HELLO, "logprobs": True, "top_logprobs": 50},
    ),
    "completions-temperature": ("/v1/completions", {"prompt": "hello", "temperature": -1}),
    "responses-temperature": ("/v1/responses", {"input": "hello", "temperature": -1}),
}


def post(client: httpx.Client, url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return client.post(url + path, json={"model": MODEL, "max_tokens": 2, **body})


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_vllm_refusals_are_relayed_unchanged(real: Real, case: str) -> None:
    path, body = REFUSED[case]
    if path == "/v1/responses":
        body = {**body, "max_output_tokens": 16}
    with httpx.Client(timeout=60) as client:
        direct = post(client, real.fast.url, path, body)
        through = post(client, real.gateway.url, path, body)
    assert direct.status_code == 400, direct.text
    assert (through.status_code, through.json()) == (direct.status_code, direct.json())


def test_an_unknown_model_is_404_in_vllms_shape(real: Real) -> None:
    body = {"messages": HELLO, "model": "no-such-model"}
    with httpx.Client(timeout=60) as client:
        direct = post(client, real.fast.url, "/v1/chat/completions", body)
        through = post(client, real.gateway.url, "/v1/chat/completions", body)
    assert direct.status_code == through.status_code == 404
    theirs, ours = direct.json()["error"], through.json()["error"]
    # The gateway knows its models and answers without an engine: vLLM's fields, its sentence.
    assert {k: ours[k] for k in ("type", "param", "code")} == {
        k: theirs[k] for k in ("type", "param", "code")
    }
    assert ours["message"].startswith("The model `no-such-model` does not exist.")
    assert theirs["message"].startswith("The model `no-such-model` does not exist.")


def test_a_prompt_longer_than_the_context_is_400_in_vllms_shape(real: Real) -> None:
    body = {"prompt": "The" + " cat" * (MAX_MODEL_LEN + 100), "max_tokens": 1}
    with httpx.Client(timeout=60) as client:
        direct = post(client, real.heavy.url, "/v1/completions", body)
        through = post(client, real.gateway.url, "/v1/completions", body)
    assert direct.status_code == through.status_code == 400, through.text
    theirs, ours = direct.json()["error"], through.json()["error"]
    assert theirs["param"] == ours["param"] == "input_tokens"
    assert theirs["code"] == ours["code"] == 400
    assert str(MAX_MODEL_LEN + 101) in ours["message"], ours


def test_max_tokens_equal_to_the_context_is_served_as_vllm_serves_it(real: Real) -> None:
    """vLLM 0.32 accepts ``max_tokens == max_model_len`` and shortens the output to the context
    left; the gateway must not refuse what the engine serves."""
    prompt = "The" + " dog" * (MAX_MODEL_LEN - 13)  # 8,180 tokens: 12 left for the output
    body = {"prompt": prompt, "max_tokens": MAX_MODEL_LEN}
    with httpx.Client(timeout=60) as client:
        direct = post(client, real.heavy.url, "/v1/completions", body)
        through = post(client, real.gateway.url, "/v1/completions", body)
    assert direct.status_code == 200, direct.text
    assert direct.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 12
    assert direct.json()["usage"]["completion_tokens"] == 12
    assert through.status_code == 200, through.text
    assert through.json()["usage"] == direct.json()["usage"]


@pytest.mark.parametrize("max_tokens", [13, 500, MAX_MODEL_LEN - 1])
def test_any_budget_within_the_context_is_shortened_as_vllm_does(
    real: Real, max_tokens: int
) -> None:
    """vLLM 0.32 clamps every ``max_tokens`` up to its context to what the prompt leaves
    (``get_max_tokens``), not only ``max_model_len`` itself: the capability gate must not keep
    such a request from the engine."""
    prompt = "The" + " dog" * (MAX_MODEL_LEN - 13)  # 8,180 tokens: 12 left for the output
    body = {"prompt": prompt, "max_tokens": max_tokens}
    with httpx.Client(timeout=60) as client:
        direct = post(client, real.heavy.url, "/v1/completions", body)
        through = post(client, real.gateway.url, "/v1/completions", body)
    assert direct.status_code == 200, direct.text
    assert direct.json()["usage"]["completion_tokens"] == 12
    assert through.status_code == 200, through.text
    assert through.json()["usage"] == direct.json()["usage"]


def test_a_budget_above_the_context_is_refused_in_vllms_words(real: Real) -> None:
    body = {"prompt": "hello", "max_tokens": MAX_MODEL_LEN + 1}
    with httpx.Client(timeout=60) as client:
        direct = post(client, real.heavy.url, "/v1/completions", body)
        through = post(client, real.gateway.url, "/v1/completions", body)
    assert direct.status_code == through.status_code == 400, through.text
    theirs, ours = direct.json()["error"], through.json()["error"]
    # The gateway knows the model's context and answers without an engine, in vLLM's words.
    assert {k: ours[k] for k in ("message", "param", "code")} == {
        k: theirs[k] for k in ("message", "param", "code")
    }
