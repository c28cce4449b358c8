"""The simulator's scheduler against real vLLM's: who gets the step budget while a long prompt
prefills, without and with ``--long-prefill-token-threshold``.

The simulator (engine_pool/sim/scheduler.py) claims vLLM V1's rule: with no threshold (vLLM's
default) a long prompt's prefill takes every step's whole budget, so a short request that arrives
behind it gets its first token in the same step as the long one, at the end of its prefill; with
a threshold, the long prompt takes at most that many tokens a step while anyone else is running or
waiting, and the short request is admitted into the rest and answers at once. Both servers of the
tier run the CPU build's 2048-token budget; the fast one has no threshold, the heavy one 256.

Each case sends a long token-id prompt (fresh random ids: nothing cached) straight to one server,
then a short one 20 ms later, both streamed with one token each measured at its first byte of
output; the simulator, given the same limits and token counts, predicts the order and the test
checks that the server keeps it.

The same race with the second request repeating the first one's prompt (a document's second
question sent while the first still reads it) checks the simulator's prefix-cache rule: a request
finds the blocks scheduled by the time it is admitted (vLLM caches a block when it allocates its
slots, before the step computes it), not the ones a running prefill will schedule later: vLLM's
``vllm:prefix_cache_hits_total`` moves by what the simulator predicts for some step the repeat
may arrive in. Without a threshold the repeat waits and finds every full block (7,936 tokens);
with one it is admitted beside the read, finds part and reads the rest a second time. (Written
first with blocks cached when computed, the simulator's rule then, this test found vLLM's: 7,936
where it predicted 6,144, and 2,304, which it did not predict at all.)

A prompt whose client leaves while it prefills checks the simulator's abort: the blocks
scheduled before the abort stay cached (``Scheduler.abort`` leaves the prefix cache alone), so
the same prompt sent again finds them and prefills only the rest, as vLLM frees an aborted
request's blocks into its cache, hashes kept. A gateway that stops a long read for a cached
question and sends it again later loses at most the step it stopped in.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from typing import Any

import httpx
import pytest

from engine_pool.sim.prefix_cache import BlockCache
from engine_pool.sim.profile import CostParams, SchedulerLimits
from engine_pool.sim.scheduler import Scheduler
from tests.real.engines import (
    BATCHED_TOKENS,
    KV_BLOCK,
    LONG_PREFILL_THRESHOLD,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    MODEL,
    Real,
)

LONG, SHORT = 8000, 100
LONG_OUT, SHORT_OUT = 2, 40
SHORT_AFTER_S = 0.02
HITS = "vllm:prefix_cache_hits_total"
# Any costs: the prediction is an order of steps, not seconds.
COSTS = CostParams(
    step_overhead_s=0.01,
    prefill_s_per_token=1e-5,
    prefill_s_per_token_per_context_token=0.0,
    decode_s_per_seq=0.0,
    decode_s_per_kv_token=0.0,
    decode_kv_read_cap_tokens=1,
)


def simulated(
    threshold: int, second_arrives_in_step: int, repeat: bool = False
) -> tuple[dict[str, int], int]:
    """The simulator's steps (1-based) of each request's first token, and the prompt tokens the
    second found cached, the second arriving once ``second_arrives_in_step`` steps have run (0:
    with the long one); ``repeat``: the second is the long prompt and ``SHORT`` tokens more."""
    limits = SchedulerLimits(
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=BATCHED_TOKENS,
        kv_capacity_tokens=10 * MAX_MODEL_LEN,
        long_prefill_token_threshold=threshold,
    )
    sched = Scheduler(limits, COSTS, cache=BlockCache(10_000), block_tokens=KV_BLOCK)
    blocks = list(range(LONG // KV_BLOCK))
    sched.add("long", LONG, LONG_OUT, arrival=0.0, blocks=blocks)
    second = (LONG + SHORT, (LONG + SHORT) // KV_BLOCK) if repeat else (SHORT, 0)
    first: dict[str, int] = {}
    now, step = 0.0, 0
    while sched.has_work:
        if step == second_arrives_in_step:
            sched.add("short", second[0], SHORT_OUT, arrival=now, blocks=range(second[1]))
        result = sched.step(now)
        assert result is not None
        step += 1
        for key in result.first_tokens:
            first[key] = step
        now = result.end
    return first, sched.hits.get("short", 0)


def predicted_first_steps(threshold: int, short_arrives_in_step: int) -> tuple[int, int]:
    """The simulator's steps (1-based) of the long and the short request's first tokens."""
    first, _ = simulated(threshold, short_arrives_in_step)
    return first["long"], first["short"]


def predicted_hits(threshold: int) -> set[int]:
    """The prompt tokens a repeat of the long prompt finds cached, for each step it may arrive in
    while the long one is still prefilling (its steps alone: the budget's worth each)."""
    steps_alone = -(-LONG // BATCHED_TOKENS)
    return {simulated(threshold, step, repeat=True)[1] for step in range(steps_alone)}


def test_the_simulator_predicts_both_orders() -> None:
    for arrives in (0, 1):
        long_at, short_at = predicted_first_steps(0, arrives)
        assert short_at == long_at, (arrives, long_at, short_at)
        long_at, short_at = predicted_first_steps(LONG_PREFILL_THRESHOLD, arrives)
        assert short_at <= arrives + 1 < long_at, (arrives, long_at, short_at)
    # A repeat finds the blocks scheduled before it was admitted: without a threshold it waits
    # in the queue, admitted in the step of the long one's last chunk, after it (every full
    # block); with one it is admitted at once, finds what was scheduled so far (the first step's
    # budget, then the threshold a step) and reads the rest beside the long one.
    assert predicted_hits(0) == {7936}
    assert predicted_hits(LONG_PREFILL_THRESHOLD) == {256, 2304, 4352, 6400}


def predicted_resumed_hits() -> set[int]:
    """The prompt tokens the long prompt finds cached when sent again after an abort, for each
    step it may be aborted after while it prefills alone (the first to the last: after the
    last, its first token is made but has not reached the client that left)."""
    steps_alone = -(-LONG // BATCHED_TOKENS)
    found = set()
    for aborted_after in range(1, steps_alone + 1):
        limits = SchedulerLimits(
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=BATCHED_TOKENS,
            kv_capacity_tokens=10 * MAX_MODEL_LEN,
        )
        sched = Scheduler(limits, COSTS, cache=BlockCache(10_000), block_tokens=KV_BLOCK)
        blocks = list(range(LONG // KV_BLOCK))
        sched.add("long", LONG, LONG_OUT, arrival=0.0, blocks=blocks)
        now = 0.0
        for step in range(1, aborted_after + 1):
            result = sched.step(now)
            assert result is not None
            assert bool(result.first_tokens) == (step == steps_alone)
            now = result.end
        assert sched.abort("long")
        sched.add("again", LONG, LONG_OUT, arrival=now, blocks=blocks)
        assert sched.step(now) is not None
        found.add(sched.hits["again"])
    return found


def test_the_simulator_keeps_an_aborted_prefills_blocks() -> None:
    # Aborted after 1, 2 or 3 of its 4 steps of 2,048 tokens: that many steps' full blocks;
    # after the 4th, every full block (62 of 128 tokens).
    assert predicted_resumed_hits() == {2048, 4096, 6144, 7936}


def body(ids: list[int], out: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": ids,
        "max_tokens": out,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }


async def first_token_at(client: httpx.AsyncClient, url: str, data: dict[str, Any]) -> float:
    """Seconds (monotonic) when the first output token's event arrives; reads the stream out."""
    first = 0.0
    async with client.stream("POST", url + "/v1/completions", json=data) as answer:
        assert answer.status_code == 200, await answer.aread()
        async for line in answer.aiter_lines():
            if not first and line.startswith("data: {"):
                event = json.loads(line[6:])
                if event.get("choices"):
                    first = time.monotonic()
    assert first, "no token event"
    return first


async def race(url: str, repeat: bool = False) -> tuple[float, float]:
    """Time to first token of the long and of the short request, from the long one's send;
    ``repeat``: the second request is the long prompt and ``SHORT`` ids more."""
    rng = random.Random(time.time_ns())
    long_ids = [rng.randrange(1000, 100_000) for _ in range(LONG)]
    short_ids = [rng.randrange(1000, 100_000) for _ in range(SHORT)]
    if repeat:
        short_ids = long_ids + short_ids
    async with httpx.AsyncClient(timeout=120) as client:
        sent = time.monotonic()
        long_task = asyncio.create_task(first_token_at(client, url, body(long_ids, LONG_OUT)))
        await asyncio.sleep(SHORT_AFTER_S)
        short_first = await first_token_at(client, url, body(short_ids, SHORT_OUT))
        long_first = await long_task
    return long_first - sent, short_first - sent


@pytest.mark.parametrize("server", ["fast", "heavy"])
async def test_a_short_request_behind_a_long_prefill_answers_when_the_simulator_says(
    real: Real, server: str
) -> None:
    threshold = LONG_PREFILL_THRESHOLD if server == "heavy" else 0
    # Where the short request lands (with the long one or during its first step), the
    # simulator's order is the same (test_the_simulator_predicts_both_orders).
    long_at, short_at = predicted_first_steps(threshold, 0)
    url = real.engines[server].url
    await race(url)  # warm: the first long prompt after boot pays for allocations
    long_ttft, short_ttft = await race(url)
    print(
        f"\n{server} (long_prefill_token_threshold {threshold}): long TTFT {long_ttft:.3f}s, "
        f"short {short_ttft:.3f}s; simulator: first tokens in steps {long_at} and {short_at}",
        file=sys.stderr,
    )
    # Disjoint verdicts, in seconds, for an order predicted in steps (the long one's steps of
    # 2,048 tokens last ~0.2-0.9 s here, its 256-token ones tens of ms: a step count does not
    # scale to seconds). CI once measured 1.921 s and 0.986 s with the threshold, a 0.51 ratio.
    if short_at == long_at:
        # The same engine step: the short one's token comes with the long one's, not before.
        assert short_ttft >= 0.8 * long_ttft, (long_ttft, short_ttft)
    else:
        # Clearly first: the long one still had its capped steps to run.
        assert short_ttft < 0.8 * long_ttft, (long_ttft, short_ttft)
        assert long_ttft - short_ttft > 0.1, (long_ttft, short_ttft)


@pytest.mark.parametrize("server", ["fast", "heavy"])
async def test_a_repeat_of_a_prompt_in_prefill_finds_only_the_blocks_computed_so_far(
    real: Real, server: str
) -> None:
    threshold = LONG_PREFILL_THRESHOLD if server == "heavy" else 0
    expected = predicted_hits(threshold)
    engine = real.engines[server]
    await race(engine.url)  # warm, as above
    before = engine.metrics().value(HITS)
    await race(engine.url, repeat=True)
    hits = engine.metrics().value(HITS) - before
    print(
        f"\n{server} (long_prefill_token_threshold {threshold}): the repeat found {hits:g} "
        f"tokens cached; simulator, by arrival step: {sorted(expected)}",
        file=sys.stderr,
    )
    assert hits in expected, (hits, sorted(expected))
    if threshold:
        # Not the whole prompt: nothing waits for a prefix still being computed.
        assert hits < LONG // KV_BLOCK * KV_BLOCK


# When the client leaves, as shares of the prompt's prefill time alone.
SHARES = (0.1, 0.2, 0.33, 0.5)


async def leave_after(url: str, ids: list[int], after_s: float) -> None:
    """Send the prompt streamed and leave (close the connection) ``after_s`` seconds later,
    before any output: vLLM aborts the request."""
    async with httpx.AsyncClient(timeout=120) as client:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(after_s):
                async with client.stream(
                    "POST", url + "/v1/completions", json=body(ids, LONG_OUT)
                ) as answer:
                    async for line in answer.aiter_lines():
                        assert not line.startswith("data: {"), "answered before the client left"


async def test_a_prefill_aborted_by_its_client_resumes_from_its_cached_blocks(real: Real) -> None:
    expected = predicted_resumed_hits()
    engine = real.engines["fast"]  # no threshold: the prompt prefills alone, 2,048 a step
    await race(engine.url)  # warm, as above
    rng = random.Random(time.time_ns())
    # How long the prompt takes alone here, then leave at a tenth, a fifth, a third and half of
    # it: a machine that runs faster or slower than that moves the step, not the verdict. (vLLM
    # sees the client leave a little later: left at 1/3 and 1/2, the tier found 6,144 and 4,096
    # or 6,144, and once at 2/3 the whole prompt, 7,936.)
    ids = [rng.randrange(1000, 100_000) for _ in range(LONG)]
    async with httpx.AsyncClient(timeout=120) as client:
        sent = time.monotonic()
        alone_s = await first_token_at(client, engine.url, body(ids, LONG_OUT)) - sent
    seen = []
    for share in SHARES:
        ids = [rng.randrange(1000, 100_000) for _ in range(LONG)]
        await leave_after(engine.url, ids, share * alone_s)
        deadline = time.monotonic() + 30
        while engine.running() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not engine.running(), "vLLM kept running the request its client left"
        before = engine.metrics().value(HITS)
        async with httpx.AsyncClient(timeout=120) as client:
            await first_token_at(client, engine.url, body(ids, LONG_OUT))
        seen.append(engine.metrics().value(HITS) - before)
    print(
        f"\nfast: the prompt alone took {alone_s:.3f}s; sent again after its client left at "
        f"{SHARES} of that, it found {seen} tokens cached; simulator, by the step it is "
        f"aborted after: {sorted(expected)}",
        file=sys.stderr,
    )
    # Each resumed prompt found a whole number of the steps computed before the abort; one left
    # before its first step ends finds none (0), as the simulator would. The step lengths are
    # not equal (the later chunks attend to more context), so at least one must have left
    # mid-prefill.
    assert all(hits in expected | {0} for hits in seen), (seen, sorted(expected))
    assert any(hits in expected - {max(expected)} for hits in seen), (seen, sorted(expected))
