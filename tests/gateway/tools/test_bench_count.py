"""``shapegate bench count --smoke``: runs end to end, writes its JSON, restores CPU affinity."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gateway.tools.cli import main

ROOT = Path(__file__).resolve().parents[3]


def test_bench_count_smoke_writes_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # the demo policy is found at configs/demo.yaml
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None

    assert main(["bench", "count", "--smoke", "--out", str(tmp_path)]) == 0

    result = json.loads((tmp_path / "count.json").read_text())
    assert result["smoke"] is True and result["tokenizer"] == "qwen3.6/gigatoken"
    by_size = {r["size"]: r for r in result["requests"]}
    assert set(by_size) == {"3k", "32k", "300k"}
    # The small request is decided by the bound, the others by an exact count that HF confirms.
    assert by_size["3k"]["decide_methods"] == ["bound"]
    assert by_size["300k"]["decide_methods"] == ["exact"]
    assert by_size["300k"]["cache_methods"] == ["cache"]
    assert all(r["hf_agrees"] and r["hf"]["p50_ms"] > 0 for r in result["requests"])
    assert by_size["3k"]["tokens"] < by_size["32k"]["tokens"] < by_size["300k"]["tokens"]
    assert {(c["vocabulary"], c["kind"]) for c in result["calibration"]} == {
        (v, k)
        for v in ("qwen3.6/gigatoken", "cl100k_base/gigatoken")
        for k in ("prose", "code", "json")
    }
    assert all(0.5 < c["chars_per_token"] < 10 for c in result["calibration"])
    assert result["rss_mb"]["after_load"] > 0
    assert len(result["targets"]) == 5
    for target in result["targets"]:  # "met" is the value against the limit, nothing else
        assert target["value"] > 0, target
        faster = "times faster" in target["target"]
        below = target["value"] < target["limit"]
        assert target["met"] is (not below if faster else below), target
    assert "1_core" in result["loop_stall"]
    out = capsys.readouterr().out
    assert "chars/tok" in out and "300k" in out
    if cpus is not None:
        assert os.sched_getaffinity(0) == cpus
