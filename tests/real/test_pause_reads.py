"""``lanes[].pause_reads`` in front of real vLLM: a cached question pauses a long read on the
same engine, gets its first token long before the read's, and the read, sent again, finds the
blocks it had computed before the pause in vLLM's prefix cache.

A gateway of its own (the tier's policy, its heavy lane moved onto the fast server, which runs
vLLM's default of no ``--long-prefill-token-threshold``: a running prefill takes each step's
whole 2,048-token budget, so a request behind it gets its first token with the read's;
tests/real/test_long_prefill.py), the lane weighing prefixes and pausing reads. Token-id
completions prompts, fresh random ids each run:

1. document A (6,000 ids plus a question) once, so the engine and the gateway's index hold it;
2. a read of a new 7,900-id prompt, streamed;
3. 50 ms after the gateway sent the read on, a second question on A (about 160 ids uncached).

Without the pause the question would wait for the read's prefill (about 0.7 s alone on this
machine). With it the gateway closes the read's connection (vLLM aborts it, keeping its blocks),
answers the question, then sends the read again: vLLM's ``prefix_cache_hits_total`` moves by
the question's cached document and by a whole number of the read's 2,048-token steps.
"""

from __future__ import annotations

import asyncio
import copy
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.real.engines import KV_BLOCK, Real
from tests.real.test_long_prefill import HITS, body, first_token_at
from tests.real.test_shipped_defaults import serving
from tests.support.servers import free_port

DOC, QUESTION, READ = 6000, 50, 7900
QUESTION_AFTER_S = 0.05  # the read's prefill alone takes about 0.7 s


def pausing_policy(real: Real) -> dict[str, Any]:
    config = copy.deepcopy(real.policy)
    config["server"]["port"] = free_port()
    heavy = next(lane for lane in config["lanes"] if lane["name"] == "heavy")
    heavy["clusters"] = ["fast"]
    heavy["weights"] = {"load": 1.0, "prefix": 1.0}
    heavy["pause_reads"] = {"question_max_tokens": 1024, "read_min_tokens": 4000}
    return config


async def test_a_cached_question_pauses_a_read_and_the_read_resumes_from_its_blocks(
    real: Real, tmp_path: Path
) -> None:
    engine = real.engines["fast"]
    rng = random.Random(time.time_ns())

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, 100_000) for _ in range(n)]

    doc, read = ids(DOC), ids(READ)
    with serving(pausing_policy(real), tmp_path, "pausing") as gateway:
        async with httpx.AsyncClient(timeout=120) as client:
            await first_token_at(client, gateway.url, body(doc + ids(QUESTION), 1))
            await asyncio.sleep(0.5)  # the engine's KV events reach the gateway
            before = engine.metrics().value(HITS)
            decided = len(gateway.events("route.decision"))
            sent = time.monotonic()
            reading = asyncio.create_task(first_token_at(client, gateway.url, body(read, 2)))
            # Once the gateway has sent the read on (its decision logged), the question follows.
            while len(gateway.events("route.decision")) == decided:
                assert time.monotonic() - sent < 10, gateway.tail()
                await asyncio.sleep(0.01)
            await asyncio.sleep(QUESTION_AFTER_S)
            asked = await first_token_at(client, gateway.url, body(doc + ids(QUESTION), 2))
            read_at = await reading
        hits = engine.metrics().value(HITS) - before
        paused = gateway.events("route.paused")
        resumed = gateway.events("route.resumed")
        finished = {e["request_id"]: e for e in gateway.events("route.finished")}
    question_hits = DOC // KV_BLOCK * KV_BLOCK
    print(
        f"\npause_reads: question's first token at {asked - sent:.3f}s, the read's at "
        f"{read_at - sent:.3f}s; paused {len(paused)}, prefix cache hits {hits:g} "
        f"(the question's {question_hits}, the resumed read's {hits - question_hits:g})",
        file=sys.stderr,
    )
    assert len(paused) == 1 and len(resumed) == 1, (paused, resumed)
    read_id = paused[0]["request_id"]
    assert finished[read_id]["pauses"] == 1 and finished[read_id]["outcome"] == "ok"
    assert paused[0]["remaining_tokens"] >= READ - KV_BLOCK
    assert asked < read_at
    # The question found its document; the read, sent again, the whole steps it had computed
    # before the pause (at least one: it was paused mid-prefill or after it) and no more.
    resumed_hits = hits - question_hits
    assert resumed_hits % KV_BLOCK == 0, hits
    assert 0 < resumed_hits <= (READ - 1) // KV_BLOCK * KV_BLOCK, hits
