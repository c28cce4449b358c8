"""What an engine reports it holds, held against its lanes: pure decisions, and the simulator
reporting what vLLM reports."""

from __future__ import annotations

import httpx
import pytest

from engine_pool.capability import (
    Capability,
    CapabilityError,
    LaneNeed,
    holding,
    judge,
    parse_cache_config,
    parse_models,
    refusal,
)
from engine_pool.cluster import Cluster, EngineState, EngineView
from engine_pool.registry import EnginePool
from engine_pool.sim.server import run_sim
from gateway.count.tokens import TokenCounter
from gateway.settings import parse_settings
from gateway.tools.sim_support import RegistryCounter
from gateway.upstream.engines import lane_needs
from tests.conftest import lanes_config
from tests.support.prom import parse

# vLLM 0.32's /v1/models for `--served-model-name qwen3.6 Qwen/Qwen3.6-35B-A3B --max-model-len
# 32768` (the fields the check reads; the simulator answers the same shape: wire.model_list).
VLLM_MODELS = {
    "object": "list",
    "data": [
        {"id": "qwen3.6", "object": "model", "root": "/models/q", "max_model_len": 32768},
        {"id": "Qwen/Qwen3.6-35B-A3B", "object": "model", "max_model_len": 32768},
    ],
}
# vLLM's info gauge: the CacheConfig fields as labels, set to 1.
CACHE_INFO = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
    'engine="0",gpu_memory_utilization="0.9",num_gpu_blocks="1500"} 1.0\n'
)
QWEN = (("qwen3.6", "Qwen/Qwen3.6-35B-A3B"),)


def view(url: str, context: int | None, state: EngineState = EngineState.UP) -> EngineView:
    return EngineView("big", url, state, in_flight=0, context_tokens=context)


def test_models_and_cache_config_are_read_as_vllm_reports_them() -> None:
    capability = parse_models(VLLM_MODELS, parse_cache_config(CACHE_INFO))
    assert capability.models == ("qwen3.6", "Qwen/Qwen3.6-35B-A3B")
    assert capability.max_model_len == 32768
    assert capability.kv_capacity_tokens == 24000  # 16 x 1500: smaller, so it is the limit
    assert capability.context_tokens == 24000
    assert "vllm:cache_config_info" in capability.limit_text()
    assert parse_cache_config("vllm:num_requests_running 0\n") is None
    unsized = CACHE_INFO.replace('num_gpu_blocks="1500"', 'num_gpu_blocks="None"')
    assert parse_cache_config(unsized) is None  # not profiled yet: unknown, not zero
    with pytest.raises(CapabilityError):
        parse_models({"detail": "Not Found"})


def test_a_lane_larger_than_the_engine_is_named_with_both_numbers() -> None:
    engine = Capability(("qwen3.6",), 32768)
    big = LaneNeed("big", 131_072, 1, QWEN)
    evidence = judge(engine, [big])
    assert evidence is not None
    assert "131,072" in evidence and "32,768" in evidence and "'big'" in evidence
    # The lane's largest prompt plus min_output_tokens is exactly the engine's context: fine.
    assert judge(engine, [LaneNeed("fast", 32_767, 1, QWEN)]) is None
    # ... but not with room for 1,024 output tokens (lanes[].min_output_tokens).
    assert judge(engine, [LaneNeed("fast", 32_767, 1024, QWEN)]) is not None
    # Unknown context (an engine that does not report it): no verdict on size.
    assert judge(Capability(("qwen3.6",), None), [big]) is None


def test_an_engine_serving_none_of_a_models_names_is_misconfigured() -> None:
    only_alias = Capability(("Qwen/Qwen3.6-35B-A3B",), 1_048_576)
    assert judge(only_alias, [LaneNeed("big", 1000, 1, QWEN)]) is None
    other = Capability(("llama",), 1_048_576)
    evidence = judge(other, [LaneNeed("big", 1000, 1, QWEN)])
    assert evidence is not None and "'qwen3.6'" in evidence and "'llama'" in evidence


def test_prompts_an_endpoint_cannot_hold_go_elsewhere_else_are_refused() -> None:
    short, long_ = view("http://s", 32768), view("http://l", 1_048_576)
    unknown = view("http://u", None)
    assert holding([short, long_, unknown], 60_001) == [long_, unknown]
    assert holding([short, long_], 1_001) == [short, long_]
    assert refusal([short, long_], 60_001) is None  # another endpoint holds it
    assert refusal([short, view("http://s2", 16384)], 60_001) == short  # the largest named
    assert refusal([short, view("http://d", 1_048_576, EngineState.DOWN)], 60_001) == short
    assert refusal([view("http://d", 32768, EngineState.DOWN)], 60_001) is None  # health's
    assert refusal([short], 32_768) is None


