"""``shapegate bench fidelity``: does the what-if replay predict what the live gateway does?

For each time scale (default 0.1, the demo's, and 0.05): ``shapegate demo`` starts (four
simulated engines and the gateway, in their own processes) with its engines at that scale; the
``production-burst`` trace (seed 1), cut to its busiest ``--duration`` seconds
(``trace_window.busiest``: the most monsters, then the most requests), is played against it by
``replay --live``'s player (``live_cli.play_and_predict``), and the same trace is simulated by
``fleet_sim`` three ways:

- ``engine_only``: the engines alone (the replay before it modelled the live path): the
  baseline measured in the same run;
- ``predicted``: with the live path's default costs (``fleet_model.LiveCosts()``);
- ``calibrated``: with the costs measured in this very run from the engines' records
  (``live_measure``).

Reported per scale and model: live / predicted for TTFT and completion p50, p95, p99, small
and large requests, and the worst of them; the measured costs; the load average before and
after. Goal (issue 23): every metric within 10% (worst ratio <= 1.10) at every scale, on a quiet
machine; the verdict says met or MISS with the load it was measured under.
``--smoke``: one scale (0.05), a 30-second window.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from gateway.config_check import load_settings
from gateway.extras import pyplot, save
from gateway.observe.trace import synthesize
from gateway.shipped import resolve_policy
from gateway.tools.bench import harness
from gateway.tools.bench.harness import (
    Child,
    free_port,
    machine,
    machine_line,
    publish,
    with_targets,
)
from gateway.tuning.fleet_model import LiveCosts
from gateway.tuning.live_cli import Target, build_prompts, default_deadline, play_and_predict
from gateway.tuning.trace_window import busiest, cut

GOAL = 1.10
MODELS = ("engine_only", "predicted", "calibrated")


def register(suites: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = suites.add_parser("fidelity", help="replay --live against the demo vs the what-if")
    parser.add_argument("--out", default="bench-results", help="folder for fidelity.json/png")
    parser.add_argument(
        "--scales", type=float, nargs="+", default=[0.1, 0.05], help="engine time scales"
    )
    parser.add_argument("--duration", type=float, default=300.0, help="trace window, seconds")
    parser.add_argument("--seed", type=int, default=1, help="production-burst seed")
    parser.add_argument("--smoke", action="store_true", help="scale 0.05, a 30-second window")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    pyplot()  # a missing [bench] extra fails now, not after minutes of play
    scales = [0.05] if args.smoke else args.scales
    duration = 30.0 if args.smoke else args.duration
    result = measure(scales, duration, args.seed, smoke=args.smoke)
    return publish(args.out, "fidelity", result, table(result), lambda png: plot(result, png))


def _ports() -> tuple[int, int]:
    """A gateway port and an engine base whose +1, +2, +11, +12 are all free."""
    for _ in range(50):
        port, base = free_port(), free_port()
        wanted = {port: "gateway"} | {base + k: "engine" for k in (1, 2, 11, 12)}
        if len(wanted) == 5 and all(_free(p) for p in wanted):
            return port, base
    raise RuntimeError("no free ports for the demo")


def _free(port: int) -> bool:
    if not 0 < port < 65536:
        return False
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# The demo exits naming a port another process took between our check and its bind.
_PORT_TAKEN = ("already in use", "Address already in use", "Errno 98")


def start_demo(scale: float, folder: Path, attempts: int = 3) -> tuple[Child, int, int]:
    """The demo on free ports, ready: (its process, the gateway's port, the engines' base).
    The ports are free when chosen and bound by the demo's processes a moment later; one taken
    in between (an outgoing connection's ephemeral port, another test's server) makes the demo
    exit naming it, and it is started again on new ports, at most ``attempts`` times. Any
    other exit is raised at once."""
    for attempt in range(1, attempts + 1):
        port, base = _ports()
        argv = [sys.executable, "-m", "gateway.tools.cli", "demo", "--port", str(port)]
        argv += ["--engine-port-base", str(base), "--time-scale", str(scale)]
        log = folder / f"demo-{attempt}.log"
        demo = Child.start("demo", argv, log, None)
        try:
            # Starting the demo's five processes on a loaded 2-core machine takes a while.
            harness.wait_http(f"http://127.0.0.1:{port}/readyz", demo, 180)
        except RuntimeError:
            demo.stop(30)
            said = log.read_text(errors="replace") if log.is_file() else ""
            if attempt == attempts or not any(words in said for words in _PORT_TAKEN):
                raise
            print(f"demo: a port was taken before it bound (attempt {attempt}); new ports")
            continue
        return demo, port, base
    raise AssertionError("unreachable: the last attempt returns or raises")


def one_scale(scale: float, trace: Any, prompts: Any, settings: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="shapegate-fidelity-") as folder:
        demo, port, base = start_demo(scale, Path(folder))
        try:
            url = f"http://127.0.0.1:{port}"
            load_before = os.getloadavg()[0]
            engines = tuple(f"http://127.0.0.1:{base + k}" for k in (1, 2, 11, 12))
            live = play_and_predict(
                settings,
                trace,
                prompts,
                Target(url, scale, engines),
                default_deadline(trace, scale),
                costs=LiveCosts(time_scale=scale),
            )
            load_after = os.getloadavg()[0]
        finally:
            demo.stop(30)  # SIGINT: the demo stops its engines and the gateway
    report = live.report
    row: dict[str, Any] = {
        "time_scale": scale,
        "requests": len(trace),
        "not_served": report["live"]["all"]["rejected"],
        "load_before": round(load_before, 2),
        "load_after": round(load_after, 2),
        "send_lag": report["send_lag"],
        "measured_costs": report.get("measured_costs"),
        "count_mismatches": report["count_mismatches"],
        "live": _figures(report["live"]),
    }
    for model in MODELS:
        key = "ratios" if model == "predicted" else f"ratios_{model}"
        worst = "worst_ratio" if model == "predicted" else f"worst_ratio_{model}"
        if key in report:
            row[model] = {
                "figures": _figures(report[model]),
                "ratios": report[key],
                "worst_ratio": round(report[worst], 3),
            }
    return row


def _figures(summary: dict[str, Any]) -> dict[str, Any]:
    keys = ("ttft_p50", "ttft_p95", "ttft_p99", "e2e_p50", "e2e_p95", "e2e_p99")
    return {
        group: {k: round(summary[group][k], 3) for k in keys}
        for group in ("small_requests", "large_requests")
    }


def measure(scales: list[float], duration: float, seed: int, smoke: bool) -> dict[str, Any]:
    info = machine()
    settings = load_settings(resolve_policy("configs/demo.yaml"))
    full = synthesize("production-burst", seed)
    if smoke:  # small requests only: the smoke run checks the plumbing, fast
        full = [r for r in full if r.prompt_tokens < 32768]
    start = busiest(full, duration)
    trace = cut(full, start, duration)
    prompts = build_prompts(settings, trace, None)
    rows = [one_scale(scale, trace, prompts, settings) for scale in scales]
    targets = []
    for row in rows:
        for model in ("predicted", "calibrated"):
            if model in row:
                worst = row[model]["worst_ratio"]
                targets.append(
                    {
                        "target": f"every metric within 10% of live, scale {row['time_scale']:g}, "
                        f"{model} (load {row['load_before']:g}->{row['load_after']:g})",
                        "value": worst,
                        "limit": GOAL,
                        "met": worst <= GOAL,
                    }
                )
    return {
        "machine": info,
        "trace": {"kind": "production-burst", "seed": seed, "window_start_s": start},
        "duration_s": duration,
        "requests": len(trace),
        "monsters": sum(1 for r in trace if r.prompt_tokens >= 32768),
        "smoke": smoke,
        "scales": rows,
        "targets": targets,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        machine_line(result["machine"]),
        f"trace: production-burst seed {result['trace']['seed']}, {result['requests']} requests "
        f"({result['monsters']} of 32k+ tokens) in {result['duration_s']:g} s from "
        f"{result['trace']['window_start_s']:g} s",
        "",
        "live / predicted, the worst metric (TTFT and completion p50/p95/p99, small and large):",
        f"{'scale':>6}  {'load':>9}  " + "  ".join(f"{m:>12}" for m in MODELS) + "  measured",
    ]
    for row in result["scales"]:
        worst = "  ".join(
            f"{row[m]['worst_ratio']:>11.2f}x" if m in row else f"{'-':>12}" for m in MODELS
        )
        costs = row["measured_costs"] or {}
        lines.append(
            f"{row['time_scale']:>6g}  {row['load_before']:>4g}->{row['load_after']:<4g}  {worst}"
            f"  pre-engine p50 {costs.get('pre_engine_ms_p50', '-')} ms, "
            f"relay {costs.get('relay_ms_p50', '-')} ms"
        )
    for row in result["scales"]:
        for model in MODELS:
            if model in row:
                small = row[model]["ratios"].get("small", {})
                lines.append(
                    f"  scale {row['time_scale']:g} {model:<12} small: "
                    + "  ".join(f"{k} {v:.2f}" for k, v in small.items())
                )
    return with_targets(lines, result["targets"])


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    scales = [row["time_scale"] for row in result["scales"]]
    width = 0.8 / len(MODELS)
    for i, model in enumerate(MODELS):
        values = [row[model]["worst_ratio"] if model in row else 0 for row in result["scales"]]
        ax.bar([x + i * width for x in range(len(scales))], values, width, label=model)
    ax.axhline(GOAL, color="red", linestyle="--", label="goal (1.10)")
    ax.set_xticks([x + width for x in range(len(scales))], [f"scale {s:g}" for s in scales])
    ax.set_ylabel("worst live / predicted (either way)")
    ax.set_title("replay fidelity: shapegate demo played live vs fleet_sim")
    ax.legend()
    save(fig, path)
