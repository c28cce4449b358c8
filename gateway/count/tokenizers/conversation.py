"""The messages a chat template receives: vLLM 0.32's conversation, built from the request's.

vLLM does not hand a request's messages to the template as they came. Before rendering, it
(``vllm/renderers/chat_utils.py`` ``_parse_chat_message_content``, ``_postprocess_messages``;
``vllm/renderers/hf.py`` ``_detect_content_format``, ``safe_apply_chat_template``):

- picks a **content format** per template. ``content_format(ast)`` is its rule: "openai" when the
  template loops over a message's content (``for part in message.content``, a loop over a
  variable named ``content`` outside any macro, or a loop inside a macro over a parameter some
  call passes ``message.content`` to), else "string". Qwen3.6's template loops over its
  ``render_content`` macro's ``content``, so it is "openai"; the built-in ChatML is "string".
  - "string": a message's content becomes one string, its text parts (``text``, ``input_text``,
    ``output_text``, ``refusal``, ``thinking``; plain strings too) joined with "\\n"; empty
    texts and media parts leave nothing (media placeholders depend on the media and are not
    counted).
  - "openai": content becomes a list of ``{"type": "text", "text": ...}`` parts (a string content
    is one such part; media parts become ``{"type": "image"|"audio"|"video"}``), and the
    template joins them itself: Qwen's concatenates them with nothing between.
  - either way, a ``tool`` message whose parts are all text gets them joined with "\\n".
- drops Claude Code's billing line: in a ``system`` message, a text part that starts with
  ``x-anthropic-billing-header`` loses its first line (the part goes when nothing is left).
- keeps only the fields it knows: role, content, ``name`` and ``task`` (strings),
  ``tool_call_id`` (tool), ``tool_calls`` and ``reasoning`` (assistant; ``reasoning`` is handed
  on as ``reasoning`` and ``reasoning_content``), ``tools`` (developer). A request's own
  ``reasoning_content`` or ``thinking`` field never reaches the template.
- normalises an assistant's tool calls: an empty list is dropped; ``arguments`` become an
  object (a JSON string parsed; an empty, invalid or non-object one becomes ``{}``); a call
  that is not a ``function`` object is a 400.
- maps ``developer`` to ``system`` when the template does not name the role (neither
  ``"developer"`` nor ``'developer'`` in its source; Qwen3.6's does not), then merges every
  system message into one at the front (texts joined with "\\n\\n") when there is more than one
  or one stands anywhere but first.

``conversation(prompt, fmt, developer_role)`` returns that list of new dicts; the request's
messages are never changed. A message vLLM would refuse raises ``TemplateRejected``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

from jinja2 import nodes

from gateway.protocols.openai import ChatPrompt

ContentFormat = Literal["string", "openai"]

BILLING_HEADER = "x-anthropic-billing-header"
_TEXT_FIELDS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_MODALITY = {
    "image_url": "image",
    "input_image": "image",
    "image_pil": "image",
    "image_embeds": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "video_embeds": "video",
}


class TemplateRejected(ValueError):
    """The chat template refused the messages (as the engine would, with a 400)."""


# -- the content format: vLLM's reading of the template's syntax tree -------------------------


def _stripped(node: nodes.Node) -> nodes.Node:
    """``node`` without the filters, tests and slices around it (``messages[::-1]|list``)."""
    while True:
        if isinstance(node, nodes.Filter | nodes.Test) and node.node is not None:
            inner: nodes.Node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            inner = node.node
        else:
            return node
        node = inner


def _is_name(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether ``node`` reads variable ``name`` (or its ``key`` item), through filters."""
    node = _stripped(node)
    if key is None:
        return _is_name(node, name)
    if isinstance(node, nodes.Getitem):
        return (
            isinstance(node.arg, nodes.Const)
            and node.arg.value == key
            and _is_name(node.node, name)
        )
    if isinstance(node, nodes.Getattr):
        return node.attr == key and _is_name(node.node, name)
    return False


class _Unreadable(Exception):
    """A shape vLLM's detection does not handle (it falls back to "string")."""


def _target(loop: nodes.For | nodes.Assign) -> str:
    if not isinstance(loop.target, nodes.Name):
        raise _Unreadable
    return loop.target.name


def _message_names(root: nodes.Template) -> list[str]:
    """Loop variables over ``messages`` (or over a variable assigned from it)."""
    aliases = ["messages"]
    pending = ["messages"]
    while pending:
        name = pending.pop(0)
        for assign in root.find_all(nodes.Assign):
            if _reads(assign.node, name):
                alias = _target(assign)
                aliases.append(alias)
                if alias != name:
                    pending.append(alias)
    return [
        _target(loop)
        for loop in root.find_all(nodes.For)
        if any(_reads(loop.iter, alias) for alias in aliases)
    ]


