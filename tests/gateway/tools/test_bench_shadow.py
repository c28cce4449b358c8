"""``shapegate bench shadow --smoke``: the overhead rounds and the prediction against the
promoted policy live, on the real gateway and the real demo."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from gateway.tools.bench.shadow import (
    MAX_CPU_RATIO,
    SHADOW_FAST_ENDS,
    _keep_skipped,
    candidate,
    demo_config,
    median_ci,
    targets,
)
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
    # The medians of the pairs come with their interval, said next to the verdict.
    low, high = cost["cpu_ratio_ci"]
    assert low <= cost["cpu_ratio"] <= high
    low, high = cost["added_median_ms_ci"]
    assert low <= cost["added_median_ms"] <= high
    assert "95% CI" in result["targets"][1]["target"]
    guess = result["prediction"]
    assert guess["compared"] == guess["requests"] > 0
    moved = sum(d["requests"] for d in guess["disagreements"])
    assert moved == guess["in_8192_32767"]
    assert guess["not_served"] == {"first": 0, "promoted": 0}
    assert all(math.isfinite(e) for e in guess["error"].values())
    assert "bench fidelity" in guess["predicted_effect"]["calibration"]["source"]
    assert [t["limit"] for t in result["targets"]] == [1.0, 1.03, 0.2, 0.2, 0.2]


def test_the_median_of_paired_ratios_comes_with_a_bootstrap_interval() -> None:
    steady = [1.02] * 40
    assert median_ci(steady) == (1.02, 1.02, 1.02)
    spread = [1.0 + 0.01 * (i % 11) for i in range(40)]  # 1.00 .. 1.10
    middle, low, high = median_ci(spread)
    assert middle == pytest.approx(1.045)  # the 20th and 21st of 40: 1.04, 1.05
    assert 1.0 < low < middle < high < 1.10
    assert median_ci(spread) == (middle, low, high)  # seeded: a run reproduces its interval
    # More pairs, a narrower interval.
    more_low, more_high = median_ci(spread * 4)[1:]
    assert more_high - more_low < high - low


def cost(ratio: float, low: float, high: float) -> dict[str, object]:
    return {
        "overhead": {
            "rounds": 40,
            "confidence": 0.95,
            "added_median_ms": 0.02,
            "added_median_ms_ci": [0.01, 0.03],
            "cpu_ratio": ratio,
            "cpu_ratio_ci": [low, high],
        }
    }


def test_the_cpu_verdict_says_whether_its_interval_resolves_the_limit() -> None:
    def said(ratio: float, low: float, high: float) -> tuple[bool, str]:
        found = targets(cost(ratio, low, high))[1]
        assert found["limit"] == MAX_CPU_RATIO
        return found["met"], found["target"]

    met, text = said(1.01, 1.0, 1.02)
    assert met and "met at this confidence" in text and "1.000x-1.020x" in text
    met, text = said(1.05, 1.04, 1.07)
    assert not met and "missed at this confidence" in text
    met, text = said(1.025, 1.01, 1.04)
    assert met and "not resolved" in text


def test_the_instruction_verdict_is_named_for_what_it_counts() -> None:
    result = cost(1.02, 1.0, 1.05) | {
        "instructions": {
            "requests": 200,
            "instruction_ratio": 1.012,
            "windows": [
                {"mode": "off", "instructions": 1000},
                {"mode": "on", "instructions": 1010},
                {"mode": "off", "instructions": 1002},
                {"mode": "on", "instructions": 1016},
            ],
        },
    }
    found = targets(result)[2]
    assert found["limit"] == MAX_CPU_RATIO and found["value"] == 1.012 and found["met"]
    assert "instructions per request" in found["target"]
    assert "not CPU seconds" in found["target"]
    assert "pairs 1.0100x, 1.0140x" in found["target"]
    result["instructions"]["instruction_ratio"] = 1.031
    assert not targets(result)[2]["met"]
    # The wall-CPU figure stays beside it.
    assert "CPU per request" in targets(result)[1]["target"]
    # With --memo-miss, the shadow deciding every request afresh is a target of its own.
    result["instructions_memo_miss"] = result["instructions"] | {"instruction_ratio": 1.05}
    missing = targets(result)[3]
    assert "memo missing every request" in missing["target"]
    assert missing["value"] == 1.05 and not missing["met"]


def test_a_part_measured_alone_keeps_the_others_figures_from_the_earlier_run(
    tmp_path: Path,
) -> None:
    earlier = {
        "machine": {"at": "2026-12-05T07:54:17Z"},
        "overhead": {"cpu_ratio": 1.018},
        "prediction": {"compared": 103},
    }
    path = tmp_path / "shadow.json"
    path.write_text(json.dumps(earlier))
    now: dict[str, object] = {"machine": {"at": "later"}, "instructions": {"ratio": 1.01}}
    _keep_skipped(path, now)
    assert now["overhead"] == {"cpu_ratio": 1.018}
    assert now["prediction"] == {"compared": 103}
    assert now["instructions"] == {"ratio": 1.01}
    assert now["kept_from"] == {
        "overhead": "2026-12-05T07:54:17Z",
        "prediction": "2026-12-05T07:54:17Z",
    }
    # A smoke run never mixes with a real run's figures.
    smoke: dict[str, object] = {"machine": {"at": "later"}, "smoke": True}
    _keep_skipped(path, smoke)
    assert "overhead" not in smoke
