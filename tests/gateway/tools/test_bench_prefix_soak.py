"""``shapegate bench prefix-soak`` (gateway/tools/bench/prefix_soak.py), small: a few seconds of
unique-prefix traffic through a real ``shapegate serve`` keep the prefix index at its bound,
and the JSON has the shape the README's figures are read from. The 10-minute run is the same
code (tests/test_readme_commands.py excludes its command as too long).

The memory check here is loose on purpose: seconds of traffic on a loaded CI core say nothing
about a slope (a strict one flaked under CI load); the committed 10-minute JSON is the
evidence for that."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import orjson

from gateway.count.tokens import TokenCounter
from gateway.tools.bench import prefix_soak
from gateway.tools.bench.harness import write_json
from gateway.tools.bench.soak_traffic import SoakOptions, memory_fit, seconds_of
from gateway.tools.cli import build_parser
from gateway.tools.sim_support import RegistryCounter


async def test_a_short_prefix_soak_keeps_the_index_at_its_bound(
    counter: TokenCounter, tmp_path: Path
) -> None:
    options = SoakOptions(seconds=6, rate=50, seed=3, disconnect_share=0.0)
    result = await prefix_soak.prefix_soak(
        options, max_blocks=256, counter=RegistryCounter(counter, "qwen3.6")
    )
    print(prefix_soak.table(result))

    index = result["prefix_index"]
    assert index["bound"] == 256
    # Unique prefixes (about 8 blocks a request) overflow the bound many times over: the index
    # reached it, never passed it, and evicted the rest.
    assert result["requests"] > 150
    assert index["peak_entries"] == index["final_entries"] == 256
    assert index["evicted"] > 256 and index["at_bound_after_s"] is not None
    assert index["samples"] >= 4 and result["index_bounded"]
    # Answered (a loaded CI core may time out a few: not what this checks).
    assert result["client_outcomes"].get("ok", 0) >= 0.9 * result["requests"]
    for key in ("memory_pss", "memory_rss"):
        memory = result[key]
        assert set(memory) == {
            "baseline_mb",
            "final_mb",
            "peak_mb",
            "growth_mb",
            "slope_mb_per_min",
        }
        assert 20 < memory["baseline_mb"] < 2000
        assert abs(memory["growth_mb"]) < 200  # loose: see the module's docstring
    assert isinstance(result["memory_flat"], bool)
    assert result["passed"] == (result["index_bounded"] and result["memory_flat"])

    path = write_json(tmp_path, "prefix-soak", result)
    assert path.name == "prefix-soak.json"
    assert orjson.loads(path.read_bytes())["prefix_index"]["bound"] == 256


def test_the_prefix_soak_is_a_bench_suite_of_ten_minutes_by_default() -> None:
    args = build_parser().parse_args(["bench", "prefix-soak"])
    assert isinstance(args, argparse.Namespace) and args.func is prefix_soak.run
    assert seconds_of(args) == 600 and args.rate == 50 and args.max_blocks == 65_536
    assert args.out == "bench-results"
    short = build_parser().parse_args(["bench", "prefix-soak", "--minutes", "0.1"])
    assert seconds_of(short) == 6


def test_every_body_starts_a_prefix_of_its_own() -> None:
    rng = random.Random(1)
    bodies = [orjson.loads(prefix_soak.unique_prefix_body(rng, n)) for n in range(50)]
    systems = [b["messages"][0]["content"] for b in bodies]
    # The index cuts blocks of 512 bytes: no two prompts share their first.
    assert len({s.encode()[:64] for s in systems}) == 50
    assert all(len(s.encode()) > 8 * 512 for s in systems)


def test_memory_fit_reads_a_slope_and_ignores_the_warm_up() -> None:
    climbing = [(float(t), 100.0 + t / 60) for t in range(0, 600)]  # 1 MB/min
    assert memory_fit(climbing, 300)["slope_mb_per_min"] == 1.0
    warmed = [(float(t), 50.0 if t < 300 else 230.0) for t in range(0, 600)]
    flat = memory_fit(warmed, 300)
    assert flat["slope_mb_per_min"] == 0.0 and flat["growth_mb"] == 0.0
    assert flat["baseline_mb"] == 230.0 and flat["peak_mb"] == 230.0
