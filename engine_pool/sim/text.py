"""The simulator's output text: a function of the context it continues, so a stream cut short
and continued elsewhere reads as the one that was never cut. Pure.

Contract:
- The sim speaks ``wire.WORDS``, one word a token, each word followed by its successor in that
  list (cyclically): a greedy model whose next token depends on its context only. A fresh
  answer (the context ends with anything but a word) starts at ``WORDS[seed % len(WORDS)]``
  (``seed`` the request's sampling seed, 0 without one); a context that already ends with a
  word (a chat whose final assistant message is continued, ``continue_final_message``; a
  completions prompt that is an earlier prompt plus the text it got) goes on with that word's
  successor. So the output is the same for the same (prompt, sampling), and a continuation
  of the first k tokens is tokens k.. of the uninterrupted answer.
- ``first_word(kind, data, index)``: where the answer to prompt ``index`` of request body
  ``data`` starts in ``WORDS`` (the ``start`` ``wire.output_text`` takes).
"""

from __future__ import annotations

from typing import Any

from engine_pool.sim.wire import WORDS


def _seed(data: dict[str, Any]) -> int:
    seed = data.get("seed")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else 0


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # text parts, concatenated as the shipped template does
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _tail(kind: str, data: dict[str, Any], index: int) -> str:
    """The text the answer continues: a continued final assistant message, or the prompt."""
    if kind == "chat":
        messages = data.get("messages")
        if not (data.get("continue_final_message") is True and isinstance(messages, list)):
            return ""
        last = messages[-1] if messages else None
        if isinstance(last, dict) and last.get("role") == "assistant":
            return _content(last.get("content"))
        return ""
    if kind == "completions":
        prompt = data.get("prompt")
        if isinstance(prompt, list):
            prompt = prompt[index] if index < len(prompt) else None
        return prompt if isinstance(prompt, str) else ""
    return ""


def first_word(kind: str, data: Any, index: int = 0) -> int:
    if not isinstance(data, dict):
        return 0
    tail = _tail(kind, data, index)
    for i, word in enumerate(WORDS):
        if tail.endswith(word):
            return i + 1
    return _seed(data) % len(WORDS)
