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

from gateway.replay import SimReport, analyze, cluster_profiles, plot, render, simulate
from gateway.settings import ConfigError, load_settings
from gateway.shipped import resolve_policy
from gateway.trace import SYNTH_KINDS, read_trace, synthesize, write_trace


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


def _replay(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(resolve_policy(args.config))
        others = [load_settings(resolve_policy(path)) for path in args.compare]
        trace = read_trace(args.trace)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"shapegate: {exc}", file=sys.stderr)
        return 2
    profiles = cluster_profiles(settings) if all(c.sim_profile for c in settings.clusters) else None
    report: dict[str, Any] = {"analysis": analyze(settings, trace, profiles)}
    print(orjson.dumps(report["analysis"], option=orjson.OPT_INDENT_2).decode())
    if args.simulate:
        runs: list[SimReport] = []
        for name, policy in [
            (Path(args.config).stem, settings),
            *((Path(p).stem, s) for p, s in zip(args.compare, others, strict=True)),
        ]:
            runs.append(
                simulate(
                    name,
                    policy,
                    trace,
                    cluster_profiles(policy),
                    count_by=args.count_by,
                    progress=_progress(name),
                )
            )
        print(render(runs))
        if len(runs) > 1:
            base, other = runs[0].summary["small_requests"], runs[1].summary["small_requests"]
            if base["ttft_p99"] > 0:
                print(
                    f"small-request TTFT p99: {runs[0].name} is "
                    f"{other['ttft_p99'] / base['ttft_p99']:.1f}x better than {runs[1].name}"
                )
        report["simulations"] = [r.summary for r in runs]
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            plot(runs, out / "replay.png")
            print(f"plots: {out / 'replay.png'}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "replay.json").write_bytes(
            orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
        )
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
    replay.add_argument("--out", help="directory for replay.json and replay.png")
    replay.set_defaults(func=_replay)
