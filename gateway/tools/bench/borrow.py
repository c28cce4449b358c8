"""``shapegate bench borrow``: lanes that lend against lanes that don't and one shared pool.

Each seed's trace of two shapes (``gateway.observe.trace.synthesize``: ``production-burst``, 658
requests over three hours with nine monsters opening bursts; ``agent-storm``, eight storms of
80-165 agent calls within three seconds, monsters just before them, interactive chat turns all
along) is played by ``gateway.tuning.replay.simulate`` (the discrete-event ``fleet_sim``, which
calls the same borrowing and class rules as the live admission) against four H100s:

- ``shared``: one pool of 4 x h100-shared, least-loaded routing (configs/shared-pool.yaml);
- ``lanes``: configs/demo.yaml with its ``lend`` rule removed (2 fast + 2 heavy engines);
- ``borrow``: configs/demo.yaml as shipped: the heavy lane lends idle engines to short
  fast-lane requests.

Reported per trace, policy and seed: small-request (below the heavy threshold) TTFT p50, p95,
p99; monster completion p50; the share of requests served on a borrowed engine; monsters that
ran on a fast engine; TTFT p50/p99 per priority class. Targets, on the worst seed of each trace
(``borrow`` against ``shared``): small TTFT p50 at most 1.1x, p99 at least 10x better, monster
completion p50 at most 1.2x, no monster on a fast engine. ``--smoke``: seed 1 of each shape,
its first 40 minutes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import yaml

from gateway.observe.trace import synthesize
from gateway.settings import Settings, parse_settings
from gateway.shipped import resolve_policy
from gateway.tools.bench.harness import machine, machine_line, publish, with_targets
from gateway.tuning.replay import SimReport, cluster_profiles, plot, simulate

TRACES = ("production-burst", "agent-storm")
POLICIES = ("shared", "lanes", "borrow")
P50_AT_MOST, P99_AT_LEAST, MONSTER_AT_MOST = 1.1, 10.0, 1.2
SMOKE_SPAN_S = 2400.0


def register(suites: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = suites.add_parser("borrow", help="lanes that lend vs lanes vs a shared pool")
    parser.add_argument("--out", default="bench-results", help="folder for borrow.json/png")
    parser.add_argument("--seeds", type=int, default=5, help="traces per shape (seeds 1..N)")
    parser.add_argument("--smoke", action="store_true", help="seed 1, first 40 minutes")
    parser.set_defaults(func=run)


def policies() -> dict[str, Settings]:
    def raw(name: str) -> dict[str, Any]:
        data: dict[str, Any] = yaml.safe_load(
            resolve_policy(f"configs/{name}").read_text(encoding="utf-8")
        )
        return data

    plain = raw("demo.yaml")
    for lane in plain["lanes"]:
        lane.pop("lend", None)
    return {
        "shared": parse_settings(raw("shared-pool.yaml"), {}),
        "lanes": parse_settings(plain, {}),
        "borrow": parse_settings(raw("demo.yaml"), {}),
    }


def run(args: argparse.Namespace) -> int:
    result, first = measure(seeds=1 if args.smoke else args.seeds, smoke=args.smoke)
    return publish(args.out, "borrow", result, table(result), lambda png: plot(first, png))


def _row(report: SimReport) -> dict[str, Any]:
    s = report.summary
    small, large = s["small_requests"], s["large_requests"]
    return {
        "small_ttft_p50_s": small["ttft_p50"],
        "small_ttft_p95_s": small["ttft_p95"],
        "small_ttft_p99_s": small["ttft_p99"],
        "monster_e2e_p50_s": large["e2e_p50"],
        "monsters": large["requests"],
        "rejected": s["all"]["rejected"],
        "borrowed_share": s["borrowing"]["share"],
        "monsters_on_fast_engines": s["large_on_light_engines"],
        "by_class": {
            name: {"ttft_p50_s": c["ttft_p50"], "ttft_p99_s": c["ttft_p99"]}
            for name, c in s["by_class"].items()
        },
    }


def measure(*, seeds: int, smoke: bool) -> tuple[dict[str, Any], list[SimReport]]:
    info = machine()
    configs = policies()
    heavy = configs["borrow"].lane("heavy").min_prompt_tokens
    started = time.perf_counter()
    per_trace: dict[str, list[dict[str, Any]]] = {}
    first: list[SimReport] = []
    for kind in TRACES:
        per_trace[kind] = []
        for seed in range(1, seeds + 1):
            trace = synthesize(kind, seed)
            if smoke:
                trace = [r for r in trace if r.t < SMOKE_SPAN_S]
            rows = {}
            for name in POLICIES:
                settings = configs[name]
                report = simulate(
                    name, settings, trace, cluster_profiles(settings), small_below=heavy
                )
                rows[name] = _row(report)
                if kind == TRACES[0] and seed == 1:
                    first.append(report)
            per_trace[kind].append({"seed": seed, "requests": len(trace), "policies": rows})
    result: dict[str, Any] = {
        "suite": "borrow",
        "smoke": smoke,
        "machine": info,
        "seeds": seeds,
        "heavy_threshold_tokens": heavy,
        "capacity": "4 x H100 each way: shared = 4 x h100-shared; lanes and borrow = "
        "2 x h100-fast + 2 x h100-heavy-lending (monsters held to 4 an engine)",
        "simulated_in_s": round(time.perf_counter() - started, 2),
        "per_trace": per_trace,
        "ratios": {kind: _ratios(rows) for kind, rows in per_trace.items()},
    }
    result["targets"] = targets(result)
    return result, first


def _ratio(rows: list[dict[str, Any]], top: str, bottom: str, key: str) -> dict[str, Any]:
    values = [r["policies"][top][key] / r["policies"][bottom][key] for r in rows]
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "per_seed": [round(v, 3) for v in values],
    }


def _ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        name: {
            # against shared, lower is better
            "small_ttft_p50_vs_shared": _ratio(rows, name, "shared", "small_ttft_p50_s"),
            # times better than shared, higher is better
            "small_ttft_p99_x_better": _ratio(rows, "shared", name, "small_ttft_p99_s"),
            "monster_e2e_p50_vs_shared": _ratio(rows, name, "shared", "monster_e2e_p50_s"),
        }
        for name in ("lanes", "borrow")
    }


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for kind, ratios in result["ratios"].items():
        r = ratios["borrow"]
        leaked = sum(
            s["policies"]["borrow"]["monsters_on_fast_engines"] for s in result["per_trace"][kind]
        )
        out += [
            {
                "target": f"{kind}: borrow small TTFT p50 vs shared (worst seed)",
                "value": r["small_ttft_p50_vs_shared"]["max"],
                "limit": P50_AT_MOST,
                "met": r["small_ttft_p50_vs_shared"]["max"] <= P50_AT_MOST,
            },
            {
                "target": f"{kind}: borrow small TTFT p99, times better than shared (worst seed)",
                "value": r["small_ttft_p99_x_better"]["min"],
                "limit": P99_AT_LEAST,
                "met": r["small_ttft_p99_x_better"]["min"] >= P99_AT_LEAST,
            },
            {
                "target": f"{kind}: borrow monster completion p50 vs shared (worst seed)",
                "value": r["monster_e2e_p50_vs_shared"]["max"],
                "limit": MONSTER_AT_MOST,
                "met": r["monster_e2e_p50_vs_shared"]["max"] <= MONSTER_AT_MOST,
            },
            {
                "target": f"{kind}: borrow monsters on fast engines (all seeds)",
                "value": leaked,
                "limit": 0,
                "met": leaked == 0,
            },
        ]
    return out


def ratio_text(ratio: dict[str, Any]) -> str:
    """One policy's ratios against shared, median [min-max] over seeds."""
    p50, p99 = ratio["small_ttft_p50_vs_shared"], ratio["small_ttft_p99_x_better"]
    mon = ratio["monster_e2e_p50_vs_shared"]
    return (
        f"small-request TTFT p50 {p50['median']:.2f}x shared's [{p50['min']:.2f}-"
        f"{p50['max']:.2f}], p99 {p99['median']:.1f}x better [{p99['min']:.1f}-"
        f"{p99['max']:.1f}]; monster completion {mon['median']:.2f}x shared's "
        f"[{mon['min']:.2f}-{mon['max']:.2f}]"
    )


