"""``shapegate trace synth`` and ``shapegate replay``.

    shapegate trace synth production-burst --seed 1 --out burst.jsonl
    shapegate replay --config configs/demo.yaml burst.jsonl                 # offline what-if
    shapegate replay --config configs/demo.yaml burst.jsonl --simulate \\
        --compare configs/shared-pool.yaml --out replay-out/               # side by side + PNG
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson
import yaml

from gateway.config_check import load_settings
from gateway.extras import pyplot
from gateway.observe.trace import SYNTH_KINDS, TraceRecord, read_trace, synthesize, write_trace
from gateway.settings import ConfigError
from gateway.shipped import resolve_policy
from gateway.tuning import live_cli
from gateway.tuning.replay import (
    SimReport,
    analyze,
    cluster_profiles,
    demand_table,
    plot,
    render,
    verdict,
)
from gateway.tuning.sweep import Sweep, parse_sweep, plot_sweep, render_sweep, run_sweep
from gateway.tuning.trace_window import busiest, cut


def _progress(label: str) -> Any:
    def show(done: float) -> None:
        filled = int(done * 30)
        sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (30 - filled)}] {done:4.0%}")
        if done >= 1:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def _synth(args: argparse.Namespace) -> int:
    records = synthesize(args.kind, args.seed)
    write_trace(args.out, records)
    print(f"wrote {len(records)} requests to {args.out}")
    return 0


def _cut(args: argparse.Namespace) -> int:
    try:
        trace = read_trace(args.trace)
        start = busiest(trace, args.duration) if args.busiest else args.start
        records = cut(trace, start, args.duration)
    except (OSError, ValueError) as exc:
        print(f"shapegate: {exc}", file=sys.stderr)
        return 2
    write_trace(args.out, records)
    print(
        f"wrote {len(records)} requests from [{start:g}, {start + args.duration:g}) s to {args.out}"
    )
    return 0


def _replay(args: argparse.Namespace) -> int:
    if (args.simulate or args.sweep) and args.out:
        pyplot()  # a missing [bench] extra fails now, not after minutes of simulation
    if args.compare and not args.simulate:
        print("shapegate replay: --compare needs --simulate", file=sys.stderr)
        return 2
    if args.sweep and (args.compare or args.simulate):
        print(
            "shapegate replay: --sweep runs its own simulations; drop --simulate and --compare",
            file=sys.stderr,
        )
        return 2
    if args.time_scale <= 0:
        print("shapegate replay: --time-scale must be positive", file=sys.stderr)
        return 2
    if args.live and (args.compare or args.sweep):
        print(
            "shapegate replay: --live plays one policy; drop --compare and --sweep", file=sys.stderr
        )
        return 2
    path = resolve_policy(args.config)
    try:
        settings = load_settings(path)
        others = [load_settings(resolve_policy(p)) for p in args.compare]
        trace = read_trace(args.trace)
        sweep = parse_sweep(args.sweep) if args.sweep else None
    except (ConfigError, OSError, ValueError) as exc:
        print(f"shapegate: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    if sweep is not None:
        return _sweep(path, sweep, trace, args, out)
    if args.live:
        return live_cli.run_live(args, settings, trace, out, _progress)
    profiles = cluster_profiles(settings) if all(c.sim_profile for c in settings.clusters) else None
    analysis = analyze(settings, trace, profiles)
    report: dict[str, Any] = {"analysis": analysis}
    print(orjson.dumps(analysis, option=orjson.OPT_INDENT_2).decode())
    if args.simulate:
        runs: list[SimReport] = []
        for name, policy in [
            (Path(args.config).stem, settings),
            *((Path(p).stem, s) for p, s in zip(args.compare, others, strict=True)),
        ]:
            costs = live_cli.live_costs(args)
            runs.append(
                live_cli.predict(name, policy, trace, costs, args.count_by, _progress(name))
            )
        print(render(runs))
        for other in runs[1:]:
            print(verdict(runs[0], other))
        print(demand_table(analysis, runs[0]))
        report["simulations"] = [r.summary for r in runs]
        if out is not None:
            plot(runs, out / "replay.png")
            print(f"plots: {out / 'replay.png'}")
    if out is not None:
        (out / "replay.json").write_bytes(
            orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
        )
    return 0


def _sweep(
    path: Path, sweep: Sweep, trace: list[TraceRecord], args: argparse.Namespace, out: Path | None
) -> int:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        rows = run_sweep(data, sweep, trace, small_below=args.small_below, progress=_progress)
    except (ConfigError, OSError, ValueError, TypeError, yaml.YAMLError) as exc:
        print(f"shapegate: {exc}", file=sys.stderr)
        return 2
    print(render_sweep(sweep, rows))
    out = out or Path(".")
    plot_sweep(sweep, rows, out / "sweep.png")
    (out / "sweep.json").write_bytes(
        orjson.dumps(
            {"sweep": sweep.name, "rows": [{"value": r.label, **r.report.summary} for r in rows]},
            option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY,
        )
    )
    print(f"plot: {out / 'sweep.png'}")
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    trace = subparsers.add_parser("trace", help="traffic traces (request shapes, no text)")
    trace_sub = trace.add_subparsers(
        dest="trace_command", required=True, metavar="ACTION", help="what to do with traces"
    )
    synth = trace_sub.add_parser("synth", help="generate a trace from a description")
    synth.add_argument("kind", choices=SYNTH_KINDS, help="the traffic to describe")
    synth.add_argument("--seed", type=int, default=0, help="seed of the random shapes")
    synth.add_argument("--out", required=True, help="trace file to write (JSON lines)")
    synth.set_defaults(func=_synth)
    window = trace_sub.add_parser("cut", help="a window of a trace, its times rebased to 0")
    window.add_argument("trace", help="trace file to cut")
    window.add_argument("--duration", type=float, required=True, help="window length, seconds")
    where = window.add_mutually_exclusive_group(required=True)
    where.add_argument("--start", type=float, help="window start, seconds into the trace")
    where.add_argument(
        "--busiest", action="store_true", help="the window with the most monsters, then requests"
    )
    window.add_argument("--out", required=True, help="trace file to write")
    window.set_defaults(func=_cut)

    replay = subparsers.add_parser("replay", help="what a policy would do with a trace")
    replay.add_argument(
        "--config", required=True, help="policy file (YAML), or a shipped one: configs/NAME.yaml"
    )
    replay.add_argument("trace", help="trace file (JSON lines; shapegate trace synth makes one)")
    replay.add_argument(
        "--simulate",
        action="store_true",
        help="play the trace against the clusters' simulated engines",
    )
    replay.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="OTHER_CONFIG",
        help="another policy simulated on the same trace (needs --simulate; repeatable)",
    )
    replay.add_argument(
        "--count-by",
        choices=("tokens", "chars4"),
        default="tokens",
        help="route the simulation by real tokens, or by characters / 4 (to see what it costs)",
    )
    replay.add_argument(
        "--sweep",
        metavar="KEY=V1,V2,...",
        help="simulate one policy per value of KEY and print one table and one plot, e.g. "
        "lanes.fast.max_prompt_tokens=8k,16k,32k,64k (k = 1024; a lane boundary moves with "
        "its neighbour)",
    )
    replay.add_argument(
        "--small-below",
        type=int,
        default=32768,
        help="--sweep: prompts under this many tokens are 'small', the rest 'monsters'",
    )
    replay.add_argument(
        "--out", help="directory for replay.json and replay.png (sweep.json and sweep.png)"
    )
    live_cli.add_arguments(replay)
    replay.set_defaults(func=_replay)
