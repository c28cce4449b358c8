"""A prompt as the counter counts it (``Plan``): the text the engine sees cut into pieces, each
sequence's range of pieces, and the free bound. Pure: no tokenizer runs here.

Contract: ``plan_prompt(model, prompt, exact_above)`` renders a chat prompt with the model's
template (``chat_pieces``: the model's Jinja template, the built-in ChatML cut by message, or
the plain texts) and cuts it before each split token (``<|im_start|>``: special tokens are split
out before any BPE runs, so piece counts add up exactly to the whole); a completions prompt is
one sequence a text. The bound is the UTF-8 bytes of each sequence plus what the
post-processor adds (of the NFC form where the tokenizer normalises, computed only when the
bound is below ``exact_above``, the one case it is used); none when the vocabulary cannot prove
it (``bound_sound``). Token-id prompts have no plan (None).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from gateway.count.tokenizers.templates import (
    ChatTemplate,
    TemplateRejected,
    chatml_pieces,
    plain_text,
    split_before,
)
from gateway.count.tokenizers.vocab import Vocabulary
from gateway.errors import BadRequest
from gateway.protocols.openai import ChatPrompt, CompletionPrompt, Prompt


@dataclass(frozen=True, slots=True)
class Model:
    """A model's vocabulary and the chat template its prompts are rendered with."""

    vocab: Vocabulary
    chat_template: Literal["chatml", "hf", "none"]
    template: ChatTemplate | None


class Plan(NamedTuple):
    """A prompt cut into pieces: ``sequences`` are [start, end) ranges of ``pieces``. A named
    tuple, not a frozen dataclass: made once a request, and a frozen dataclass's ``__init__``
    sets each of its eight fields through ``object.__setattr__``."""

    vocab: Vocabulary
    pieces: tuple[str, ...]
    encoded: tuple[bytes | None, ...]  # UTF-8 of the non-ASCII pieces, kept for the cache key
    sequences: tuple[tuple[int, int], ...]
    extra: int
    bound: int  # the sum of the sequences' bounds
    largest_bound: int
    prompt_bytes: int


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest("prompt text holds a lone surrogate: not valid Unicode") from exc


def _nfc_len(text: str, raw: int) -> int:
    """UTF-8 bytes of the NFC form: what an NFC-normalising tokenizer actually encodes."""
    if text.isascii() or unicodedata.is_normalized("NFC", text):
        return raw
    return len(unicodedata.normalize("NFC", text).encode("utf-8"))


def chat_pieces(entry: Model, prompt: ChatPrompt) -> list[str]:
    """The chat prompt as the engine sees it: one rendered text, or ChatML's messages."""
    if entry.template is not None:
        try:
            return [entry.template.render(prompt)]
        except TemplateRejected as exc:
            raise BadRequest(str(exc), param="messages") from exc
    if entry.chat_template == "none":
        return [plain_text(prompt)]
    return chatml_pieces(prompt)


def plan_prompt(entry: Model, prompt: Prompt, exact_above: int) -> Plan | None:
    """The prompt as pieces to count, with its free bound; None for token-id prompts.

    ``bound`` is sound whenever it is below ``exact_above`` (the only case it is used): the
    NFC check, a full scan of the text, runs only then, on a text that is small by then.
    """
    vocab = entry.vocab
    texts: Sequence[str]
    if isinstance(prompt, CompletionPrompt):
        if not prompt.texts:
            return None
        texts, extra = prompt.texts, vocab.completion_extra
    else:
        texts, extra = [], 0
    pieces: list[str] = []
    sequences: list[tuple[int, int]] = []
    if isinstance(prompt, ChatPrompt):
        chat = chat_pieces(entry, prompt)
        if len(chat) == 1 or vocab.split_token is None:
            # A rendered template or plain text is cut here; ChatML comes cut by message.
            chat = split_before("".join(chat), vocab.split_token)
        pieces.extend(chat)
        sequences.append((0, len(pieces)))
    for text in texts:
        start = len(pieces)
        pieces.extend(split_before(text, vocab.split_token))
        sequences.append((start, len(pieces)))
    # ASCII (the common case) needs no encoding to know its size: isascii() is O(1).
    encoded = [None if piece.isascii() else _utf8(piece) for piece in pieces]
    raw = [
        len(piece) if data is None else len(data)
        for piece, data in zip(pieces, encoded, strict=True)
    ]

    def bounds_of(sizes: list[int]) -> list[int]:
        return [sum(sizes[a:b]) + extra for a, b in sequences] or [0]

    bounds = bounds_of(raw)
    if not vocab.bound_sound:
        bounds = [2**62]  # no provable bound: every count is exact
    elif vocab.nfc and sum(bounds) < exact_above and encoded.count(None) < len(encoded):
        # (ASCII is its own NFC form: an all-ASCII prompt's bound needs no second pass.)
        bounds = bounds_of([_nfc_len(piece, n) for piece, n in zip(pieces, raw, strict=True)])
    return Plan(
        vocab,
        tuple(pieces),
        tuple(encoded),
        tuple(sequences),
        extra,
        sum(bounds),
        max(bounds),
        sum(raw),
    )
