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
- RSS after the demo tokenizers load (before the HF baseline loads), and the calibration report:
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
from gateway.count.tokenizers.vocab import Vocabulary
from gateway.count.tokens import TokenCounter
from gateway.protocols.openai import ChatPrompt, parse_request
from gateway.settings import ConfigError, ModelSettings, Settings, TokenizerSettings
from gateway.shipped import resolve_policy
from gateway.tools.bench.corpus import KINDS, Corpus
from gateway.tools.bench.harness import machine_line, package_version, tree_rss_mb, with_targets

SIZES = (("3k", 3_000, 300), ("32k", 32_000, 40), ("300k", 300_000, 15))
# Requests decided before the timed ones: a running gateway's tokenizer is warm (gigatoken keeps
# a cache of pre-tokens; the first large encodes of a process are up to 2x slower).
WARM = 3
HF_RUNS = {"3k": 20, "32k": 5, "300k": 2}
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
    print(_table(result))
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


def _rss_mb() -> float:
    return tree_rss_mb()  # this process and the tokenizer child


def _stats(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    return {
        "p50_ms": round(statistics.median(ms), 4),
        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 4),
        "n": len(ms),
    }


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
    rss_start = _rss_mb()
    loaded = time.perf_counter()
    counter = TokenCounter.from_settings(settings)
    load_s = time.perf_counter() - loaded
    rss_loaded = _rss_mb()
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
            requests[-1]["decide_own_template"] = _stats(times)
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
    # The benchmark's own texts are not the gateway's: take them off the process's RSS.
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
    rss_counted = _rss_mb() - bench_texts / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    plain = _plain_install(
        settings,
        requests,
        counter.tokenizer_id(model),
        lambda other: _loop_stall(other, model, corpus, stall_chars, runs, seed),
    )
    _against_hf(counter, model, settings.models[0].tokenizer, requests, smoke=smoke)
    calibration = _calibration(counter, model, corpus, chars=20_000 if smoke else 200_000)
    counter.close()
    result: dict[str, Any] = {
        "suite": "count",
        "smoke": smoke,
        "scale": scale,
        "model": model,
        "tokenizer": counter.tokenizer_id(model),
        "exact_backend": _backend(counter.tokenizer_id(model)),
        "exact_above": exact_above,
        "versions": {
            name: package_version(name) for name in ("gigatoken", "tokenizers", "tiktoken")
        },
        "python": platform.python_version(),
        "load_s": round(load_s, 3),
        "rss_mb": {
            "before_load": round(rss_start, 1),
            "after_load": round(rss_loaded, 1),
            "after_counting_less_bench_texts": round(rss_counted, 1),
            "peak_before_hf": round(peak, 1),
        },
        "requests": [{k: v for k, v in r.items() if not k.startswith("_")} for r in requests],
        "loop_stall": stall,
        "plain_install": plain,
        "calibration": calibration,
    }
    result["targets"] = _targets(result)
    return result


def _backend(tokenizer_id: str) -> str:
    """The backend in a tokenizer id: ``Vocabulary.id`` is ``{name}/{encoder.backend}``."""
    return tokenizer_id.rsplit("/", 1)[-1]


def _plain_install(
    settings: Settings,
    requests: list[dict[str, Any]],
    ours: str,
    loop_stall: Callable[[TokenCounter], dict[str, Any]],
) -> dict[str, Any]:
    """The plain install's exact path: the policy's first model with ``backend: tiktoken``.

    Loaded as the gateway loads it (``TokenCounter.from_settings``, warm-up included), in a counter
    of its own so its cache is empty; each request's fresh prompts counted once with
    ``count_sync`` (``request["tiktoken"]``). Counts that differ from ours fail the run. A
    vocabulary tiktoken cannot count exactly is reported absent, with the reason.
    """
    first = settings.models[0]
    forced = first.model_copy(
        update={"tokenizer": first.tokenizer.model_copy(update={"backend": "tiktoken"})}
    )
    rss_before = _rss_mb()
    started = time.perf_counter()
    try:
        counter = TokenCounter.from_settings(settings.model_copy(update={"models": (forced,)}))
    except ConfigError as exc:
        return {"backend": None, "absent": str(exc)}
    load_s = time.perf_counter() - started
    rss_added = _rss_mb() - rss_before
    try:
        for request in requests:
            times, counts = [], []
            for prompt in request["_prompts"]:
                started = time.perf_counter()
                counts.append(counter.count_sync(first.name, prompt).tokens)
                times.append(time.perf_counter() - started)
            if counts != request["_counts"]:
                raise RuntimeError(
                    f"{request['size']}: tiktoken counts {counts}, {ours} {request['_counts']}"
                )
            request["tiktoken"] = _stats(times)
            request["_tiktoken_counts"] = counts
        stall = {"1_core": loop_stall(counter)}
        tokenizer = counter.tokenizer_id(first.name)
    finally:
        counter.close()
    return {
        "backend": _backend(tokenizer),
        "tokenizer": tokenizer,
        "load_s": round(load_s, 3),
        "rss_mb_added": round(rss_added, 1),
        "loop_stall": stall,
    }


