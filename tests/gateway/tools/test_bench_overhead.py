"""``shapegate bench overhead --smoke``: a real gateway between the generator and the upstream."""

from __future__ import annotations

import json
import os
from pathlib import Path

from gateway.tools.bench.overhead import SUSTAIN_P99_S
from gateway.tools.cli import main


def test_bench_overhead_smoke_measures_the_gateway_against_the_direct_upstream(
    tmp_path: Path,
) -> None:
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None

    assert main(["bench", "overhead", "--smoke", "--out", str(tmp_path)]) == 0

    result = json.loads((tmp_path / "overhead.json").read_text())
    assert (tmp_path / "overhead.png").stat().st_size > 10_000
    assert result["smoke"] is True and result["machine"]["cores"] >= 1
    rows = {(r["shape"], r["offered_rps"]): r for r in result["rows"]}
    assert set(rows) == {(shape, rate) for shape in ("json", "sse") for rate in (50, 200)}
    for row in rows.values():
        # Every request answered, direct and through the gateway, at these low rates.
        for side in ("direct", "gateway"):
            assert row[side]["errors"] == 0 and row[side]["ok"] == row[side]["sent"] > 0
        # The gateway does work the direct path does not: it costs time and CPU.
        assert row["gateway"]["p50_ms"] > 0 and row["gateway_cpu_s_per_1k"] > 0
        assert row["added_p50_ms"] == round(row["gateway"]["p50_ms"] - row["direct"]["p50_ms"], 3)
    # Two decision-log lines per request went to the gateway's log (plus start-up lines).
    assert result["gateway_log_lines"] >= 2 * result["gateway_requests_measured"]
    assert result["generator_ceiling"]["steps"][0]["ok"] > 0
    for shape in ("json", "sse"):
        # The one smoke step (200 requests/s): every request answered, and "highest clean" is
        # 200 exactly when the step met the rule it names, else 0.
        sustained = result["sustained"][shape]
        (step,) = sustained["steps"]
        assert step["errors"] == 0 and step["ok"] == step["sent"] > 0, step
        clean = step["lag_p50_ms"] < 1.0 and step["p99_ms"] < SUSTAIN_P99_S * 1000
        assert sustained["highest_clean_rps"] == (200 if clean else 0), sustained
    if cpus is not None:
        assert os.sched_getaffinity(0) == cpus  # the benchmark gave the CPUs back
