"""What a live play measured, as plain data and tables (``replay --live``'s report).

- ``play_row``, ``send_lag``, ``count_mismatches``: per request, the player's lateness, the
  prompts the target counted otherwise than the trace;
- ``ratios(live, predicted)``: live / predicted for every TTFT and completion percentile, per
  request group and per lane; ``worst_ratio`` the one furthest from 1, either way;
- ``render_ratios``, ``render_lanes``, ``monster_rows`` / ``render_monsters``: the tables.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from gateway.tuning.live_replay import Play
from gateway.tuning.replay import SimReport, percentile

METRICS = ("ttft_p50", "ttft_p95", "ttft_p99", "e2e_p50", "e2e_p95", "e2e_p99")


def play_row(item: Play) -> dict[str, Any]:
    """One played request as plain data (wall seconds since the play's start)."""
    return {
        "index": item.index,
        "t": item.record.t,
        "prompt_tokens": item.record.prompt_tokens,
        "output_tokens": item.record.output_tokens,
        "sent": item.sent,
        "first_token": item.first_token,
        "finished": item.finished,
        "status": item.status,
        "lane": item.lane,
        "cluster": item.cluster,
        "target_prompt_tokens": item.target_prompt_tokens,
        "error": item.error,
    }


def send_lag(plays: Sequence[Play]) -> dict[str, float]:
    """How late the player sent, in wall milliseconds (a late send is the player's fault, not
    the target's: it is not in TTFT, which runs from the actual send)."""
    lags = [item.lag * 1000 for item in plays if item.lag is not None]
    return {
        "p50_ms": percentile(lags, 0.5),
        "p99_ms": percentile(lags, 0.99),
        "max_ms": max(lags, default=math.nan),
    }


def count_mismatches(plays: Sequence[Play]) -> int:
    """Requests whose target counted another number of prompt tokens than the trace holds."""
    return sum(
        1
        for item in plays
        if item.target_prompt_tokens is not None
        and item.target_prompt_tokens != item.record.prompt_tokens
    )


def ratios(live: SimReport, predicted: SimReport) -> dict[str, dict[str, float]]:
    """live / predicted for every TTFT and e2e percentile, per request group and per lane."""
    out: dict[str, dict[str, float]] = {}
    groups = [("small", "small_requests"), ("large", "large_requests")]
    groups += [(f"lane {name}", name) for name in live.summary["by_lane"]]
    for label, group in groups:
        ours = live.summary.get(group) or live.summary["by_lane"].get(group, {})
        theirs = predicted.summary.get(group) or predicted.summary["by_lane"].get(group, {})
        for metric in METRICS:
            a, b = ours.get(metric, math.nan), theirs.get(metric, math.nan)
            if math.isnan(a) or math.isnan(b) or b <= 0:
                continue
            out.setdefault(label, {})[metric] = a / b
    return out


def worst_ratio(found: dict[str, dict[str, float]]) -> float:
    """The ratio furthest from 1 (either way), as a factor >= 1."""
    factors = [max(r, 1 / r) for metrics in found.values() for r in metrics.values() if r > 0]
    return max(factors, default=math.nan)


def render_ratios(found: dict[str, dict[str, float]]) -> str:
    rows: list[tuple[str, ...]] = [("live / predicted", *METRICS)]
    for label, metrics in found.items():
        rows.append((label, *(f"{metrics[m]:.2f}" if m in metrics else "-" for m in METRICS)))
    return _table(rows)


def render_lanes(report: SimReport) -> str:
    rows: list[tuple[str, ...]] = [("lane", "requests", "rejected", *METRICS)]
    for lane, stats in report.summary["by_lane"].items():
        rows.append(
            (
                lane,
                str(stats["requests"]),
                str(stats["rejected"]),
                *(_seconds(stats[m]) for m in METRICS),
            )
        )
    return f"per lane, {report.name} (engine seconds):\n" + _table(rows)


def monster_rows(
    live: SimReport, predicted: SimReport | None, small_below: int
) -> list[dict[str, Any]]:
    theirs = {o.key: o for o in predicted.result.outcomes} if predicted is not None else {}
    rows = []
    for outcome in live.result.outcomes:
        if outcome.prompt_tokens < small_below:
            continue
        other = theirs.get(outcome.key)
        rows.append(
            {
                "key": outcome.key,
                "t": outcome.arrival,
                "prompt_tokens": outcome.prompt_tokens,
                "lane": outcome.lane,
                "ttft": outcome.ttft,
                "e2e": outcome.e2e,
                "predicted_ttft": other.ttft if other is not None else None,
                "predicted_e2e": other.e2e if other is not None else None,
                "rejected": outcome.rejected,
            }
        )
    return rows


def render_monsters(rows: Sequence[dict[str, Any]]) -> str:
    table = [("monster", "t", "tokens", "lane", "TTFT", "pred", "ratio", "e2e", "pred", "ratio")]
    for row in rows:
        table.append(
            (
                row["key"],
                f"{row['t']:.0f}",
                f"{row['prompt_tokens']:,}",
                row["lane"],
                _seconds(row["ttft"]),
                _seconds(row["predicted_ttft"]),
                _ratio(row["ttft"], row["predicted_ttft"]),
                _seconds(row["e2e"]),
                _seconds(row["predicted_e2e"]),
                _ratio(row["e2e"], row["predicted_e2e"]),
            )
        )
    return "monsters (engine seconds):\n" + _table(table)


def _seconds(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b <= 0 else f"{a / b:.2f}"


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
    )
