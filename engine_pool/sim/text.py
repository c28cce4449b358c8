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
  ``data`` starts in ``WORDS`` (the ``start`` ``wire.output_text`` takes). A token-id prompt
  (completions) whose last id is a word's (``wire.WORD_IDS``) goes on with its successor: an
  answer continued from its token ids (the prompt's, then the answer's) reads as the one
  never cut, as on vLLM.
- ``prompt_ids(kind, data, index, tokens)``: the prompt's token ids when the body asks for them
  (``return_token_ids``): a token-id prompt's own, else ``tokens`` placeholders.
"""

from __future__ import annotations

from typing import Any

from engine_pool.sim.wire import PROMPT_ID, WORD_IDS, WORDS


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


def _token_ids(kind: str, data: dict[str, Any], index: int) -> list[int] | None:
    """Prompt ``index``'s token ids, when the completions prompt is given as ids."""
    prompt = data.get("prompt") if kind == "completions" else None
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(i, int) for i in prompt):
        return prompt if index == 0 else None
    one = prompt[index] if index < len(prompt) else None
    if isinstance(one, list) and all(isinstance(i, int) for i in one):
        return one
    return None


def prompt_ids(kind: str, data: Any, index: int, tokens: int) -> list[int] | None:
    if not isinstance(data, dict) or data.get("return_token_ids") is not True:
        return None
    ids = _token_ids(kind, data, index)
    return list(ids) if ids is not None else [PROMPT_ID] * tokens


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
    ids = _token_ids(kind, data, index)
    if ids is not None:
        last = ids[-1] if ids else None
        return WORD_IDS.index(last) + 1 if last in WORD_IDS else _seed(data) % len(WORDS)
    tail = _tail(kind, data, index)
    for i, word in enumerate(WORDS):
        if tail.endswith(word):
            return i + 1
    return _seed(data) % len(WORDS)
