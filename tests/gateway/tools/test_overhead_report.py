"""overhead_report.targets: the goals judged from a result, without running the benchmark."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.tools.bench.httpload import LoadResult, percentile
from gateway.tools.bench.overhead import merged
from gateway.tools.bench.overhead_report import targets

ISSUE31 = "json: p99 at 1000 requests/s vs smg's (issue 31)"
ADDED_P99 = "json: added p99 at 1000 requests/s vs smg's"


def _side(p50: float, p99: float, *, errors: int = 0) -> dict[str, Any]:
    return {
        "p50_ms": p50,
        "p99_ms": p99,
        "errors": errors,
        "sent": 10_000,
        "ok": 10_000 - errors,
        "lag_p50_ms": 0.05,
    }


def _row(gateway_p99: float, smg_p99: float, *, errors: int = 0) -> dict[str, Any]:
    direct = _side(0.06, 0.14)
    row: dict[str, Any] = {
        "shape": "json",
        "offered_rps": 1000,
        "direct": direct,
        "smg": _side(0.45, smg_p99),
        "gateway": _side(0.69, gateway_p99, errors=errors),
    }
    for prefix, side in (("", "gateway"), ("smg_", "smg")):
        for q in ("p50", "p99"):
            row[f"{prefix}added_{q}_ms"] = round(row[side][f"{q}_ms"] - direct[f"{q}_ms"], 3)
    for q in ("p50", "p99"):
        row[f"added_{q}_vs_smg"] = round(row[f"added_{q}_ms"] / row[f"smg_added_{q}_ms"], 2)
    return row


def _result(*rows: dict[str, Any], smg: bool = True) -> dict[str, Any]:
    sides = ["direct", "smg", "gateway"] if smg else ["direct", "gateway"]
    return {"rows": list(rows), "sides": sides, "closed_loop": []}


def _by_name(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["target"]: t for t in targets(result)}


def test_issue31_line_judges_the_client_side_p99_against_twice_smgs() -> None:
    # The README's run of 0d0e43e: 1.87 vs 0.96 ms client-side (1.95x: met), while the added
    # p99 (1.73 vs 0.82 ms, 2.11x) misses issue 21's 1.5x, which stays reported beside it.
    got = _by_name(_result(_row(1.87, 0.96)))
    line = got[ISSUE31]
    assert line["met"] is True
    assert line["value"] == "1.95x (1.87 vs 0.96 ms)"
    assert line["limit"] == "<= 2x"
    assert got[ADDED_P99]["met"] is False
    assert got[ADDED_P99]["limit"] == "<= 1.5x"
    assert got[ADDED_P99]["value"].startswith("2.11x")


def test_issue31_line_misses_past_twice_smgs_and_when_shapegate_did_not_keep_up() -> None:
    over = _by_name(_result(_row(2.05, 1.0)))[ISSUE31]
    assert over["met"] is False and over["value"] == "2.05x (2.05 vs 1.00 ms)"
    failed = _by_name(_result(_row(1.2, 1.0, errors=3)))[ISSUE31]
    assert failed["met"] is False and failed["value"].endswith("; shapegate did not keep up")


def test_issue31_line_without_smg_or_without_the_rate() -> None:
    alone = _by_name(_result(_row(1.0, 1.0), smg=False))[ISSUE31]
    assert alone == {
        "target": ISSUE31,
        "value": "smg not measured",
        "limit": "<= 2x",
        "met": False,
    }
    other_rate = _row(1.0, 1.0)
    other_rate["offered_rps"] = 500
    assert ISSUE31 not in _by_name(_result(other_rate))


def test_merged_runs_keep_every_request_of_each_turn() -> None:
    first, second = LoadResult(rate=1000, seconds=2.0), LoadResult(rate=1000, seconds=2.0)
    first.answered(200, 0.0, 0.0001, 0.0005)
    first.error("reset")
    second.answered(200, 1.0, 1.0001, 1.003)
    second.answered(503, 1.0, 1.0001, 1.001)
    first.sent, second.sent = 2, 2
    first.elapsed, second.elapsed = 2.0, 2.1
    first.connections, second.connections = 16, 17
    both = merged([first, second])
    assert (both.sent, both.ok, both.errors) == (4, 2, 2)
    assert both.error_kinds == {"reset": 1, "status_503": 1}
    assert both.total == pytest.approx([0.0005, 0.003])
    assert (both.seconds, both.elapsed, both.connections) == (4.0, 4.1, 17)
    assert percentile(both.total, 0.99) == pytest.approx(0.003)
