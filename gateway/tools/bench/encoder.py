"""``shapegate bench encoder``: the tokenizer's memory under adversarial floods, and what the
bound costs in count latency.

gigatoken 0.10.0 caches every distinct pre-token it encodes, without bound. The gateway runs it
in a child process replaced once the child's resident memory passes
``counting.max_encoder_rss_mb`` (gateway/count/tokenizers/worker.py). This suite measures both
modes in
one run, with the Qwen3.6 vocabulary:

1. ``flood``: unique random text (CJK, then base64), ``--flood-mb`` MB of each in 40 kB
   prompts, counted exactly through ``TokenCounter.count_sync`` (no count cache, so every piece
   reaches the tokenizer). Memory is the proportional set sizes (PSS) of this process and its
   children (the tokenizer template and its counting child, which share the template's pages
   copy-on-write: summed resident memory would count those pages twice), read after every
   prompt; per tenth of the text the peak is kept. Bounded means the peak over the second half
   of the text is no higher than over the first half (+``FLAT_MB``).
   The peak itself is the old child past the bound by what it grows while its replacement
   loads, plus that replacement (worker.py); it is reported, not a target.
   The in-process baseline (``max_encoder_rss_mb: null``) floods a quarter as much text: it grows
   without bound, by 3-6 MB per MB of text.
2. ``latency``: p50 of an exact count (``Encoder.count_many``) of fresh text of ~3k, ~32k and
   ~300k tokens, in-process and through the child, the same texts alternating: the ratio is the
   cost of the bound (a pipe round trip and the text's pickling).
``--smoke`` floods 2 MB and times a few counts, for the test suite.
"""

from __future__ import annotations

import argparse
import base64
import gc
import random
import statistics
import time
from importlib import resources
from pathlib import Path
from typing import Any

from gateway.config_check import load_settings
from gateway.count.tokenizers.backends import DEFAULT_MAX_RSS_MB, EncoderLimits
from gateway.count.tokenizers.sources import load_vocabulary
from gateway.count.tokens import TokenCounter
from gateway.protocols.openai import ChatPrompt
from gateway.settings import CountingSettings, Settings, TokenizerSettings
from gateway.tools.bench.corpus import Corpus
from gateway.tools.bench.harness import machine, machine_line, target_lines, tree_pss_mb, write_json

PROMPT_BYTES = 40_000
FLAT_MB = 16.0
# (name, characters of mixed text, timed runs): small counts are noisier on a shared machine.
SIZES = (("3k", 12_000, 60), ("32k", 130_000, 30), ("300k", 1_200_000, 10))


