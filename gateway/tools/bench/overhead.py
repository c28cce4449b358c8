"""``shapegate bench overhead``: what the gateway adds to a request, beside SGLang's Rust gateway.

Set-up (``harness``): the fixed fast upstream (``upstream.py``) (one process; JSON, or an SSE
stream of ``SSE_CHUNKS`` chunks), a real gateway (``shapegate serve``, uvloop + httptools, JSON
logs to a file) in front of it, smg (SGLang's model gateway, Rust, PyPI ``smg`` from the bench
extra: ``smg launch --policy round_robin`` with the upstream as its one worker) beside it, and the
generators of ``httpload`` in this process. With two or more CPUs both gateways are pinned to
the first CPU (one at a time is loaded) and the upstream and the generator to the second
(``--no-pin`` leaves placement to the kernel). Without smg installed its column is absent and
the goals against it say so.

Measured, in this order, in one run:
1. the generator's own ceiling: the upstream alone at rising rates; the highest rate at which
   every request succeeded, the schedule was kept (lag p50 under 1 ms) and p99 stayed under
   5 ms. The gateway figures mean something only well below it.
2. for each shape (JSON; SSE) and offered rate (100, 500, 1,000 requests/s), open loop: the
   upstream direct, then through smg, then through shapegate, ``--seconds`` each, after a short
   warm-up of each. Added latency = through a gateway minus direct, at p50 and p99 of the time
   to the last byte, from the same run; each gateway's CPU seconds per 1,000 requests from
   ``/proc/PID/stat``.
3. closed loop, per shape: ``--connections`` (64) keep-alive connections sending back to back
   for ``--seconds``, direct, through smg, through shapegate: requests/s on one core.
Goals (issue 21), each a ratio against smg in the same run: p99 at 100 requests/s within 3x of
p50; added p50 and p99 at 500 and 1,000 requests/s at most 1.5x smg's; no error at 1,000
requests/s; closed-loop throughput at least 50% of smg's. The absolute goals of issue 9 (added
p50 under 1 ms and p99 under 3 ms at 500 requests/s) are reported too. ``--smoke`` runs 0.3 s
at 50 and 200 requests/s and a 0.3 s closed loop on 8 connections, for the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from gateway.extras import save, side_by_side
from gateway.tools.bench.harness import (
    Child,
    gateway_rig,
    machine,
    machine_line,
    package_version,
    publish,
    with_targets,
)
from gateway.tools.bench.httpload import (
    LoadResult,
    closed_loop,
    new_event_loop,
    open_loop,
    percentile,
)

PATH = "/v1/chat/completions"
BODIES = {
    "json": b'{"model":"qwen3.6","max_tokens":16,"messages":[{"role":"system","content":'
    b'"You are terse."},{"role":"user","content":"Say hello in one word."}]}',
    "sse": b'{"model":"qwen3.6","max_tokens":20,"stream":true,"messages":[{"role":"system",'
    b'"content":"You are terse."},{"role":"user","content":"Count to twenty."}]}',
}
SSE_CHUNKS = 20  # the stream the issue measured: 20 content chunks, usage, [DONE]
CEILING_RATES = (2000, 3000, 4000, 6000)
TARGET_P50_MS, TARGET_P99_MS = 1.0, 3.0  # issue 9: added, at 500 requests/s
SUSTAIN_P99_S = 0.5  # a run "kept up": no error, schedule kept, p99 under this
# Issue 21, against smg in the same run.
TAIL_RATE, TAIL_RATIO = 100, 3.0  # p99 / p50 at a steady 100 requests/s
SMG_RATES, SMG_LATENCY_RATIO = (500, 1000), 1.5  # added p50 and p99 / smg's
ERROR_FREE_RATE = 1000
THROUGHPUT_SHARE = 0.5  # closed-loop requests/s / smg's
CLOSED_CONNECTIONS = 64
SIDES = ("direct", "smg", "gateway")  # "gateway" is shapegate


def register(suites: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = suites.add_parser("overhead", help="latency and CPU the gateway adds, beside smg")
    parser.add_argument("--out", default="bench-results", help="folder for overhead.json/png")
    parser.add_argument("--smoke", action="store_true", help="half a second at two low rates")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each run")
    parser.add_argument("--rates", default="100,500,1000", help="offered requests/s, commas")
    parser.add_argument(
        "--connections", type=int, default=CLOSED_CONNECTIONS, help="closed-loop connections"
    )
    parser.add_argument("--no-smg", action="store_true", help="leave smg out even if installed")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    result = measure(
        smoke=args.smoke,
        seconds=0.3 if args.smoke else args.seconds,
        rates=(50, 200) if args.smoke else tuple(int(r) for r in args.rates.split(",")),
        pin=not args.no_pin,
        connections=8 if args.smoke else args.connections,
        smg=not args.no_smg,
    )
    return publish(args.out, "overhead", result, table(result), lambda png: plot(result, png))


def _summary(result: LoadResult) -> dict[str, Any]:
    ms = 1000.0
    return {
        "offered_rps": result.rate,
        "sent": result.sent,
        "ok": result.ok,
        "errors": result.errors,
        "error_kinds": result.error_kinds,
        "achieved_rps": round(result.ok / result.elapsed, 1) if result.elapsed else 0.0,
        "p50_ms": round(percentile(result.total, 0.5) * ms, 3),
        "p99_ms": round(percentile(result.total, 0.99) * ms, 3),
        "ttfb_p50_ms": round(percentile(result.ttfb, 0.5) * ms, 3),
        "ttfb_p99_ms": round(percentile(result.ttfb, 0.99) * ms, 3),
        "lag_p50_ms": round(percentile(result.lag, 0.5) * ms, 3),
        "lag_p99_ms": round(percentile(result.lag, 0.99) * ms, 3),
        "connections": result.connections,
    }


def _clean(summary: dict[str, Any], p99_ms: float) -> bool:
    return bool(
        summary["errors"] == 0
        and summary["lag_p50_ms"] < 1.0
        and summary["p99_ms"] < p99_ms
        and summary["ok"] == summary["sent"]
    )


def _ratio(ours: float, theirs: float) -> float:
    """ours / theirs; a peer's added latency at or below zero (noise) counts as 0.01 ms."""
    return round(ours / max(theirs, 0.01), 2)


