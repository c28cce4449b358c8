"""``shapegate replay --live URL TRACE``: the command around ``gateway/tuning/live_replay.py``.

    shapegate trace synth production-burst --out burst.jsonl
    shapegate trace cut burst.jsonl --busiest 300 --out cut.jsonl
    shapegate demo &                                                    # engines at scale 0.1
    shapegate replay --config configs/demo.yaml cut.jsonl --live http://127.0.0.1:8000 \\
        --time-scale 0.1 --simulate --out live-out/

Prints the replay's tables for what was measured (engine seconds: wall / time scale), per lane
and per monster, the player's send lag, and with ``--simulate`` the prediction beside it and
live / predicted per metric. ``--out`` writes ``live.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from gateway.count.tokens import TokenCounter
from gateway.observe.trace import TraceRecord
from gateway.settings import ConfigError, Settings
from gateway.tuning import live_measure, live_replay, live_report
from gateway.tuning.fleet_model import LiveCosts
from gateway.tuning.fleet_sim import CountBy, FleetSim
from gateway.tuning.replay import SimReport, cluster_profiles, render, summarize

# What live.json keeps of each engine record (to fit the costs again offline).
ENGINE_FIELDS = ("request_id", "arrived_s", "arrived_wall", "first_token_s", "finished_s")
# Wall seconds the player waits for the last answers after the last send, at least.
GRACE_S = 120.0


def live_costs(args: argparse.Namespace) -> LiveCosts:
    """The costs the replay models, from the command line (defaults: measured)."""
    if args.engine_only:
        return LiveCosts.none(args.time_scale)
    base = LiveCosts()
    return LiveCosts(
        time_scale=args.time_scale,
        gateway_s=_ms(args.gateway_ms, base.gateway_s),
        forward_s=_ms(args.forward_ms, base.forward_s),
        relay_s=_ms(args.relay_ms, base.relay_s),
        per_mtoken_s=_ms(args.per_mtoken_ms, base.per_mtoken_s),
    )


def _ms(value: float | None, default: float) -> float:
    return default if value is None else value / 1000


def build_prompts(
    settings: Settings, trace: Sequence[TraceRecord], progress: Callable[[float], None] | None
) -> list[list[dict[str, str]]]:
    """One verified prompt per traced request, with the policy's tokenizer for its model."""
    counter = TokenCounter.from_settings(settings)
    builders: dict[str, live_replay.PromptBuilder] = {}
    prompts = []
    for index, record in enumerate(trace):
        builder = builders.get(record.model)
        if builder is None:
            builder = builders[record.model] = live_replay.PromptBuilder(counter, record.model)
        prompts.append(builder.build(index, record.prompt_tokens))
        if progress is not None and (index % 20 == 0 or index == len(trace) - 1):
            progress((index + 1) / len(trace))
    return prompts


def default_deadline(trace: Sequence[TraceRecord], time_scale: float) -> float:
    span = trace[-1].t if trace else 0.0
    return span * time_scale * 1.5 + GRACE_S


