"""``shapegate bench lanes --smoke``: the burst trace on equal capacity, three ways."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.tools.cli import main

ROOT = Path(__file__).resolve().parents[3]


def test_bench_lanes_smoke_compares_the_three_policies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # configs/shared-pool.yaml and configs/demo.yaml

    assert main(["bench", "lanes", "--smoke", "--out", str(tmp_path)]) == 0

    result = json.loads((tmp_path / "lanes.json").read_text())
    assert (tmp_path / "lanes.png").stat().st_size > 10_000
    assert result["seeds"] == 2 and [s["seed"] for s in result["per_seed"]] == [1, 2]
    for seed in result["per_seed"]:
        shared, chars4, tokens = (seed["policies"][n] for n in ("shared", "chars4", "tokens"))
        # Real token counts keep every monster out of the fast lane; a character threshold
        # does not (the trace's JSON tool results are dense in tokens).
        assert tokens["leaked_monsters"] == 0 < chars4["leaked_monsters"]
        # Lanes shield small requests from monster prefills: a far better TTFT tail.
        assert tokens["small_ttft_p99_s"] * 10 < shared["small_ttft_p99_s"]
        assert tokens["monsters"] == shared["monsters"] > 0
    # Same trace, same capacity: the ratios are computed from the per-seed figures.
    ratios = result["ratios"]["tokens"]["small_ttft_p99_x_better"]["per_seed"]
    assert ratios == [
        round(
            s["policies"]["shared"]["small_ttft_p99_s"]
            / s["policies"]["tokens"]["small_ttft_p99_s"],
            3,
        )
        for s in result["per_seed"]
    ]
    assert {t["target"].split(":")[0] for t in result["targets"]} == {"tokens"}
