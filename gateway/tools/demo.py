"""``shapegate demo``: two simulated clusters and the gateway in front, from one command.

Starts four simulated vLLM engines (each cluster's ``sim_profile``: ``fast``, two ``h100-fast``;
``heavy``, two ``h100-heavy``),
then the gateway with ``configs/demo.yaml`` (endpoints and ports rewritten to the ones chosen),
prints the URLs and runs until Ctrl-C or SIGTERM, stopping every child. ``--burst`` also plays
traffic shaped like production (mostly ~3k-token prompts with ~37 output tokens, plus a few
100k-700k-token monsters) and prints what each lane did. No network, GPU, Redis or Docker.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.edge.admin.guard import reload_command
from gateway.shipped import configs_dir


def demo_config(port: int, engine_base: int) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((configs_dir() / "demo.yaml").read_text())
    config["server"]["port"] = port
    for i, cluster in enumerate(config["clusters"]):
        cluster["endpoints"] = [f"http://127.0.0.1:{engine_base + 10 * i + k}" for k in (1, 2)]
    return config


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as handle:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(  # noqa: S603 - our own interpreter and fixed arguments
            [sys.executable, "-m", "gateway.tools.cli", *args],
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


class DemoError(Exception):
    """The demo cannot start; the message says which port or process, and why."""


def taken_ports(ports: Mapping[int, str]) -> list[str]:
    """The ports (with what they were for) another process already listens on.

    The probe binds as a server does, with ``SO_REUSEADDR``: connections left in TIME_WAIT by
    a demo that just stopped (the gateway's keep-alive connections to its engines) do not make
    a port look taken, and the demo can start again at once; a socket listening on the port
    (or bound to it without ``SO_REUSEADDR``) still refuses the bind, and the port is named.
    """
    taken = []
    for port, role in ports.items():
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                taken.append(f"{port} ({role})")
    return taken


def _tail(log: Path, lines: int = 15) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError as exc:
        return f"    (cannot read {log}: {exc.strerror})"
    return "\n".join(f"    {line}" for line in text)


async def _wait_up(
    url: str, children: Mapping[subprocess.Popen[bytes], Path], timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2) as client:
        while time.monotonic() < deadline:
            for child, log in children.items():
                if child.poll() is not None:
                    raise DemoError(
                        f"{log.stem} (pid {child.pid}) exited with code {child.returncode}; "
                        f"the end of its log:\n{_tail(log)}"
                    )
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise DemoError(f"{url} did not come up within {timeout_s:g}s")


def _prompt(rng: random.Random, tokens: int) -> str:
    words = ("route", "token", "lane", "prefill", "decode", "slot", "engine", "queue")
    return " ".join(rng.choice(words) for _ in range(tokens))


async def _one(client: httpx.AsyncClient, url: str, text: str, output: int) -> dict[str, Any]:
    body = {
        "model": "qwen3.6",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": output,
        "stream": True,
    }
    started = time.monotonic()
    ttft = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        async for chunk in response.aiter_raw():
            if ttft is None and b'"content"' in chunk:
                ttft = time.monotonic() - started
        return {
            "lane": response.headers.get("x-shapegate-lane", "-"),
            "status": response.status_code,
            "ttft": ttft,
            "e2e": time.monotonic() - started,
            "tokens": int(response.headers.get("x-shapegate-prompt-tokens", 0)),
        }


async def play_burst(url: str, requests: int, monsters: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    shapes = [
        (
            min(20_000, int(rng.lognormvariate(math.log(3000), 0.5))),
            max(4, int(rng.lognormvariate(math.log(37), 0.4))),
        )
        for _ in range(requests)
    ]
    shapes += [(rng.randint(100_000, 700_000), 124) for _ in range(monsters)]
    rng.shuffle(shapes)
    # A monster's prefill legitimately takes minutes: no read timeout on the client side.
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10)) as client:
        tasks = []
        for tokens, output in shapes:
            tasks.append(asyncio.create_task(_one(client, url, _prompt(rng, tokens), output)))
            await asyncio.sleep(rng.expovariate(20))
        return list(await asyncio.gather(*tasks))


def summarize(results: list[dict[str, Any]]) -> str:
    lines = ["lane    requests  prompt tokens (max)  TTFT p50   TTFT p99   e2e p99"]
    for lane in sorted({r["lane"] for r in results}):
        mine = [r for r in results if r["lane"] == lane]
        ttfts = sorted(r["ttft"] for r in mine if r["ttft"] is not None) or [math.nan]
        e2e = sorted(r["e2e"] for r in mine)

        def pct(values: list[float], q: float) -> float:
            return values[min(len(values) - 1, int(q * len(values)))]

        lines.append(
            f"{lane:<7} {len(mine):>8}  {max(r['tokens'] for r in mine):>19,}  "
            f"{pct(ttfts, 0.5):>7.2f}s  {pct(ttfts, 0.99):>7.2f}s  {pct(e2e, 0.99):>7.2f}s"
        )
    return "\n".join(lines)


async def _run(args: argparse.Namespace, workdir: Path) -> int:
    config = demo_config(args.port, args.engine_port_base)
    ports = {args.port: "gateway, --port"}
    for cluster in config["clusters"]:
        for endpoint in cluster["endpoints"]:
            ports[int(endpoint.rsplit(":", 1)[1])] = f"{cluster['name']} engine, --engine-port-base"
    taken = taken_ports(ports)
    if taken:
        raise DemoError(
            f"port{'s' if len(taken) > 1 else ''} already in use: {', '.join(taken)}; "
            "choose free ones with --port and --engine-port-base"
        )
    config_path = workdir / "demo.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    children: dict[subprocess.Popen[bytes], Path] = {}
    try:
        for cluster in config["clusters"]:
            for endpoint in cluster["endpoints"]:
                port = endpoint.rsplit(":", 1)[1]
                log = workdir / f"sim-{port}.log"
                sim = ["sim", "--port", port, "--profile", cluster["sim_profile"]]
                children[_spawn([*sim, "--time-scale", str(args.time_scale)], log)] = log
        for cluster in config["clusters"]:
            for endpoint in cluster["endpoints"]:
                await _wait_up(endpoint + "/health", children, 60)
        log = workdir / "gateway.log"
        gateway = _spawn(["serve", "--config", str(config_path)], log)
        children[gateway] = log
        url = f"http://127.0.0.1:{args.port}"
        await _wait_up(url + "/readyz", children, 60)
        print(
            f"shapegate demo is up (engines at time scale {args.time_scale:g})\n"
            f"  API        {url}/v1  (model qwen3.6)\n"
            f"  dashboard  {url}/dashboard\n"
            f"  metrics    {url}/metrics\n"
            f"  state      {url}/admin/state\n"
            f"  policy     {config_path}\n"
            f"  reload     edit the policy, then: {reload_command(url)}\n"
            f"             or: kill -HUP {gateway.pid}\n"
            f"  logs       {workdir}  (removed when the demo stops)",
            flush=True,
        )
        if args.burst:
            print(
                f"playing a burst: {args.burst_requests} small requests and "
                f"{args.burst_monsters} monsters ...",
                flush=True,
            )
            results = await play_burst(url, args.burst_requests, args.burst_monsters, args.seed)
            print(summarize(results), flush=True)
            if args.exit_after_burst:
                return 0 if all(r["status"] == 200 for r in results) else 1
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        return 0
    finally:
        for child in children:
            if child.poll() is None:
                child.terminate()
        for child in children:
            try:
                child.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait(timeout=15)


def _demo(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="shapegate-demo-"))
    try:
        return asyncio.run(_run(args, workdir))
    except DemoError as exc:
        print(f"shapegate demo: {exc}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = subparsers.add_parser("demo", help="two simulated clusters and the gateway in front")
    demo.add_argument("--port", type=int, default=8000, help="the gateway's port")
    demo.add_argument(
        "--engine-port-base",
        type=int,
        default=9100,
        help="engines listen on BASE+1, BASE+2 (fast) and BASE+11, BASE+12",
    )
    demo.add_argument(
        "--time-scale",
        type=float,
        default=0.1,
        help="simulated engine clock: 0.1 runs 10x faster than an H100",
    )
    demo.add_argument("--burst", action="store_true", help="play production-shaped traffic")
    demo.add_argument("--burst-requests", type=int, default=200, help="small requests in the burst")
    demo.add_argument(
        "--burst-monsters", type=int, default=3, help="100k-700k-token prompts in the burst"
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of the burst's shapes")
    demo.add_argument("--exit-after-burst", action="store_true", help=argparse.SUPPRESS)
    demo.set_defaults(func=_demo)
