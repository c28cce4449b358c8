"""A completions request whose prompt is token ids, cut mid-stream, continues from the ids
(gateway/request/migration.py) on real vLLM: asked for the ids, vLLM's stream carries the
prompt's own ids and every token's, the relay collects them whole (``SoFar``), and the
continuation's body (the prompt's ids, then the answer's) is accepted by the other server,
which reads exactly that context (its ``prompt_token_ids`` and its usage's prompt tokens).

The texts are not compared: the tier's random-weight model has exactly tied logits
(test_migrated_stream.py says where), which a prefill of the relayed tokens may round otherwise
than their decode did; the simulator's migration test compares them (tests/reliability)."""

from __future__ import annotations

import json
from typing import Any

import httpx

from gateway.request.migration import asking_ids, by_text, cannot_migrate, continuation
from gateway.request.relay import Relay
from tests.real.engines import MODEL, Real

PROMPT = [9707, 11, 1879, 0, 576, 374, 264, 1273, 13]
CUT_AFTER_EVENTS = 12
JSON = {"content-type": "application/json"}


def body() -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 40,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def events_of(raw: bytes) -> list[Any]:
    lines = [ln[6:] for ln in raw.split(b"\n\n") if ln.startswith(b"data: ")]
    return [ln.decode() if ln == b"[DONE]" else json.loads(ln) for ln in lines]


async def test_a_token_id_prompt_cut_mid_stream_continues_from_the_ids(real: Real) -> None:
    data = body()
    relay = Relay("completions", collect_ids=True, strip_ids=True, ask_ids=True)
    relayed = b""
    async with httpx.AsyncClient(timeout=120) as client:
        sent = asking_ids(json.dumps(data).encode())
        url = real.fast.url + "/v1/completions"
        async with client.stream("POST", url, content=sent, headers=JSON) as answer:
            assert answer.status_code == 200, await answer.aread()
            async for piece in answer.aiter_bytes():
                relayed += relay.feed(piece)
                if relayed.count(b"data: ") >= CUT_AFTER_EVENTS:
                    break  # the engine "fails" here: what was relayed is what the client has
        so_far = relay.so_far()
        assert so_far.prompt_ids == PROMPT, so_far
        assert so_far.ids is not None and len(so_far.ids) == so_far.tokens > 0, so_far
        assert b'token_ids":[' not in relayed  # collected, blanked for the client
        assert cannot_migrate("completions", True, data, so_far) is None
        why = by_text("completions", data, so_far, "vllm")
        following = continuation("completions", data, so_far, None, why)
        assert following.by == "token_ids"
        again = asking_ids(following.body)  # to read back the context the server took
        url = real.heavy.url + "/v1/completions"
        continued = await client.post(url, content=again, headers=JSON)
    assert continued.status_code == 200, continued.text
    events = [e for e in events_of(continued.content) if isinstance(e, dict)]
    firsts = [e["choices"][0] for e in events if e.get("choices")]
    assert firsts[0]["prompt_token_ids"] == [*PROMPT, *so_far.ids]
    usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
    assert usage["prompt_tokens"] == len(PROMPT) + so_far.tokens
    assert usage["completion_tokens"] == 40 - so_far.tokens  # the budget shrank by what was sent
