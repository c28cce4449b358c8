"""``shapegate bench lanes``: the production-burst trace on equal capacity, three ways.

Each seed's ``production-burst`` trace (``gateway.observe.trace.synthesize``: 658 requests over
three hours, 21 of them above 32,768 tokens) is played by ``gateway.tuning.replay.simulate`` (the
discrete-event ``fleet_sim`` over the simulator's scheduler and cost model) against four H100s:

- ``shared``: one pool of 4 x h100-shared, least-loaded routing (configs/shared-pool.yaml),
  the shape-blind baseline;
- ``chars4``: shape lanes (configs/demo.yaml: 2 fast + 2 heavy engines) routed by characters/4;
- ``tokens``: the same lanes routed by real token counts, as the gateway does.

Reported per policy and seed: small-request (below the heavy threshold) TTFT p50/p99; monster
(at or above it) TTFT and completion time, p50 and max; output and prompt tokens per second over
the run; monsters that landed in the fast lane. Across seeds: median, min and max. Targets
(issue 9), each checked on the median over seeds and on every seed: small-request TTFT p99 at
least 10x better than shared, monster completion (p50) no worse than 1.2x shared, no leaked
monster with token counts. Plot: TTFT CDFs and slot occupancy of the first seed
(``replay.plot``). ``--smoke`` plays two seeds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from gateway.config_check import load_settings
from gateway.observe.trace import synthesize
from gateway.settings import Settings
from gateway.shipped import resolve_policy
from gateway.tools.bench.harness import machine, machine_line, publish, with_targets
from gateway.tuning.fleet_sim import CountBy
from gateway.tuning.replay import SimReport, cluster_profiles, plot, simulate

POLICIES: tuple[tuple[str, str, CountBy], ...] = (
    ("shared", "shared-pool.yaml", "tokens"),
    ("chars4", "demo.yaml", "chars4"),
    ("tokens", "demo.yaml", "tokens"),
)
TARGET_TTFT_RATIO, TARGET_MONSTER_RATIO = 10.0, 1.2
HEAVY = 32768  # the demo policy's heavy lane starts here (checked at run time)


def register(suites: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = suites.add_parser("lanes", help="shape lanes vs one shared pool, simulated")
    parser.add_argument("--out", default="bench-results", help="folder for lanes.json/png")
    parser.add_argument("--seeds", type=int, default=5, help="traces to play (seeds 1..N)")
    parser.add_argument("--smoke", action="store_true", help="two seeds")
    parser.set_defaults(func=run)


def _config(name: str) -> Settings:
    return load_settings(resolve_policy(f"configs/{name}"))


def run(args: argparse.Namespace) -> int:
    result, first = measure(seeds=2 if args.smoke else args.seeds, smoke=args.smoke)
    return publish(args.out, "lanes", result, table(result), lambda png: plot(first, png))


def _row(report: SimReport) -> dict[str, Any]:
    s = report.summary
    small, large = s["small_requests"], s["large_requests"]
    monsters = [
        o for o in report.result.outcomes if o.prompt_tokens >= HEAVY and o.rejected is None
    ]
    return {
        "small_ttft_p50_s": small["ttft_p50"],
        "small_ttft_p99_s": small["ttft_p99"],
        "monster_ttft_p50_s": large["ttft_p50"],
        "monster_ttft_max_s": max((o.ttft or 0.0 for o in monsters), default=float("nan")),
        "monster_e2e_p50_s": large["e2e_p50"],
        "monster_e2e_max_s": max((o.e2e or 0.0 for o in monsters), default=float("nan")),
        "monsters": large["requests"],
        "monsters_rejected": large["rejected"],
        "small_rejected": small["rejected"],
        "leaked_monsters": s["large_in_light_lane"],
        "output_tokens_per_s": s["all"]["output_tokens_per_s"],
        "prompt_tokens_per_s": s["all"]["prompt_tokens_per_s"],
        "makespan_s": s["makespan_s"],
    }


def measure(*, seeds: int, smoke: bool) -> tuple[dict[str, Any], list[SimReport]]:
    info = machine()
    configs = {name: _config(file) for name, file, _ in POLICIES}
    heavy = min(
        (lane.min_prompt_tokens for lane in configs["tokens"].lanes if lane.min_prompt_tokens),
        default=HEAVY,
    )
    if heavy != HEAVY:
        raise RuntimeError(f"the demo policy's heavy threshold moved to {heavy}: update HEAVY")
    per_seed: list[dict[str, Any]] = []
    first: list[SimReport] = []
    started = time.perf_counter()
    for seed in range(1, seeds + 1):
        trace = synthesize("production-burst", seed)
        rows = {}
        for name, _, count_by in POLICIES:
            settings = configs[name]
            report = simulate(
                name, settings, trace, cluster_profiles(settings), count_by, small_below=heavy
            )
            rows[name] = _row(report)
            if seed == 1:
                first.append(report)
        per_seed.append({"seed": seed, "requests": len(trace), "policies": rows})
    result: dict[str, Any] = {
        "suite": "lanes",
        "smoke": smoke,
        "machine": info,
        "trace": "production-burst",
        "seeds": seeds,
        "heavy_threshold_tokens": heavy,
        "capacity": "4 x H100 each way: shared = 4 x h100-shared; lanes = 2 x h100-fast + "
        "2 x h100-heavy-lending (configs/demo.yaml: the heavy lane lends idle seats to short "
        "fast-lane requests)",
        "simulated_in_s": round(time.perf_counter() - started, 2),
        "per_seed": per_seed,
        "spread": _spread(per_seed),
    }
    result["ratios"] = _ratios(per_seed)
    result["targets"] = targets(result)
    return result, first


def _spread(per_seed: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, _, _ in POLICIES:
        keys = per_seed[0]["policies"][name].keys()
        out[name] = {key: _stats([s["policies"][name][key] for s in per_seed]) for key in keys}
    return out


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def _ratio(per_seed: list[dict[str, Any]], top: str, bottom: str, key: str) -> dict[str, Any]:
    """``top``'s figure over ``bottom``'s, per seed, with its spread."""
    values = [s["policies"][top][key] / s["policies"][bottom][key] for s in per_seed]
    return {**_stats(values), "per_seed": [round(v, 3) for v in values]}


def _ratios(per_seed: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        name: {
            # times better than shared: higher is better
            "small_ttft_p99_x_better": _ratio(per_seed, "shared", name, "small_ttft_p99_s"),
            "small_ttft_p50_x_better": _ratio(per_seed, "shared", name, "small_ttft_p50_s"),
            # against shared: lower is better, 1.0 is the same
            "monster_e2e_p50_vs_shared": _ratio(per_seed, name, "shared", "monster_e2e_p50_s"),
        }
        for name in ("chars4", "tokens")
    }


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    tokens = result["ratios"]["tokens"]
    leaked = [s["policies"]["tokens"]["leaked_monsters"] for s in result["per_seed"]]
    return [
        {
            "target": "tokens: small-request TTFT p99, times better than shared (worst seed)",
            "value": tokens["small_ttft_p99_x_better"]["min"],
            "limit": TARGET_TTFT_RATIO,
            "met": tokens["small_ttft_p99_x_better"]["min"] >= TARGET_TTFT_RATIO,
        },
        {
            "target": "tokens: monster completion p50 vs shared (worst seed)",
            "value": tokens["monster_e2e_p50_vs_shared"]["max"],
            "limit": TARGET_MONSTER_RATIO,
            "met": tokens["monster_e2e_p50_vs_shared"]["max"] <= TARGET_MONSTER_RATIO,
        },
        {
            "target": "tokens: monsters leaked into the fast lane (all seeds)",
            "value": sum(leaked),
            "limit": 0,
            "met": sum(leaked) == 0,
        },
    ]


def table(result: dict[str, Any]) -> str:
    spread = result["spread"]

    def cell(name: str, key: str) -> str:
        s = spread[name][key]
        return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"

    rows = [
        ("small TTFT p50 s", "small_ttft_p50_s"),
        ("small TTFT p99 s", "small_ttft_p99_s"),
        ("monster TTFT p50 s", "monster_ttft_p50_s"),
        ("monster TTFT max s", "monster_ttft_max_s"),
        ("monster done p50 s", "monster_e2e_p50_s"),
        ("monster done max s", "monster_e2e_max_s"),
        ("output tok/s", "output_tokens_per_s"),
        ("prompt tok/s", "prompt_tokens_per_s"),
        ("leaked monsters", "leaked_monsters"),
        ("monsters rejected", "monsters_rejected"),
    ]
    names = [name for name, _, _ in POLICIES]
    width = 28
    lines = [
        f"shapegate bench lanes: {result['trace']}, seeds 1..{result['seeds']}, "
        f"median [min-max]{' (SMOKE)' if result['smoke'] else ''}",
        machine_line(result["machine"]),
        f"capacity: {result['capacity']}; heavy threshold "
        f"{result['heavy_threshold_tokens']} tokens",
        "",
        f"{'':>20} " + " ".join(f"{n:>{width}}" for n in names),
    ]
    for label, key in rows:
        lines.append(f"{label:>20} " + " ".join(f"{cell(n, key):>{width}}" for n in names))
    lines.append("")
    for name, r in result["ratios"].items():
        p99 = r["small_ttft_p99_x_better"]
        mon = r["monster_e2e_p50_vs_shared"]
        lines.append(
            f"{name}: small TTFT p99 {p99['median']:.1f}x better than shared "
            f"[{p99['min']:.1f}-{p99['max']:.1f}]; monster completion {mon['median']:.2f}x "
            f"shared [{mon['min']:.2f}-{mon['max']:.2f}]"
        )
    return with_targets(lines, result["targets"])
