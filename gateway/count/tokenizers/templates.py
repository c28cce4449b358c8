"""What the engine sees for chat messages: built-in ChatML pieces, or the model's Jinja template.

Contract:
- ``chatml_pieces(prompt)`` returns the ChatML prompt as one string a message, in order:
  ``<|im_start|>{role}\\n{text}<|im_end|>\\n`` each, then ``<|im_start|>assistant\\n``.
  Every piece starts with ``<|im_start|>``, so where that is a special token the pieces tokenize
  independently and their counts add up to the count of the whole (tested).
- ``ChatTemplate(source, variables).render(prompt)`` renders a Hugging Face chat template the way
  transformers does (sandboxed Jinja, ``trim_blocks``/``lstrip_blocks``, ``tojson``,
  ``raise_exception``, ``continue_final_message`` cut at a marker) with the
  prompt's ``TemplateOptions`` (``add_generation_prompt``, ``continue_final_message``,
  ``documents``, ``chat_template_kwargs`` such as ``enable_thinking``), over the conversation
  vLLM builds from the messages (``tokenizers/conversation.py``: the template's content format,
  developer -> system, the Claude Code billing line dropped, tool-call arguments as objects).
  ``ChatTemplate.content_format`` is the format vLLM detects for the template ("openai" for
  Qwen3.6's: text parts reach it as a list and it concatenates them). A template that rejects
  the messages raises ``TemplateRejected``; so does a template error on odd input.
- The built-in ChatML honours ``add_generation_prompt`` and ``continue_final_message`` (the last
  message left open); it has no variables, so ``chat_template_kwargs`` change nothing there.
- ``split_before(text, token)`` cuts a rendered prompt before each occurrence of ``token``.

What the built-in ChatML renders, and where it differs from Qwen3.6's own template
(``tokenizer_data/qwen3.6/chat_template.jinja``, the ``hf`` mode):
- text: vLLM's "string" content format (its own ``template_chatml.jinja`` reads content as a
  string): a string content as is; text parts of an array joined with "\\n"; ``null`` as
  nothing; image/audio parts render nothing (the engine's placeholder tokens depend on the
  media and are not counted). Qwen3.6's template is "openai": its text parts are concatenated.
- role ``developer``: rendered as ``system`` (merged into one leading system message), as vLLM
  does for templates that do not name the role.
- ``tools``: one leading system message, ``# Tools\\n\\n<tools>\\n{json a line}\\n</tools>``.
  Qwen3.6 merges them into the system message with ~230 tokens of instructions.
- ``tool_calls``: ``\\n<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` after the
  text (Qwen2.5/Hermes style). Qwen3.6 renders ``<function=...><parameter=...>`` XML.
- role ``tool``: its own ``<|im_start|>tool`` message. Qwen3.6 folds consecutive tool results
  into one user message of ``<tool_response>`` blocks.
- no trimming; Qwen3.6 strips each message's surrounding whitespace.
- generation prompt ``<|im_start|>assistant\\n``; Qwen3.6 adds ``<think>\\n`` (2 tokens), and
  wraps assistant turns after the last user query in ``<think>...</think>``.
For a plain conversation the two differ by those 2 tokens (a test pins this).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.count.tokenizers.conversation import (
    ContentFormat,
    TemplateRejected,
    content_format,
    conversation,
    names_developer,
)
from gateway.protocols.openai import ChatPrompt

__all__ = ["GENERATION_PROMPT", "ChatTemplate", "TemplateRejected", "chatml_pieces"]

GENERATION_PROMPT = "<|im_start|>assistant\n"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _tool_calls_text(calls: Any) -> str:
    if not isinstance(calls, list):
        return ""
    out = []
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else {}
        if not isinstance(function, dict):
            continue
        body = {"name": function.get("name"), "arguments": function.get("arguments")}
        out.append(f"\n<tool_call>\n{_dumps(body)}\n</tool_call>")
    return "".join(out)


def chatml_pieces(prompt: ChatPrompt) -> list[str]:
    """The ChatML prompt, one piece a message (see the module docstring for what is rendered)."""
    pieces = []
    if prompt.tools:
        lines = "\n".join(_dumps(tool) for tool in prompt.tools)
        pieces.append(f"<|im_start|>system\n# Tools\n\n<tools>\n{lines}\n</tools><|im_end|>\n")
    # vLLM's conversation for a template that reads content as a string and names no
    # developer role (its own template_chatml.jinja): parts joined with "\n", developer -> system.
    for message in conversation(prompt, "string", developer_role=False):
        calls = _tool_calls_text(message["tool_calls"]) if "tool_calls" in message else ""
        # One join: a 1 MB message is copied once, not once per "+".
        role = str(message["role"])
        text = message["content"]
        pieces.append("".join(("<|im_start|>", role, "\n", text, calls, "<|im_end|>\n")))
    if prompt.options.continue_final_message and len(pieces) > 1:
        pieces[-1] = pieces[-1].removesuffix("<|im_end|>\n")
    elif prompt.options.add_generation_prompt:
        pieces.append(GENERATION_PROMPT)
    return pieces


def plain_text(prompt: ChatPrompt) -> str:
    """``chat_template: none``: the messages' texts joined by newlines, nothing else."""
    return "\n".join(_text(message.get("content")) for message in prompt.messages)


def split_before(text: str, token: str | None) -> list[str]:
    """``text`` cut just before every occurrence of ``token`` (no empty pieces)."""
    if token is None:
        return [text] if text else []
    pieces = []
    start = 0
    at = text.find(token, 1)
    while at != -1:
        pieces.append(text[start:at])
        start = at
        at = text.find(token, at + len(token))
    pieces.append(text[start:])
    return [piece for piece in pieces if piece]


def _raise(message: str) -> None:
    raise TemplateRejected(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: json.dumps without HTML escaping (Jinja's own escapes '<' and '>').
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class ChatTemplate:
    """A compiled Hugging Face chat template."""

    def __init__(self, source: str, variables: Mapping[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().astimezone().strftime(fmt)
        self._template = env.from_string(source)  # raises TemplateSyntaxError on a bad template
        self._variables = dict(variables)
        self.content_format: ContentFormat = content_format(env.parse(source))
        self.developer_role = names_developer(source)

    def render(self, prompt: ChatPrompt) -> str:
        options = prompt.options
        messages = conversation(prompt, self.content_format, self.developer_role)
        final = None
        if options.continue_final_message:
            messages[-1], final = _tag_final(messages[-1])
        try:
            rendered = self._template.render(
                messages=messages,
                tools=list(prompt.tools) or None,
                documents=None if options.documents is None else list(options.documents),
                add_generation_prompt=options.add_generation_prompt,
                **{**self._variables, **options.kwargs},
            )
        except TemplateRejected:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise TemplateRejected(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        return rendered if final is None else _cut_at_tag(rendered, final)


# transformers' marker for continue_final_message: appended to the final text, cut after render.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final(message: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The final message with the continue marker after its text, and that text."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": content + _CONTINUE_TAG}, content
    if isinstance(content, list):
        parts = list(content)
        for i in range(len(parts) - 1, -1, -1):
            part = parts[i]
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts[i] = {**part, "text": part["text"] + _CONTINUE_TAG}
                return {**message, "content": parts}, part["text"]
    raise TemplateRejected("continue_final_message is set but the final message has no text")


def _cut_at_tag(rendered: str, final: str) -> str:
    """Cut the render where the final message's text ends, as transformers does."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise TemplateRejected(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()