def measure(
    *,
    smoke: bool,
    seconds: float,
    rates: tuple[int, ...],
    pin: bool,
    connections: int = CLOSED_CONNECTIONS,
    smg: bool = True,
) -> dict[str, Any]:
    info = machine()
    with gateway_rig(pin, chunks=SSE_CHUNKS, smg=smg) as rig:
        ports = {"direct": rig.upstream_port, "gateway": rig.gateway_port}
        children = {"gateway": rig.gateway}
        if rig.smg is not None:
            ports["smg"], children["smg"] = rig.smg_port, rig.smg
        with asyncio.Runner(loop_factory=new_event_loop()) as runner:
            result = runner.run(_measure(ports, children, smoke, seconds, rates, connections))
        log_lines = (rig.folder / "gateway.log").read_bytes().count(b"\n")
        gateway_cpus, load_cpus = rig.gateway_cpus, rig.load_cpus
    result["gateway_log_lines"] = log_lines
    result.update(
        suite="overhead",
        smoke=smoke,
        machine=info,
        seconds_per_run=seconds,
        smg={
            "version": package_version("smg"),
            "measured": "smg" in result["sides"],
            "command": "smg launch --policy round_robin --worker-urls <upstream>",
        },
        sse_chunks=SSE_CHUNKS,
        placement={
            "gateway_cpus": sorted(gateway_cpus) if gateway_cpus else "any",
            "generator_and_upstream_cpus": sorted(load_cpus) if load_cpus else "any",
        },
    )
    result["targets"] = targets(result)
    return result


