"""``shapegate bench soak``: hours of production in minutes, with nothing lost.

A ``shapegate serve`` process (so its memory is its own) in front of four time-scaled simulated
engines (two ``h100-fast``, two ``h100-heavy``, in this process), under open-loop traffic
(soak_traffic.py) for ``--minutes`` (or ``--seconds``):
- mixed lanes: 85% short prompts (fast lane), 15% prompts of 3k-12k tokens (heavy lane); 60%
  streaming; 8-80 output tokens;
- 20% of the clients reset their connection at a random moment (queued, prefill, decode or
  waiting for a plain answer);
- faults, about 10% of requests: every engine answers 4% of requests with a 500 and 3% with a
  429, and every few seconds one engine has an episode of a crash (restarting), a hang, a stall
  mid-stream, dropped connections or a slow first byte.

Every 100 ms it reads ``/admin/state`` and checks the invariant: no lane and no endpoint holds
more slots than its limit and no queue is longer than its depth; and it reads the gateway's
memory: the PSS of its process and its children (the tokenizer template and its counting child,
a page they share counted once; ``harness.tree_pss_mb``). At the end (arrivals stopped, clients
done) nothing may be held any more and no engine may still be generating for anybody; then
SIGTERM must stop the gateway with exit 0.

Figures (``<out>/soak.json``, printed as a table): requests, client outcomes, disconnects,
faults injected by kind, leaked slots, invariant checks and violations, peak slots in use,
memory (``memory_pss``: baseline after warm-up, final, peak, growth, slope), the gateway's
exit code. The exit
code is 0 when nothing leaked, the invariant held, memory stayed flat and the gateway exited 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import random
import signal
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from gateway.tools.bench.harness import Child, free_port, machine, start_gateway, write_json
from gateway.tools.bench.soak_traffic import (
    SOAK_HEALTH,
    SoakOptions,
    Tally,
    add_length_args,
    faults,
    memory_fit,
    seconds_of,
    soak_policy,
    traffic,
)

if TYPE_CHECKING:
    from engine_pool.sim.counting import PromptCounter

HEAVY_FROM = 2000  # prompt tokens
# Memory is flat when the post-warm-up growth stays under this (allocator noise, caches filling).
FLAT_MB = 24.0


def register(suites: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = suites.add_parser("soak", help="long mixed load with faults and disconnects")
    add_length_args(parser, rate=40.0)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    options = SoakOptions(seconds=seconds_of(args), rate=args.rate, seed=args.seed)
    result = asyncio.run(soak(options))
    path = write_json(Path(args.out), "soak", result)
    print(table(result))
    print(f"\nwritten: {path}")
    return 0 if result["passed"] else 1


def policy(fast: list[str], heavy: list[str], port: int) -> dict[str, Any]:
    clusters = [{"name": "fast", "endpoints": fast}, {"name": "heavy", "endpoints": heavy}]
    lanes = [
        {
            "name": "fast",
            "max_prompt_tokens": HEAVY_FROM,
            "clusters": ["fast"],
            "slots": {"lane": 32, "per_endpoint": 16},
            "queue": {"depth": 256, "max_wait_s": 10},
            "timeouts": {"connect_s": 1, "first_byte_s": 2, "idle_s": 1.5, "total_s": 30},
            "health": SOAK_HEALTH,
        },
        {
            "name": "heavy",
            "min_prompt_tokens": HEAVY_FROM,
            "max_prompt_tokens": 1_000_000,
            "clusters": ["heavy"],
            "slots": {"lane": 6, "per_endpoint": 3},
            "queue": {"depth": 64, "max_wait_s": 20},
            "timeouts": {
                "connect_s": 1,
                "first_byte_s": 3,
                "first_byte_per_1k_tokens_s": 0.1,
                "idle_s": 1.5,
                "total_s": 60,
            },
            "health": SOAK_HEALTH,
        },
    ]
    return soak_policy(port, clusters, lanes)


def held(state: dict[str, Any]) -> int:
    lanes = sum(lane["slots_in_use"] + lane["queue_depth"] for lane in state["lanes"])
    endpoints = sum(
        e["slots_in_use"] + e["in_flight"] for c in state["clusters"] for e in c["endpoints"]
    )
    return int(lanes + endpoints + state["in_flight"])


def check(state: dict[str, Any], per_endpoint: dict[str, int], tally: Tally) -> None:
    """The invariant, once: every count within its limit."""
    tally.checks += 1
    for lane in state["lanes"]:
        name = lane["name"]
        tally.peak[name] = max(tally.peak[name], lane["slots_in_use"])
        if lane["slots_in_use"] > lane["slot_limit"]:
            tally.violations.append(f"lane {name}: {lane['slots_in_use']} > {lane['slot_limit']}")
        if lane["queue_depth"] > lane["queue_limit"]:
            tally.violations.append(f"lane {name} queue: {lane['queue_depth']}")
    for cluster in state["clusters"]:
        for endpoint in cluster["endpoints"]:
            limit = per_endpoint[cluster["name"]]
            if endpoint["slots_in_use"] > limit:
                tally.violations.append(f"{endpoint['url']}: {endpoint['slots_in_use']} > {limit}")


async def _watch(url: str, gateway: Child, per_endpoint: dict[str, int], tally: Tally) -> None:
    """Every 100 ms until cancelled: the invariant, and the gateway's memory (PSS, with its
    children)."""
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            tick = time.monotonic()
            try:
                state = (await client.get(url + "/admin/state")).json()
            except httpx.HTTPError as exc:
                tally.violations.append(f"admin state unreadable: {type(exc).__name__}")
            else:
                check(state, per_endpoint, tally)
            tally.pss.append((tick - started, gateway.pss_mb()))
            await asyncio.sleep(max(0.0, 0.1 - (time.monotonic() - tick)))


def memory(samples: list[tuple[float, float]], seconds: float) -> dict[str, float]:
    """Baseline after warm-up (the first fifth, at least 5 s), final, peak, growth, slope."""
    return memory_fit(samples, max(5.0, seconds / 5))


async def soak(options: SoakOptions, counter: PromptCounter | None = None) -> dict[str, Any]:
    """Run one soak; ``counter`` shares an already loaded tokenizer with the engines."""
    from engine_pool.sim.profile import load_profile
    from engine_pool.sim.server import run_sim
    from gateway.tools.sim_support import RegistryCounter

    rng = random.Random(options.seed)
    profiles = ["h100-fast", "h100-fast", "h100-heavy", "h100-heavy"]
    counter = counter or RegistryCounter.for_profile(load_profile("h100-fast"))
    tally = Tally()
    info = machine()
    async with contextlib.AsyncExitStack() as stack:
        sims = [
            await stack.enter_async_context(
                run_sim(p, time_scale=options.time_scale, counter=counter, seed=options.seed + i)
            )
            for i, p in enumerate(profiles)
        ]
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-")))
        config = policy([s.url for s in sims[:2]], [s.url for s in sims[2:]], free_port())
        per_endpoint = {
            lane["clusters"][0]: lane["slots"]["per_endpoint"] for lane in config["lanes"]
        }
        gateway = await asyncio.to_thread(start_gateway, config, folder, None)
        url = f"http://127.0.0.1:{config['server']['port']}"
        try:
            started = time.monotonic()
            until = started + options.seconds
            watcher = asyncio.create_task(_watch(url, gateway, per_endpoint, tally))
            await asyncio.gather(
                traffic(url, options, rng, tally, until),
                faults(sims, options, rng, tally, until),
            )
            leaked, state = await _settle(url)
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            # Work an engine still does for nobody, and requests it never saw end.
            orphans = sum(s.engine.snapshot().running + s.engine.snapshot().waiting for s in sims)
            unclosed = sum(1 for s in sims for r in s.requests() if r.outcome == "running")
            injected = Counter[str]()
            for sim in sims:
                injected.update(sim.faults.injected)
            exit_code = await _sigterm(gateway)
        finally:
            gateway.stop()
        logged = _gateway_outcomes(gateway.log_path)
    mem = memory(tally.pss, options.seconds)
    passed = (
        leaked == 0
        and orphans == 0
        and unclosed == 0
        and not tally.violations
        and exit_code == 0
        and mem["growth_mb"] < FLAT_MB
    )
    return {
        "passed": passed,
        "seconds": round(time.monotonic() - started, 1),
        "options": dataclasses.asdict(options),
        "requests": tally.requests,
        "disconnects": tally.disconnects,
        "client_outcomes": dict(tally.outcomes.most_common()),
        "gateway_outcomes": logged,
        "faults_injected": sum(injected.values()),
        "faults_by_kind": dict(injected.most_common()),
        "fault_episodes": dict(tally.episodes),
        "fault_share": round(sum(injected.values()) / max(1, tally.requests), 3),
        "leaked_slots": leaked,
        "engine_orphans": orphans,
        "engine_records_unclosed": unclosed,
        "invariant_checks": tally.checks,
        "invariant_violations": tally.violations[:20],
        "peak_slots_in_use": dict(tally.peak),
        "slot_limits": {lane["name"]: lane["slot_limit"] for lane in state["lanes"]},
        "memory_pss": mem,
        "gateway_exit_code": exit_code,
        "machine": info,
    }


async def _settle(url: str, within_s: float = 5.0) -> tuple[int, dict[str, Any]]:
    """What the gateway still holds once traffic stopped (0 unless something leaked)."""
    deadline = time.monotonic() + within_s
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            state: dict[str, Any] = (await client.get(url + "/admin/state")).json()
            if held(state) == 0 or time.monotonic() > deadline:
                return held(state), state
            await asyncio.sleep(0.1)


async def _sigterm(gateway: Child, within_s: float = 20.0) -> int | None:
    gateway.process.send_signal(signal.SIGTERM)
    try:
        return await asyncio.to_thread(gateway.process.wait, within_s)
    except subprocess.TimeoutExpired:
        return None


def _gateway_outcomes(log: Path) -> dict[str, int]:
    """``route.finished`` outcomes and ``error.swallowed`` places, from the gateway's log."""
    counts: Counter[str] = Counter()
    for line in log.read_bytes().splitlines():
        if b'"route.finished"' not in line and b'"error.swallowed"' not in line:
            continue
        with contextlib.suppress(orjson.JSONDecodeError):
            event = orjson.loads(line)
            if event.get("event") == "route.finished":
                counts[event["outcome"]] += 1
            else:
                counts[f"swallowed:{event.get('where')}"] += 1
    return dict(counts.most_common())


