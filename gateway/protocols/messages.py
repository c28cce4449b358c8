"""``POST /v1/messages`` (Anthropic): the chat messages vLLM renders for a Messages request.

Follows vLLM's ``AnthropicServingMessages._convert_anthropic_to_openai_request``
(``vllm/entrypoints/anthropic/serving.py``):

- ``system`` (a string, or text blocks) and any ``role: system`` messages are joined with no
  separator into one leading ``system`` message; text blocks starting with
  ``x-anthropic-billing-header`` are dropped (Claude Code's per-request hash);
- each other message keeps its role; a string content stays a string; blocks become:
  ``text`` -> a text part, ``image`` -> an image part (not counted: media placeholders depend on
  the image), ``thinking`` -> the message's ``reasoning``, ``tool_use`` -> a tool call whose
  arguments are ``json.dumps(input)``, ``tool_result`` in a user message -> a ``tool`` message
  (its text blocks joined by newlines) placed before the user message, ``tool_result`` in an
  assistant message -> a text part "Tool result: ...";
  a single text part becomes a plain string; a user message left with no content is dropped;
- ``tools``: ``{"type": "function", "function": {name, description, parameters:
  input_schema, defer_loading}}``; ``chat_template_kwargs`` pass to the template;
- ``max_tokens`` is the output budget.
Errors on this route are answered in Anthropic's shape (``gateway/errors.py``).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import BadRequest
from gateway.protocols.common import load_object, model_of, objects, positive_int, stream_of
from gateway.protocols.openai import ChatPrompt, RoutedRequest
from gateway.protocols.template_options import template_options
from gateway.protocols.tools import anthropic_tool

BILLING_HEADER = "x-anthropic-billing-header"


def _system_texts(content: Any, where: str) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content] if content else []
    texts = []
    for block in objects(content, where):
        text = block.get("text")
        wanted = block.get("type") == "text" and isinstance(text, str) and text
        if wanted and not str(text).startswith(BILLING_HEADER):
            texts.append(str(text))
    return texts


def _tool_result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(item.get("text", ""))
            for item in content
            if isinstance(item, dict) and item.get("type") == "text"
        )
    return ""


def _convert(message: dict[str, Any], out: list[dict[str, Any]], i: int) -> None:
    role = message.get("role")
    if not isinstance(role, str):
        raise BadRequest(f"'messages[{i}].role' must be a string", param="messages")
    converted: dict[str, Any] = {"role": role}
    content = message.get("content")
    if isinstance(content, str):
        converted["content"] = content
        out.append(converted)
        return
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in objects(content, f"messages[{i}].content"):
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": ""}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(str(block["thinking"]))
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block.get("id") or "call_0",
                    "type": "function",
                    "function": {
                        "name": block.get("name") or "",
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
        elif kind == "tool_result":
            if role == "user":
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.get("tool_use_id") or "",
                        "content": _tool_result_text(block.get("content")) or "",
                    }
                )
            else:
                text = str(block["content"]) if block.get("content") else ""
                parts.append({"type": "text", "text": f"Tool result: {text}"})
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if calls:
        converted["tool_calls"] = calls
    if parts:
        only_text = len(parts) == 1 and parts[0]["type"] == "text"
        converted["content"] = parts[0]["text"] if only_text else parts
    if not (role == "user" and "content" not in converted):
        out.append(converted)


def anthropic_messages(data: dict[str, Any]) -> list[dict[str, Any]]:
    raw = objects(data.get("messages"), "messages")
    system = _system_texts(data.get("system"), "system")
    for i, message in enumerate(raw):
        if message.get("role") == "system":
            system.extend(_system_texts(message.get("content"), f"messages[{i}].content"))
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": "".join(system)})
    for i, message in enumerate(raw):
        if message.get("role") != "system":
            _convert(message, out, i)
    return out


def parse_messages(body: bytes) -> RoutedRequest:
    data = load_object(body)
    model = model_of(data)
    if not isinstance(data.get("messages"), list) or not data["messages"]:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    messages = anthropic_messages(data)
    tools = tuple(anthropic_tool(t) for t in objects(data.get("tools"), "tools"))
    options = template_options({"chat_template_kwargs": data.get("chat_template_kwargs")})
    return RoutedRequest(
        route="messages",
        model=model,
        prompt=ChatPrompt(messages=tuple(messages), tools=tools, options=options),
        stream=stream_of(data),
        include_usage=True,
        max_tokens=positive_int(data, "max_tokens"),
        max_tokens_param="max_completion_tokens",
        body_bytes=len(body),
    )
