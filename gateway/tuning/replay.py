"""What a policy would do with a traffic trace, before it ships.

- ``analyze(settings, trace, profiles)``: offline and instant (100k requests in about a second):
  the lane of every request, requests within 10% of a lane boundary, the requests a
  characters / 4 rule would have put in another lane, and the slot demand per lane over time
  against the limits (each request holding its slot for its isolated service time on the
  cluster's simulated engine, a lower bound on real demand).
- ``simulate(settings, trace, profiles)``: the trace played through ``fleet_sim.FleetSim``;
  per-lane TTFT, e2e and queue-wait percentiles, throughput, rejections and slot occupancy.
- ``compare`` renders two simulations side by side; ``plot`` draws TTFT distributions and
  slot occupancy over time (PNG).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_pool.sim.costs import isolated_prefill_seconds
from engine_pool.sim.profile import EngineProfile, load_profile
from gateway.extras import save, side_by_side
from gateway.observe.trace import TraceRecord
from gateway.request.lanes import lane_for
from gateway.settings import Settings
from gateway.tuning.fleet_result import FleetResult, SimulatedRequest
from gateway.tuning.fleet_sim import CountBy, FleetSim

NEAR = 0.10
DEMAND_NOTE = (
    "a lower bound: each request holds its slot only for its service time alone on an idle "
    "engine (no queueing, no batch slowing it down); --simulate gives the simulated peak"
)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def cluster_profiles(settings: Settings) -> dict[str, EngineProfile]:
    missing = [c.name for c in settings.clusters if not c.sim_profile]
    if missing:
        raise ValueError(f"clusters without sim_profile: {', '.join(missing)}")
    return {c.name: load_profile(str(c.sim_profile)) for c in settings.clusters}


def isolated_seconds(profile: EngineProfile, prompt: int, output: int) -> float:
    costs = profile.costs
    prefill = isolated_prefill_seconds(costs, prompt, profile.scheduler.max_num_batched_tokens)
    per_token = (
        costs.step_overhead_s
        + costs.decode_s_per_seq
        + costs.decode_s_per_kv_token * min(prompt, costs.decode_kv_read_cap_tokens)
    )
    return prefill + max(0, output - 1) * per_token


def analyze(
    settings: Settings,
    trace: Sequence[TraceRecord],
    profiles: Mapping[str, EngineProfile] | None = None,
) -> dict[str, Any]:
    lanes = settings.lanes
    boundaries = sorted(
        {lane.max_prompt_tokens for lane in lanes}
        | {lane.min_prompt_tokens for lane in lanes if lane.min_prompt_tokens}
    )
    by_lane: dict[str, list[int]] = {lane.name: [] for lane in lanes}
    by_lane["none"] = []
    near = 0
    moved: dict[str, int] = {}
    intervals: dict[str, list[tuple[float, float]]] = {lane.name: [] for lane in lanes}
    for record in trace:
        lane = lane_for(record.prompt_tokens, lanes)
        name = lane.name if lane else "none"
        by_lane[name].append(record.prompt_tokens)
        if any(abs(record.prompt_tokens - b) <= NEAR * b for b in boundaries):
            near += 1
        by_chars = lane_for(record.chars // 4, lanes)
        other = by_chars.name if by_chars else "none"
        if other != name:
            moved[f"{name}->{other}"] = moved.get(f"{name}->{other}", 0) + 1
        if lane is not None and profiles is not None:
            profile = profiles[lane.clusters[0]]
            held = isolated_seconds(profile, record.prompt_tokens, record.output_tokens)
            intervals[lane.name].append((record.t, record.t + held))
    report: dict[str, Any] = {
        "requests": len(trace),
        "lanes": {
            name: {
                "requests": len(tokens),
                "share": round(len(tokens) / max(1, len(trace)), 4),
                "prompt_tokens_p50": percentile(tokens, 0.5),
                "prompt_tokens_max": max(tokens) if tokens else None,
            }
            for name, tokens in by_lane.items()
            if tokens or name != "none"
        },
        "near_threshold": near,
        "chars4_would_move": moved,
    }
    if profiles is not None:
        report["slot_demand_lower_bound"] = {
            lane.name: _demand(intervals[lane.name], lane.slots.lane) for lane in lanes
        }
        report["slot_demand_note"] = DEMAND_NOTE
    return report


def _demand(intervals: list[tuple[float, float]], limit: int) -> dict[str, float]:
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    level = peak = 0
    over = 0.0
    last = events[0][0] if events else 0.0
    for at, step in events:
        if level > limit:
            over += at - last
        level += step
        peak = max(peak, level)
        last = at
    span = (events[-1][0] - events[0][0]) if events else 0.0
    return {
        "peak": peak,
        "limit": limit,
        "time_over_limit_share": round(over / span, 4) if span else 0.0,
    }


@dataclass(frozen=True, slots=True)
class SimReport:
    name: str
    result: FleetResult
    summary: dict[str, Any]


def _stats(outcomes: Sequence[SimulatedRequest], makespan: float) -> dict[str, Any]:
    served = [o for o in outcomes if o.rejected is None]
    ttft = [o.ttft for o in served if o.ttft is not None]
    e2e = [o.e2e for o in served if o.e2e is not None]
    wait = [o.queue_wait for o in served if o.queue_wait is not None]
    return {
        "requests": len(outcomes),
        "rejected": len(outcomes) - len(served),
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p95": percentile(ttft, 0.95),
        "ttft_p99": percentile(ttft, 0.99),
        "e2e_p50": percentile(e2e, 0.5),
        "e2e_p95": percentile(e2e, 0.95),
        "e2e_p99": percentile(e2e, 0.99),
        "e2e_max": max(e2e, default=math.nan),
        "queue_wait_p99": percentile(wait, 0.99),
        "output_tokens_per_s": sum(o.output_tokens for o in served) / makespan if makespan else 0,
        "prompt_tokens_per_s": sum(o.prompt_tokens for o in served) / makespan if makespan else 0,
    }


def simulate(
    name: str,
    settings: Settings,
    trace: Sequence[TraceRecord],
    profiles: Mapping[str, EngineProfile],
    count_by: CountBy = "tokens",
    small_below: int = 32768,
    progress: Any = None,
) -> SimReport:
    result = FleetSim(settings, profiles, count_by).run(trace, progress)
    return summarize(name, settings, result, count_by, small_below)


def summarize(
    name: str,
    settings: Settings,
    result: FleetResult,
    count_by: CountBy = "tokens",
    small_below: int = 32768,
) -> SimReport:
    """The tables' figures of a played trace: simulated, or measured live (live_replay.py)."""
    lanes = sorted({o.lane for o in result.outcomes})
    small = [o for o in result.outcomes if o.prompt_tokens < small_below]
    large = [o for o in result.outcomes if o.prompt_tokens >= small_below]
    # The light lane takes the shortest prompts; with one lane only, nothing can leak into it.
    light = lane_for(0, settings.lanes) if len(settings.lanes) > 1 else None
    peaks = {}
    for lane in result.limits:
        levels = [n for _, name, n in result.occupancy if name == lane]
        peaks[lane] = {"peak": max(levels, default=0), "limit": result.limits[lane]}
    summary = {
        "policy": name,
        "count_by": count_by,
        "makespan_s": result.makespan,
        "by_lane": {
            lane: _stats([o for o in result.outcomes if o.lane == lane], result.makespan)
            for lane in lanes
        },
        "small_requests": _stats(small, result.makespan),
        "large_requests": _stats(large, result.makespan),
        "small_below": small_below,
        "large_in_light_lane": sum(1 for o in large if light is not None and o.lane == light.name),
        # Monsters that ran on an engine of the light lane (borrowing never sends them there).
        "large_on_light_engines": sum(
            1 for o in large if light is not None and o.cluster in light.clusters
        ),
        "borrowing": _borrowing(result.outcomes),
        "by_class": {
            name: _stats([o for o in result.outcomes if o.priority == name], result.makespan)
            for name in sorted({o.priority for o in result.outcomes})
        },
        "all": _stats(result.outcomes, result.makespan),
        "slot_occupancy": peaks,
    }
    return SimReport(name, result, summary)