def _by_backend(request: dict[str, Any], exact_backend: str) -> dict[str, Any]:
    """Exact-count p50 and p99 by backend, with the HF baseline's p50 over it; None: absent.

    ``tiktoken`` is the plain install's counter (even when ``auto`` also loaded tiktoken)."""
    figures: dict[str, dict[str, Any] | None] = {"gigatoken": None, "tiktoken": None}
    if exact_backend in figures:
        figures[exact_backend] = request["exact"]
    figures["tiktoken"] = request.get("tiktoken", figures["tiktoken"])
    hf_p50 = request["hf"]["p50_ms"]
    return {
        backend: None if stats is None else {**stats, "x_hf": round(hf_p50 / stats["p50_ms"], 1)}
        for backend, stats in figures.items()
    }


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
        "decide": _stats(decide),
        "decide_methods": sorted({c.method for c, _ in decisions}),
        "decide_lanes": sorted({lane for _, lane in decisions}),
        "exact": _stats(exact_times),
        "exact_methods": sorted({c.method for c in exact}),
        "cache": _stats(cache_times),
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


def _against_hf(
    counter: TokenCounter,
    model: str,
    spec: TokenizerSettings,
    requests: list[dict[str, Any]],
    *,
    smoke: bool,
) -> None:
    """Time HF tokenizers on the very prompts counted exactly; every backend's counts must agree."""
    import tokenizers

    from gateway.count.tokenizers.hf_json import read_tokenizer_json
    from gateway.count.tokenizers.sources import builtin_path

    if spec.source == "builtin":
        with builtin_path(spec.name or "") as path:
            data, _ = read_tokenizer_json(path)
    elif spec.source == "hf_json":
        data, _ = read_tokenizer_json(Path(spec.path or ""))
    else:
        raise RuntimeError("the HF baseline needs a tokenizer.json model (builtin or hf_json)")
    hf = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    hf.encode("warm up", add_special_tokens=False)
    for request in requests:
        runs = 1 if smoke else HF_RUNS[request["size"]]
        times = []
        plain = request.get("_tiktoken_counts", request["_counts"])
        for prompt, ours, tiktoken_count in list(
            zip(request["_prompts"], request["_counts"], plain, strict=True)
        )[:runs]:
            text = counter.render_chat(model, prompt)
            started = time.perf_counter()
            theirs = len(hf.encode(text, add_special_tokens=False).ids)
            times.append(time.perf_counter() - started)
            if not theirs == ours == tiktoken_count:
                raise RuntimeError(
                    f"{request['size']}: HF counts {theirs}, shapegate {ours} "
                    f"(plain install's tiktoken {tiktoken_count})"
                )
        request["hf"] = _stats(times)
        request["hf_agrees"] = True
        request["tiktoken_agrees"] = "_tiktoken_counts" in request
        request["exact_by_backend"] = _by_backend(request, _backend(counter.tokenizer_id(model)))
        request["speedup_exact_vs_hf"] = round(
            request["hf"]["p50_ms"] / request["exact"]["p50_ms"], 1
        )
        request["speedup_decide_vs_hf"] = round(
            request["hf"]["p50_ms"] / request["decide"]["p50_ms"], 1
        )


def _calibration(
    counter: TokenCounter, model: str, corpus: Corpus, chars: int
) -> list[dict[str, Any]]:
    """Characters and bytes per token by kind of text, on every shipped vocabulary."""
    from gateway.count.tokenizers.sources import BUILTIN_VOCABULARIES, load_vocabulary

    rows = []
    encoders: list[tuple[str, Callable[[str], int]]] = [
        (counter.tokenizer_id(model), lambda text: len(counter.encode(model, text)))
    ]
    for name in BUILTIN_VOCABULARIES:
        if counter.tokenizer_id(model).startswith(name + "/"):
            continue
        vocab = load_vocabulary(TokenizerSettings(source="builtin", name=name))
        encoders.append((vocab.id, _counter_of(vocab)))
    for vocab_id, count in encoders:
        for kind in KINDS:
            text = corpus.take(kind, chars, seed=7)
            tokens = count(text)
            n_bytes = len(text.encode("utf-8"))
            rows.append(
                {
                    "vocabulary": vocab_id,
                    "kind": kind,
                    "chars": len(text),
                    "tokens": tokens,
                    "chars_per_token": round(len(text) / tokens, 2),
                    "bytes_per_token": round(n_bytes / tokens, 2),
                    # what a chars/4 estimate says, as a share of the real count
                    "chars_over_4_vs_real": round(len(text) / 4 / tokens, 2),
                }
            )
    return rows


def _counter_of(vocab: Vocabulary) -> Callable[[str], int]:
    return lambda text: vocab.encoder.count_many([text])[0]