def register(suites: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = suites.add_parser("encoder", help="tokenizer memory under floods; cost of the bound")
    parser.add_argument("--out", default="bench-results", help="folder for encoder.json")
    parser.add_argument("--flood-mb", type=float, default=200.0, help="MB of each kind, bounded")
    parser.add_argument(
        "--max-rss-mb",
        type=float,
        default=DEFAULT_MAX_RSS_MB,
        help="the child encoder's memory bound under test, MB",
    )
    parser.add_argument("--smoke", action="store_true", help="2 MB floods, few timings")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    result = measure(
        flood_mb=2.0 if args.smoke else args.flood_mb,
        max_rss_mb=args.max_rss_mb,
        runs=3 if args.smoke else 60,
        smoke=args.smoke,
    )
    path = write_json(Path(args.out), "encoder", result)
    print(table(result))
    print(f"\nwritten: {path}")
    return 0


def _settings(max_rss_mb: float | None) -> Settings:
    """The demo policy's models, without a count cache, with the encoder bound given."""
    local = Path("configs/demo.yaml")  # a checkout; an installed wheel carries its own copy
    if local.is_file():
        base = load_settings(local)
    else:
        packaged = resources.files("gateway").joinpath("configs", "demo.yaml")
        with resources.as_file(packaged) as demo:
            base = load_settings(demo)
    counting = CountingSettings(cache_entries=0, max_encoder_rss_mb=max_rss_mb)
    return base.model_copy(update={"counting": counting})


def _text(kind: str, rng: random.Random) -> str:
    if kind == "cjk":
        return "".join(map(chr, rng.choices(range(0x4E00, 0x9FFF), k=PROMPT_BYTES // 3)))
    return base64.b64encode(rng.randbytes(PROMPT_BYTES * 3 // 4)).decode()


def _flood(counter: TokenCounter, kind: str, mb: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    prompts = max(10, int(mb * 2**20 / PROMPT_BYTES))
    before = tree_pss_mb()
    peaks: list[float] = []
    peak = 0.0
    tenth = max(1, prompts // 10)
    for i in range(prompts):
        text = _text(kind, rng)
        messages = ({"role": "user", "content": text},)
        counter.count_sync("qwen3.6", ChatPrompt(messages=messages))
        peak = max(peak, tree_pss_mb())
        if (i + 1) % tenth == 0:
            peaks.append(round(peak, 1))
            peak = 0.0
    half = len(peaks) // 2
    return {
        "kind": kind,
        "prompts": prompts,
        "text_mb": round(prompts * PROMPT_BYTES / 2**20, 1),
        "pss_before_mb": round(before, 1),
        "peak_per_tenth_mb": peaks,
        "peak_mb": max(peaks),
        "growth_mb": round(peaks[-1] - before, 1),
        "second_half_over_first_mb": round(max(peaks[half:]) - max(peaks[:half]), 1),
        "mb_per_text_mb": round((max(peaks) - before) / (prompts * PROMPT_BYTES / 2**20), 2),
    }


def _floods(max_rss_mb: float | None, mb: float) -> dict[str, Any]:
    gc.collect()
    start = tree_pss_mb()
    counter = TokenCounter.from_settings(_settings(max_rss_mb))
    loaded = tree_pss_mb()
    floods = [_flood(counter, kind, mb, seed) for seed, kind in enumerate(("cjk", "base64"))]
    encoder = counter._model("qwen3.6").vocab.encoder
    recycles = getattr(encoder, "recycles", 0)  # a bench reading a figure, not a strategy
    counter.close()
    del counter, encoder
    gc.collect()
    return {
        "max_encoder_rss_mb": max_rss_mb,
        "pss_start_mb": round(start, 1),
        "pss_loaded_mb": round(loaded, 1),
        "recycles": recycles,
        "floods": floods,
    }


def _latency(runs: int, max_rss_mb: float) -> list[dict[str, Any]]:
    spec = TokenizerSettings(source="builtin", name="qwen3.6")
    inproc = load_vocabulary(spec, limits=EncoderLimits(max_rss_mb=None)).encoder
    child = load_vocabulary(spec, limits=EncoderLimits(max_rss_mb=max_rss_mb)).encoder
    corpus = Corpus.load(code_chars=3_000_000)
    rows = []
    try:
        for size, chars, timed in SIZES:
            times: dict[str, list[float]] = {"in_process": [], "child": []}
            for i in range(min(runs, timed) + 1):
                text = corpus.mixed(chars, seed=100 + i)
                order = [("in_process", inproc), ("child", child)]
                for name, encoder in order if i % 2 else reversed(order):
                    started = time.perf_counter()
                    counts = encoder.count_many([text])
                    if i:  # the first run of each size warms both
                        times[name].append((time.perf_counter() - started) * 1000)
                    assert counts[0] > 0
            p50 = {name: statistics.median(values) for name, values in times.items()}
            low = {name: min(values) for name, values in times.items()}
            rows.append(
                {
                    "size": size,
                    "chars": chars,
                    "runs": len(times["child"]),
                    "tokens": inproc.count_many([corpus.mixed(chars, seed=100)])[0],
                    "in_process_p50_ms": round(p50["in_process"], 3),
                    "child_p50_ms": round(p50["child"], 3),
                    "child_over_in_process": round(p50["child"] / p50["in_process"], 2),
                    "in_process_min_ms": round(low["in_process"], 3),
                    "child_min_ms": round(low["child"], 3),
                    "child_over_in_process_min": round(low["child"] / low["in_process"], 2),
                }
            )
    finally:
        child.close()
    return rows


def measure(*, flood_mb: float, max_rss_mb: float, runs: int, smoke: bool) -> dict[str, Any]:
    info = machine()
    bounded = _floods(max_rss_mb, flood_mb)
    baseline = _floods(None, flood_mb / 4)
    result = {
        "suite": "encoder",
        "smoke": smoke,
        "machine": info,
        "bounded": bounded,
        "in_process": baseline,
        "latency": _latency(runs, max_rss_mb),
        "flat_within_mb": FLAT_MB,
    }
    result["targets"] = targets(result)
    return result


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    bounded = result["bounded"]
    out = []
    for flood in bounded["floods"]:
        out.append(
            {
                "target": f"bounded {flood['kind']}: peak PSS over the second half of "
                f"{flood['text_mb']} MB of unique text minus the first half's, MB",
                "value": flood["second_half_over_first_mb"],
                "limit": FLAT_MB,
                "met": flood["second_half_over_first_mb"] <= FLAT_MB,
            }
        )
    big = next(row for row in result["latency"] if row["size"] == "32k")
    out.extend(
        (
            {
                "target": "cost of the bound: exact count of ~32k tokens, child / in-process p50",
                "value": big["child_over_in_process"],
                "limit": 1.5,
                "met": big["child_over_in_process"] <= 1.5,
            },
            {
                "target": "cost of the bound: exact count of ~32k tokens, child / in-process, best "
                "run (scheduling noise removed)",
                "value": big["child_over_in_process_min"],
                "limit": 1.5,
                "met": big["child_over_in_process_min"] <= 1.5,
            },
        )
    )
    return out


def table(result: dict[str, Any]) -> str:
    lines = [
        f"shapegate bench encoder{' (SMOKE: figures not meaningful)' if result['smoke'] else ''}",
        machine_line(result["machine"]),
        "PSS = proportional set sizes of this process and its children (the tokenizer template and "
        "its counting child; a page they share counts once), MB",
        "",
    ]
    for name in ("bounded", "in_process"):
        mode = result[name]
        lines.append(
            f"{name}: max_encoder_rss_mb={mode['max_encoder_rss_mb']}, PSS at start "
            f"{mode['pss_start_mb']}, tokenizer loaded {mode['pss_loaded_mb']}, "
            f"recycles {mode['recycles']}"
        )
        for flood in mode["floods"]:
            lines.append(
                f"  {flood['kind']:>6} {flood['text_mb']:7.1f} MB of unique text: peak per tenth "
                f"{flood['peak_per_tenth_mb']} (growth {flood['growth_mb']:+.1f} MB, "
                f"{flood['mb_per_text_mb']} MB per MB at peak)"
            )
    lines.append("")
    lines.append(
        "size   tokens runs  in-process p50 ms  child p50 ms  ratio   in-process min  "
        "child min  ratio"
    )
    for row in result["latency"]:
        lines.append(
            f"{row['size']:>5} {row['tokens']:>8} {row['runs']:>4} "
            f"{row['in_process_p50_ms']:>18.3f} {row['child_p50_ms']:>13.3f} "
            f"{row['child_over_in_process']:>6.2f} {row['in_process_min_ms']:>16.3f} "
            f"{row['child_min_ms']:>10.3f} {row['child_over_in_process_min']:>6.2f}"
        )
    lines.append("")
    lines.extend(target_lines(result["targets"]))
    return "\n".join(lines)
