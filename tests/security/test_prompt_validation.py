"""Prompts are validated as the engine would before any slot is taken: empty prompts, empty
token lists and malformed content parts are 400 in the OpenAI shape, logged as
``route.rejected``, and never reach an engine. Image and audio parts pass."""

from __future__ import annotations

from typing import Any

import httpx
from structlog.testing import capture_logs

from gateway.count.tokens import TokenCounter
from tests.security.edge import guarded_gateway

MODEL = "qwen3.6"


def chat(content: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]}


def completion(prompt: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4}


TEXT = {"type": "text", "text": "what is in this picture?"}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}

REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("completions", completion(""), "'prompt' is empty"),
    ("completions", completion([]), "'prompt' is empty"),
    ("completions", completion([[]]), "empty token list"),
    ("completions", completion([[1, 2], []]), "'prompt[1]' is an empty token list"),
    ("completions", completion(["ok", ""]), "empty string"),
    ("completions", completion([1, -5]), "negative token id"),
    ("completions", completion([[1], "x"]), "must be a string"),
    ("completions", {"model": MODEL}, "must be a string"),
    ("chat", chat([1, 2, 3]), "'messages[0].content[0]' must be an object"),
    ("chat", chat([{"type": "text", "text": ["a", "b"]}]), "content[0].text' must be a string"),
    ("chat", chat([{"type": "text", "text": 7}]), "content[0].text' must be a string"),
    ("chat", chat([{"type": "text", "text": None}]), "content[0].text' must be a string"),
    ("chat", chat([{"type": "text"}]), "content[0].text' must be a string"),
    ("chat", chat([{"text": "no type"}]), "content[0].type' must be one of"),
    ("chat", chat([{"type": "bogus", "text": "x"}]), "content[0].type' must be one of"),
    ("chat", chat([TEXT, {"type": "image_url"}]), "content[1].image_url' must be an object"),
    ("chat", chat([{"type": "image_url", "image_url": {"url": 5}}]), "image_url.url' must be"),
    ("chat", chat([{"type": "input_audio", "input_audio": {"data": "x"}}]), "format' must be"),
    ("chat", chat({"text": "an object"}), "must be a string or an array"),
    ("chat", chat(42), "must be a string or an array"),
]


async def test_malformed_and_empty_prompts_are_400_before_any_slot(
    counter: TokenCounter, engine: Any
) -> None:
    fake, engine_url = engine
    async with guarded_gateway(counter, engine_url) as url, httpx.AsyncClient() as client:
        for endpoint, body, needle in REFUSED:
            path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
            with capture_logs() as logs:
                r = await client.post(url + path, json=body)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert needle in error["message"], (body, error)
            assert error["type"] == "invalid_request_error" and error["code"] == 400
            assert error["param"] in ("prompt", "messages")
            rejected = [e for e in logs if e["event"] == "route.rejected"]
            assert len(rejected) == 1 and rejected[0]["status"] == 400, body
            assert not any(e["event"] == "route.decision" for e in logs)
        state = (await client.get(url + "/admin/state")).json()
    assert all(lane["slots_in_use"] == 0 for lane in state["lanes"])
    assert not fake.seen


async def test_valid_parts_including_image_and_audio_are_served(
    counter: TokenCounter, engine: Any
) -> None:
    fake, engine_url = engine
    accepted = [
        chat([TEXT, IMAGE, AUDIO]),
        chat([{"type": "image_url", "image_url": "https://example.com/a.png"}, TEXT]),
        chat(""),
        chat(None) | {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
        completion([[1, 2, 3], [4]]),
        completion(["a", "b"]),
    ]
    async with guarded_gateway(counter, engine_url) as url, httpx.AsyncClient() as client:
        for body in accepted:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = await client.post(url + path, json=body)
            assert r.status_code == 200, (body, r.text)
    assert len(fake.seen) == len(accepted)
