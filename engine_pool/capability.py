"""What an engine says it can hold, held against what its lanes send it.

    parse_models(payload) -> Capability          GET /v1/models: served names, max_model_len
    parse_cache_config(text) -> int | None       /metrics: vllm:cache_config_info -> KV tokens
    judge(capability, needs) -> str | None       pure: why the engine is misconfigured, or None
    holds(view, tokens) / holding(views, tokens) pure: can an endpoint take a request of so
                                                 many tokens (prompt plus output)

vLLM's ``/v1/models`` lists each served name with the ``max_model_len`` the engine was started
with (``data[].max_model_len``); SGLang's has ``max_model_len`` too. vLLM also exports its cache
configuration as an info gauge, ``vllm:cache_config_info`` (one series set to 1 whose labels
are the ``CacheConfig`` fields, among them ``block_size`` and ``num_gpu_blocks``; from
``vllm/v1/metrics/loggers.py``, ``log_metrics_info``): their product is the KV cache's size in
tokens, which no sequence can outgrow. The engine's context is the smaller of the two known.

An endpoint is misconfigured when its context cannot hold the largest prompt a lane routing to
it admits plus the lane's ``min_output_tokens``, or when it serves none of the names of a model
the lane sends it. A misconfigured endpoint stays routable: requests it can hold still go to it,
and only those it cannot are kept away (``holding``), so one short engine never takes a lane
down; the evidence names both numbers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine_pool.cluster import EngineView

CACHE_CONFIG_INFO = "vllm:cache_config_info{"
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class Capability:
    """What an engine reports: its served model names and context, in tokens."""

    models: tuple[str, ...]
    max_model_len: int | None
    # block_size * num_gpu_blocks from vllm:cache_config_info; None where not exported.
    kv_capacity_tokens: int | None = None

    @property
    def context_tokens(self) -> int | None:
        known = [n for n in (self.max_model_len, self.kv_capacity_tokens) if n is not None]
        return min(known) if known else None

    def limit_text(self) -> str:
        """The context limit and where it comes from, for evidence and error messages."""
        if self.kv_capacity_tokens is not None and (
            self.max_model_len is None or self.kv_capacity_tokens < self.max_model_len
        ):
            return f"KV cache of {self.kv_capacity_tokens:,} tokens (vllm:cache_config_info)"
        return f"max_model_len {self.max_model_len:,}"


@dataclass(frozen=True, slots=True)
class LaneNeed:
    """What one lane asks of the engines it routes to."""

    lane: str
    # The largest prompt the lane admits (its max_prompt_tokens - 1) and the output tokens it
    # must still have room for.
    prompt_tokens: int
    output_tokens: int
    # The models the lane sends this cluster, each as all of its names (name, then aliases).
    models: tuple[tuple[str, ...], ...] = ()

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


class CapabilityError(ValueError):
    """The engine's /v1/models answer is not an OpenAI model list."""


def parse_models(payload: Any, kv_capacity_tokens: int | None = None) -> Capability:
    """The capability in a ``/v1/models`` body (parsed JSON); the smallest ``max_model_len``
    of the served names when they differ (vLLM serves one model under several names)."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        raise CapabilityError("/v1/models answer has no 'data' list")
    names = tuple(str(card["id"]) for card in data if isinstance(card, dict) and "id" in card)
    lengths = [
        card["max_model_len"]
        for card in data
        if isinstance(card, dict)
        and isinstance(card.get("max_model_len"), int)
        and card["max_model_len"] > 0
    ]
    return Capability(names, min(lengths) if lengths else None, kv_capacity_tokens)


def parse_cache_config(text: str) -> int | None:
    """KV cache capacity in tokens from ``vllm:cache_config_info`` (None when absent or when
    the engine has not sized its cache yet: ``num_gpu_blocks`` is ``None`` until profiling)."""
    at = text.find(CACHE_CONFIG_INFO)
    if at < 0 or (at > 0 and text[at - 1] != "\n"):
        return None
    end = text.find("}", at)
    fields = dict(_LABEL.findall(text[at + len(CACHE_CONFIG_INFO) : end if end >= 0 else None]))
    try:
        return int(fields["block_size"]) * int(fields["num_gpu_blocks"])
    except (KeyError, ValueError):
        return None


def judge(capability: Capability, needs: Sequence[LaneNeed]) -> str | None:
    """Why an engine reporting ``capability`` cannot serve its lanes, or None when it can."""
    problems = []
    context = capability.context_tokens
    for need in needs:
        if context is not None and need.context_tokens > context:
            problems.append(
                f"lane {need.lane!r} admits prompts of up to {need.prompt_tokens:,} tokens plus "
                f"{need.output_tokens:,} output tokens ({need.context_tokens:,}), but the engine "
                f"reports {capability.limit_text()}"
            )
        for names in need.models:
            if capability.models and not set(names) & set(capability.models):
                problems.append(
                    f"lane {need.lane!r} sends model {names[0]!r}, but the engine serves only "
                    f"{', '.join(repr(m) for m in capability.models)}"
                )
    return "; ".join(problems) or None


def holds(view: EngineView, tokens: int) -> bool:
    """Whether the endpoint's context takes ``tokens`` (prompt plus output); unknown: yes."""
    return view.context_tokens is None or tokens <= view.context_tokens


def holding(views: Sequence[EngineView], tokens: int) -> list[EngineView]:
    return [v for v in views if holds(v, tokens)]


def refusal(views: Sequence[EngineView], tokens: int) -> EngineView | None:
    """The routable endpoint with the largest context when no routable endpoint can hold
    ``tokens`` (the request is to be refused naming its limit); None otherwise (one holds it,
    or none is routable: that is a health matter, not this one)."""
    # One pass, no generator: both the active path and the shadow run it on every request.
    largest: EngineView | None = None
    for v in views:
        if v.state.routable:
            if holds(v, tokens):
                return None
            if largest is None or (v.context_tokens or 0) > (largest.context_tokens or 0):
                largest = v  # the first of the largest, as max() keeps
    return largest


def too_long_message(view: EngineView, lane: str, prompt: int) -> str:
    """The 400's message when no endpoint of the lane holds the prompt, in vLLM 0.32's words
    (measured: "... However, your prompt contains at least N input tokens, which exceeds this
    limit even without any output tokens ..."), naming the engine whose limit it is."""
    return (
        f"This model's maximum context length is {view.context_tokens} tokens on the engines "
        f"of lane '{lane}' ({view.url} reports it). However, your prompt contains {prompt} "
        "input tokens, which leaves no room for any output token. Please reduce the length "
        "of the input prompt."
    )
