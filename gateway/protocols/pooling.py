"""Embeddings, pooling, score, rerank, tokenize and detokenize: counted like batched completions.

Each text (or text pair) is its own sequence in the engine; the count is the LARGEST single
sequence, because a lane protects engines against one long prefill, not against the sum.

- ``/v1/embeddings``, ``/pooling``: ``input`` a string, strings, token ids or lists of token ids;
  or chat ``messages`` (vLLM's chat variant: no generation prompt unless asked).
- ``/v1/score``, ``/score``: ``queries``/``documents``, ``data_1``/``data_2`` or
  ``text_1``/``text_2``, each a string or strings: one side of one item is paired with every
  item of the other, two lists pair up index by index. A pair is counted as its two texts
  joined (a cross-encoder sees both plus a few special tokens).
- ``/v1/rerank``, ``/rerank``, ``/v2/rerank``: ``query`` paired with each of ``documents``
  (strings, or objects with ``text``).
- ``/tokenize``: ``prompt`` (text or ids) or chat ``messages`` (with the generation prompt
  unless asked otherwise, tools and chat_template_kwargs); ``/detokenize``: ``tokens``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine_pool.engine_api import RouteKind
from gateway.errors import BadRequest
from gateway.protocols.common import load_object, model_of, objects
from gateway.protocols.openai import ChatPrompt, CompletionPrompt, Prompt, RoutedRequest
from gateway.protocols.template_options import template_options
from gateway.protocols.tools import chat_tool


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _batch(value: Any, name: str) -> CompletionPrompt:
    """A completions-like input: text, texts, ids, or lists of ids."""
    if isinstance(value, str):
        return CompletionPrompt(texts=(value,))
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return CompletionPrompt(texts=tuple(value))
        if _is_ids(value):
            return CompletionPrompt(token_ids=(tuple(value),))
        if all(_is_ids(v) for v in value):
            return CompletionPrompt(token_ids=tuple(tuple(v) for v in value))
    raise BadRequest(f"'{name}' must be a string, an array of strings, or token ids", param=name)


def _chat(data: dict[str, Any], *, generation: bool) -> ChatPrompt:
    messages = objects(data.get("messages"), "messages")
    if not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    fields = {"add_generation_prompt": generation, **data}
    return ChatPrompt(
        messages=tuple(messages),
        tools=tuple(chat_tool(t) for t in objects(data.get("tools"), "tools")),
        options=template_options(fields),
    )


def _inputs(data: dict[str, Any]) -> Prompt:
    if "messages" in data:
        return _chat(data, generation=False)
    return _batch(data.get("input"), "input")


def _texts(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        texts = [v.get("text") if isinstance(v, dict) else v for v in value]
        if all(isinstance(t, str) for t in texts):
            return [str(t) for t in texts]
    raise BadRequest(f"'{name}' must be a string or an array of strings", param=name)


def _pairs(left: list[str], right: list[str], names: tuple[str, str]) -> CompletionPrompt:
    if len(left) == 1:
        pairs = [(left[0], r) for r in right]
    elif len(right) == 1:
        pairs = [(lt, right[0]) for lt in left]
    elif len(left) == len(right):
        pairs = list(zip(left, right, strict=True))
    else:
        raise BadRequest(
            f"'{names[0]}' and '{names[1]}' must pair one to many or index by index",
            param=names[1],
        )
    return CompletionPrompt(texts=tuple(a + b for a, b in pairs))


def _score(data: dict[str, Any]) -> Prompt:
    for names in (("queries", "documents"), ("data_1", "data_2"), ("text_1", "text_2")):
        if names[0] in data or names[1] in data:
            left = _texts(data.get(names[0]), names[0])
            return _pairs(left, _texts(data.get(names[1]), names[1]), names)
    raise BadRequest("'queries' and 'documents' are required", param="queries")


def _rerank(data: dict[str, Any]) -> Prompt:
    query = _texts(data.get("query"), "query")
    if len(query) != 1:
        raise BadRequest("'query' must be a string", param="query")
    return _pairs(query, _texts(data.get("documents"), "documents"), ("query", "documents"))


def _tokenize(data: dict[str, Any]) -> Prompt:
    if "messages" in data:
        return _chat(data, generation=True)
    return _batch(data.get("prompt"), "prompt")


def _detokenize(data: dict[str, Any]) -> Prompt:
    tokens = data.get("tokens")
    if not isinstance(tokens, list) or not _is_ids(tokens):
        raise BadRequest("'tokens' must be an array of token ids", param="tokens")
    return CompletionPrompt(token_ids=(tuple(tokens),))


_PROMPTS: dict[str, Callable[[dict[str, Any]], Prompt]] = {
    "embeddings": _inputs,
    "pooling": _inputs,
    "score": _score,
    "rerank": _rerank,
    "tokenize": _tokenize,
    "detokenize": _detokenize,
}


def parse_pooling(kind: RouteKind, body: bytes) -> RoutedRequest:
    data = load_object(body)
    return RoutedRequest(
        route=kind,
        model=model_of(data),
        prompt=_PROMPTS[kind](data),
        stream=False,
        include_usage=False,
        max_tokens=None,
        body_bytes=len(body),
    )
