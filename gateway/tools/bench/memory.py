"""``shapegate bench memory``: the gateway's memory, idle, under traffic and attacked.

Set-up as ``overhead`` (``harness``): a real gateway in front of the fixed fast upstream, the
open-loop generator in this process. Memory is the proportional set size (PSS) of the gateway
process (every thread) plus its children's (the tokenizer template and its counting child): a
page the template shares with its child copy-on-write is counted once (resident memory summed
over them would count it in each: idle, 521 MB against 384 in one session). It is read:

1. ``imports``: a Python process that only imported the gateway (``gateway.edge.app``): the floor
   (its PSS, which alone is its resident memory but for the shared libraries' pages).
2. ``idle``: the gateway ready (tokenizers loaded at start-up, boot probe passed), no traffic.
3. ``traffic``: after every block of 10,000 requests (``--requests``, 100,000 by default; JSON
   and SSE blocks alternate) at ``--rate`` requests/s. The decision ring, metric children and
   caches are bounded, so memory must level off: ``growth`` is the last sample minus the one after
   the first fifth of the requests (allocator warm-up excluded). Flat means growth within
   ``FLAT_MB``.
4. ``adversarial``: ``--adversarial`` requests (5,000: about 190 MB) of unique random text above
   the exact-count threshold, random CJK then base64, so every one is tokenized and nothing
   repeats, at 100 requests/s; the peak PSS of each tenth is kept (sampled every 0.1 s).
   gigatoken 0.10.0 caches every new piece of text it encodes without a bound (+3 MB per MB of
   CJK, +5 per MB of base64); the gateway counts in a child process replaced past
   ``counting.max_encoder_rss_mb`` (its resident memory), so memory saw-tooths. Bounded means
   the peak over the second half of the text is no higher than over the first half.
``--smoke`` sends 2,000 requests and 10 adversarial ones of each kind.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    import numpy as np

from gateway.extras import optional, save, side_by_side
from gateway.tools.bench.harness import (
    Child,
    gateway_rig,
    machine,
    machine_line,
    package_version,
    publish,
    with_targets,
)
from gateway.tools.bench.httpload import new_event_loop, open_loop
from gateway.tools.bench.overhead import BODIES, PATH

BLOCK = 10_000
FLAT_MB = 5.0
# Above the demo policy's exact-count threshold (32,768 tokens' worth of bytes), below its fast
# lane's ceiling in tokens: every such request is counted exactly and answered.
ADVERSARIAL_BYTES = 40_000
ADVERSARIAL_RATE = 100  # requests/s: each is an exact count of ~40 kB (a few ms of CPU)


def register(suites: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = suites.add_parser("memory", help="gateway PSS idle, after traffic, under attack")
    parser.add_argument("--out", default="bench-results", help="folder for memory.json/png")
    parser.add_argument(
        "--requests", type=int, default=100_000, help="requests sent while PSS is sampled"
    )
    parser.add_argument("--rate", type=int, default=800, help="requests/s while filling")
    parser.add_argument(
        "--adversarial", type=int, default=5000, help="unique-text requests of each kind"
    )
    parser.add_argument("--smoke", action="store_true", help="2,000 requests, 10 adversarial")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    result = measure(
        requests=2_000 if args.smoke else args.requests,
        block=500 if args.smoke else BLOCK,
        rate=args.rate,
        adversarial=10 if args.smoke else args.adversarial,
        smoke=args.smoke,
        pin=not args.no_pin,
    )
    return publish(args.out, "memory", result, table(result), lambda png: plot(result, png))


def _imports_pss_mb() -> float:
    code = (
        "import gateway.edge.app, gateway.edge.server\n"
        "print(next(int(l.split()[1]) for l in open('/proc/self/smaps_rollup') "
        "if l.startswith('Pss:')) / 1024)"
    )
    done = subprocess.run(  # noqa: S603 - our own interpreter
        [sys.executable, "-c", code], capture_output=True, check=True, timeout=120
    )
    return round(float(done.stdout.strip()), 1)


def _adversarial_bodies(kind: str, n: int, rng: np.random.Generator) -> tuple[list[bytes], int]:
    """``n`` chat bodies of unique random text (CJK or base64) and their total text bytes."""
    bodies, size = [], 0
    for _ in range(n):
        if kind == "cjk":
            points = rng.integers(0x4E00, 0x9FFF, ADVERSARIAL_BYTES // 3, dtype="uint32")
            text = points.astype("<u4").tobytes().decode("utf-32-le")
        else:
            text = base64.b64encode(rng.bytes(ADVERSARIAL_BYTES * 3 // 4)).decode()
        size += len(text.encode())
        bodies.append(
            orjson.dumps(
                {
                    "model": "qwen3.6",
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": text}],
                }
            )
        )
    return bodies, size


def measure(
    *, requests: int, block: int, rate: int, adversarial: int, smoke: bool, pin: bool
) -> dict[str, Any]:
    info = machine()
    imports = _imports_pss_mb()
    with gateway_rig(pin) as rig, asyncio.Runner(loop_factory=new_event_loop()) as runner:
        result = runner.run(
            _measure(rig.gateway, rig.gateway_port, requests, block, rate, adversarial)
        )
    result.update(
        suite="memory",
        smoke=smoke,
        machine=info,
        imports_pss_mb=imports,
        tokenizer_package={name: package_version(name) for name in ("gigatoken", "tokenizers")},
    )
    result["targets"] = targets(result)
    return result


async def _measure(
    gateway: Child, port: int, requests: int, block: int, rate: int, adversarial: int
) -> dict[str, Any]:
    await asyncio.sleep(1.0)
    idle = round(gateway.pss_mb(), 1)
    curve = [{"requests": 0, "pss_mb": idle}]
    sent = errors = 0
    started = time.perf_counter()
    shapes = list(BODIES)
    while sent < requests:
        n = min(block, requests - sent)
        shape = shapes[(sent // block) % len(shapes)]
        run = await open_loop("127.0.0.1", port, PATH, BODIES[shape], rate, n / rate)
        sent += run.sent
        errors += run.errors
        curve.append({"requests": sent, "pss_mb": round(gateway.pss_mb(), 1)})
    fill_s = time.perf_counter() - started
    warm = next(p for p in curve if p["requests"] >= requests // 5)
    growth = round(curve[-1]["pss_mb"] - warm["pss_mb"], 1)

    np = optional("numpy")
    rng = np.random.default_rng(9)
    attacks = []
    for kind in ("cjk", "base64"):
        before = gateway.pss_mb()
        text_mb = 0.0
        failed = 0
        points = []
        blocks = 10 if adversarial >= 100 else 1
        for _ in range(blocks):
            bodies, size = _adversarial_bodies(kind, adversarial // blocks, rng)
            text_mb += size / 2**20
            result, peak = await _with_peak(
                gateway,
                open_loop(
                    "127.0.0.1",
                    port,
                    PATH,
                    bodies,
                    ADVERSARIAL_RATE,
                    len(bodies) / ADVERSARIAL_RATE,
                ),
            )
            failed += result.errors
            points.append(
                {
                    "text_mb": round(text_mb, 2),
                    "pss_mb": round(gateway.pss_mb(), 1),
                    "peak_pss_mb": round(peak, 1),
                }
            )
        grown = gateway.pss_mb() - before
        attacks.append(
            {
                "kind": kind,
                "requests": adversarial // blocks * blocks,
                "errors": failed,
                "prompt_bytes_each": ADVERSARIAL_BYTES,
                "text_mb": round(text_mb, 2),
                "pss_before_mb": round(before, 1),
                "pss_growth_mb": round(grown, 1),
                "pss_mb_per_text_mb": round(grown / text_mb, 2) if text_mb else None,
                "peak_pss_mb": max(p["peak_pss_mb"] for p in points),
                # peak over the second half of the text minus the first half's: ~0 when bounded
                "pss_growth_second_half_mb": round(
                    max(p["peak_pss_mb"] for p in points[len(points) // 2 :])
                    - max(p["peak_pss_mb"] for p in points[: len(points) // 2]),
                    1,
                )
                if len(points) >= 2
                else None,
                "curve": points,
            }
        )
    return {
        "idle_pss_mb": idle,
        "requests": sent,
        "errors": errors,
        "rate": rate,
        "fill_s": round(fill_s, 1),
        "curve": curve,
        "growth_after_warmup_mb": growth,
        "warm_point": warm,
        "flat_within_mb": FLAT_MB,
        "adversarial": attacks,
        "final_pss_mb": round(gateway.pss_mb(), 1),
    }


async def _with_peak(gateway: Child, work: Any) -> tuple[Any, float]:
    """Await ``work`` while sampling the gateway's PSS every 0.1 s; its result and the peak."""
    peak = gateway.pss_mb()

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, gateway.pss_mb())
            await asyncio.sleep(0.1)

    sampler = asyncio.get_running_loop().create_task(sample())
    try:
        result = await work
    finally:
        sampler.cancel()
    return result, max(peak, gateway.pss_mb())


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "target": f"PSS growth from {result['warm_point']['requests']} to "
            f"{result['requests']} requests, MB",
            "value": result["growth_after_warmup_mb"],
            "limit": FLAT_MB,
            "met": abs(result["growth_after_warmup_mb"]) <= FLAT_MB and result["errors"] == 0,
        },
        *(
            {
                "target": f"adversarial {a['kind']}: peak PSS over the second half of "
                f"{a['text_mb']} MB of unique text minus the first half's, MB (bounded: ~0)",
                "value": a["pss_growth_second_half_mb"],
                "limit": FLAT_MB,
                "met": a["pss_growth_second_half_mb"] is not None
                and a["pss_growth_second_half_mb"] <= FLAT_MB
                and a["errors"] == 0,
            }
            for a in result["adversarial"]
        ),
    ]


