"""Tool schemas as vLLM hands them to the chat template (``tool.model_dump()`` of its models).

vLLM validates every tool into ``ChatCompletionToolsParam(type, function: FunctionDefinition(
name, description, parameters))`` with extra fields allowed, then renders ``model_dump()``: the
declared fields always appear (``null`` when absent), in declaration order, followed by any extra
fields in the order sent. A template that prints ``tool | tojson`` (Qwen's does) therefore sees
``"description": null``, which is real tokens the count must include.

- ``chat_tool(tool)``: a Chat Completions tool (``{"type": "function", "function": {...}}``).
- ``responses_tool(tool)``: a flat Responses function tool; vLLM dumps the openai SDK's
  ``FunctionTool`` (all its fields, ``null`` when unset) and moves everything but ``type`` into
  ``function``. ``RESPONSES_TOOL_FIELDS`` is that model's field order in openai 3.x; other SDK
  versions add or drop a null field (a few tokens). Non-function tools are not rendered.
- ``anthropic_tool(tool)``: ``name``, ``description``, ``input_schema`` as ``parameters``, and
  vLLM's ``defer_loading`` extra.
A tool that is not an object of the expected shape is passed through as sent: the engine
answers 400 for it, and the template rejects or renders it the same way here.
"""

from __future__ import annotations

from typing import Any

_DECLARED = ("name", "description", "parameters")
# openai.types.responses.FunctionTool's fields, in model_dump() order (openai 3.x).
RESPONSES_TOOL_FIELDS = (
    "name",
    "parameters",
    "strict",
    "type",
    "allowed_callers",
    "async_",
    "defer_loading",
    "description",
    "output_schema",
)


def _function(fields: dict[str, Any]) -> dict[str, Any]:
    out = {name: fields.get(name) for name in _DECLARED}
    out.update((k, v) for k, v in fields.items() if k not in out)
    return out


def chat_tool(tool: Any) -> Any:
    if not (isinstance(tool, dict) and isinstance(tool.get("function"), dict)):
        return tool
    out: dict[str, Any] = {"type": tool.get("type", "function"), "function": {}}
    out["function"] = _function(tool["function"])
    out.update((k, v) for k, v in tool.items() if k not in out)
    return out


def responses_tool(tool: dict[str, Any]) -> dict[str, Any]:
    dumped = {name: tool.get(name) for name in RESPONSES_TOOL_FIELDS}
    dumped.update((k, v) for k, v in tool.items() if k not in dumped and k != "async")
    if "async" in tool:
        dumped["async_"] = tool["async"]
    return {
        "type": "function",
        "function": _function({k: v for k, v in dumped.items() if k != "type"}),
    }


def anthropic_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": tool.get("input_schema"),
        "defer_loading": tool.get("defer_loading"),
    }
    return {"type": "function", "function": function}
