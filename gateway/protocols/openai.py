"""The few OpenAI request fields routing reads; everything else passes through untouched.

Contract: ``parse_request(endpoint, body)`` takes the raw body bytes and returns a
``RoutedRequest`` or raises ``BadRequest`` (an OpenAI-shaped 400) naming the field at fault.
The body itself is never re-serialised: the proxy forwards the original bytes.

The prompt is validated as the engine would, before any slot is taken, by small pure functions
other routes reuse (``check_content``, ``check_part``, ``check_token_ids``,
``completion_prompt``):
- a completions prompt is a non-empty string, a non-empty array of non-empty strings, or one or
  more non-empty arrays of non-negative token ids (``""``, ``[]``, ``[[]]``, ``[""]`` are 400:
  vLLM answers those with a 500 or refuses them);
- a chat message's ``content`` is a string, null, or an array of content parts, each an object
  whose ``type`` is one vLLM knows; the OpenAI part types are checked field by field (``text``
  needs a string ``text``, ``image_url`` an ``image_url.url`` string, ``input_audio`` string
  ``data`` and ``format``, ``refusal`` a string ``refusal``). Image, audio, video and file parts
  count no tokens (their placeholder tokens depend on the media; see
  ``tokenizers/templates.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

from engine_pool.engine_api import RouteKind
from gateway.errors import BadRequest
from gateway.protocols.template_options import DEFAULT, TemplateOptions, template_options
from gateway.protocols.tools import chat_tool


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """Chat messages (plain JSON data), tool schemas as vLLM renders them, template options."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()
    options: TemplateOptions = DEFAULT


@dataclass(frozen=True, slots=True)
class CompletionPrompt:
    """A completions prompt: texts, or token id lists (counted as they are)."""

    texts: tuple[str, ...] = ()
    token_ids: tuple[tuple[int, ...], ...] = ()


Prompt = ChatPrompt | CompletionPrompt


class RoutedRequest(NamedTuple):
    """The request as routing sees it. A named tuple, not a frozen dataclass: made once a
    request, and a frozen dataclass's ``__init__`` sets each of its fields through
    ``object.__setattr__``."""

    route: RouteKind
    model: str
    prompt: Prompt
    stream: bool
    include_usage: bool
    max_tokens: int | None
    body_bytes: int
    # The field the output budget came from (vLLM names it in its errors).
    max_tokens_param: str = "max_tokens"
    # Responses only: the stored response this one continues (gateway/request/response_affinity.py).
    previous_response_id: str | None = None


def _loads(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        # orjson rejects nesting deeper than 1024 and invalid UTF-8 with this same error type.
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc


def _max_tokens(data: dict[str, Any]) -> tuple[int | None, str]:
    """The output budget and the field it came from (``max_completion_tokens`` first)."""
    for field in ("max_completion_tokens", "max_tokens"):
        value = data.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequest(f"'{field}' must be an integer", param=field)
        if value < 1:
            raise BadRequest(f"'{field}' must be at least 1, got {value}", param=field)
        return value, field
    return None, "max_tokens"


# Part types vLLM's chat parser accepts (vllm/entrypoints/chat_utils.py); the OpenAI ones are
# checked field by field in check_part, the others are the engine's to judge.
PART_TYPES = frozenset(
    {
        "text",
        "input_text",
        "output_text",
        "refusal",
        "thinking",
        "image_url",
        "input_image",
        "image_embeds",
        "image_pil",
        "input_audio",
        "audio_url",
        "audio_embeds",
        "video_url",
        "file",
    }
)
# Per OpenAI part type: the field that must be an object (None: a string field) and the string
# fields required in it.
_PART_FIELDS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "text": (None, ("text",)),
    "input_text": (None, ("text",)),
    "output_text": (None, ("text",)),
    "refusal": (None, ("refusal",)),
    "image_url": ("image_url", ("url",)),
    "input_audio": ("input_audio", ("data", "format")),
}


def check_part(part: Any, where: str) -> None:
    """One content part against the OpenAI schema of its type; ``where`` names it in errors."""
    if not isinstance(part, dict):
        raise BadRequest(f"'{where}' must be an object (a content part)", param="messages")
    kind = part.get("type")
    if not isinstance(kind, str) or kind not in PART_TYPES:
        raise BadRequest(
            f"'{where}.type' must be one of {', '.join(sorted(PART_TYPES))}", param="messages"
        )
    holder, fields = _PART_FIELDS.get(kind, (None, ()))
    scope: Any = part
    if holder is not None:
        scope = part.get(holder)
        if kind == "image_url" and isinstance(scope, str):
            return  # vLLM's shorthand: {"type": "image_url", "image_url": "https://..."}
        if not isinstance(scope, dict):
            raise BadRequest(f"'{where}.{holder}' must be an object", param="messages")
        where = f"{where}.{holder}"
    for name in fields:
        if not isinstance(scope.get(name), str):
            raise BadRequest(f"'{where}.{name}' must be a string", param="messages")


def check_content(content: Any, where: str) -> None:
    """A message's content: a string, null, or an array of valid content parts."""
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise BadRequest(f"'{where}' must be a string or an array", param="messages")
    for j, part in enumerate(content):
        check_part(part, f"{where}[{j}]")


def _chat_prompt(data: dict[str, Any]) -> ChatPrompt:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"'messages[{i}]' must be an object", param="messages")
        if not isinstance(message.get("role"), str):
            raise BadRequest(f"'messages[{i}].role' must be a string", param="messages")
        check_content(message.get("content"), f"messages[{i}].content")
    tools = data.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRequest("'tools' must be an array of objects", param="tools")
    return ChatPrompt(
        messages=tuple(messages),
        tools=tuple(chat_tool(t) for t in tools),
        options=template_options(data),
    )


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def check_token_ids(ids: list[int], where: str) -> tuple[int, ...]:
    """A token-id prompt: non-empty, every id non-negative."""
    if not ids:
        raise BadRequest(f"'{where}' is an empty token list", param="prompt")
    if min(ids) < 0:
        raise BadRequest(f"'{where}' holds a negative token id", param="prompt")
    return tuple(ids)


def completion_prompt(prompt: Any) -> CompletionPrompt:
    """A completions ``prompt``: non-empty text(s) or non-empty token id list(s)."""
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' is empty", param="prompt")
        return CompletionPrompt(texts=(prompt,))
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            if not all(prompt):
                raise BadRequest("'prompt' holds an empty string", param="prompt")
            return CompletionPrompt(texts=tuple(prompt))
        if _is_ids(prompt):
            return CompletionPrompt(token_ids=(check_token_ids(prompt, "prompt"),))
        if all(_is_ids(p) for p in prompt):
            return CompletionPrompt(
                token_ids=tuple(check_token_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt))
            )
    if prompt == []:
        raise BadRequest("'prompt' is empty", param="prompt")
    raise BadRequest("'prompt' must be a string, an array of strings, or token ids", param="prompt")


def parse_request(kind: RouteKind, body: bytes) -> RoutedRequest:
    """Read the routing fields of an OpenAI chat or completions request body."""
    data = _loads(body)
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string", param="model")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    options = data.get("stream_options") or {}
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    prompt: Prompt = _chat_prompt(data) if kind == "chat" else completion_prompt(data.get("prompt"))
    max_tokens, max_tokens_param = _max_tokens(data)
    return RoutedRequest(
        route=kind,
        model=model,
        prompt=prompt,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        body_bytes=len(body),
        max_tokens_param=max_tokens_param,
    )
