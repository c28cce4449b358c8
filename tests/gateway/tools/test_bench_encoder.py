"""``shapegate bench encoder --smoke``: floods through the counter in both modes, times the cost
of the child process, writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.tools.cli import main

ROOT = Path(__file__).resolve().parents[3]


def test_bench_encoder_smoke_writes_both_modes_and_ratios(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # the demo policy is found at configs/demo.yaml
    assert main(["bench", "encoder", "--smoke", "--out", str(tmp_path)]) == 0

    result = json.loads((tmp_path / "encoder.json").read_text())
    assert result["smoke"] is True
    assert result["bounded"]["max_encoder_rss_mb"] == 384.0
    assert result["in_process"]["max_encoder_rss_mb"] is None
    for mode in ("bounded", "in_process"):
        floods = result[mode]["floods"]
        assert [f["kind"] for f in floods] == ["cjk", "base64"]
        assert result[mode]["pss_loaded_mb"] > 0
        assert all(len(f["peak_per_tenth_mb"]) >= 10 and f["peak_mb"] > 0 for f in floods)
    # PSS counts the tokenizer template and child: processes of their own, well above nothing
    # loaded (the in-process mode may reuse memory this test process freed before).
    bounded = result["bounded"]
    assert bounded["pss_loaded_mb"] > bounded["pss_start_mb"] + 50
    rows = {row["size"]: row for row in result["latency"]}
    assert set(rows) == {"3k", "32k", "300k"}
    assert rows["3k"]["tokens"] < rows["32k"]["tokens"] < rows["300k"]["tokens"]
    assert all(row["child_over_in_process"] > 0 for row in rows.values())
    assert {t["target"].split(":")[0] for t in result["targets"]} >= {
        "bounded cjk",
        "bounded base64",
        "cost of the bound",
    }
