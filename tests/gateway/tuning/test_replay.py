"""Traces, the offline what-if, and the simulated replay of a policy against a shared pool."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from gateway.config_check import load_settings
from gateway.observe.trace import TraceRecord, read_trace, synthesize, write_trace
from gateway.tools.cli import main
from gateway.tuning.replay import SimReport, analyze, cluster_profiles, simulate, verdict
from tests.conftest import lanes_config
from tests.support.fake_engine import FakeEngine
from tests.support.servers import serve_asgi
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[3]
DEMO = load_settings(ROOT / "configs" / "demo.yaml", environ={})
SHARED = load_settings(ROOT / "configs" / "shared-pool.yaml", environ={})


def test_the_production_burst_has_the_shape_it_claims() -> None:
    trace = synthesize("production-burst", seed=3)
    assert len(trace) == 658 and trace[-1].t <= 3 * 3600
    monsters = [r for r in trace if r.prompt_tokens >= 100_000]
    assert len(monsters) == 9 and max(r.prompt_tokens for r in monsters) <= 720_000
    small = sorted(r.prompt_tokens for r in trace if r.prompt_tokens < 32_768)
    assert 2500 < small[len(small) // 2] < 3600
    outputs = sorted(r.output_tokens for r in trace if r.prompt_tokens < 32_768)
    assert 30 <= outputs[len(outputs) // 2] <= 45
    assert synthesize("production-burst", seed=3) == trace
    assert synthesize("production-burst", seed=4) != trace
    burst = synthesize("burst-32k", seed=1)
    assert len(burst) == 40 and max(r.t for r in burst) <= 5


def test_traces_round_trip(tmp_path: Path) -> None:
    trace = synthesize("burst-32k", seed=2)
    write_trace(tmp_path / "t.jsonl", trace)
    assert read_trace(tmp_path / "t.jsonl") == trace


def test_the_offline_what_if_explains_lanes_thresholds_and_characters() -> None:
    trace = [
        TraceRecord(
            t=0,
            model="qwen3.6",
            prompt_tokens=3000,
            prompt_bytes=12000,
            prompt_chars=12000,
            output_tokens=37,
        ),
        TraceRecord(
            t=1,
            model="qwen3.6",
            prompt_tokens=31000,
            prompt_bytes=150000,
            prompt_chars=150000,
            output_tokens=37,
        ),
        TraceRecord(
            t=2,
            model="qwen3.6",
            prompt_tokens=60000,
            prompt_bytes=126000,
            prompt_chars=126000,
            output_tokens=60,
        ),
    ]
    report = analyze(DEMO, trace, cluster_profiles(DEMO))
    assert report["lanes"]["fast"]["requests"] == 2 and report["lanes"]["heavy"]["requests"] == 1
    assert report["near_threshold"] == 1  # 31000 is within 10% of 32768
    # prose at 31k tokens looks heavy by characters; JSON at 60k tokens looks fast
    assert report["chars4_would_move"] == {"fast->heavy": 1, "heavy->fast": 1}
    assert report["slot_demand_lower_bound"]["fast"]["peak"] >= 1
    assert "lower bound" in report["slot_demand_note"]


def test_offline_replay_of_100k_requests_takes_seconds() -> None:
    trace = synthesize("production-burst", seed=1) * 152
    started = time.monotonic()
    report = analyze(DEMO, trace, cluster_profiles(DEMO))
    assert report["requests"] == 100_016
    assert time.monotonic() - started < 15


def test_lanes_beat_a_shared_pool_of_the_same_size_many_times_at_p99() -> None:
    trace = synthesize("production-burst", seed=1)
    lanes = simulate("lanes", DEMO, trace, cluster_profiles(DEMO))
    shared = simulate("shared", SHARED, trace, cluster_profiles(SHARED))
    ours, theirs = lanes.summary["small_requests"], shared.summary["small_requests"]
    assert ours["rejected"] == theirs["rejected"] == 0
    assert theirs["ttft_p99"] / ours["ttft_p99"] >= 10
    assert lanes.summary["large_in_light_lane"] == 0
    again = simulate("lanes", DEMO, trace, cluster_profiles(DEMO))
    assert again.summary == lanes.summary  # deterministic for a given trace


def test_a_character_threshold_sends_dense_json_to_engines_that_refuse_it() -> None:
    trace = synthesize("production-burst", seed=1)
    by_chars = simulate("chars", DEMO, trace, cluster_profiles(DEMO), count_by="chars4")
    assert by_chars.summary["large_in_light_lane"] > 0
    refused = [o for o in by_chars.result.outcomes if o.rejected == "engine_context_exceeded"]
    assert refused and all(o.lane == "fast" for o in refused)


def test_replay_cli_compares_and_plots(tmp_path: Path, capsys: Any) -> None:
    trace = tmp_path / "burst.jsonl"
    assert main(["trace", "synth", "production-burst", "--seed", "1", "--out", str(trace)]) == 0
    assert (
        main(
            [
                "replay",
                "--config",
                str(ROOT / "configs" / "demo.yaml"),
                str(trace),
                "--simulate",
                "--compare",
                str(ROOT / "configs" / "shared-pool.yaml"),
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "demo is " in out and "x better than shared-pool" in out
    # the offline lower bound beside the simulated peak, said to be one
    (fast,) = [line.split() for line in out.splitlines() if line.startswith("  fast ")]
    assert int(fast[1]) <= int(fast[2]) and "lower bound" in out
    assert (tmp_path / "out" / "replay.png").stat().st_size > 10_000
    report = orjson.loads((tmp_path / "out" / "replay.json").read_bytes())
    assert len(report["simulations"]) == 2


def trace_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


async def test_the_gateway_captures_shapes_never_text(gateway_at: Any, tmp_path: Path) -> None:
    engine = FakeEngine()
    path = tmp_path / "live.jsonl"
    async with serve_asgi(engine) as engine_url:
        config = lanes_config([engine_url], [engine_url])
        config["state"] = {"trace_file": str(path)}
        async with gateway_at(config) as (url, _), httpx.AsyncClient() as client:
            for n in (10, 3000):
                r = await client.post(
                    url + "/v1/chat/completions",
                    json={
                        "model": "qwen3.6",
                        "messages": [{"role": "user", "content": "canary " * n}],
                    },
                )
                assert r.status_code == 200
            await wait_for(lambda: trace_lines(path) >= 2, 5, what="both requests traced")
    assert b"canary" not in path.read_bytes()
    records = read_trace(path)
    assert [r.prompt_tokens > 2000 for r in records] == [False, True]
    assert all(r.output_tokens == 3 for r in records)


def test_verdicts_say_better_or_worse_as_the_numbers_do() -> None:
    trace = synthesize("production-burst", seed=1)
    lanes = simulate("lanes", DEMO, trace, cluster_profiles(DEMO))
    shared = simulate("shared", SHARED, trace, cluster_profiles(SHARED))
    ours = lanes.summary["small_requests"]["ttft_p99"]
    theirs = shared.summary["small_requests"]["ttft_p99"]
    assert ours < theirs
    assert verdict(lanes, shared).endswith(f"lanes is {theirs / ours:.1f}x better than shared")
    assert verdict(shared, lanes).endswith(f"shared is {theirs / ours:.1f}x worse than lanes")
    assert verdict(lanes, lanes).endswith("lanes is the same as lanes")
    # Close calls keep their sign: the "t8k is 1.0x better than demo" was worse.
    t8k = SimReport("t8k", lanes.result, {"small_requests": {"ttft_p99": 1.90}})
    demo = SimReport("demo", lanes.result, {"small_requests": {"ttft_p99": 1.82}})
    assert verdict(t8k, demo).endswith("t8k is 1.04x worse than demo")
    assert verdict(demo, t8k).endswith("demo is 1.04x better than t8k")


def test_compare_without_simulate_is_an_error(tmp_path: Path, capsys: Any) -> None:
    trace = tmp_path / "burst.jsonl"
    write_trace(trace, synthesize("production-burst", seed=1))
    demo = str(ROOT / "configs" / "demo.yaml")
    assert main(["replay", "--config", demo, str(trace), "--compare", demo]) == 2
    assert "--compare needs --simulate" in capsys.readouterr().err
