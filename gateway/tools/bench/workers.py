"""``shapegate bench workers``: closed-loop throughput of ``serve --workers N``, N = 1 and 2.

Set-up: the fixed fast upstream (``upstream.py``) (one process), ``shapegate serve --workers N``
in front of it (the overhead suite's policy: one lane, limits far above the load, memory slots,
which with N > 1 are the supervisor's slot server), and a closed-loop generator in this process:
``--connections`` keep-alive connections, each sending the next request (the small JSON chat
completion) as soon as the previous one answered, for ``--seconds`` after a one-second warm-up.
Nothing is pinned: N workers need N cores, and the generator and upstream share them (on a
two-core machine that is the honest set-up; the figures say what a second worker adds here).

Measured in one run, in this order: the upstream direct (the rig's own ceiling), then the
gateway with 1 worker, then with 2. Per point: requests/s, p50 and p99 latency, errors, and the
gateway's CPU seconds per 1,000 requests (the supervisor and every worker) and the supervisor's
share of it (with 2 workers it is the slot server). The scaling is
requests/s at 2 workers over 1 worker, from the same run. ``--smoke`` runs half a second per
point with 8 connections, for the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway.extras import save, side_by_side
from gateway.tools.bench.harness import (
    Child,
    free_port,
    gateway_policy,
    machine,
    machine_line,
    publish,
    start_upstream,
    wait_http,
)
from gateway.tools.bench.httpload import LoadResult, closed_loop, new_event_loop, percentile

PATH = "/v1/chat/completions"
BODY = (
    b'{"model":"qwen3.6","max_tokens":16,"messages":[{"role":"system","content":'
    b'"You are terse."},{"role":"user","content":"Say hello in one word."}]}'
)
WARMUP_S = 1.0


def register(suites: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = suites.add_parser(
        "workers", help="closed-loop throughput of serve --workers 1 and 2, and the scaling"
    )
    parser.add_argument("--out", default="bench-results", help="folder for workers.json/png")
    parser.add_argument("--smoke", action="store_true", help="half a second a point")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds a point")
    parser.add_argument("--connections", type=int, default=64, help="closed-loop connections")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    seconds, connections = (0.5, 8) if args.smoke else (args.seconds, args.connections)
    result = measure(seconds=seconds, connections=connections, smoke=args.smoke)
    return publish(args.out, "workers", result, table(result), lambda p: plot(result, p))


# -- the closed-loop generator -----------------------------------------------------------------


def _closed(runner: asyncio.Runner, port: int, connections: int, seconds: float) -> LoadResult:
    """httpload's closed loop against ``port`` after a warm-up of ``WARMUP_S`` (not measured)."""
    runner.run(closed_loop("127.0.0.1", port, PATH, BODY, connections, WARMUP_S))
    return runner.run(closed_loop("127.0.0.1", port, PATH, BODY, connections, seconds))


def _point(run: LoadResult) -> dict[str, Any]:
    return {
        "requests": run.ok,
        "rps": round(run.rate, 1),
        "p50_ms": round(percentile(run.total, 0.5) * 1000, 3),
        "p99_ms": round(percentile(run.total, 0.99) * 1000, 3),
        "errors": run.errors,
    }


# -- the rig -----------------------------------------------------------------------------------


