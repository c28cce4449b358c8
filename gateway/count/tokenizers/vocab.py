"""A loaded vocabulary (``Vocabulary``): the warmed encoder and what counting needs to know about
it. sources.py loads one from a ``TokenizerSettings``.

The free bound (tokens <= UTF-8 bytes of the text) is claimed only for vocabularies where it is
provably sound: byte-level BPE whose normaliser is none or NFC (the bound then counts the NFC
form: NFC can triple a text's bytes, e.g. U+1D160) and whose pre-tokenizer adds no bytes.
Anything else (SentencePiece's ``▁`` replacement, ``add_prefix_space``) sets ``bound_sound``
false and every request is counted exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.count.tokenizers.encoders import Encoder

# The token that opens every ChatML message: a text may be cut just before it and the pieces
# counted apart, because special tokens are split out before any BPE runs.
CHATML_START = "<|im_start|>"


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """A loaded, warmed tokenizer and what counting needs to know about it."""

    name: str
    encoder: Encoder
    # Added-token strings the encoder matches inside text as one token each.
    specials: frozenset[str]
    # The text is NFC-normalised before BPE (the bound then measures the NFC form).
    nfc: bool
    # tokens <= UTF-8 bytes (of the NFC form when ``nfc``) is guaranteed for this vocabulary.
    bound_sound: bool
    # Tokens the tokenizer's post-processor adds to a completions prompt (a BOS, say).
    completion_extra: int
    # The model's own Jinja chat template, where one ships with the files.
    chat_template: str | None
    template_vars: Mapping[str, str]
    # Where it came from (a path, or ``builtin:NAME``), and why the preferred backend is not used.
    origin: str
    fallback: str | None = None
    split_token: str | None = field(default=None)
    # ``name/backend``: the cache keys' tokenizer, read a few times a count (set once).
    id: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "id", f"{self.name}/{self.encoder.backend}")


def split_token(specials: frozenset[str]) -> str | None:
    """``<|im_start|>`` if the vocabulary matches it as a special token no other one overlaps."""
    if CHATML_START not in specials:
        return None
    for other in specials - {CHATML_START}:
        overlaps = any(CHATML_START.startswith(other[-i:]) for i in range(1, len(other) + 1))
        if CHATML_START in other or overlaps:
            return None
    return CHATML_START
