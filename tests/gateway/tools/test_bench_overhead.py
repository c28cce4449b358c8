"""``shapegate bench overhead --smoke``: a real gateway (and smg, when installed) between the
generator and the upstream, open and closed loop."""

from __future__ import annotations

import json
import os
from pathlib import Path

from gateway.tools.bench.harness import smg_command
from gateway.tools.cli import main


def test_bench_overhead_smoke_measures_the_gateway_beside_smg_against_the_direct_upstream(
    tmp_path: Path,
) -> None:
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None

    assert main(["bench", "overhead", "--smoke", "--out", str(tmp_path)]) == 0

    result = json.loads((tmp_path / "overhead.json").read_text())
    assert (tmp_path / "overhead.png").stat().st_size > 10_000
    assert result["smoke"] is True and result["machine"]["cores"] >= 1
    with_smg = smg_command() is not None  # smg is in the bench extra; absent, it is skipped
    assert result["smg"]["measured"] is with_smg
    sides = ["direct", "smg", "gateway"] if with_smg else ["direct", "gateway"]
    assert result["sides"] == sides
    rows = {(r["shape"], r["offered_rps"]): r for r in result["rows"]}
    assert set(rows) == {(shape, rate) for shape in ("json", "sse") for rate in (50, 200)}
    assert result["slices"] == 2
    for row in rows.values():
        assert row["slices"] == 2  # the sides took turns: two runs of 0.15 s each
        # Every request of both turns counted: rate x seconds, each side.
        for side in sides:
            assert row[side]["sent"] == round(row["offered_rps"] * 0.15) * 2, side
        # Every request answered, direct and through each gateway, at these low rates.
        for side in sides:
            assert row[side]["errors"] == 0 and row[side]["ok"] == row[side]["sent"] > 0, side
        # The gateway does work the direct path does not: it costs time and CPU.
        assert row["gateway"]["p50_ms"] > 0 and row["gateway_cpu_s_per_1k"] > 0
        # The time each gateway waited for its core (another process on it), per run.
        assert all(row[f"{side}_runq_wait_ms"] >= 0 for side in sides if side != "direct")
        assert row["added_p50_ms"] == round(row["gateway"]["p50_ms"] - row["direct"]["p50_ms"], 3)
        if with_smg:
            assert row["smg_added_p99_ms"] == round(
                row["smg"]["p99_ms"] - row["direct"]["p99_ms"], 3
            )
            assert row["added_p50_vs_smg"] == round(
                row["added_p50_ms"] / max(row["smg_added_p50_ms"], 0.01), 2
            )
    # Closed loop: each side answered requests back to back on every connection.
    assert [p["shape"] for p in result["closed_loop"]] == ["json", "sse"]
    for point in result["closed_loop"]:
        for side in sides:
            assert point[side]["errors"] == 0 and point[side]["rps"] > 0, (point, side)
        if with_smg:
            assert point["rps_vs_smg"] == round(point["gateway"]["rps"] / point["smg"]["rps"], 3)
    # Every goal is reported met or missed, each against a figure of this run.
    names = [t["target"] for t in result["targets"]]
    assert sum("closed-loop" in n for n in names) == 2
    assert all(isinstance(t["met"], bool) for t in result["targets"])
    # Two decision-log lines per request went to the gateway's log (plus start-up lines).
    assert result["gateway_log_lines"] >= 2 * result["gateway_requests_measured"]
    assert result["generator_ceiling"]["steps"][0]["ok"] > 0
    if cpus is not None:
        assert os.sched_getaffinity(0) == cpus  # the benchmark gave the CPUs back