def table(result: dict[str, Any]) -> str:
    mem = result["memory_pss"]
    rows = [
        ("requests", result["requests"]),
        ("disconnects (client resets)", result["disconnects"]),
        ("faults injected", f"{result['faults_injected']} ({result['fault_share']:.0%})"),
        ("  by kind", result["faults_by_kind"]),
        ("client outcomes", result["client_outcomes"]),
        ("gateway outcomes", result["gateway_outcomes"]),
        ("leaked slots", result["leaked_slots"]),
        ("engine requests left running", result["engine_orphans"]),
        ("engine requests never closed", result["engine_records_unclosed"]),
        (
            "invariant checks / violations",
            f"{result['invariant_checks']} / {len(result['invariant_violations'])}",
        ),
        (
            "peak slots in use (limit)",
            {
                k: f"{v} ({result['slot_limits'][k]})"
                for k, v in result["peak_slots_in_use"].items()
            },
        ),
        (
            "gateway PSS (with its children)",
            f"baseline {mem['baseline_mb']} MB, final {mem['final_mb']} MB, peak "
            f"{mem['peak_mb']} MB, growth {mem['growth_mb']} MB, {mem['slope_mb_per_min']} MB/min",
        ),
        ("gateway exit code after SIGTERM", result["gateway_exit_code"]),
        ("passed", result["passed"]),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"soak: {result['seconds']:g} s at {result['options']['rate']:g} requests/s"]
    lines += [f"  {name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)
