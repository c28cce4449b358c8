"""Load and progress read from each engine's own Prometheus ``/metrics``.

    vLLM     vllm:num_requests_running, vllm:num_requests_waiting,
             vllm:kv_cache_usage_perc (older engines: vllm:gpu_cache_usage_perc),
             vllm:prompt_tokens_total + vllm:generation_tokens_total (progress)
    SGLang   sglang:num_running_reqs, sglang:num_queue_reqs, sglang:token_usage,
             sglang:prompt_tokens_total + sglang:generation_tokens_total (progress)

``parse_load`` is pure: it sums each series over its label sets (several models or engine
cores) and returns ``Load`` with None for what the engine does not export. ``Progress`` tells
whether the token counters moved between two scrapes, which is how a probe that timed out is
told apart: a busy engine makes progress, a hung one does not. A failed or stale scrape never
blocks routing; the picker simply has no load figure for that endpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine_pool.cluster import EngineKind

NAMES: dict[EngineKind, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "running": ("vllm:num_requests_running",),
        "waiting": ("vllm:num_requests_waiting",),
        "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "tokens": ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"),
    },
    "sglang": {
        "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",),
        "kv_usage": ("sglang:token_usage",),
        "tokens": ("sglang:prompt_tokens_total", "sglang:generation_tokens_total"),
    },
}


@dataclass(frozen=True, slots=True)
class Load:
    running: float | None
    waiting: float | None
    kv_usage: float | None
    # Prompt plus generated tokens processed since the engine started.
    tokens_total: float | None


def _samples(text: str) -> dict[str, float]:
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            value_part = line[line.rfind("}") + 1 :].split()
        else:
            name, *value_part = line.split()
        if not value_part:
            continue
        try:
            value = float(value_part[0])
        except ValueError:
            continue
        if math.isfinite(value):
            sums[name] = sums.get(name, 0.0) + value
    return sums


def parse_load(kind: EngineKind, text: str) -> Load:
    sums = _samples(text)
    names = NAMES[kind]

    def first(what: str) -> float | None:
        return next((sums[n] for n in names[what] if n in sums), None)

    token_series = [sums[n] for n in names["tokens"] if n in sums]
    return Load(
        running=first("running"),
        waiting=first("waiting"),
        kv_usage=first("kv_usage"),
        tokens_total=sum(token_series) if token_series else None,
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
