"""``shapegate bench count``: the routing decision (parse, count, choose a lane) vs HF tokenizers.

What it measures, on one core (``sched_setaffinity``; restored afterwards), for chat requests of
about 3k, 32k and 300k tokens of mixed prose, code and JSON (a fresh text every iteration, so no
cache flatters the exact path):
- ``decide``: ``parse_request`` on the body bytes, ``TokenCounter.count`` with the demo policy's
  ``exact_above``, and a lane lookup (a plain range test here; the real one is ``lanes.py``).
  A 3k request is decided by the free bound; 32k and 300k need the exact count.
- ``exact``: ``count_sync`` with no bound (render, hash, encode); ``cache``: the same prompt again.
- ``hf``: Hugging Face ``tokenizers`` encoding the same rendered prompt in the same run (the
  baseline the speed-up is a ratio against); its count must equal ours, or the run fails.
- ``tiktoken``: the plain install's exact path (no ``[gigatoken]`` extra): the same model with
  ``backend: tiktoken``, in a counter of its own (an empty cache), timed with ``count_sync`` on
  the very prompts ``exact`` counted; its counts must equal HF's and ours, or the run fails.
  ``exact_by_backend`` puts each backend's p50 beside its ratio to the HF baseline; ``exact`` is
  labelled with the backend the policy's ``auto`` actually loaded (``exact_backend``): without
  gigatoken that is tiktoken too, and the gigatoken figures are null (absent), not an error.
- ``loop stall``: the longest delay of a 1 ms asyncio ticker while a 300k-token count runs
  through ``count()`` (worker thread, GIL released) and inline on the loop; for the plain
  install's tiktoken too (``plain_install.loop_stall``, one core).
- memory after the demo tokenizers load (before the HF baseline loads): PSS of this process and
  its tokenizer template and counting child (``tree_pss_mb``: the pages the template shares
  with its child counted once, which RSS summed would count twice), and the calibration report:
  characters and bytes per token for prose, code and JSON on every shipped vocabulary.
Targets (from issue 3) are checked and printed; ``--smoke`` scales sizes and thresholds by 0.1 and
runs a few iterations, for the test suite: its figures say nothing about the targets.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from gateway.config_check import load_settings
from gateway.count.tokens import TokenCounter
from gateway.protocols.openai import ChatPrompt, parse_request
from gateway.settings import ModelSettings, Settings
from gateway.shipped import resolve_policy
from gateway.tools.bench.corpus import Corpus
from gateway.tools.bench.count_baselines import (
    against_hf,
    backend_of,
    calibration,
    plain_install,
    stats,
)
from gateway.tools.bench.count_report import table, targets
from gateway.tools.bench.harness import package_version, tree_pss_mb

SIZES = (("3k", 3_000, 300), ("32k", 32_000, 40), ("300k", 300_000, 15))
# Requests decided before the timed ones: a running gateway's tokenizer is warm (gigatoken keeps
# a cache of pre-tokens; the first large encodes of a process are up to 2x slower).
WARM = 3
SYSTEM = "You are a careful assistant. Answer from the documents the user gives you."


def register(suites: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = suites.add_parser("count", help="token counting on the routing path vs HF tokenizers")
    parser.add_argument("--out", default="bench-results", help="folder for count.json")
    parser.add_argument("--config", default=None, help="policy file (default: the demo policy)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, few iterations")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gateway.tools.bench.harness import machine

    info = machine()  # before the run: its load average is what the run competed with
    all_cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    with _one_core() as cpus:
        settings = _settings(args.config)
        result = _measure(settings, smoke=args.smoke, all_cpus=all_cpus)
    result["cpu_affinity"] = cpus
    result["machine"] = info
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "count.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    print(table(result))
    print(f"\nwritten: {out / 'count.json'}")
    return 0


@contextmanager
def _one_core() -> Iterator[list[int]]:
    """Pin every thread of this process (and those it starts) to one CPU, as the targets assume."""
    if not hasattr(os, "sched_setaffinity"):
        yield []
        return
    before = os.sched_getaffinity(0)
    _set_affinity({min(before)})
    try:
        yield sorted(os.sched_getaffinity(0))
    finally:
        _set_affinity(before)


def _set_affinity(cpus: set[int]) -> None:
    """sched_setaffinity(0) moves only the calling thread: move every thread of the process."""
    tasks = Path("/proc/self/task")
    for tid in sorted(int(t.name) for t in tasks.iterdir()) if tasks.is_dir() else [0]:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue  # the thread ended between the listing and the call: nothing to move


def _settings(path: str | None) -> Settings:
    if path is not None:
        return load_settings(path)
    return load_settings(resolve_policy("configs/demo.yaml"))


def _pss_mb() -> float:
    return tree_pss_mb()  # this process, the tokenizer template and its counting child


def _body(model: str, text: str) -> bytes:
    return orjson.dumps(
        {
            "model": model,
            "max_tokens": 256,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        }
    )


def _measure(settings: Settings, *, smoke: bool, all_cpus: set[int] | None) -> dict[str, Any]:
    scale = 0.1 if smoke else 1.0
    model = settings.models[0].name
    lowest = min(settings.lanes, key=lambda lane: lane.min_prompt_tokens)
    exact_above = (
        max(1, int(lowest.max_prompt_tokens * scale)) if lowest.min_prompt_tokens == 0 else 0
    )
    lanes = [
        (lane.name, int(lane.min_prompt_tokens * scale), int(lane.max_prompt_tokens * scale))
        for lane in settings.lanes
    ]

    def lane_for(tokens: int) -> str:
        return next((name for name, lo, hi in lanes if lo <= tokens < hi), "none")

    spec = settings.models[0].tokenizer
    templated = None
    if spec.source in ("builtin", "hf_json") and spec.chat_template != "hf":
        # A second model on the same vocabulary (no second load) rendering the model's own
        # chat template: what chat_template "hf" costs on the decision path.
        templated = f"{model}+own-template"
        own = ModelSettings(
            name=templated, tokenizer=spec.model_copy(update={"chat_template": "hf"})
        )
        settings = settings.model_copy(update={"models": (*settings.models, own)})
    pss_start = _pss_mb()
    loaded = time.perf_counter()
    counter = TokenCounter.from_settings(settings)
    load_s = time.perf_counter() - loaded
    pss_loaded = _pss_mb()
    corpus = Corpus.load(code_chars=3_000_000 if smoke else 12_000_000)
    seed = iter(range(1, 1_000_000))
    chars_per_token = _chars_per_token(counter, model, corpus)
    requests = []
    for label, tokens, iterations in SIZES:
        runs = max(2, iterations // 10) if smoke else iterations
        chars = int(tokens * scale * chars_per_token)
        bodies = [_body(model, corpus.mixed(chars, next(seed))) for _ in range(runs + WARM)]
        fresh = [_body(model, corpus.mixed(chars, next(seed))) for _ in range(min(runs, 10))]
        requests.append(_measure_size(counter, model, label, bodies, fresh, exact_above, lane_for))
        if templated is not None:  # the same decision through the model's own Jinja template
            bodies = [_body(model, corpus.mixed(chars, next(seed))) for _ in range(runs + WARM)]
            times, decisions = _decide(counter, templated, bodies, exact_above, lane_for)
            requests[-1]["decide_own_template"] = stats(times)
            requests[-1]["decide_own_template_methods"] = sorted({c.method for c, _ in decisions})
    stall_chars = int(300_000 * scale * chars_per_token)
    runs = 1 if smoke else 3
    stall = {"1_core": _loop_stall(counter, model, corpus, stall_chars, runs, seed)}
    if all_cpus is not None and len(all_cpus) > 1:
        pinned = os.sched_getaffinity(0)
        _set_affinity(all_cpus)
        stall[f"{len(all_cpus)}_cores"] = _loop_stall(
            counter, model, corpus, stall_chars, runs, seed
        )
        _set_affinity(pinned)
    gc.collect()
    # The benchmark's own texts are not the gateway's: take them off the process's memory.
    bench_texts = (
        sys.getsizeof(corpus.prose)
        + sys.getsizeof(corpus.code)
        + sum(
            sys.getsizeof(m.get("content"))
            for r in requests
            for p in r["_prompts"]
            for m in p.messages
        )
    )
    pss_counted = _pss_mb() - bench_texts / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    plain = plain_install(
        settings,
        requests,
        counter.tokenizer_id(model),
        lambda other: _loop_stall(other, model, corpus, stall_chars, runs, seed),
    )
    against_hf(counter, model, settings.models[0].tokenizer, requests, smoke=smoke)
    calibrated = calibration(counter, model, corpus, chars=20_000 if smoke else 200_000)
    counter.close()
    result: dict[str, Any] = {
        "suite": "count",
        "smoke": smoke,
        "scale": scale,
        "model": model,
        "tokenizer": counter.tokenizer_id(model),
        "exact_backend": backend_of(counter.tokenizer_id(model)),
        "exact_above": exact_above,
        "versions": {
            name: package_version(name) for name in ("gigatoken", "tokenizers", "tiktoken")
        },
        "python": platform.python_version(),
        "load_s": round(load_s, 3),
        "pss_mb": {
            "before_load": round(pss_start, 1),
            "after_load": round(pss_loaded, 1),
            "after_counting_less_bench_texts": round(pss_counted, 1),
        },
        "peak_rss_mb_before_hf": round(peak, 1),  # this process alone (getrusage)
        "requests": [{k: v for k, v in r.items() if not k.startswith("_")} for r in requests],
        "loop_stall": stall,
        "plain_install": plain,
        "calibration": calibrated,
    }
    result["targets"] = targets(result)
    return result


def _chars_per_token(counter: TokenCounter, model: str, corpus: Corpus) -> float:
    sample = corpus.mixed(200_000, 0)
    return len(sample) / len(counter.encode(model, sample))


def _decide(
    counter: TokenCounter,
    model: str,
    bodies: list[bytes],
    exact_above: int,
    lane_for: Callable[[int], str],
) -> tuple[list[float], list[tuple[Any, str]]]:
    """The routing decision for each body, timed: parse, count (async, as served), lane."""

    async def decide_all() -> tuple[list[float], list[tuple[Any, str]]]:
        times, decisions = [], []
        for body in bodies:
            started = time.perf_counter()
            request = parse_request("chat", body)
            count = await counter.count(model, request.prompt, exact_above=exact_above)
            lane = lane_for(count.tokens)
            times.append(time.perf_counter() - started)
            decisions.append((count, lane))
        return times[WARM:], decisions[WARM:]

    return asyncio.run(decide_all())


def _measure_size(
    counter: TokenCounter,
    model: str,
    label: str,
    bodies: list[bytes],
    fresh: list[bytes],
    exact_above: int,
    lane_for: Callable[[int], str],
) -> dict[str, Any]:
    """decide on ``bodies``; exact, cache (and later hf) on ``fresh``, never counted before."""
    decide, decisions = _decide(counter, model, bodies, exact_above, lane_for)
    prompts = [parse_request("chat", body).prompt for body in fresh]
    exact_times, exact = [], []
    for prompt in prompts:
        started = time.perf_counter()
        exact.append(counter.count_sync(model, prompt))
        exact_times.append(time.perf_counter() - started)
    cache_times, cached = [], []
    for prompt in prompts:
        started = time.perf_counter()
        cached.append(counter.count_sync(model, prompt))
        cache_times.append(time.perf_counter() - started)
    if [c.tokens for c in cached] != [c.tokens for c in exact]:
        raise RuntimeError(f"{label}: cached counts differ from exact ones")
    return {
        "size": label,
        "tokens": exact[0].tokens,
        "body_bytes": len(fresh[0]),
        "prompt_bytes": exact[0].prompt_bytes,
        "decide": stats(decide),
        "decide_methods": sorted({c.method for c, _ in decisions}),
        "decide_lanes": sorted({lane for _, lane in decisions}),
        "exact": stats(exact_times),
        "exact_methods": sorted({c.method for c in exact}),
        "cache": stats(cache_times),
        "cache_methods": sorted({c.method for c in cached}),
        "_prompts": prompts,
        "_counts": [c.tokens for c in exact],
    }


def _loop_stall(
    counter: TokenCounter, model: str, corpus: Corpus, chars: int, runs: int, seed: Iterator[int]
) -> dict[str, Any]:
    """How late a 1 ms ticker runs while a large count goes through count() vs inline."""

    async def ticker(stop: asyncio.Event, lates: list[float]) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            started = loop.time()
            await asyncio.sleep(0.001)
            lates.append(loop.time() - started - 0.001)

    async def one(inline: bool) -> tuple[float, float]:
        prompt = ChatPrompt(({"role": "user", "content": corpus.mixed(chars, next(seed))},))
        stop = asyncio.Event()
        lates: list[float] = []
        task = asyncio.create_task(ticker(stop, lates))
        await asyncio.sleep(0.01)
        lates.clear()
        started = time.perf_counter()
        if inline:
            counter.count_sync(model, prompt)
        else:
            await counter.count(model, prompt, exact_above=0)
        took = time.perf_counter() - started
        await asyncio.sleep(0.003)
        stop.set()
        await task
        return took, max(lates, default=0.0)

    async def all_runs() -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_chars": chars}
        for mode, inline in (("worker_thread", False), ("inline", True)):
            results = [await one(inline) for _ in range(runs)]
            out[mode] = {
                "count_ms": round(statistics.median(r[0] for r in results) * 1000, 2),
                "max_tick_late_ms": round(max(r[1] for r in results) * 1000, 2),
            }
        return out

    return asyncio.run(all_runs())
