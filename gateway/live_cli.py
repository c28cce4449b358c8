"""``shapegate replay --live URL TRACE``: the command around ``gateway/live_replay.py``.

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from gateway import live_replay
from gateway.fleet_model import LiveCosts
from gateway.replay import SimReport, cluster_profiles, render, simulate, summarize
from gateway.settings import ConfigError, Settings
from gateway.tokens import TokenCounter
from gateway.trace import TraceRecord

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
    if args.time_scale <= 0:
        print("shapegate replay: --time-scale must be positive", file=sys.stderr)
        return 2
    try:
        costs = live_costs(args)
        prompts = build_prompts(settings, trace, progress("prompts"))
    except (ConfigError, ValueError) as exc:
        print(f"shapegate: {exc}", file=sys.stderr)
        return 2
    deadline = args.deadline or default_deadline(trace, args.time_scale)
    plays = asyncio.run(
        live_replay.play(args.live, trace, prompts, args.time_scale, deadline, _bar)
    )
    name = "live"
    live = summarize(name, settings, live_replay.as_result(settings, plays, args.time_scale))
    predicted = None
    if args.simulate:
        predicted = simulate(
            "predicted", settings, trace, cluster_profiles(settings), live=costs
        )
    report = live_report(live, predicted, plays, costs, args.small_below)
    print(render([live, predicted] if predicted is not None else [live]))
    print(live_replay.render_lanes(live))
    if predicted is not None:
        print(live_replay.render_lanes(predicted))
    print(live_replay.render_monsters(report["monsters"]))
    lag = report["send_lag"]
    print(
        f"send lag (wall ms): p50 {lag['p50_ms']:.1f}  p99 {lag['p99_ms']:.1f}  "
        f"max {lag['max_ms']:.1f}; prompts counted otherwise by the target: "
        f"{report['count_mismatches']}; not served: {live.summary['all']['rejected']}"
    )
    if predicted is not None:
        print(live_replay.render_ratios(report["ratios"]))
        print(f"worst ratio: {report['worst_ratio']:.2f}x")
    if out is not None:
        (out / "live.json").write_bytes(
            orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
        )
        print(f"report: {out / 'live.json'}")
    return 0 if live.summary["all"]["rejected"] < len(trace) else 1


def live_report(
    live: SimReport,
    predicted: SimReport | None,
    plays: Sequence[live_replay.Play],
    costs: LiveCosts,
    small_below: int,
) -> dict[str, Any]:
    found = live_replay.ratios(live, predicted) if predicted is not None else {}
    worst = live_replay.worst_ratio(found) if found else math.nan
    return {
        "live": live.summary,
        "predicted": predicted.summary if predicted is not None else None,
        "ratios": found,
        "worst_ratio": worst,
        "monsters": live_replay.monster_rows(live, predicted, small_below),
        "send_lag": live_replay.send_lag(plays),
        "count_mismatches": live_replay.count_mismatches(plays),
        "costs": {
            "time_scale": costs.time_scale,
            "gateway_ms": costs.gateway_s * 1000,
            "forward_ms": costs.forward_s * 1000,
            "relay_ms": costs.relay_s * 1000,
            "per_mtoken_ms": costs.per_mtoken_s * 1000,
            "model_scrape": costs.model_scrape,
        },
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
    costs = replay.add_argument_group("the live path's costs the simulation models (wall ms)")
    costs.add_argument("--gateway-ms", type=float, help="client send to admission")
    costs.add_argument("--forward-ms", type=float, help="admission to the engine's arrival")
    costs.add_argument("--relay-ms", type=float, help="a token from the engine to the client")
    costs.add_argument("--per-mtoken-ms", type=float, help="counting and copying, per 1M tokens")
    costs.add_argument(
        "--engine-only", action="store_true", help="model the engines alone (no live costs)"
    )