def _content_loops(root: nodes.Template) -> Iterator[nodes.For]:
    messages = _message_names(root)

    def passes_content(arg: nodes.Node) -> bool:
        return any(_reads(arg, name, "content") for name in messages)

    in_macro: set[int] = set()
    macro_params: dict[int, set[str]] = {}
    for macro in root.find_all(nodes.Macro):
        names = [arg.name for arg in macro.args]
        params: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not _is_name(call.node, macro.name):
                continue
            params.update(
                names[i]
                for i, arg in enumerate(call.args)
                if i < len(names) and passes_content(arg)
            )
            params.update(
                kw.key for kw in call.kwargs if kw.key in names and passes_content(kw.value)
            )
        for loop in macro.find_all(nodes.For):
            in_macro.add(id(loop))
            if params:
                macro_params[id(loop)] = params
    for loop in root.find_all(nodes.For):
        over_content = any(_reads(loop.iter, name, "content") for name in messages)
        # A loop over a macro parameter that receives message.content, or (outside macros)
        # over a variable named content.
        over_param = isinstance(loop.iter, nodes.Name) and (
            loop.iter.name in macro_params.get(id(loop), ())
            or (id(loop) not in in_macro and loop.iter.name == "content")
        )
        if over_content or over_param:
            yield loop


def content_format(root: nodes.Template) -> ContentFormat:
    """vLLM's content format for a parsed template: "openai" when it loops over content."""
    try:
        found = next(_content_loops(root), None)
    except _Unreadable:
        return "string"
    return "string" if found is None else "openai"


def names_developer(source: str) -> bool:
    """vLLM's test of whether a template handles the ``developer`` role itself."""
    return '"developer"' in source or "'developer'" in source


# -- the conversation -----------------------------------------------------------------------


def _without_billing(parts: list[Any]) -> list[Any]:
    out = []
    for part in parts:
        if isinstance(part, str):
            text: Any = part
        elif isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _part(part: Any, fmt: ContentFormat) -> Any:
    """One content part as the template gets it (None: nothing)."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if fmt == "openai" else part
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind in _TEXT_FIELDS:
        text = part.get(_TEXT_FIELDS[kind])
        if not isinstance(text, str):
            return None
        return {"type": "text", "text": text} if fmt == "openai" else text
    if kind == "tool_reference":
        name = part.get("name")
        return {"type": "tool_reference", "name": name} if fmt == "openai" else name
    modality = _MODALITY.get(kind) if isinstance(kind, str) else None
    return {"type": modality} if fmt == "openai" and modality else None


def _content(content: Any, role: str, fmt: ContentFormat) -> Any:
    if isinstance(content, str) and not (role == "system" and content.startswith(BILLING_HEADER)):
        # One text, the common case, is what the general path below makes of it.
        if fmt == "string" or role == "tool":
            return content
        return [{"type": "text", "text": content}]  # (kept when empty, as a part is)
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [content]
    else:
        parts = list(content)
    if role == "system":
        parts = _without_billing(parts)
    # vLLM keeps only what is truthy: an empty text leaves no "\n" in the string format.
    items = [item for item in (_part(part, fmt) for part in parts) if item]
    if fmt == "string":
        return "\n".join(items)
    if role == "tool" and all(isinstance(i, dict) and i.get("type") == "text" for i in items):
        return "\n".join(i["text"] for i in items)
    return items


def _tool_calls(calls: list[Any]) -> list[Any]:
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise TemplateRejected(
                "chat completions only support assistant tool_calls of type 'function'."
            )
        out.append({**call, "function": {**function, "arguments": _arguments(function)}})
    return out


def _arguments(function: dict[str, Any]) -> dict[str, Any]:
    raw = function.get("arguments")
    if not raw:
        return {}
    parsed = raw
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except ValueError:
            # Not an error to record: vLLM coerces such arguments to {} and renders the turn.
            return {}
    return parsed if isinstance(parsed, dict) else {}


def _message(message: dict[str, Any], fmt: ContentFormat) -> dict[str, Any]:
    role = str(message.get("role"))
    out: dict[str, Any] = {"role": role, "content": _content(message.get("content"), role, fmt)}
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None:
            out["tool_calls"] = list(calls) if isinstance(calls, list) else calls
        reasoning = message.get("reasoning")
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    if "name" in message or "task" in message:
        for name in ("name", "task"):
            if isinstance(message.get(name), str):
                out[name] = message[name]
    if role == "developer":
        out["tools"] = message.get("tools")
    if "tool_calls" in out:  # an assistant's
        calls = out["tool_calls"]
        if isinstance(calls, list):
            if calls:
                out["tool_calls"] = _tool_calls(calls)
            else:
                del out["tool_calls"]
    return out


def _system_text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(
            part["text"] if isinstance(part, dict) else part
            for part in content
            if isinstance(part, str) or (isinstance(part, dict) and "text" in part)
        )
    return content if isinstance(content, str) else ""


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    converted = []
    for message in messages:
        if message["role"] == "developer":
            converted.append(
                {**{k: v for k, v in message.items() if k != "tools"}, "role": "system"}
            )
        else:
            converted.append(message)
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if not systems or systems == [0]:
        return converted
    texts = [_system_text(converted[i].get("content")) for i in systems]
    merged = {"role": "system", "content": "\n\n".join(text for text in texts if text)}
    return [merged, *(m for m in converted if m["role"] != "system")]


def conversation(
    prompt: ChatPrompt, fmt: ContentFormat, developer_role: bool
) -> list[dict[str, Any]]:
    """The messages vLLM hands the template (see the module docstring)."""
    messages = [_message(message, fmt) for message in prompt.messages]
    if not developer_role:
        for message in messages:
            if message["role"] == "developer":
                return _developer_as_system(messages)
    return messages