def own_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of one process, every thread (Linux /proc)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its live descendants."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            total += own_cpu_s(current)
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children", "rb") as children:
                    todo.extend(int(c) for c in children.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue  # it exited between two reads
    return total


def start_workers(folder: Path, upstream_port: int, count: int) -> tuple[Child, int]:
    import yaml

    port = free_port()
    path = folder / f"gateway-{count}.yaml"
    path.write_text(yaml.safe_dump(gateway_policy(upstream_port, port)), encoding="utf-8")
    argv = [sys.executable, "-m", "gateway.tools.cli", "serve", "--config", str(path)]
    argv += ["--workers", str(count)]
    child = Child.start(f"gateway-{count}", argv, folder / f"gateway-{count}.log", None)
    wait_http(f"http://127.0.0.1:{port}/readyz", child, 60.0)
    if count > 1:  # every worker up, not only the first to answer
        deadline = time.monotonic() + 60
        while _answering(port) < count and time.monotonic() < deadline:
            time.sleep(0.1)
    return child, port


def _answering(port: int) -> int:
    import urllib.request

    import orjson

    url = f"http://127.0.0.1:{port}/admin/state"
    with urllib.request.urlopen(url, timeout=5) as response:
        return len(orjson.loads(response.read()).get("workers", []))


def measure(*, seconds: float, connections: int, smoke: bool) -> dict[str, Any]:
    result: dict[str, Any] = {
        "machine": machine(),
        "smoke": smoke,
        "seconds": seconds,
        "connections": connections,
    }
    with tempfile.TemporaryDirectory(prefix="shapegate-bench-") as tmp:
        folder = Path(tmp)
        upstream, upstream_port = start_upstream(folder, None)
        try:
            with asyncio.Runner(loop_factory=new_event_loop()) as runner:
                result["direct"] = _point(_closed(runner, upstream_port, connections, seconds))
                points = []
                for count in (1, 2):
                    gateway, port = start_workers(folder, upstream_port, count)
                    try:
                        runner.run(
                            closed_loop("127.0.0.1", port, PATH, BODY, connections, WARMUP_S)
                        )
                        cpu_before = tree_cpu_s(gateway.pid)
                        supervisor_before = own_cpu_s(gateway.pid)
                        run = runner.run(
                            closed_loop("127.0.0.1", port, PATH, BODY, connections, seconds)
                        )
                        cpu = tree_cpu_s(gateway.pid) - cpu_before
                        supervisor = own_cpu_s(gateway.pid) - supervisor_before
                    finally:
                        gateway.stop()
                    point = {"workers": count, **_point(run)}
                    point["cpu_s_per_1k"] = round(cpu / max(1, run.ok) * 1000, 3)
                    # With 2 workers the supervisor is the slot server: its share of the CPU.
                    # (With 1 worker there is no supervisor: serve runs the gateway itself.)
                    shared = count > 1 and cpu > 0
                    point["supervisor_cpu_share"] = round(supervisor / cpu, 3) if shared else None
                    points.append(point)
        finally:
            upstream.stop()
    result["points"] = points
    one, two = points[0]["rps"], points[1]["rps"]
    result["scaling"] = round(two / one, 3) if one else None
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return result


def table(result: dict[str, Any]) -> str:
    lines = [
        machine_line(result["machine"]),
        f"closed loop, {result['connections']} connections, {result['seconds']:g} s a point",
        "",
        "| | req/s | p50 ms | p99 ms | errors | gateway CPU s / 1k req |",
        "|---|---|---|---|---|---|",
    ]
    d = result["direct"]
    lines.append(
        f"| upstream direct | {d['rps']:,} | {d['p50_ms']} | {d['p99_ms']} | {d['errors']} | - |"
    )
    for p in result["points"]:
        lines.append(
            f"| shapegate, {p['workers']} worker{'s' if p['workers'] > 1 else ''} | "
            f"{p['rps']:,} | {p['p50_ms']} | {p['p99_ms']} | {p['errors']} | {p['cpu_s_per_1k']} |"
        )
    share = result["points"][-1]["supervisor_cpu_share"]
    lines += [
        "",
        f"scaling, 2 workers over 1: {result['scaling']}x",
        f"the supervisor (slot server) at 2 workers: {share:.1%} of the gateway's CPU"
        if share is not None
        else "",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    fig, (ax_rps, ax_lat) = side_by_side(10, 3.8)
    names = ["direct", *(f"{p['workers']} worker(s)" for p in result["points"])]
    rows = [result["direct"], *result["points"]]
    ax_rps.bar(names, [r["rps"] for r in rows], color=["grey", "tab:blue", "tab:green"])
    ax_rps.set_ylabel("requests/s (closed loop)")
    ax_rps.set_title(f"throughput; 2 workers / 1 = {result['scaling']}x")
    ax_lat.bar(names, [r["p99_ms"] for r in rows], color=["grey", "tab:blue", "tab:green"])
    ax_lat.set_ylabel("p99 ms")
    ax_lat.set_title("latency at that load")
    save(fig, path)
