"""What changes the rendered chat prompt besides the messages and tools (vLLM's request fields).

Contract: ``template_options(data)`` reads ``add_generation_prompt`` (default true),
``continue_final_message`` (default false; both true is a 400, as in vLLM),
``chat_template_kwargs`` (an object; e.g. Qwen's ``enable_thinking``) and ``documents`` (an
array of objects) from a request body, raising ``BadRequest`` naming the field at fault.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import BadRequest

# Names the renderer sets itself; chat_template_kwargs cannot override them (vLLM drops them too).
RESERVED = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}
)


@dataclass(frozen=True, slots=True)
class TemplateOptions:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    documents: tuple[dict[str, Any], ...] | None = None


DEFAULT = TemplateOptions()


def _flag(data: Mapping[str, Any], name: str, default: bool) -> bool:
    value = data.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean", param=name)
    return value


def template_options(data: Mapping[str, Any]) -> TemplateOptions:
    generation = _flag(data, "add_generation_prompt", True)
    cont = _flag(data, "continue_final_message", False)
    if generation and cont:
        raise BadRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    kwargs = data.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    documents = data.get("documents")
    if documents is not None and not (
        isinstance(documents, list) and all(isinstance(d, dict) for d in documents)
    ):
        raise BadRequest("'documents' must be an array of objects", param="documents")
    if not (kwargs or documents is not None or not generation):
        return DEFAULT
    return TemplateOptions(
        add_generation_prompt=generation,
        continue_final_message=cont,
        kwargs={k: v for k, v in kwargs.items() if k not in RESERVED},
        documents=None if documents is None else tuple(documents),
    )
