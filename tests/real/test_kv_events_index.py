"""Real vLLM's KV events feed the gateway's prefix index, which predicts vLLM's own cache hits.

The tier's fast server publishes its KV events (``--kv-events-config``, zmq with the replay
socket) and the gateway reads them (``prefix_index.source: kv_events``; tests/real/engines.py
``with_kv_events``). 200 chat requests through the gateway, one at a time, max_tokens 1: system
prompts of about 150 to 1,500 tokens shared by many requests, unique user turns, some requests
sent twice. For each, the gateway's ``route.decision`` says how many prompt tokens it believes
the engine holds (``cached_tokens``: the prompt rendered with the model's template, tokenized,
hashed in 128-token blocks and looked up in the blocks the engine's events reported). vLLM
recomputes a prompt's last token, so it can hit at most ``(prompt - 1) // 128`` blocks; the
sum of the predictions so capped must be within 5% of the delta of vLLM's
``vllm:prefix_cache_hits_total``.
"""

from __future__ import annotations

import random
import sys
import time
from typing import Any

import httpx

from tests.real.engines import KV_BLOCK, MODEL, Real

REQUESTS = 200
HITS = "vllm:prefix_cache_hits_total"
# The engine's events reach the gateway after the answer: a pause before the next request.
SETTLE_S = 0.15


def conversations(rng: random.Random) -> list[list[dict[str, str]]]:
    systems = [
        f"System {k}. " + " ".join(f"rule{k}x{j}" for j in range(rng.randrange(25, 250)))
        for k in range(8)
    ]
    out: list[list[dict[str, str]]] = []
    for i in range(REQUESTS):
        if out and rng.random() < 0.2:
            out.append(rng.choice(out))
            continue
        user = f"Question {i}: " + " ".join(str(rng.randrange(10**6)) for _ in range(20))
        out.append(
            [{"role": "system", "content": rng.choice(systems)}, {"role": "user", "content": user}]
        )
    return out


def test_the_gateways_index_from_kv_events_predicts_vllms_prefix_cache_hits(real: Real) -> None:
    gateway, engine = real.gateway, real.fast
    before = engine.metrics().value(HITS)
    seen = len(gateway.events("route.decision"))
    prompt_tokens: list[int] = []
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        for messages in conversations(random.Random(32)):
            body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 1}
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            prompt_tokens.append(response.json()["usage"]["prompt_tokens"])
            time.sleep(SETTLE_S)
    actual = engine.metrics().value(HITS) - before
    decisions = gateway.events("route.decision")[seen:]
    assert len(decisions) == REQUESTS
    assert all(d["endpoint"] == engine.url for d in decisions)
    predicted = sum(
        min(d["cached_tokens"], (n - 1) // KV_BLOCK * KV_BLOCK)
        for d, n in zip(decisions, prompt_tokens, strict=True)
    )
    blocks = gateway.metrics().value("shapegate_kv_events_blocks", endpoint=engine.url)
    print(
        f"\nkv events through the gateway: predicted {predicted} hit tokens, vLLM counted "
        f"{actual:.0f}; the index holds {blocks:.0f} blocks of the fast server",
        file=sys.stderr,
    )
    assert actual > 10 * KV_BLOCK
    assert abs(predicted - actual) <= 0.05 * actual, (predicted, actual)
