"""Load and progress read from each engine's own Prometheus ``/metrics``.

    vLLM     vllm:num_requests_running, vllm:num_requests_waiting,
             vllm:kv_cache_usage_perc (older engines: vllm:gpu_cache_usage_perc),
             vllm:prompt_tokens_total + vllm:generation_tokens_total (progress)
    SGLang   sglang:num_running_reqs, sglang:num_queue_reqs, sglang:token_usage,
             sglang:prompt_tokens_total + sglang:generation_tokens_total (progress)
    both     process_start_time_seconds (``started_s``: the server process's start, Unix
             seconds, from prometheus_client's process collector; a new value is a restart)

``parse_load`` is pure: it sums each series over its label sets (several models or engine
cores) and returns ``Load`` with None for what the engine does not export (``started_s`` is
the highest value, never a sum: one process, one start). ``Progress`` tells whether the token
counters moved between two scrapes, which is how a probe that timed out is
told apart: a busy engine makes progress, a hung one does not. A failed or stale scrape never
blocks routing; the picker simply has no load figure for that endpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from engine_pool.cluster import EngineKind

NAMES: dict[EngineKind, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "running": ("vllm:num_requests_running",),
        "waiting": ("vllm:num_requests_waiting",),
        "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "tokens": ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"),
        "started": ("process_start_time_seconds",),
    },
    "sglang": {
        "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",),
        "kv_usage": ("sglang:token_usage",),
        "tokens": ("sglang:prompt_tokens_total", "sglang:generation_tokens_total"),
        "started": ("process_start_time_seconds",),
    },
}


@dataclass(frozen=True, slots=True)
class Load:
    running: float | None
    waiting: float | None
    kv_usage: float | None
    # Prompt plus generated tokens processed since the engine started.
    tokens_total: float | None
    # When the engine's server process started (Unix seconds): changes when it restarts.
    started_s: float | None = None


def _line_starts(text: str, name: str) -> Iterator[int]:
    """Where the lines beginning with ``name`` start (C-speed ``find``, no split of the text)."""
    at = 0 if text.startswith(name) else -1
    if at < 0:
        found = text.find("\n" + name)
        at = found + 1 if found >= 0 else -1
    while at >= 0:
        yield at
        found = text.find("\n" + name, at)
        at = found + 1 if found >= 0 else -1


def _samples(
    text: str, names: Iterable[str], highest: frozenset[str] = frozenset()
) -> dict[str, float]:
    """The sum over label sets of each series in ``names`` (the highest value, for those in
    ``highest``). Only those lines are read: an
    engine's /metrics holds thousands of histogram lines (a vLLM's: ~2,600 lines, 10 ms to
    split and parse whole on a loaded core, every scrape interval, on the event loop), and the
    load needs six series."""
    sums: dict[str, float] = {}
    for name in names:
        for at in _line_starts(text, name):
            end = text.find("\n", at)
            line = text[at : end if end >= 0 else len(text)]
            rest = line[len(name) :]
            if rest[:1] == "{":
                value_part = rest[rest.rfind("}") + 1 :].split()
            elif rest[:1] in (" ", "\t"):
                value_part = rest.split()
            else:
                continue  # a longer name that starts with this one
            if not value_part:
                continue
            try:
                value = float(value_part[0])
            except ValueError:
                continue
            if not math.isfinite(value):
                continue
            if name in highest:
                sums[name] = max(sums.get(name, value), value)
            else:
                sums[name] = sums.get(name, 0.0) + value
    return sums


def parse_load(kind: EngineKind, text: str) -> Load:
    names = NAMES[kind]
    sums = _samples(
        text, (n for series in names.values() for n in series), frozenset(names["started"])
    )

    def first(what: str) -> float | None:
        return next((sums[n] for n in names[what] if n in sums), None)

    token_series = [sums[n] for n in names["tokens"] if n in sums]
    return Load(
        running=first("running"),
        waiting=first("waiting"),
        kv_usage=first("kv_usage"),
        tokens_total=sum(token_series) if token_series else None,
        started_s=first("started"),
    )


@dataclass(slots=True)
class Progress:
    """Whether an engine's token counters advanced between the last two scrapes."""

    last_total: float | None = None
    advanced: bool = False

    def update(self, total: float | None) -> None:
        self.advanced = (
            total is not None and self.last_total is not None and total > self.last_total
        )
        if total is not None:
            self.last_total = total
