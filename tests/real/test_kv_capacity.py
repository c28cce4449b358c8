"""Real vLLM's KV cache size reaches the gateway's view of each endpoint.

vLLM exports its ``CacheConfig`` as the info gauge ``vllm:cache_config_info`` (its fields as
labels: ``block_size``, ``num_gpu_blocks``, ...; on the CPU backend ``num_gpu_blocks`` is the
KV cache's blocks in host memory). The gateway reads it with the capability check
(engine_pool/capability.py ``parse_cache_config``) and carries it on the endpoint's view, where
the approximate prefix index bounds each endpoint's record by it (engine_pool/prefix_index.py).
"""

from __future__ import annotations

import sys

import httpx

from engine_pool.capability import parse_cache_config
from tests.real.engines import KV_BLOCK, Real
from tests.support.prom import parse
from tests.support.waiting import wait_for


async def test_the_kv_capacity_real_vllm_reports_is_carried_to_its_endpoint(real: Real) -> None:
    reported: dict[str, int] = {}
    for name, engine in real.engines.items():
        text = httpx.get(engine.url + "/metrics", timeout=5).text
        (labels,) = [
            have for n, have, v in parse(text).samples if n == "vllm:cache_config_info" and v == 1
        ]
        assert labels["block_size"] == str(KV_BLOCK), (name, labels)
        blocks = int(labels["num_gpu_blocks"])
        assert blocks > 0, (name, labels)
        assert parse_cache_config(text) == KV_BLOCK * blocks
        reported[engine.url] = KV_BLOCK * blocks
    print(f"\nvllm:cache_config_info, KV tokens per endpoint: {reported}", file=sys.stderr)

    def carried() -> bool:
        endpoints = [e for c in real.gateway.state()["clusters"] for e in c["endpoints"]]
        shown = {e["url"]: e.get("kv_capacity_tokens") for e in endpoints}
        return all(shown.get(url) == tokens for url, tokens in reported.items())

    await wait_for(carried, 30, interval=0.5, what="each endpoint's KV capacity in /admin/state")
