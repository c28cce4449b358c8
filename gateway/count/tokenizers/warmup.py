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
- ``rehearsal_text(chars, index)``: a text no count cache holds, opening with new words
  (``new_words``), that a counting child counts through its pipe before it takes a call
  (processes.py) and that request/rehearsal.py sends through the request path.
"""

from __future__ import annotations

import random

from gateway.count.tokenizers.child import warm_text
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


def rehearsal_text(chars: int, index: int) -> str:
    """A text of about ``chars`` characters, different for each ``index``: no count cache holds
    it, so it takes the path a new prompt takes. It opens with up to ``NEW_WORD_CHARS`` of words
    the tokenizer has not seen (``new_words``), then ``warm_text``'s mix: a new prompt's words
    grow gigatoken's pre-token cache, and the first ones after a fork copy the template's pages
    they write to (and may grow the table): that happens here, not in a request's count."""
    head = f"rehearsal {index:x}: "
    words = new_words(min(max(0, chars - len(head)), NEW_WORD_CHARS), index)
    return head + words + warm_text(max(0, chars - len(head) - len(words)))


# Measured on Qwen3.6 after a fork (2026-12-05): the first 200k-token prose count took 20 ms
# against 4-6 ms later ones (3,100 page faults); after ~50,000 new words in the rehearsal
# (330 kB) 9 ms, after 20,000 no better than none. 400 kB is ~60,000 words, under 0.1 s.
NEW_WORD_CHARS = 400_000
_LETTERS = bytes(32 if i % 8 == 0 else 97 + i % 26 for i in range(256))  # space, a-z


def new_words(chars: int, seed: int) -> str:
    """``chars`` characters of random lower-case words (a space about every 8th character),
    the same for the same seed; made at C speed (bytes.translate), so the recycle thread holds
    the GIL for well under a millisecond."""
    return random.Random(seed).randbytes(chars).translate(_LETTERS).decode("ascii")
