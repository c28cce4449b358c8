"""The traffic of ``shapegate bench soak`` (soak.py) and ``bench prefix-soak``
(prefix_soak.py): open-loop clients, injected faults, their shared options and memory fit.

- ``traffic``: requests at ``rate`` a second (exponential gaps) until ``until``, each body made
  by ``body_of(rng, serial)`` (by default ``mixed_body``: 85% short prompts (fast lane), 15%
  prompts of 3k-12k tokens (heavy lane); 60% streaming; 8-80 output tokens); a
  ``disconnect_share`` of the clients reset their connection (an RST) at a random moment
  (queued, prefill, decode or waiting for a plain answer). Each outcome is tallied.
- ``faults``: every engine answers 4% of requests with a 500 and 3% with a 429, and every
  ``episode_every_s`` one engine has an episode of a crash (restarting), a hang, a stall
  mid-stream, dropped connections or a slow first byte.
- ``add_length_args(parser, rate)`` / ``seconds_of(args)``: ``--minutes`` (default 10) or
  ``--seconds``, ``--rate``, ``--seed``, ``--out``, as both soaks take them.
- ``memory_fit(samples, from_s)``: a memory series (seconds, MB) from ``from_s`` on: its
  baseline (median of the first tenth), final (of the last tenth), peak, growth, and the slope
  of a least-squares line (MB/min).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import socket
import statistics
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import orjson

if TYPE_CHECKING:
    from engine_pool.sim.server import SimServer

JSON_HEADERS = {"content-type": "application/json"}
BASE_FAULTS = {"error_500_rate": 0.04, "error_429_rate": 0.03}
EPISODES: tuple[dict[str, Any], ...] = (
    {"crash": True, "restart_after_s": 1.5},
    {"hang": True},
    {"stall_after_tokens": 3, "stall_for_s": 3.0},
    {"drop_after_chunks": 4},
    {"first_byte_delay_s": 4.0},
)


@dataclass(frozen=True, slots=True)
class SoakOptions:
    seconds: float
    rate: float = 40.0
    seed: int = 1
    time_scale: float = 0.25
    disconnect_share: float = 0.2
    episode_every_s: float = 6.0
    episode_s: float = 2.5


@dataclass
class Tally:
    requests: int = 0
    disconnects: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    checks: int = 0
    violations: list[str] = field(default_factory=list)
    peak: Counter[str] = field(default_factory=Counter)
    pss: list[tuple[float, float]] = field(default_factory=list)  # (s, MB): harness.tree_pss_mb
    episodes: Counter[str] = field(default_factory=Counter)


# A request body from the traffic's random source and the request's serial number.
BodyOf = Callable[[random.Random, int], bytes]


def add_length_args(parser: argparse.ArgumentParser, *, rate: float) -> None:
    """The options both soaks take: how long, how fast, which traffic, where to write."""
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float, default=None, help="how long (default 10)")
    length.add_argument("--seconds", type=float, default=None, help="how long, in seconds")
    parser.add_argument("--rate", type=float, default=rate, help="requests per second offered")
    parser.add_argument("--seed", type=int, default=1, help="seed of the traffic mix")
    parser.add_argument("--out", default="bench-results", help="folder for the JSON")


def seconds_of(args: argparse.Namespace) -> float:
    return float(args.seconds) if args.seconds is not None else 60.0 * (args.minutes or 10.0)


def memory_fit(samples: list[tuple[float, float]], from_s: float) -> dict[str, float]:
    """Baseline, final, peak, growth and slope (MB/min) of ``samples`` (s, MB) from ``from_s``
    on (all of them when none is that late); the peak is over every sample."""
    after = [(t, mb) for t, mb in samples if t >= from_s] or samples
    tenth = max(1, len(after) // 10)
    baseline = statistics.median(mb for _, mb in after[:tenth])
    final = statistics.median(mb for _, mb in after[-tenth:])
    slope = 0.0
    if len(after) > 2:
        slope = statistics.linear_regression([t for t, _ in after], [mb for _, mb in after]).slope
    return {
        "baseline_mb": round(baseline, 1),
        "final_mb": round(final, 1),
        "peak_mb": round(max(mb for _, mb in samples), 1),
        "growth_mb": round(final - baseline, 1),
        "slope_mb_per_min": round(slope * 60, 2),
    }


def mixed_body(rng: random.Random, serial: int) -> bytes:
    heavy = rng.random() < 0.15
    tokens = rng.randrange(3000, 12000) if heavy else rng.randrange(50, 1500)
    text = f"soak {serial} " + " ".join(f"w{rng.randrange(100_000)}" for _ in range(tokens // 3))
    body = {
        "model": "qwen3.6",
        "stream": rng.random() < 0.6,
        "max_tokens": rng.randrange(8, 80),
        "messages": [{"role": "user", "content": text}],
    }
    return orjson.dumps(body)


async def _finish_normally(client: httpx.AsyncClient, url: str, body: bytes, tally: Tally) -> None:
    try:
        async with client.stream(
            "POST", url + "/v1/chat/completions", content=body, headers=JSON_HEADERS
        ) as r:
            payload = b"".join([piece async for piece in r.aiter_raw()])
    except httpx.HTTPError as exc:
        tally.outcomes[f"transport:{type(exc).__name__}"] += 1
        return
    if r.status_code != 200:
        tally.outcomes[f"http_{r.status_code}"] += 1
    elif b'data: {"error"' in payload:
        tally.outcomes["stream_error_event"] += 1
    else:
        tally.outcomes["ok"] += 1


async def _leave_early(url: str, body: bytes, hold_s: float, tally: Tally) -> None:
    host, port = url.removeprefix("http://").split(":")
    try:
        _reader, writer = await asyncio.open_connection(host, int(port))
    except OSError:
        tally.outcomes["transport:connect"] += 1
        return
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    writer.write(head + body)
    with contextlib.suppress(OSError):
        await writer.drain()
    await asyncio.sleep(hold_s)
    sock = writer.get_extra_info("socket")
    if sock is not None:  # SO_LINGER 0: an RST, as a killed client sends
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
    tally.outcomes["client_reset"] += 1


async def traffic(
    url: str,
    options: SoakOptions,
    rng: random.Random,
    tally: Tally,
    until: float,
    body_of: BodyOf = mixed_body,
) -> None:
    # Idle client connections are dropped well before the gateway's 5 s keep-alive closes them:
    # reusing one the server closes at that very moment is a ReadError of the load generator's,
    # not a gateway fault (seen once in a 10-minute run with httpx's default of 5 s).
    limits = httpx.Limits(max_connections=600, max_keepalive_connections=100, keepalive_expiry=2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        running: set[asyncio.Task[None]] = set()
        due = time.monotonic()
        while due < until:
            due += rng.expovariate(options.rate)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            body = body_of(rng, tally.requests)
            tally.requests += 1
            if rng.random() < options.disconnect_share:
                tally.disconnects += 1
                job = _leave_early(url, body, rng.uniform(0.0, 1.5), tally)
            else:
                job = _finish_normally(client, url, body, tally)
            task = asyncio.create_task(job)
            running.add(task)
            task.add_done_callback(running.discard)
        if running:
            await asyncio.wait(running, timeout=120)


async def faults(
    sims: list[SimServer], options: SoakOptions, rng: random.Random, tally: Tally, until: float
) -> None:
    for sim in sims:
        await sim.set_faults(BASE_FAULTS)
    while time.monotonic() + options.episode_every_s < until:
        await asyncio.sleep(options.episode_every_s - options.episode_s)
        sim, episode = rng.choice(sims), rng.choice(EPISODES)
        tally.episodes[next(iter(episode))] += 1
        await sim.set_faults({**BASE_FAULTS, **episode})
        await asyncio.sleep(options.episode_s)
        await sim.set_faults(BASE_FAULTS)
    for sim in sims:
        await sim.set_faults({})


# The probes and scrapes of a soak's lanes: every second, up after two answers.
SOAK_HEALTH = {"interval_s": 1.0, "timeout_s": 1.0, "up_after_successes": 2, "scrape_interval_s": 1}


def soak_policy(
    port: int, clusters: list[dict[str, Any]], lanes: list[dict[str, Any]]
) -> dict[str, Any]:
    """A soak's gateway policy: loopback on ``port``, no boot probe, a 5 s drain, info logs,
    qwen3.6 counted with its HF template, and the soak's own ``clusters`` and ``lanes``."""
    return {
        "server": {"host": "127.0.0.1", "port": port, "boot_probe": False, "drain_timeout_s": 5},
        "logging": {"level": "info"},
        "models": [
            {
                "name": "qwen3.6",
                "tokenizer": {"source": "builtin", "name": "qwen3.6", "chat_template": "hf"},
            }
        ],
        "clusters": clusters,
        "lanes": lanes,
    }
