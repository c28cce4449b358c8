"""``POST /v1/responses``: the chat messages vLLM renders for a Responses request.

Follows vLLM's ``construct_input_messages`` and ``construct_tool_dicts``
(``vllm/entrypoints/openai/responses/utils.py``):

- ``instructions`` (if non-empty) becomes the first message, role ``system``;
- ``input`` as a string becomes one ``user`` message;
- ``input`` as a list of items, in order:
  - a message object (``role`` user/system/developer, ``content`` a string or parts such as
    ``input_text``) is passed as it is;
  - an assistant message (``role: assistant`` or ``type: message`` output) becomes
    ``{"role": "assistant", "content": <its first part's text>}``, merged into a directly
    preceding assistant message that has no content yet;
  - ``function_call`` becomes a tool call ``{"id": call_id, "function": {"name", "arguments"},
    "type": "function"}``, appended to a directly preceding assistant message, else a new
    assistant message holding only ``tool_calls``;
  - ``function_call_output`` becomes ``{"role": "tool", "content": output, "tool_call_id"}``;
  - ``reasoning`` becomes the assistant message's ``reasoning`` (content text, else summary);
- ``tools``: function tools only, dumped as vLLM does (``tools.responses_tool``), rendered
  whatever ``tool_choice`` says (as vLLM does by default);
- a last item that is an assistant message or reasoning with ``status`` "in_progress" or
  "incomplete" is continued (``continue_final_message``, no generation prompt), as in vLLM;
- ``chat_template_kwargs`` pass to the template; ``max_output_tokens`` is the output budget.

``previous_response_id``: the engine that stored that response prepends its conversation; the
gateway cannot see it, so the count covers this request's own input only (a lower bound), and
the request is sent to that engine (``gateway/request/response_affinity.py``).
"""

from __future__ import annotations

from typing import Any

from gateway.errors import BadRequest
from gateway.protocols.common import load_object, model_of, objects, positive_int, stream_of
from gateway.protocols.openai import ChatPrompt, RoutedRequest
from gateway.protocols.template_options import template_options
from gateway.protocols.tools import responses_tool


def _first_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        first = content[0]
        if isinstance(first, dict):
            text = first.get("text", "")
            return text if isinstance(text, str) else ""
        return first if isinstance(first, str) else ""
    return ""


def _reasoning(item: dict[str, Any]) -> str:
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list) and parts:
            first = parts[0]
            text = first.get("text", "") if isinstance(first, dict) else first
            return text if isinstance(text, str) else ""
    return ""


def _message(item: dict[str, Any], prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """A new chat message for ``item``, or None when it was merged into ``prev``."""
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    kind = item.get("type")
    if kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            "type": "function",
        }
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise BadRequest("Encrypted content is not supported.", param="input")
        text = _reasoning(item)
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = text
            return None
        return {"role": "assistant", "reasoning": text}
    if item.get("role") == "assistant":
        text = _first_text(item.get("content"))
        if assistant is not None and assistant.get("content") is None:
            assistant["content"] = text
            return None
        return {"role": "assistant", "content": text}
    if not isinstance(item.get("role"), str):
        raise BadRequest(f"input item of type {kind!r} is not supported", param="input")
    return item


def responses_messages(data: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string", param="instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    request_input = data.get("input")
    if isinstance(request_input, str):
        messages.append({"role": "user", "content": request_input})
        return messages
    for item in objects(request_input, "input"):
        message = _message(item, messages[-1] if messages else None)
        if message is not None:
            messages.append(message)
    return messages


def parse_responses(body: bytes) -> RoutedRequest:
    data = load_object(body)
    model = model_of(data)
    if "input" not in data:
        raise BadRequest("'input' is required", param="input")
    messages = responses_messages(data)
    if not messages:
        raise BadRequest("'input' must not be empty", param="input")
    tools = tuple(
        responses_tool(t)
        for t in objects(data.get("tools"), "tools")
        if t.get("type") == "function"
    )
    partial = _continues(data.get("input"))
    options = template_options(
        {
            "chat_template_kwargs": data.get("chat_template_kwargs"),
            "add_generation_prompt": not partial,
            "continue_final_message": partial,
        }
    )
    previous = data.get("previous_response_id")
    if previous is not None and not (isinstance(previous, str) and previous):
        raise BadRequest("'previous_response_id' must be a string", param="previous_response_id")
    return RoutedRequest(
        route="responses",
        model=model,
        prompt=ChatPrompt(messages=tuple(messages), tools=tools, options=options),
        stream=stream_of(data),
        include_usage=True,
        max_tokens=positive_int(data, "max_output_tokens"),
        max_tokens_param="max_output_tokens",
        body_bytes=len(body),
        previous_response_id=previous,
    )


def _continues(request_input: Any) -> bool:
    """vLLM's should_continue_final_message: a partial assistant message or reasoning last."""
    if not isinstance(request_input, list) or not request_input:
        return False
    last = request_input[-1]
    return (
        isinstance(last, dict)
        and last.get("type", "message") in ("message", "reasoning")
        and last.get("status") in ("in_progress", "incomplete")
    )
