"""Unique monster texts of five shapes, for ``bench monsters``.

Contract: ``Texts.load(seed)`` reads the corpus (``corpus.py``); ``unique(shape, tokens)``
returns a text of about ``tokens`` Qwen3.6 tokens that no earlier call returned (each starts
with its own serial number, and the body is a new slice or a new random draw):

- ``prose``, ``code``: slices of the corpus's English docstrings and Python sources;
- ``json``: slices of a synthetic JSON array of API records (built once);
- ``letters``: random lowercase letters in random-length words, the vocabulary-hostile shape
  (nearly every word is new to the tokenizer, which caches each one: the child's memory grows
  fastest on it);
- ``cjk``: random characters of the CJK Unified Ideographs block.

Characters per token are measured on Qwen3.6 (``CHARS_PER_TOKEN``); the exact count of each
request is the gateway's ``x-shapegate-prompt-tokens``, which the benchmark reports.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from gateway.tools.bench.corpus import Corpus

SHAPES = ("prose", "code", "json", "letters", "cjk")
# Qwen3.6, measured on 1M-character texts of each shape.
CHARS_PER_TOKEN = {"prose": 4.2, "code": 4.2, "json": 2.44, "letters": 2.03, "cjk": 0.572}
_JSON_CHARS = 3_000_000
_CJK_FIRST, _CJK_COUNT = 0x4E00, 0x9FA5 - 0x4E00
# A byte to a letter or a space (26 letters, 6 spaces: words of ~4 letters on average).
_LETTERS = bytes.maketrans(bytes(range(256)), b"abcdefghijklmnopqrstuvwxyz      " * 8)


@dataclass
class Texts:
    corpus: Corpus
    json: str
    rng: random.Random
    serial: int = field(default=0)

    @classmethod
    def load(cls, seed: int = 31) -> Texts:
        corpus = Corpus.load()
        return cls(corpus, corpus.take("json", _JSON_CHARS, seed), random.Random(seed))

    def unique(self, shape: str, tokens: int) -> str:
        self.serial += 1
        head = f"request {self.serial} of this run:\n"
        chars = max(1, int(tokens * CHARS_PER_TOKEN[shape]) - len(head))
        return head + self._body(shape, chars)

    def _body(self, shape: str, chars: int) -> str:
        if shape in ("prose", "code"):
            return self.corpus.take(shape, chars, self.rng.randrange(1 << 30))  # type: ignore[arg-type]
        if shape == "json":
            start = self.rng.randrange(len(self.json))
            text = self.json[start:] + "\n" + self.json
            while len(text) < chars:
                text += "\n" + self.json
            return text[:chars]
        if shape == "letters":
            return self.rng.randbytes(chars).translate(_LETTERS).decode("ascii")
        if shape == "cjk":
            draws = self.rng.randbytes(2 * chars)
            return "".join(
                chr(_CJK_FIRST + int.from_bytes(draws[i : i + 2], "little") % _CJK_COUNT)
                for i in range(0, 2 * chars, 2)
            )
        raise ValueError(f"unknown text shape {shape!r}; known: {', '.join(SHAPES)}")