async def _measure(
    ports: dict[str, int],
    children: dict[str, Child],
    smoke: bool,
    seconds: float,
    rates: tuple[int, ...],
    connections: int,
) -> dict[str, Any]:
    sides = [side for side in SIDES if side in ports]
    ceiling_rates = (500,) if smoke else CEILING_RATES
    ceiling = []
    for rate in ceiling_rates:
        run = _summary(
            await open_loop("127.0.0.1", ports["direct"], PATH, BODIES["json"], rate, seconds)
        )
        ceiling.append(run)
        if not _clean(run, 5.0):
            break
    kept = [r["offered_rps"] for r in ceiling if _clean(r, 5.0)]
    rows = []
    requests = 0
    for shape, body in BODIES.items():
        for rate in rates:
            row: dict[str, Any] = {"shape": shape, "offered_rps": rate}
            for side in sides:
                # Warm each: its connections, caches, the upstream pool.
                await open_loop("127.0.0.1", ports[side], PATH, body, rate, min(1.0, seconds / 2))
                child = children.get(side)
                cpu_before = child.cpu_s() if child else 0.0
                run = _summary(await open_loop("127.0.0.1", ports[side], PATH, body, rate, seconds))
                row[side] = run
                if child is not None:
                    cpu = child.cpu_s() - cpu_before
                    row[f"{side}_cpu_s_per_1k"] = round(cpu / max(1, run["sent"]) * 1000, 3)
                    row[f"{side}_cpu_share"] = round(cpu / seconds, 3)
            requests += row["gateway"]["sent"]
            for side in sides[1:]:
                prefix = "" if side == "gateway" else f"{side}_"
                for q in ("p50", "p99"):
                    added = row[side][f"{q}_ms"] - row["direct"][f"{q}_ms"]
                    row[f"{prefix}added_{q}_ms"] = round(added, 3)
            if "smg" in sides:
                for q in ("p50", "p99"):
                    row[f"added_{q}_vs_smg"] = _ratio(
                        row[f"added_{q}_ms"], row[f"smg_added_{q}_ms"]
                    )
            rows.append(row)
    closed = []
    for shape, body in BODIES.items():
        point: dict[str, Any] = {"shape": shape, "connections": connections}
        for side in sides:
            loop = await closed_loop("127.0.0.1", ports[side], PATH, body, connections, seconds)
            point[side] = {**_summary(loop), "rps": loop.rate}
            await asyncio.sleep(0.2)
        if "smg" in sides:
            point["rps_vs_smg"] = round(point["gateway"]["rps"] / max(point["smg"]["rps"], 1), 3)
        closed.append(point)
    return {
        "generator_ceiling": {
            "highest_clean_rps": max(kept, default=0),
            "steps": ceiling,
            "rule": "all ok, lag p50 < 1 ms, p99 < 5 ms, upstream direct, one core shared "
            "with the upstream",
        },
        "sides": sides,
        "rows": rows,
        "closed_loop": closed,
        "gateway_requests_measured": requests,
    }