def _borrowing(outcomes: Sequence[SimulatedRequest]) -> dict[str, Any]:
    """How many served requests ran on another lane's engine, by lender."""
    served = [o for o in outcomes if o.rejected is None]
    lenders: dict[str, int] = {}
    for o in served:
        if o.lender is not None:
            lenders[o.lender] = lenders.get(o.lender, 0) + 1
    borrowed = sum(lenders.values())
    return {
        "borrowed": borrowed,
        "share": round(borrowed / len(served), 4) if served else 0.0,
        "by_lender": lenders,
    }


def _fmt(value: float) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def render(reports: Sequence[SimReport]) -> str:
    rows = [("", *(r.name for r in reports))]
    keys = ("ttft_p50", "ttft_p95", "ttft_p99", "e2e_p99", "queue_wait_p99", "rejected")
    for group in ("small_requests", "large_requests"):
        for key in keys:
            rows.append(
                (f"{group.split('_')[0]} {key}", *(_fmt(r.summary[group][key]) for r in reports))
            )
    rows.append(("large in light lane", *(str(r.summary["large_in_light_lane"]) for r in reports)))
    rows.append(
        ("large on light engines", *(str(r.summary["large_on_light_engines"]) for r in reports))
    )
    rows.append(("large e2e_p50", *(_fmt(r.summary["large_requests"]["e2e_p50"]) for r in reports)))
    rows.append(("borrowed share", *(f"{r.summary['borrowing']['share']:.1%}" for r in reports)))
    classes = sorted({name for r in reports for name in r.summary["by_class"]})
    for name in classes if len(classes) > 1 else ():
        for key in ("ttft_p50", "ttft_p99"):
            rows.append(
                (
                    f"class {name} {key}",
                    *(
                        _fmt(r.summary["by_class"].get(name, {}).get(key, math.nan))
                        for r in reports
                    ),
                )
            )
    rows.append(("output tok/s", *(_fmt(r.summary["all"]["output_tokens_per_s"]) for r in reports)))
    rows.append(("prompt tok/s", *(_fmt(r.summary["all"]["prompt_tokens_per_s"]) for r in reports)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
    )


def verdict(base: SimReport, other: SimReport, group: str = "small_requests") -> str:
    """``base`` against ``other`` on TTFT p99 (lower is better), in words that match the numbers."""
    ours, theirs = base.summary[group]["ttft_p99"], other.summary[group]["ttft_p99"]
    kind = group.split("_", maxsplit=1)[0]
    label = f"{kind}-request TTFT p99: {base.name} {ours:.2f}s, {other.name} {theirs:.2f}s"
    if math.isnan(ours) or math.isnan(theirs):
        return f"{label}: no comparison (a side served none)"
    if math.isclose(ours, theirs, rel_tol=0.005):
        return f"{label}: {base.name} is the same as {other.name}"
    better = ours < theirs
    ratio = max(ours, theirs) / min(ours, theirs) if min(ours, theirs) > 0 else math.inf
    times = f"{ratio:.2f}x" if ratio < 2 else f"{ratio:.1f}x"  # never "1.0x better"
    return f"{label}: {base.name} is {times} {'better' if better else 'worse'} than {other.name}"


def demand_table(analysis: Mapping[str, Any], report: SimReport) -> str:
    """The offline lower bound of slot demand beside the simulated peak, per lane."""
    bound = analysis.get("slot_demand_lower_bound", {})
    peaks = report.summary["slot_occupancy"]
    rows = [("lane", "offline demand (lower bound)", "simulated peak", "limit")]
    for lane, peak in peaks.items():
        low = bound.get(lane, {}).get("peak", "-")
        rows.append((lane, str(low), str(peak["peak"]), str(peak["limit"])))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return f"slot demand, {report.name} (the offline figure is {DEMAND_NOTE}):\n" + "\n".join(
        "  " + line for line in lines
    )


def plot(reports: Sequence[SimReport], path: Path) -> None:
    fig, (ax_ttft, ax_slots) = side_by_side(13, 4.5)
    for report in reports:
        ttft = sorted(
            o.ttft for o in report.result.outcomes if o.ttft is not None and o.prompt_tokens < 32768
        )
        if ttft:
            ax_ttft.plot(ttft, [i / len(ttft) for i in range(len(ttft))], label=report.name)
        for lane in report.result.limits:
            points = [(t, n) for t, name, n in report.result.occupancy if name == lane]
            if points:
                ax_slots.step(
                    [t / 60 for t, _ in points],
                    [n for _, n in points],
                    where="post",
                    label=f"{report.name}: {lane}",
                )
    ax_ttft.set_xscale("log")
    ax_ttft.set_xlabel("small-request TTFT (s, log)")
    ax_ttft.set_ylabel("fraction of requests")
    ax_ttft.set_title("TTFT distribution, prompts under 32k tokens")
    ax_ttft.legend()
    ax_slots.set_xlabel("minutes")
    ax_slots.set_ylabel("slots in use")
    ax_slots.set_title("slot occupancy")
    ax_slots.legend(fontsize=7)
    save(fig, path)