def test_the_pool_reports_a_change_of_verdict_once() -> None:
    pool = EnginePool([Cluster("big", "vllm", ("http://s",))])
    engine = Capability(("qwen3.6",), 32768)
    assert not pool.capability_read("big", "http://s")
    first = pool.set_capability("big", "http://s", engine, "too small")
    assert first is not None and first.misconfigured and first.evidence == "too small"
    assert pool.set_capability("big", "http://s", engine, "too small") is None
    assert pool.set_capability("big", "http://s", None, None) is None  # unread: kept
    assert pool.views("big")[0].context_tokens == 32768
    assert pool.engine("big", "http://s").as_json(0.0)["state"] == "misconfigured"
    fixed = pool.set_capability("big", "http://s", Capability(("qwen3.6",), 262144), None)
    assert fixed is not None and not fixed.misconfigured
    assert pool.engine("big", "http://s").as_json(0.0)["state"] == "up"


def test_the_kv_capacity_is_carried_from_the_metric_to_the_endpoints_view() -> None:
    """What vllm:cache_config_info says (16 x 1500 tokens) reaches the view the chain and the
    prefix index read; an engine exporting none (SGLang) leaves it unknown."""
    pool = EnginePool([Cluster("big", "vllm", ("http://v", "http://s"))])
    assert [v.kv_capacity_tokens for v in pool.views("big")] == [None, None]
    pool.set_capability(
        "big", "http://v", parse_models(VLLM_MODELS, parse_cache_config(CACHE_INFO)), None
    )
    pool.set_capability("big", "http://s", parse_models(VLLM_MODELS, None), None)
    by_url = {v.url: v for v in pool.views("big")}
    assert by_url["http://v"].kv_capacity_tokens == 24_000
    assert by_url["http://s"].kv_capacity_tokens is None
    assert pool.engine("big", "http://v").as_json(0.0)["kv_capacity_tokens"] == 24_000


def test_needs_come_from_the_lanes_a_cluster_is_primary_for() -> None:
    config = lanes_config(["http://f"], ["http://h"], threshold=32768)
    config["lanes"][1]["min_output_tokens"] = 256
    config["lanes"][0]["emergency_clusters"] = ["heavy"]
    settings = parse_settings(config, environ={})
    (fast,) = lane_needs(settings, settings.cluster("fast"))
    assert (fast.lane, fast.prompt_tokens, fast.output_tokens) == ("fast", 32767, 1)
    (heavy,) = lane_needs(settings, settings.cluster("heavy"))  # not the lane it stands in for
    assert (heavy.lane, heavy.prompt_tokens, heavy.output_tokens) == ("heavy", 999_999, 256)
    assert heavy.models == (("qwen3.6", "Qwen/Qwen3.6-35B-A3B"),)


async def test_the_simulator_reports_its_context_and_counts_every_request(
    counter: TokenCounter,
) -> None:
    shared = RegistryCounter(counter, "qwen3.6")
    # Nothing here is timed: httpx's default 5 s would be a deadline by accident. The simulator
    # answers on this test's own event loop, so a worker starved for 5 s (two xdist workers
    # beside other jobs on two cores) would fail on time, not on anything the engine reports.
    async with (
        run_sim("h100-fast", time_scale=0.01, counter=shared) as sim,
        httpx.AsyncClient(base_url=sim.url, timeout=60) as client,
    ):
        capability = parse_models(
            (await client.get("/v1/models")).json(),
            parse_cache_config((await client.get("/metrics")).text),
        )
        assert capability.max_model_len == 32768
        assert capability.kv_capacity_tokens == 2_097_152  # the profile's KV capacity
        too_long = {
            "model": "qwen3.6",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 40_000,
        }
        assert (await client.post("/v1/chat/completions", json=too_long)).status_code == 400
        scrape = parse((await client.get("/metrics")).text)
    chat = {"handler": "/v1/chat/completions", "method": "POST"}
    assert scrape.value("http_requests_total", status="4xx", **chat) == 1
    assert not scrape.has("http_requests_total", handler="/metrics")
