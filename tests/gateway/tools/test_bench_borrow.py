"""``shapegate bench borrow --smoke``: lanes that lend, lanes, and a shared pool on two shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.tools.cli import main

ROOT = Path(__file__).resolve().parents[3]


def test_bench_borrow_smoke_compares_the_three_policies_on_both_shapes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["bench", "borrow", "--smoke", "--out", str(tmp_path)]) == 0

    result = json.loads((tmp_path / "borrow.json").read_text())
    assert (tmp_path / "borrow.png").stat().st_size > 10_000
    assert set(result["per_trace"]) == {"production-burst", "agent-storm"}
    for kind, rows in result["per_trace"].items():
        (row,) = rows
        shared, lanes, borrow = (row["policies"][n] for n in ("shared", "lanes", "borrow"))
        # Only the policy that lends borrows, and never puts a monster on a fast engine.
        assert lanes["borrowed_share"] == 0 < borrow["borrowed_share"], kind
        assert borrow["monsters_on_fast_engines"] == 0
        # Borrowing wins back the median the idle heavy engines cost plain lanes.
        assert borrow["small_ttft_p50_s"] < lanes["small_ttft_p50_s"], kind
        assert borrow["small_ttft_p99_s"] * 10 < shared["small_ttft_p99_s"], kind
        assert borrow["monsters"] == shared["monsters"] > 0
    # The interactive class of the agent-storm shape is reported per class.
    storm = result["per_trace"]["agent-storm"][0]["policies"]["borrow"]["by_class"]
    assert {"interactive", "batch"} <= set(storm)
    assert len(result["targets"]) == 8
