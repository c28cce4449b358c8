"""``shapegate bench workers --smoke``: closed loop against 1 and 2 real workers, same run."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.tools.cli import main


def test_bench_workers_smoke_measures_one_and_two_workers(tmp_path: Path) -> None:
    assert main(["bench", "workers", "--smoke", "--out", str(tmp_path)]) == 0

    result = json.loads((tmp_path / "workers.json").read_text())
    assert (tmp_path / "workers.png").stat().st_size > 10_000
    assert result["smoke"] is True and result["connections"] == 8
    assert result["direct"]["requests"] > 0 and result["direct"]["errors"] == 0
    assert [p["workers"] for p in result["points"]] == [1, 2]
    for point in result["points"]:
        assert point["requests"] > 0 and point["errors"] == 0, point
        assert point["cpu_s_per_1k"] > 0  # the supervisor and its workers were measured
        assert 0 < point["p50_ms"] <= point["p99_ms"]
    assert result["points"][0]["supervisor_cpu_share"] is None  # serve alone: no supervisor
    assert 0 <= result["points"][1]["supervisor_cpu_share"] < 1
    one, two = (p["rps"] for p in result["points"])
    assert result["scaling"] == round(two / one, 3)
