"""``shapegate bench memory --smoke``: PSS of a real gateway, idle, under traffic, attacked."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.tools.cli import main


def test_bench_memory_smoke_follows_the_gateways_pss(tmp_path: Path) -> None:
    assert main(["bench", "memory", "--smoke", "--out", str(tmp_path)]) == 0

    result = json.loads((tmp_path / "memory.json").read_text())
    assert (tmp_path / "memory.png").stat().st_size > 10_000
    # Loading the tokenizers is most of a gateway's memory: idle is well above bare imports.
    assert result["idle_pss_mb"] > result["imports_pss_mb"] + 20
    assert result["requests"] == 2_000 and result["errors"] == 0
    samples = [p["requests"] for p in result["curve"]]
    assert samples == [0, 500, 1000, 1500, 2000]
    assert all(p["pss_mb"] > 0 for p in result["curve"])
    for attack in result["adversarial"]:
        assert attack["requests"] == 10 and attack["errors"] == 0
        assert attack["text_mb"] > 0.3  # ten unique 40 kB prompts, each counted exactly
    packages = result["tokenizer_package"]
    assert packages["gigatoken"] != "absent"