def _target(name: str, value: Any, limit: Any, met: bool) -> dict[str, Any]:
    return {"target": name, "value": value, "limit": limit, "met": bool(met)}


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 21's goals (against smg, same run), then issue 9's absolute ones."""
    out = []
    at = {(r["shape"], r["offered_rps"]): r for r in result["rows"]}
    with_smg = "smg" in result["sides"]
    for shape in BODIES:
        row = at.get((shape, TAIL_RATE))
        if row is not None:
            g = row["gateway"]
            tail = round(g["p99_ms"] / max(g["p50_ms"], 0.001), 2)
            out.append(
                _target(
                    f"{shape}: p99 / p50 at {TAIL_RATE} requests/s (shapegate)",
                    f"{tail} ({g['p99_ms']:.2f} / {g['p50_ms']:.2f} ms)",
                    f"<= {TAIL_RATIO:g}",
                    tail <= TAIL_RATIO and g["errors"] == 0,
                )
            )
        for rate in SMG_RATES:
            row = at.get((shape, rate))
            if row is None:
                continue
            for q in ("p50", "p99"):
                name = f"{shape}: added {q} at {rate} requests/s vs smg's"
                if not with_smg:
                    out.append(_target(name, "smg not measured", f"<= {SMG_LATENCY_RATIO}x", False))
                    continue
                value = row[f"added_{q}_vs_smg"]
                ours, theirs = row[f"added_{q}_ms"], row[f"smg_added_{q}_ms"]
                # A run whose queue kept growing (p99 past SUSTAIN_P99_S) did not keep up: a
                # ratio of two growing queues says nothing, so it never counts as met.
                kept_up = _clean(row["gateway"], SUSTAIN_P99_S * 1000)
                out.append(
                    _target(
                        name,
                        f"{value}x ({ours:.2f} vs {theirs:.2f} ms)"
                        + ("" if kept_up else "; shapegate did not keep up"),
                        f"<= {SMG_LATENCY_RATIO}x",
                        value <= SMG_LATENCY_RATIO and kept_up,
                    )
                )
        row = at.get((shape, ERROR_FREE_RATE))
        if row is not None:
            g = row["gateway"]
            out.append(
                _target(
                    f"{shape}: errors at {ERROR_FREE_RATE} requests/s (shapegate)",
                    f"{g['errors']} errors of {g['sent']}, p99 {g['p99_ms']:.1f} ms",
                    "0 errors",
                    g["errors"] == 0 and g["ok"] == g["sent"],
                )
            )
    for point in result["closed_loop"]:
        name = (
            f"{point['shape']}: closed-loop requests/s on one core ({point['connections']} "
            "connections) vs smg's"
        )
        if not with_smg:
            out.append(_target(name, "smg not measured", f">= {THROUGHPUT_SHARE:.0%}", False))
            continue
        share = point["rps_vs_smg"]
        out.append(
            _target(
                name,
                f"{share:.0%} ({point['gateway']['rps']:.0f} vs {point['smg']['rps']:.0f})",
                f">= {THROUGHPUT_SHARE:.0%}",
                share >= THROUGHPUT_SHARE,
            )
        )
    for shape in BODIES:
        row = at.get((shape, 500))
        if row is not None:
            ok = row["gateway"]["errors"] == 0
            for q, limit in (("p50", TARGET_P50_MS), ("p99", TARGET_P99_MS)):
                value = row[f"added_{q}_ms"]
                out.append(
                    _target(
                        f"{shape}: added {q} at 500 requests/s, ms (issue 9)",
                        value,
                        limit,
                        value < limit and ok,
                    )
                )
    return out


def _cell(summary: dict[str, Any] | None) -> str:
    return "-" if summary is None else f"{summary['p50_ms']:.2f} / {summary['p99_ms']:.2f}"


def table(result: dict[str, Any]) -> str:
    lines = [
        f"shapegate bench overhead{' (SMOKE: figures not meaningful)' if result['smoke'] else ''}",
        machine_line(result["machine"]),
        f"placement: gateways on cpus {result['placement']['gateway_cpus']}, generator and "
        f"upstream on {result['placement']['generator_and_upstream_cpus']}; "
        f"{result['seconds_per_run']:g} s per run; smg {result['smg']['version']}"
        f"{'' if result['smg']['measured'] else ' (not measured)'}",
        f"load generator alone against the upstream: clean up to "
        f"{result['generator_ceiling']['highest_clean_rps']} requests/s",
        "",
        "p50 / p99 ms, time to the last byte, open loop",
        f"{'shape':>5} {'rps':>5} {'direct':>15} {'smg':>15} {'shapegate':>15} "
        f"{'added vs smg p50':>16} {'p99':>6} {'errors':>6} {'cpu s/1k':>8}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['shape']:>5} {r['offered_rps']:>5} {_cell(r['direct']):>15} "
            f"{_cell(r.get('smg')):>15} {_cell(r['gateway']):>15} "
            f"{r.get('added_p50_vs_smg', '-'):>15}x {r.get('added_p99_vs_smg', '-'):>5}x "
            f"{r['gateway']['errors']:>6} {r['gateway_cpu_s_per_1k']:>8.3f}"
        )
    lines += ["", "closed loop, requests/s"]
    for point in result["closed_loop"]:
        cells = ", ".join(f"{side} {point[side]['rps']:.0f}" for side in SIDES if side in point)
        lines.append(f"{point['shape']:>5} {point['connections']} connections: {cells}")
    return with_targets(lines, result["targets"])


def plot(result: dict[str, Any], path: Path) -> None:
    fig, (ax_lat, ax_rps) = side_by_side(12, 4.2)
    for shape, marker in (("json", "o"), ("sse", "s")):
        rows = [r for r in result["rows"] if r["shape"] == shape]
        rates = [r["offered_rps"] for r in rows]
        for prefix, who in (("", "shapegate"), ("smg_", "smg")):
            if who == "smg" and "smg" not in result["sides"]:
                continue
            for q, style in (("p50", "-"), ("p99", "--")):
                ax_lat.plot(
                    rates,
                    [max(r[f"{prefix}added_{q}_ms"], 0.01) for r in rows],
                    style,
                    marker=marker,
                    label=f"{who} {shape} {q}",
                )
    ax_lat.set_yscale("log")
    ax_lat.set_xlabel("offered requests/s (open loop)")
    ax_lat.set_ylabel("added latency, ms (gateway minus direct, log)")
    ax_lat.set_title("latency each gateway adds, one core each")
    ax_lat.legend(fontsize=7)
    points = result["closed_loop"]
    sides = [s for s in SIDES if s in result["sides"]]
    width = 0.8 / max(1, len(sides))
    for i, side in enumerate(sides):
        ax_rps.bar(
            [j + i * width for j in range(len(points))],
            [p[side]["rps"] for p in points],
            width,
            label="shapegate" if side == "gateway" else side,
        )
    ax_rps.set_xticks([j + width for j in range(len(points))], [p["shape"] for p in points])
    ax_rps.set_ylabel("requests/s, closed loop")
    ax_rps.set_title(f"throughput on one core ({points[0]['connections']} connections)")
    ax_rps.legend(fontsize=8)
    save(fig, path)
