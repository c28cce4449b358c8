"""``shapegate bench shadow --smoke``: the overhead rounds and the prediction against the
promoted policy live, on the real gateway and the real demo."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from gateway.tools.bench.shadow import SHADOW_FAST_ENDS, candidate, demo_config
from gateway.tools.cli import main

ROOT = Path(__file__).resolve().parents[3]


def test_the_candidate_is_the_policy_with_its_fast_lane_ending_at_8192() -> None:
    policy = yaml.safe_load(candidate(demo_config(8000, 9100)))
    fast, heavy = policy["lanes"]
    assert fast["max_prompt_tokens"] == heavy["min_prompt_tokens"] == SHADOW_FAST_ENDS
    assert policy["clusters"][1]["endpoints"] == ["http://127.0.0.1:9111", "http://127.0.0.1:9112"]


def test_bench_shadow_smoke_measures_the_overhead_and_the_prediction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["bench", "shadow", "--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "shadow.json").read_text())
    cost = result["overhead"]
    # Every request of the "on" rounds was compared; none failed.
    assert cost["shadow_compared"] == cost["requests"]["on"] > 0
    assert cost["errors"] == {"off": 0, "on": 0}
    assert math.isfinite(cost["added_median_ms"]) and cost["cpu_ratio"] > 0
    guess = result["prediction"]
    assert guess["compared"] == guess["requests"] > 0
    moved = sum(d["requests"] for d in guess["disagreements"])
    assert moved == guess["in_8192_32767"]
    assert guess["not_served"] == {"first": 0, "promoted": 0}
    assert all(math.isfinite(e) for e in guess["error"].values())
    assert "bench fidelity" in guess["predicted_effect"]["calibration"]["source"]
    assert [t["limit"] for t in result["targets"]] == [1.0, 1.03, 0.2, 0.2, 0.2]
