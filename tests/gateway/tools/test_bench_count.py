"""``shapegate bench count --smoke``: runs end to end, writes its JSON, restores CPU affinity.

Beside gigatoken and the HF baseline it times the plain install's tiktoken on the same prompts,
with the same counts; without gigatoken its figures are reported absent.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from gateway.tools.cli import main
from tests.support.plain_install import hide_gigatoken

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
    assert_plain_install(result)
    assert result["exact_backend"] == "gigatoken"
    for r in result["requests"]:  # gigatoken's figures are the exact ones, with their ratio
        gigatoken = r["exact_by_backend"]["gigatoken"]
        assert gigatoken["p50_ms"] == r["exact"]["p50_ms"]
        assert gigatoken["x_hf"] == round(r["hf"]["p50_ms"] / r["exact"]["p50_ms"], 1)
    assert by_size["3k"]["tokens"] < by_size["32k"]["tokens"] < by_size["300k"]["tokens"]
    assert {(c["vocabulary"], c["kind"]) for c in result["calibration"]} == {
        (v, k)
        for v in ("qwen3.6/gigatoken", "cl100k_base/gigatoken")
        for k in ("prose", "code", "json")
    }
    assert all(0.5 < c["chars_per_token"] < 10 for c in result["calibration"])
    assert result["pss_mb"]["after_load"] > 0
    assert len(result["targets"]) == 5
    for target in result["targets"]:  # "met" is the value against the limit, nothing else
        assert target["value"] > 0, target
        faster = "times faster" in target["target"]
        below = target["value"] < target["limit"]
        assert target["met"] is (not below if faster else below), target
    assert "1_core" in result["loop_stall"]
    out = capsys.readouterr().out
    assert "chars/tok" in out and "300k" in out
    assert "event loop, tiktoken, 1_core" in out
    if cpus is not None:
        assert os.sched_getaffinity(0) == cpus


def assert_plain_install(result: dict[str, Any]) -> None:
    """The tiktoken counter timed every prompt, agreed with HF, and has its ratio and loop stall."""
    plain = result["plain_install"]
    assert plain["backend"] == "tiktoken" and plain["tokenizer"] == "qwen3.6/tiktoken"
    assert plain["load_s"] > 0
    stall = plain["loop_stall"]["1_core"]
    assert stall["worker_thread"]["count_ms"] > 0 and stall["inline"]["count_ms"] > 0
    for r in result["requests"]:
        assert r["tiktoken_agrees"] is True
        assert r["tiktoken"]["n"] == r["exact"]["n"] and r["tiktoken"]["p50_ms"] > 0
        tiktoken = r["exact_by_backend"]["tiktoken"]
        assert tiktoken["p50_ms"] == r["tiktoken"]["p50_ms"]
        assert tiktoken["x_hf"] == round(r["hf"]["p50_ms"] / r["tiktoken"]["p50_ms"], 1)


def test_bench_count_without_gigatoken_reports_it_absent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain install: ``auto`` loads tiktoken, the run completes, gigatoken's figures are null."""
    monkeypatch.chdir(ROOT)
    hide_gigatoken(monkeypatch)

    assert main(["bench", "count", "--smoke", "--out", str(tmp_path)]) == 0

    result = json.loads((tmp_path / "count.json").read_text())
    assert result["tokenizer"] == "qwen3.6/tiktoken" and result["exact_backend"] == "tiktoken"
    assert all(r["exact_by_backend"]["gigatoken"] is None for r in result["requests"])
    assert all(r["hf_agrees"] for r in result["requests"])
    assert_plain_install(result)
    out = capsys.readouterr().out
    assert "absent" in out and "event loop, gigatoken" not in out
