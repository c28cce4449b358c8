"""The report of ``shapegate bench monsters`` (monsters.py): its targets, its table (one line a
phase, printed as each phase ends), its plot and the README's section (``shapegate bench
readme``), from the result it writes to ``monsters.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.extras import save, side_by_side
from gateway.tools.bench.harness import machine_line, with_targets

FIRST_BURST_LIMIT = 2.0
TAIL_LIMIT = 3.0
CPU_LIMIT_MS = 10.0
MIN_RECYCLES = 3


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    first = result["first_burst"]
    found = [
        {
            "target": "first burst after boot: slowest request / steady-state median",
            "value": first["worst_ratio"],
            "limit": FIRST_BURST_LIMIT,
            "met": first["worst_ratio"] <= FIRST_BURST_LIMIT
            and all(s == 200 for s in first["statuses"]),
        }
    ]
    for p in result["phases"]:
        name = f"{p['shape']} {p['tokens'] // 1000}k x{p['concurrency']}"
        found.append(
            {
                "target": f"{name}: p99 / p50 (errors {p['errors']})",
                "value": p["tail_ratio"],
                "limit": TAIL_LIMIT,
                "met": p["errors"] == 0
                and p["tail_ratio"] is not None
                and p["tail_ratio"] <= TAIL_LIMIT,
            }
        )
    if not result["smoke"]:
        found.append(
            {
                "target": "tokenizer child recycles during the run",
                "value": result["recycles"],
                "limit": f">= {MIN_RECYCLES}",
                "met": result["recycles"] >= MIN_RECYCLES,
            }
        )
    prose = next(
        (p for p in result["phases"] if p["shape"] == "prose" and p["tokens"] <= 200_000), None
    )
    if prose is not None:
        found.append(
            {
                "target": f"CPU ms per unique {prose['tokens'] // 1000}k-token prose request "
                "(tokenizer child included)",
                "value": prose["cpu_ms_per_request"],
                "limit": CPU_LIMIT_MS,
                "met": prose["cpu_ms_per_request"] <= CPU_LIMIT_MS,
            }
        )
    return found


def phase_line(p: dict[str, Any]) -> str:
    return (
        f"| {p['shape']} | {p['tokens_mean']:,} | {p['concurrency']} | {p['requests']} | "
        f"{p['p50_ms']} | {p['p99_ms']} | {p['tail_ratio']} | {p['errors']} | "
        f"{p['cpu_ms_per_request']} | {p['recycles']} | {p.get('peak_pss_mb', '-')} |"
    )


def table(result: dict[str, Any]) -> str:
    first = result["first_burst"]
    lines = [
        machine_line(result["machine"]),
        f"load average after: {', '.join(f'{x:g}' for x in result['load_average_after'])}; "
        f"tokenizer child bound {result['max_rss_mb']:g} MB",
        "",
        f"first burst after boot, {result['slots']} x {result['burst_tokens']:,}-token prose: "
        f"{first['latencies_ms']} ms; steady median {first['steady_median_ms']} ms over "
        f"{first['steady_requests']} requests; slowest / median {first['worst_ratio']}x",
        "",
        "| shape | tokens (mean) | concurrency | requests | p50 ms | p99 ms | p99/p50 | errors "
        "| CPU ms / request | recycles | peak PSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(phase_line(p) for p in result["phases"]),
    ]
    return with_targets(lines, result["targets"])


def plot(result: dict[str, Any], path: Path) -> None:
    fig, (ax_lat, ax_cpu) = side_by_side(11, 3.8)
    phases = result["phases"]
    names = [f"{p['shape']}\n{p['tokens'] // 1000}k" for p in phases]
    ax_lat.bar(names, [p["p50_ms"] for p in phases], label="p50", color="tab:blue")
    ax_lat.scatter(names, [p["p99_ms"] for p in phases], label="p99", color="tab:red", zorder=3)
    ax_lat.set_ylabel("ms through the gateway")
    ax_lat.set_yscale("log")
    ax_lat.legend()
    ax_lat.set_title("latency of unique monsters")
    ax_cpu.bar(names, [p["cpu_ms_per_request"] for p in phases], color="tab:green")
    ax_cpu.set_ylabel("CPU ms per request (gateway + tokenizer child)")
    ax_cpu.set_title(f"recycles in the run: {result['recycles']}")
    save(fig, path)


def readme_lines(
    r: dict[str, Any], machine_text: str, smoke: list[str], verdicts: list[str], plots: Path
) -> list[str]:
    """The README's section (``shapegate bench readme``)."""
    first = r["first_burst"]
    after = ", ".join(f"{x:g}" for x in r["load_average_after"])
    return [
        "### Unique monsters (`shapegate bench monsters`)",
        "",
        f"Machine: {machine_text}; load average {after} at the end. `shapegate serve` and its "
        "tokenizer processes on one core, this generator and a fixed upstream on the other; every "
        "prompt unique (no cache holds it), so each is counted exactly by the tokenizer child; "
        f"the child's bound `counting.max_encoder_rss_mb: {r['max_rss_mb']:g}`. Latency is the "
        "client's, to the whole answer; CPU is the gateway's, its tokenizer children included; "
        "peak PSS is the memory of the gateway with its tokenizer template and counting "
        "children (proportional set sizes: a page the template shares with a child counts "
        "once), after each answer (during a recycle two counting children: the old one past the "
        "bound, the fresh fork).",
        *smoke,
        "",
        f"First burst after boot ({r['slots']} concurrent unique "
        f"{r['burst_tokens']:,}-token prose prompts right after `/readyz`): "
        f"{', '.join(f'{x:g}' for x in first['latencies_ms'])} ms; the steady state of the same "
        f"shape (the next {first['steady_requests']} requests, in bursts of {r['slots']}): median "
        f"{first['steady_median_ms']:g} ms; slowest / median {first['worst_ratio']:g}x.",
        "",
        "| shape | tokens (mean) | concurrency | requests | p50 ms | p99 ms | p99/p50 | errors "
        "| CPU ms / request | recycles | peak PSS MB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(phase_line(p) for p in r["phases"]),
        "",
        *verdicts,
        "",
        f"![monsters]({(plots / 'monsters.png').as_posix()})",
        "",
    ]
