"""The baselines of ``shapegate bench count`` (count.py), each on the very prompts the gateway's
counter counted exactly, each required to agree with it or the run fails:
- ``against_hf``: Hugging Face ``tokenizers`` encoding the rendered prompt (the baseline the
  speed-up is a ratio against);
- ``plain_install``: the plain install's exact path (no ``[gigatoken]`` extra): the policy's
  first model with ``backend: tiktoken``, in a counter of its own (an empty cache);
- ``calibration``: characters and bytes per token by kind of text, on every shipped vocabulary.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.count.tokenizers.vocab import Vocabulary
from gateway.count.tokens import TokenCounter
from gateway.settings import ConfigError, Settings, TokenizerSettings
from gateway.tools.bench.corpus import KINDS, Corpus
from gateway.tools.bench.harness import tree_pss_mb

HF_RUNS = {"3k": 20, "32k": 5, "300k": 2}


def stats(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    return {
        "p50_ms": round(statistics.median(ms), 4),
        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 4),
        "n": len(ms),
    }


def backend_of(tokenizer_id: str) -> str:
    """The backend in a tokenizer id: ``Vocabulary.id`` is ``{name}/{encoder.backend}``."""
    return tokenizer_id.rsplit("/", 1)[-1]


def plain_install(
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
    pss_before = tree_pss_mb()
    started = time.perf_counter()
    try:
        counter = TokenCounter.from_settings(settings.model_copy(update={"models": (forced,)}))
    except ConfigError as exc:
        return {"backend": None, "absent": str(exc)}
    load_s = time.perf_counter() - started
    pss_added = tree_pss_mb() - pss_before
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
            request["tiktoken"] = stats(times)
            request["_tiktoken_counts"] = counts
        stall = {"1_core": loop_stall(counter)}
        tokenizer = counter.tokenizer_id(first.name)
    finally:
        counter.close()
    return {
        "backend": backend_of(tokenizer),
        "tokenizer": tokenizer,
        "load_s": round(load_s, 3),
        "pss_mb_added": round(pss_added, 1),
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


def against_hf(
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
        request["hf"] = stats(times)
        request["hf_agrees"] = True
        request["tiktoken_agrees"] = "_tiktoken_counts" in request
        request["exact_by_backend"] = _by_backend(request, backend_of(counter.tokenizer_id(model)))
        request["speedup_exact_vs_hf"] = round(
            request["hf"]["p50_ms"] / request["exact"]["p50_ms"], 1
        )
        request["speedup_decide_vs_hf"] = round(
            request["hf"]["p50_ms"] / request["decide"]["p50_ms"], 1
        )


def calibration(
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