def _targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    by = {r["size"]: r for r in result["requests"]}
    rss = result["rss_mb"]
    rows = [
        (
            "3k decided by the bound (no tokenizer), p50 ms",
            by["3k"]["decide"]["p50_ms"],
            0.2,
            by["3k"]["decide_methods"] == ["bound"],
        ),
        ("32k decided exactly, p50 ms", by["32k"]["decide"]["p50_ms"], 3.0, True),
        ("300k decided exactly, p50 ms", by["300k"]["decide"]["p50_ms"], 15.0, True),
        (
            "RSS with the demo tokenizers loaded, MB",
            rss["after_load"],
            300.0,
            True,
        ),
    ]
    out = [
        {"target": name, "value": value, "limit": limit, "met": bool(ok and value < limit)}
        for name, value, limit, ok in rows
    ]
    speedup = by["32k"].get("speedup_decide_vs_hf", 0.0)
    out.append(
        {
            "target": "32k: times faster than HF tokenizers (decide vs HF encode)",
            "value": speedup,
            "limit": 30.0,
            "met": speedup >= 30.0,
        }
    )
    return out


def _table(result: dict[str, Any]) -> str:
    lines = [
        f"shapegate bench count: {result['tokenizer']} on cpus {result['cpu_affinity']}"
        f"{' (SMOKE: sizes x0.1, figures not meaningful)' if result['smoke'] else ''}",
        machine_line(result["machine"]),
        f"exact_above={result['exact_above']}  load={result['load_s']}s  "
        f"rss after load={result['rss_mb']['after_load']} MB, after counting "
        f"{result['rss_mb']['after_counting_less_bench_texts']} MB"
        + (
            " (gigatoken's pre-token cache grows with every new word it sees, in a child "
            "replaced past its bound)"
            if result["exact_backend"] == "gigatoken"
            else ""
        ),
        "",
        f"{'size':>5} {'tokens':>8} {'decide p50':>11} {'how':>6} {'exact p50':>10} "
        f"{'cache p50':>10} {'HF p50':>9} {'x HF':>7} {'jinja decide':>12}",
    ]
    for r in result["requests"]:
        lines.append(
            f"{r['size']:>5} {r['tokens']:>8} {r['decide']['p50_ms']:>9.3f}ms "
            f"{','.join(r['decide_methods']):>6} {r['exact']['p50_ms']:>8.3f}ms "
            f"{r['cache']['p50_ms']:>8.3f}ms {r.get('hf', {}).get('p50_ms', float('nan')):>7.1f}ms "
            f"{r.get('speedup_decide_vs_hf', float('nan')):>7.1f} "
            f"{r.get('decide_own_template', {}).get('p50_ms', float('nan')):>10.3f}ms"
        )
    lines.append("")
    lines += _by_backend_lines(result)
    lines.append("")
    plain = result["plain_install"]
    stalls = [(result["exact_backend"], c, s) for c, s in result["loop_stall"].items()]
    stalls += [(plain["backend"], c, s) for c, s in plain.get("loop_stall", {}).items()]
    for backend, cores, stall in stalls:
        lines.append(
            f"event loop, {backend}, {cores}, {stall['prompt_chars']}-char count: via count() "
            f"{stall['worker_thread']['count_ms']} ms, 1 ms ticker late <= "
            f"{stall['worker_thread']['max_tick_late_ms']} ms; inline "
            f"{stall['inline']['count_ms']} ms, late <= {stall['inline']['max_tick_late_ms']} ms"
        )
    lines += [
        "",
        f"{'vocabulary':>22} {'kind':>6} {'chars/tok':>9} {'bytes/tok':>9} {'chars/4 vs real':>15}",
    ]
    for c in result["calibration"]:
        lines.append(
            f"{c['vocabulary']:>22} {c['kind']:>6} {c['chars_per_token']:>9} "
            f"{c['bytes_per_token']:>9} {c['chars_over_4_vs_real']:>15}"
        )
    return with_targets(lines, result["targets"])


def _by_backend_lines(result: dict[str, Any]) -> list[str]:
    """Exact counts of the same prompts by backend, p50 and its ratio to HF's in this run."""
    plain = result["plain_install"]
    lines = [
        "exact count of the same prompts, p50 (x HF: HF p50 over it, same run); tiktoken is the "
        "plain install (no [gigatoken] extra)"
        + (f", absent: {plain['absent']}" if plain["backend"] is None else ""),
        f"{'size':>5} {'tokens':>8} {'gigatoken':>18} {'tiktoken':>18} {'HF':>10}",
    ]
    for r in result["requests"]:
        cells = []
        for backend in ("gigatoken", "tiktoken"):
            figures = r["exact_by_backend"][backend]
            cells.append(
                "absent"
                if figures is None
                else f"{figures['p50_ms']:.3f}ms x{figures['x_hf']:<5.1f}"
            )
        lines.append(
            f"{r['size']:>5} {r['tokens']:>8} {cells[0]:>18} {cells[1]:>18} "
            f"{r['hf']['p50_ms']:>8.3f}ms"
        )
    if plain["backend"] is not None:
        lines.append(
            f"plain install counter ({plain['tokenizer']}): loaded in {plain['load_s']} s, "
            f"+{plain['rss_mb_added']} MB RSS"
        )
    return lines
