"""``shapegate bench monsters``: sustained unique monster prompts through a real gateway.

Set-up: the fixed fast upstream (``upstream.py``) and ``shapegate serve`` (the overhead suite's
policy with the heavy lane's slots at ``--slots`` and ``counting.max_encoder_rss_mb`` at
``--max-rss-mb``), the gateway and its tokenizer child pinned to one core, this process and
the upstream to the other when there are two. Every prompt is a chat request no cache holds
(``texts.py``: prose, code, JSON, random letters, CJK; each text different), so every one is
counted exactly by the tokenizer child; the upstream answers at once, so a latency is the
gateway's own: read, parse, count, route, forward.

Measured in one run, in this order:

1. ``first burst``: right after ``/readyz`` answers 200, ``--slots`` concurrent unique prose
   prompts of ``--tokens`` tokens (default 4 x 200k); then ``--bursts`` more bursts of the same
   shape, whose median latency is the steady state. Target: each request of the first burst
   within 2x that median (issue 31: 1.35 s against 37 ms, 36x, before the boot rehearsal).
2. ``phases``: for each shape and size, ``--requests`` requests (``--big-requests`` at 1M
   tokens; enough that the p99 is not simply the slowest one) at a closed-loop concurrency (4
   at 200k, 2 at 1M): latency p50/p99, errors, CPU per request
   (the gateway process, its live tokenizer child and the children it reaped: replaced ones),
   the tokenizer child's recycles in that phase (``tokenizer.recycled`` in the gateway's log)
   and their load times, and the peak resident memory of the gateway with its tokenizer
   children (two of them while a replacement loads). Targets: p99 within 3x p50 and no error
   in every phase; at least 3 recycles in the run; CPU per unique 200k-token prose request
   at most 10 ms.

The bound is 256 MB by default here (the setting's default is 384), so vocabulary-hostile text
recycles the child several times within a run of a few minutes; ``--max-rss-mb 384`` measures
the default. ``--smoke`` runs tiny prompts (40k tokens, 2 shapes, 4 requests) for the suite.
Writes ``<out>/monsters.json`` and ``.png`` (its targets, table and plot: monsters_report.py);
``shapegate bench readme`` puts its table in the README.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from gateway.tools.bench.harness import (
    Child,
    descendants,
    free_port,
    gateway_policy,
    machine,
    pin_self,
    publish,
    start_gateway,
    start_upstream,
    tree_pss_mb,
    two_core_plan,
)
from gateway.tools.bench.httpload import percentile
from gateway.tools.bench.monsters_report import phase_line, plot, table, targets
from gateway.tools.bench.texts import SHAPES, Texts

PATH = "/v1/chat/completions"


def register(suites: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = suites.add_parser(
        "monsters", help="sustained unique monster prompts: latency, CPU, tokenizer recycles"
    )
    parser.add_argument("--out", default="bench-results", help="folder for monsters.json/png")
    parser.add_argument("--smoke", action="store_true", help="tiny prompts, for the suite")
    parser.add_argument("--tokens", type=int, default=200_000, help="first burst's prompt size")
    parser.add_argument("--slots", type=int, default=4, help="heavy lane slots = burst size")
    parser.add_argument("--bursts", type=int, default=6, help="steady bursts after the first")
    parser.add_argument("--requests", type=int, default=100, help="requests a 200k phase")
    parser.add_argument("--big-requests", type=int, default=40, help="requests a 1M phase")
    parser.add_argument("--max-rss-mb", type=float, default=256.0, help="the child's bound")
    parser.add_argument("--no-pin", action="store_true", help="leave every process unpinned")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.smoke:
        plan = Plan(40_000, 4, 2, 4, [("prose", 40_000, 4), ("letters", 40_000, 4)])
    else:
        big = args.big_requests
        phases = [(shape, 200_000, args.requests) for shape in SHAPES]
        phases += [(shape, 1_000_000, big) for shape in ("prose", "letters", "cjk")]
        plan = Plan(args.tokens, args.slots, args.bursts, args.requests, phases)
    result = measure(plan, max_rss_mb=args.max_rss_mb, pin=not args.no_pin, smoke=args.smoke)
    return publish(args.out, "monsters", result, table(result), lambda p: plot(result, p))


@dataclass(frozen=True, slots=True)
class Plan:
    tokens: int  # the first burst's prompt size
    slots: int  # the heavy lane's slots: the burst's size
    bursts: int  # steady bursts after the first
    requests: int
    phases: list[tuple[str, int, int]]  # (shape, tokens, requests)


# -- load ----------------------------------------------------------------------------------------


async def _post(port: int, body: bytes) -> tuple[float, int, int, float]:
    """One request on a fresh connection: (seconds to the whole answer, status, exact tokens,
    when it started, Unix time: the gateway log's clock)."""
    at = time.time()
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = (
            f"POST {PATH} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        ).encode()
        writer.write(head + body)
        await writer.drain()
        answer = await reader.read()
    finally:
        writer.close()
    seconds = time.perf_counter() - started
    head_end = answer.find(b"\r\n\r\n")
    lines = answer[:head_end].split(b"\r\n")
    status = int(lines[0].split()[1]) if lines and lines[0] else 0
    tokens = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"x-shapegate-prompt-tokens":
            tokens = int(value.strip())
    return seconds, status, tokens, at


Sample = tuple[float, int, int, float]


async def _burst(port: int, bodies: list[bytes]) -> list[Sample]:
    return list(await asyncio.gather(*(_post(port, body) for body in bodies)))


async def _closed(
    port: int, bodies: list[bytes], concurrency: int, rss: list[float], pid: int
) -> list[Sample]:
    """The closed loop; ``rss`` gets the gateway's resident memory with its tokenizer children
    (``harness.tree_pss_mb``: the tokenizer template's pages shared with its counting children
    counted once) after every answer: two children during a recycle show there."""
    todo = list(reversed(bodies))
    done: list[Sample] = []

    async def client() -> None:
        while todo:
            done.append(await _post(port, todo.pop()))
            rss.append(tree_pss_mb(pid))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done


# -- the gateway's CPU and recycles ---------------------------------------------------------------


def _cpu_s(pid: int) -> float:
    """The gateway's CPU seconds: of it and every live descendant (the tokenizer template and
    its counting children), each with the time of the children it reaped (the replaced
    counting children are the template's, reaped by it)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for current in descendants(pid):
        try:
            with open(f"/proc/{current}/stat", encoding="ascii") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited between two reads: its time is in its parent's reaped total soon
        total += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return total / ticks


def _recycles(log: Path) -> list[float]:
    """Load seconds of every ``tokenizer.recycled`` event in the gateway's JSON log so far."""
    loads = []
    for line in log.read_bytes().splitlines():
        if b"tokenizer.recycled" in line:
            loads.append(float(orjson.loads(line).get("load_s", 0.0)))
    return loads


def _windows(log: Path, since: float) -> list[list[float]]:
    """[s after ``since``] of each ``tokenizer.recycle_started`` and ``tokenizer.recycled`` in
    the gateway's log after ``since``: when a replacement was loading."""
    from datetime import datetime

    found = []
    for line in log.read_bytes().splitlines():
        if b"tokenizer.recycle" not in line:
            continue
        event = orjson.loads(line)
        at = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
        if at >= since:
            found.append(
                [round(at - since, 2), 1.0 if event["event"] == "tokenizer.recycled" else 0.0]
            )
    return found


def _timeline(samples: list[Sample], since: float) -> list[list[float]]:
    """[start s after ``since``, latency ms] of each request, by start: a slow one can be set
    against the recycle it overlapped."""
    return [
        [round(at - since, 2), round(s * 1000, 1)]
        for s, _, _, at in sorted(samples, key=lambda x: x[3])
    ]


# -- the run ------------------------------------------------------------------------------------


def _stats(samples: list[Sample], cpu_s: float) -> dict[str, Any]:
    ok = [s for s, status, *_ in samples if status == 200]
    p50 = percentile(ok, 0.5) * 1000 if ok else 0.0
    p99 = percentile(ok, 0.99) * 1000 if ok else 0.0
    return {
        "requests": len(samples),
        "errors": sum(1 for _, status, *_ in samples if status != 200),
        "tokens_mean": round(statistics.fmean(t for _, _, t, _ in samples)) if samples else 0,
        "p50_ms": round(p50, 1),
        "p99_ms": round(p99, 1),
        "tail_ratio": round(p99 / p50, 2) if p50 else None,
        "cpu_ms_per_request": round(cpu_s * 1000 / max(1, len(samples)), 2),
    }


def measure(plan: Plan, *, max_rss_mb: float, pin: bool, smoke: bool) -> dict[str, Any]:
    gateway_cpus, load_cpus = two_core_plan(pin)
    restore = pin_self(load_cpus)
    texts = Texts.load()
    result: dict[str, Any] = {"machine": machine(), "smoke": smoke, "max_rss_mb": max_rss_mb}
    result["slots"], result["burst_tokens"] = plan.slots, plan.tokens
    try:
        with tempfile.TemporaryDirectory(prefix="shapegate-bench-") as tmp:
            folder = Path(tmp)
            upstream, upstream_port = start_upstream(folder, load_cpus)
            gateway: Child | None = None
            try:
                port = free_port()
                policy = gateway_policy(upstream_port, port)
                policy["lanes"][1]["slots"] = {"lane": plan.slots, "per_endpoint": plan.slots}
                policy["lanes"][1]["queue"] = {"depth": 64, "max_wait_s": 120}
                policy["counting"] = {"max_encoder_rss_mb": max_rss_mb}
                gateway = start_gateway(policy, folder, gateway_cpus)
                result.update(_run(plan, texts, port, gateway, folder / "gateway.log"))
            finally:
                if gateway is not None:
                    gateway.stop()
                upstream.stop()
    finally:
        pin_self(restore)
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    result["targets"] = targets(result)
    return result


def _run(plan: Plan, texts: Texts, port: int, gateway: Child, log: Path) -> dict[str, Any]:
    def bodies(shape: str, tokens: int, count: int) -> list[bytes]:
        return [_body(texts.unique(shape, tokens)) for _ in range(count)]

    out: dict[str, Any] = {}
    first_bodies = bodies("prose", plan.tokens, plan.slots)  # made before the clock starts
    first = asyncio.run(_burst(port, first_bodies))
    steady: list[Sample] = []
    for _ in range(plan.bursts):
        steady += asyncio.run(_burst(port, bodies("prose", plan.tokens, plan.slots)))
    median = statistics.median(s for s, status, *_ in steady if status == 200) * 1000
    out["first_burst"] = {
        "latencies_ms": [round(s * 1000, 1) for s, *_ in first],
        "statuses": [status for _, status, *_ in first],
        "tokens": [t for _, _, t, _ in first],
        "steady_median_ms": round(median, 1),
        "steady_requests": len(steady),
        "worst_ratio": round(max(s for s, *_ in first) * 1000 / median, 2),
    }
    phases = []
    for shape, tokens, requests in plan.phases:
        concurrency = 4 if tokens <= 200_000 else 2
        made = bodies(shape, tokens, requests)
        before_cpu, before_recycles = _cpu_s(gateway.pid), len(_recycles(log))
        since = time.time()
        rss: list[float] = []
        samples = asyncio.run(_closed(port, made, concurrency, rss, gateway.pid))
        cpu = _cpu_s(gateway.pid) - before_cpu
        loads = _recycles(log)[before_recycles:]
        phase = {"shape": shape, "tokens": tokens, "concurrency": concurrency}
        phase |= _stats(samples, cpu)
        phase |= {"recycles": len(loads), "recycle_load_s": loads}
        phase["peak_pss_mb"] = round(max(rss, default=0.0), 1)
        phase["timeline"] = _timeline(samples, since)
        phase["recycle_events"] = _windows(log, since)  # [s, 0 started / 1 taken over]
        phases.append(phase)
        print(phase_line(phase), flush=True)
    out["phases"] = phases
    out["recycles"] = sum(p["recycles"] for p in phases)
    return out


def _body(text: str) -> bytes:
    return orjson.dumps(
        {"model": "qwen3.6", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}
    )
