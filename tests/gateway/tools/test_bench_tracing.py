"""``shapegate bench tracing --smoke``: every mode measured, ratios against the untraced path."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.tools.cli import main


def test_bench_tracing_smoke_measures_every_mode_against_off(tmp_path: Path) -> None:
    assert main(["bench", "tracing", "--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "tracing.json").read_text())
    assert result["smoke"] is True
    cpu = result["cpu_us_per_request"]
    assert set(cpu) == {"off", "unsampled", "sampled", "otlp_encoded"}
    assert all(v > 0 for v in cpu.values())
    assert result["ratio_to_off"]["off"] == 1.0
    assert result["machine"]["load_average"]
    # Every sampled request's span reached the exporter: none dropped.
    spans = result["spans_exported_last_round"]
    assert spans["off"] == spans["unsampled"] == 0
    assert spans["sampled"] == spans["otlp_encoded"] == result["requests_per_round"] + 1