class _Bar:
    """The play's progress on stderr, redrawn at most ten times a second."""

    def __init__(self) -> None:
        self._last = 0.0

    def __call__(self, sent: int, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        _bar(sent, done, total)


def _bar(sent: int, done: int, total: int) -> None:
    filled = int(30 * done / max(1, total))
    sys.stderr.write(
        f"\rlive [{'#' * filled}{'.' * (30 - filled)}] sent {sent}/{total} done {done}/{total}"
    )
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def run_live(
    args: argparse.Namespace,
    settings: Settings,
    trace: list[TraceRecord],
    out: Path | None,
    progress: Callable[[str], Any],
) -> int:
    if not trace:
        print("shapegate replay: the trace is empty", file=sys.stderr)
        return 2
    try:
        costs = live_costs(args)
        prompts = build_prompts(settings, trace, progress("prompts"))
    except (ConfigError, ValueError) as exc:
        print(f"shapegate: {exc}", file=sys.stderr)
        return 2
    deadline = args.deadline or default_deadline(trace, args.time_scale)
    run = play_and_predict(
        settings,
        trace,
        prompts,
        Target(args.live, args.time_scale, tuple(args.engine)),
        deadline,
        costs if args.simulate else None,
        args.small_below,
    )
    live, predicted, report = run.live, run.predicted, run.report
    if "measured_costs" in report:
        print(f"measured live path (wall ms): {report['measured_costs']}")
    print(render([live, predicted] if predicted is not None else [live]))
    print(live_report.render_lanes(live))
    if predicted is not None:
        print(live_report.render_lanes(predicted))
    print(live_report.render_monsters(report["monsters"]))
    lag = report["send_lag"]
    print(
        f"send lag (wall ms): p50 {lag['p50_ms']:.1f}  p99 {lag['p99_ms']:.1f}  "
        f"max {lag['max_ms']:.1f}; prompts counted otherwise by the target: "
        f"{report['count_mismatches']}; not served: {live.summary['all']['rejected']}"
    )
    if predicted is not None:
        print(live_report.render_ratios(report["ratios"]))
        print(f"worst ratio: {report['worst_ratio']:.2f}x")
    for name, label in (("engine_only", "the engines alone"), ("calibrated", "measured costs")):
        if f"ratios_{name}" in report:
            print(f"predicted with {label} ({name}):")
            print(live_report.render_ratios(report[f"ratios_{name}"]))
            print(f"worst ratio: {report[f'worst_ratio_{name}']:.2f}x")
    if out is not None:
        (out / "live.json").write_bytes(
            orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
        )
        print(f"report: {out / 'live.json'}")
    return 0 if live.summary["all"]["rejected"] < len(trace) else 1


@dataclass(frozen=True, slots=True)
class Target:
    """What to play against: the URL, its engines' time scale, the engines behind it (their
    ``/sim/requests`` give the live path's costs; none: not measured)."""

    url: str
    time_scale: float
    engines: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LiveRun:
    live: SimReport
    predicted: SimReport | None
    report: dict[str, Any]


def play_and_predict(
    settings: Settings,
    trace: Sequence[TraceRecord],
    prompts: Sequence[list[dict[str, str]]],
    target: Target,
    deadline_s: float,
    costs: LiveCosts | None,
    small_below: int = 32768,
) -> LiveRun:
    """Play the trace live; with ``costs``, predict it too (with those costs, with the engines
    alone as the old model did, and with the costs measured in this play when ``engines``)."""
    plays = asyncio.run(
        live_replay.play(target.url, trace, prompts, target.time_scale, deadline_s, _Bar())
    )
    result = live_replay.as_result(settings, plays, target.time_scale)
    live = summarize("live", settings, result)
    measured, records = None, {}
    if target.engines:
        try:
            records = asyncio.run(live_measure.fetch_engine_records(target.engines))
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            # Not a simulated engine (no /sim/requests), or gone: the play stands, unmeasured.
            print(f"shapegate replay: costs not measured: {exc!r}", file=sys.stderr)
        measured = live_measure.measure(plays, records, target.time_scale)
    predicted = None
    if costs is not None:
        predicted = predict("predicted", settings, trace, costs)
    report = report_of(live, predicted, plays, costs or LiveCosts(), small_below)
    if measured is not None:
        report["measured_costs"] = measured.as_dict() | {"model": measured.costs.as_json()}
        report["engine_records"] = [
            {k: records[rid].get(k) for k in ENGINE_FIELDS} for rid in sorted(records)
        ]
    if costs is not None:
        others = [("engine_only", LiveCosts.none(target.time_scale))]
        if measured is not None:
            others.append(("calibrated", measured.costs))
        for name, other in others:
            sim = predict(name, settings, trace, other)
            report[name] = sim.summary
            report[f"ratios_{name}"] = found = live_report.ratios(live, sim)
            report[f"worst_ratio_{name}"] = live_report.worst_ratio(found)
    return LiveRun(live, predicted, report)


def predict(
    name: str,
    settings: Settings,
    trace: Sequence[TraceRecord],
    costs: LiveCosts,
    count_by: CountBy = "tokens",
    progress: Callable[[float], None] | None = None,
) -> SimReport:
    """``replay.simulate`` with the live path's costs modelled (``fleet_model.LiveCosts``)."""
    profiles = cluster_profiles(settings)
    result = FleetSim(settings, profiles, count_by, costs).run(trace, progress)
    return summarize(name, settings, result, count_by)


def report_of(
    live: SimReport,
    predicted: SimReport | None,
    plays: Sequence[live_replay.Play],
    costs: LiveCosts,
    small_below: int,
) -> dict[str, Any]:
    found = live_report.ratios(live, predicted) if predicted is not None else {}
    worst = live_report.worst_ratio(found) if found else math.nan
    return {
        "live": live.summary,
        "predicted": predicted.summary if predicted is not None else None,
        "ratios": found,
        "worst_ratio": worst,
        "monsters": live_report.monster_rows(live, predicted, small_below),
        "send_lag": live_report.send_lag(plays),
        "count_mismatches": live_report.count_mismatches(plays),
        "plays": [live_report.play_row(item) for item in plays],
        "costs": costs.as_json(),
    }


def add_arguments(replay: argparse.ArgumentParser) -> None:
    replay.add_argument(
        "--live",
        metavar="URL",
        help="play the trace against this running gateway or engine at its arrival times "
        "(with --simulate: live / predicted per metric)",
    )
    replay.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="the engines' clock (shapegate demo --time-scale): --live sends at t x S; "
        "--simulate converts the live path's wall costs to engine seconds",
    )
    replay.add_argument(
        "--deadline", type=float, help="--live: wall seconds before it stops (default: enough)"
    )
    replay.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="URL",
        help="--live: a simulated engine behind the target (repeatable): measure the live "
        "path's costs from its /sim/requests and, with --simulate, predict with them too",
    )
    costs = replay.add_argument_group("the live path's costs the simulation models (wall ms)")
    costs.add_argument("--gateway-ms", type=float, help="client send to admission")
    costs.add_argument("--forward-ms", type=float, help="admission to the engine's arrival")
    costs.add_argument("--relay-ms", type=float, help="a token from the engine to the client")
    costs.add_argument("--per-mtoken-ms", type=float, help="counting and copying, per 1M tokens")
    costs.add_argument(
        "--engine-only", action="store_true", help="model the engines alone (no live costs)"
    )
