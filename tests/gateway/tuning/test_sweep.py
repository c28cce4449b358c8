"""``replay --sweep``: one table and one plot answer "which threshold?"."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from gateway.observe.trace import synthesize, write_trace
from gateway.settings import parse_settings
from gateway.tools.cli import main
from gateway.tuning.sweep import candidate, parse_sweep

ROOT = Path(__file__).resolve().parents[3]
DEMO = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())


def test_a_spec_reads_token_suffixes_and_refuses_nonsense() -> None:
    sweep = parse_sweep("lanes.fast.max_prompt_tokens=8k,16k,1m,5000")
    assert sweep.key == ("lanes", "fast", "max_prompt_tokens")
    assert sweep.values == (8192, 16384, 1048576, 5000)
    assert sweep.labels == ("8k", "16k", "1m", "5000")
    for bad in ("lanes.fast.max_prompt_tokens", "x=1", "lanes.fast.max_prompt_tokens="):
        with pytest.raises(ValueError, match="expected KEY=V1,V2"):
            parse_sweep(bad)


def test_a_moved_threshold_moves_the_neighbouring_lane_too() -> None:
    moved = candidate(DEMO, parse_sweep("lanes.fast.max_prompt_tokens=8k"), 8192)
    fast, heavy = moved["lanes"]
    assert fast["max_prompt_tokens"] == 8192 and heavy["min_prompt_tokens"] == 8192
    assert parse_settings(moved, environ={}).lane("heavy").min_prompt_tokens == 8192
    assert DEMO["lanes"][0]["max_prompt_tokens"] == 32768  # the original is untouched
    slots = candidate(DEMO, parse_sweep("lanes.heavy.slots.lane=4"), 4)
    assert slots["lanes"][1]["slots"] == {"lane": 4, "per_endpoint": 4}
    with pytest.raises(ValueError, match="no 'medium' here"):
        candidate(DEMO, parse_sweep("lanes.medium.slots.lane=4"), 4)


def test_four_thresholds_on_the_production_burst_give_one_table_and_one_plot(
    tmp_path: Path, capsys: Any
) -> None:
    trace = tmp_path / "burst.jsonl"
    write_trace(trace, synthesize("production-burst", seed=1))
    out = tmp_path / "out"
    started = time.monotonic()
    code = main(
        [
            "replay",
            "--config",
            str(ROOT / "configs" / "demo.yaml"),
            str(trace),
            "--sweep",
            "lanes.fast.max_prompt_tokens=8k,16k,32k,64k",
            "--out",
            str(out),
        ]
    )
    elapsed = time.monotonic() - started
    assert code == 0
    printed = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in printed.splitlines() if line[:1].isdigit()}
    assert list(rows) == ["8k", "16k", "32k", "64k"]
    header = next(line for line in printed.splitlines() if line.startswith("lanes.fast."))
    for column in ("small TTFT p50", "small TTFT p99", "monster completion", "monsters leaked"):
        assert column in header
    assert "slot peak/limit" in header
    assert rows["8k"][-4] == "fast" and rows["8k"][-2] == "heavy"  # peak/limit per lane
    # Prompts of 32k-64k tokens go to the fast lane at 64k: monsters leak, and the fast engines
    # (max_model_len 32768) refuse them.
    report = orjson.loads((out / "sweep.json").read_bytes())
    by_value = {row["value"]: row for row in report["rows"]}
    assert by_value["32k"]["large_in_light_lane"] == 0
    assert by_value["64k"]["large_in_light_lane"] > 0
    assert by_value["64k"]["all"]["rejected"] > 0
    assert (
        by_value["8k"]["slot_occupancy"]["heavy"]["peak"]
        > (by_value["32k"]["slot_occupancy"]["heavy"]["peak"])
    )
    assert (out / "sweep.png").stat().st_size > 10_000
    assert elapsed < 30, f"the sweep took {elapsed:.1f}s"
