"""``shapegate bench fidelity --smoke``: the demo played live at scale 0.05 against the what-if."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gateway.tools.cli import main

ROOT = Path(__file__).resolve().parents[3]


def test_bench_fidelity_smoke_plays_the_demo_and_writes_ratios(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["bench", "fidelity", "--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "fidelity.json").read_text())
    assert (tmp_path / "fidelity.png").stat().st_size > 5_000
    (row,) = result["scales"]
    assert row["time_scale"] == 0.05 and result["requests"] == row["requests"] > 0
    assert row["not_served"] == 0 and row["count_mismatches"] == 0
    # Measured from the engines' own records: the live path costs milliseconds.
    assert row["measured_costs"]["requests"] == result["requests"]
    assert row["measured_costs"]["pre_engine_ms_p50"] > 0
    for model in ("engine_only", "predicted", "calibrated"):
        worst = row[model]["worst_ratio"]
        assert math.isfinite(worst) and worst >= 1
        assert set(row[model]["ratios"]["small"]) >= {"ttft_p50", "e2e_p99"}
    # Modelling the live path can only add time: the baseline predicts less than the model.
    assert (
        row["engine_only"]["figures"]["small_requests"]["ttft_p50"]
        < row["predicted"]["figures"]["small_requests"]["ttft_p50"]
    )
    assert [t["limit"] for t in result["targets"]] == [1.1, 1.1]