def table(result: dict[str, Any]) -> str:
    lines = [
        f"shapegate bench memory{' (SMOKE: figures not meaningful)' if result['smoke'] else ''}",
        machine_line(result["machine"]),
        f"tokenizer packages: {result['tokenizer_package']}",
        "",
        f"python + gateway imports only   {result['imports_pss_mb']:8.1f} MB",
        f"gateway idle, tokenizers loaded {result['idle_pss_mb']:8.1f} MB",
    ]
    for point in result["curve"][1:]:
        lines.append(f"after {point['requests']:>7} requests         {point['pss_mb']:8.1f} MB")
    lines.append(
        f"growth after warm-up ({result['warm_point']['requests']} -> {result['requests']} "
        f"requests, {result['errors']} errors, {result['rate']} requests/s): "
        f"{result['growth_after_warmup_mb']:+.1f} MB"
    )
    lines.append("")
    for a in result["adversarial"]:
        lines.append(
            f"adversarial {a['kind']:>6}: {a['requests']} requests of {a['prompt_bytes_each']} "
            f"bytes of unique text ({a['text_mb']} MB): PSS {a['pss_growth_mb']:+.1f} MB, "
            f"{a['pss_mb_per_text_mb']} MB per MB, peak {a['peak_pss_mb']} MB, second half's "
            f"peak {_signed(a['pss_growth_second_half_mb'])} MB over the first's "
            f"({a['errors']} errors)"
        )
    return with_targets(lines, result["targets"])


def plot(result: dict[str, Any], path: Path) -> None:
    fig, (ax_fill, ax_attack) = side_by_side(12, 4.2)
    curve = result["curve"]
    ax_fill.plot([p["requests"] for p in curve], [p["pss_mb"] for p in curve], marker="o")
    ax_fill.axhline(result["imports_pss_mb"], color="grey", linestyle=":", label="imports only")
    ax_fill.set_xlabel("requests served")
    ax_fill.set_ylabel("gateway PSS (with its children), MB")
    ax_fill.set_title("resident memory under ordinary traffic")
    ax_fill.set_ylim(bottom=0)
    ax_fill.legend(fontsize=8)
    for a in result["adversarial"]:
        ax_attack.plot(
            [0.0] + [p["text_mb"] for p in a["curve"]],
            [0.0] + [p["pss_mb"] - a["pss_before_mb"] for p in a["curve"]],
            marker="o",
            label=a["kind"],
        )
    ax_attack.set_xlabel("MB of unique prompt text counted")
    ax_attack.set_ylabel("PSS growth, MB")
    ax_attack.set_title("adversarial input: unique text above the exact-count threshold")
    ax_attack.legend(fontsize=8)
    save(fig, path)


def _signed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+}"
