"""Warm-up that rehearses arrivals: how large a text each tokenizer encodes at boot.

A tokenizer's first large encode is slow however warm its small encodes are: measured, the first
300k-token prompt after boot took 0.2-1.6 s to count against 15-30 ms warm (gigatoken in its
child process, ``worker.py``), while a ~20 KB warm-up text left that cost in place. So at boot
each model's tokenizer counts a text as large as the lanes admit, through the path requests
take (``TokenCounter.warm_up``), and each child process encodes one as large before it answers
(``ChildEncoder``'s ``warm_chars``; a replacement child too, so a recycle never brings the cold
cost back).

- ``warm_tokens(settings, max_model_len)``: ``counting.warmup_tokens`` when set (0: the small
  warm-up only), else the largest prompt any lane admits, capped by the model's
  ``max_model_len`` and by ``MAX_WARM_TOKENS``.
"""

from __future__ import annotations

from gateway.settings import Settings

# A policy that admits 10**9 tokens still warms with a text of about this many.
MAX_WARM_TOKENS = 1_048_576
# Characters a token of the warm-up text (child.warm_text: prose, CJK, emoji, JSON) for Qwen3.6:
# 40,960 characters are 24,868 tokens. Other vocabularies land near it; a warm-up need not be exact.
CHARS_PER_TOKEN = 1.65


def warm_tokens(settings: Settings, max_model_len: int | None) -> int:
    if settings.counting.warmup_tokens is not None:
        return settings.counting.warmup_tokens
    admitted = max(lane.max_prompt_tokens for lane in settings.lanes) - 1
    return min(admitted, max_model_len or MAX_WARM_TOKENS, MAX_WARM_TOKENS)
