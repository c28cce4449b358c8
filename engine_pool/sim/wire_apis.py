"""vLLM's bodies and SSE events for the Responses, Anthropic Messages and pooling routes. Pure.

Modelled on vLLM main (2026):
- Responses (``vllm/entrypoints/openai/responses/{protocol,serving,streaming_events}.py``): the
  body is ``ResponsesResponse.model_dump()``; a stream is ``event: <type>\\ndata: <json>\\n\\n``
  per event (no ``[DONE]``): ``response.created``, ``response.in_progress``,
  ``response.output_item.added``, ``response.content_part.added``, one
  ``response.output_text.delta`` per token, ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done``, ``response.completed``, each
  with a ``sequence_number`` counting from 0.
- Anthropic Messages (``vllm/entrypoints/anthropic/{protocol,serving}.py``): the body is
  ``{"id", "type": "message", "role", "content": [{"type": "text", "text"}], "model",
  "stop_reason", "stop_sequence", "usage"}``; a stream is ``message_start``,
  ``content_block_start``, one ``content_block_delta`` (``text_delta``) per token,
  ``content_block_stop``, ``message_delta`` (stop reason and usage), ``message_stop``, each as
  ``event: <type>\\ndata: <json>\\n\\n``. ``stop_reason`` maps stop -> end_turn and length ->
  max_tokens. Errors are ``{"type": "error", "error": {"type", "message"}}``.
- Pooling (``vllm/entrypoints/pooling/``): embeddings (floats, or base64 of little-endian
  float32 when ``encoding_format`` is "base64", the openai SDK's default), pooling, score,
  rerank; usage counts prompt tokens only. ``/detokenize`` answers ``{"prompt": text}``.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from typing import Any

import orjson

from engine_pool import engine_api

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def event(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


# -- Responses --------------------------------------------------------------------------------


def _responses_usage(prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt_tokens + output_tokens,
    }


def output_message(item_id: str, text: str, status: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = [
        {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
    ]
    return {
        "id": item_id,
        "content": content if status == "completed" else [],
        "role": "assistant",
        "status": status,
        "type": "message",
    }


def response_body(
    id_: str,
    created: int,
    model: str,
    request: dict[str, Any],
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "id": id_,
        "created_at": created,
        "incomplete_details": None,
        "instructions": request.get("instructions"),
        "metadata": request.get("metadata"),
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "temperature": request.get("temperature", 1.0),
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": request.get("tools", []),
        "top_p": request.get("top_p", 1.0),
        "background": request.get("background", False),
        "max_output_tokens": request.get("max_output_tokens"),
        "max_tool_calls": request.get("max_tool_calls"),
        "previous_response_id": request.get("previous_response_id"),
        "prompt": None,
        "reasoning": request.get("reasoning"),
        "service_tier": request.get("service_tier", "auto"),
        "status": status,
        "text": request.get("text"),
        "top_logprobs": request.get("top_logprobs", 0),
        "truncation": request.get("truncation", "disabled"),
        "usage": usage,
        "user": request.get("user"),
        "input_messages": None,
        "output_messages": None,
    }


def response_full(
    id_: str,
    created: int,
    model: str,
    request: dict[str, Any],
    text: str,
    finish: str,
    tokens: tuple[int, int],
) -> dict[str, Any]:
    """The body of a finished Response; ``tokens`` is (prompt tokens, output tokens)."""
    status = "completed" if finish == "stop" else "incomplete"
    body = response_body(
        id_,
        created,
        model,
        request,
        status=status,
        output=[output_message("msg_" + id_.removeprefix("resp_"), text, "completed")],
        usage=_responses_usage(*tokens),
    )
    if status == "incomplete":
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    return body


class ResponsesEvents:
    """The event sequence of one streamed Response; ``sequence_number`` counts every event."""

    def __init__(self, id_: str, created: int, model: str, request: dict[str, Any]) -> None:
        self.id, self.created, self.model, self.request = id_, created, model, request
        self.item_id = "msg_" + id_.removeprefix("resp_")
        self.seq = 0
        self.text: list[str] = []

    def _next(self, kind: str, payload: dict[str, Any]) -> bytes:
        payload = {**payload, "sequence_number": self.seq, "type": kind}
        self.seq += 1
        return event(kind, payload)

    def _response(
        self, status: str, usage: dict[str, Any] | None, output: list[dict[str, Any]]
    ) -> dict[str, Any]:
        return response_body(
            self.id,
            self.created,
            self.model,
            self.request,
            status=status,
            output=output,
            usage=usage,
        )

    def opening(self) -> list[bytes]:
        part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
        return [
            self._next("response.created", {"response": self._response("in_progress", None, [])}),
            self._next(
                "response.in_progress", {"response": self._response("in_progress", None, [])}
            ),
            self._next(
                "response.output_item.added",
                {"item": output_message(self.item_id, "", "in_progress"), "output_index": 0},
            ),
            self._next(
                "response.content_part.added",
                {"content_index": 0, "item_id": self.item_id, "output_index": 0, "part": part},
            ),
        ]

    def token(self, text: str) -> bytes:
        self.text.append(text)
        return self._next(
            "response.output_text.delta",
            {
                "content_index": 0,
                "delta": text,
                "item_id": self.item_id,
                "logprobs": [],
                "output_index": 0,
            },
        )

    def closing(self, finish: str, prompt_tokens: int, output_tokens: int) -> list[bytes]:
        text = "".join(self.text)
        message = output_message(self.item_id, text, "completed")
        part = message["content"][0]
        final = self._response(
            "completed" if finish == "stop" else "incomplete",
            _responses_usage(prompt_tokens, output_tokens),
            [message],
        )
        if finish != "stop":
            final["incomplete_details"] = {"reason": "max_output_tokens"}
        return [
            self._next(
                "response.output_text.done",
                {
                    "content_index": 0,
                    "item_id": self.item_id,
                    "logprobs": [],
                    "output_index": 0,
                    "text": text,
                },
            ),
            self._next(
                "response.content_part.done",
                {"content_index": 0, "item_id": self.item_id, "output_index": 0, "part": part},
            ),
            self._next("response.output_item.done", {"item": message, "output_index": 0}),
            self._next("response.completed", {"response": final}),
        ]


# -- Anthropic Messages -----------------------------------------------------------------------

# vLLM's Anthropic server answers errors in Anthropic's shape, typed by HTTP status.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "api_error",
}


def anthropic_error_body(message: str, status: int) -> dict[str, Any]:
    return engine_api.anthropic_error_body(message, status, ANTHROPIC_ERROR_TYPES)


def message_full(
    id_: str, model: str, text: str, finish: str, prompt_tokens: int, output_tokens: int
) -> dict[str, Any]:
    return {
        "id": id_,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "model": model,
        "stop_reason": STOP_REASONS.get(finish, "end_turn"),
        "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": output_tokens},
    }


class MessagesEvents:
    def __init__(self, id_: str, model: str, prompt_tokens: int) -> None:
        self.id, self.model, self.prompt_tokens = id_, model, prompt_tokens

    def opening(self) -> list[bytes]:
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }
        block = {"type": "text", "text": ""}
        return [
            event("message_start", {"type": "message_start", "message": message}),
            event(
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": block},
            ),
        ]

    def token(self, text: str) -> bytes:
        delta = {"type": "text_delta", "text": text}
        return event(
            "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
        )

    def closing(self, finish: str, prompt_tokens: int, output_tokens: int) -> list[bytes]:
        usage = {"input_tokens": prompt_tokens, "output_tokens": output_tokens}
        delta = {"stop_reason": STOP_REASONS.get(finish, "end_turn")}
        return [
            event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}),
            event("message_stop", {"type": "message_stop"}),
        ]


# -- pooling ----------------------------------------------------------------------------------

EMBEDDING_DIM = 16


def embedding(text: str) -> list[float]:
    """A deterministic unit-ish vector from the text (same text, same vector)."""
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    return [round((b - 127.5) / 127.5, 6) for b in digest[:EMBEDDING_DIM]]


def _pool_usage(prompt_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


def _pool_list(
    id_: str, created: int, model: str, data: list[dict[str, Any]], prompt_tokens: int
) -> dict[str, Any]:
    return {
        "id": id_,
        "object": "list",
        "created": created,
        "model": model,
        "data": data,
        "usage": _pool_usage(prompt_tokens),
    }


def embeddings_body(
    id_: str, created: int, model: str, texts: list[str], prompt_tokens: int, encoding: str
) -> dict[str, Any]:
    data = []
    for i, text in enumerate(texts):
        vector = embedding(text)
        value: Any = vector
        if encoding == "base64":
            value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"index": i, "object": "embedding", "embedding": value})
    return _pool_list(id_, created, model, data, prompt_tokens)


def pooling_body(
    id_: str, created: int, model: str, texts: list[str], prompt_tokens: int
) -> dict[str, Any]:
    data = [{"index": i, "object": "pooling", "data": embedding(t)} for i, t in enumerate(texts)]
    return _pool_list(id_, created, model, data, prompt_tokens)


def score(text: str) -> float:
    return round(embedding(text)[0] / 2 + 0.5, 6)


def score_body(
    id_: str, created: int, model: str, pairs: list[str], prompt_tokens: int
) -> dict[str, Any]:
    data = [{"index": i, "object": "score", "score": score(p)} for i, p in enumerate(pairs)]
    return _pool_list(id_, created, model, data, prompt_tokens)


def rerank_body(
    id_: str,
    model: str,
    documents: list[str],
    pairs: list[str],
    prompt_tokens: int,
    top_n: int | None,
) -> dict[str, Any]:
    results: list[dict[str, Any]] = [
        {"index": i, "document": {"text": doc, "multi_modal": None}, "relevance_score": score(pair)}
        for i, (doc, pair) in enumerate(zip(documents, pairs, strict=True))
    ]
    results.sort(key=lambda r: -r["relevance_score"])
    return {
        "id": id_,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        "results": results[:top_n] if top_n else results,
    }