ROWS = (
    ("small TTFT p50 s", "small_ttft_p50_s"),
    ("small TTFT p95 s", "small_ttft_p95_s"),
    ("small TTFT p99 s", "small_ttft_p99_s"),
    ("monster done p50 s", "monster_e2e_p50_s"),
    ("borrowed share", "borrowed_share"),
    ("monsters on fast", "monsters_on_fast_engines"),
    ("rejected", "rejected"),
)


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def table(result: dict[str, Any]) -> str:
    width = 22
    lines = [
        f"shapegate bench borrow: seeds 1..{result['seeds']}, median [min-max]"
        f"{' (SMOKE: first 40 minutes)' if result['smoke'] else ''}",
        machine_line(result["machine"]),
        f"capacity: {result['capacity']}; heavy threshold "
        f"{result['heavy_threshold_tokens']} tokens",
    ]
    for kind, rows in result["per_trace"].items():
        lines += ["", f"{kind}:", f"{'':>22} " + " ".join(f"{n:>{width}}" for n in POLICIES)]
        for label, key in ROWS:
            cells = [_cell([r["policies"][n][key] for r in rows]) for n in POLICIES]
            lines.append(f"{label:>22} " + " ".join(f"{c:>{width}}" for c in cells))
        classes = sorted(rows[0]["policies"]["borrow"]["by_class"])
        for name in classes if len(classes) > 1 else ():
            for key in ("ttft_p50_s", "ttft_p99_s"):
                cells = [
                    _cell([r["policies"][n]["by_class"].get(name, {}).get(key, 0.0) for r in rows])
                    for n in POLICIES
                ]
                label = f"{name} {key[:8].replace('_', ' ')}"
                lines.append(f"{label:>22} " + " ".join(f"{c:>{width}}" for c in cells))
        for name, r in result["ratios"][kind].items():
            lines.append(f"  {name}: {ratio_text(r)}")
    return with_targets(lines, result["targets"])
