"""Lanes split at 2,000 tokens by vLLM's own count: a prompt vLLM counts 1,999 goes to the fast
lane, one it counts 2,000 to the heavy lane, on chat (the model's template around the text) and
on completions (the text alone)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.real.engines import MODEL, THRESHOLD, Real


def vllm_count(client: httpx.Client, real: Real, body: dict[str, Any]) -> int:
    answer = client.post(real.fast.url + "/tokenize", json=body)
    answer.raise_for_status()
    return int(answer.json()["count"])


def sized(client: httpx.Client, real: Real, route: str, tokens: int) -> dict[str, Any]:
    """A request whose prompt vLLM counts exactly ``tokens``: a run of one-token words."""

    def body(words: int) -> dict[str, Any]:
        text = "The" + " cat" * words
        if route == "chat":
            return {"model": MODEL, "messages": [{"role": "user", "content": text}]}
        return {"model": MODEL, "prompt": text}

    words = tokens - vllm_count(client, real, body(0))
    for _ in range(5):
        found = vllm_count(client, real, body(words))
        if found == tokens:
            return body(words)
        words += tokens - found
    raise AssertionError(f"no {route} prompt of exactly {tokens} tokens")


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_the_lane_boundary_is_vllms_2000th_token(real: Real, route: str) -> None:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    seen = {}
    with httpx.Client(timeout=60) as client:
        for tokens in (THRESHOLD - 1, THRESHOLD):
            body = {**sized(client, real, route, tokens), "max_tokens": 1}
            answer = client.post(real.gateway.url + path, json=body)
            assert answer.status_code == 200, answer.text
            seen[tokens] = (
                answer.headers["x-shapegate-lane"],
                answer.headers["x-shapegate-cluster"],
                answer.json()["usage"]["prompt_tokens"],
                answer.headers.get("x-shapegate-prompt-tokens"),
            )
    assert seen == {
        THRESHOLD - 1: ("fast", "fast", THRESHOLD - 1, str(THRESHOLD - 1)),
        THRESHOLD: ("heavy", "heavy", THRESHOLD, str(THRESHOLD)),
    }, seen
