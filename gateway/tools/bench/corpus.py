"""Deterministic, realistic text for benchmarks: English prose, Python code and JSON records.

Contract: ``Corpus.load()`` reads the Python standard library's own sources (present wherever
Python is): ``prose`` is its long docstrings (real English, technical), ``code`` its source
files, ``json`` synthetic API records built from the prose's words with a seeded RNG. Every
``take(kind, chars, seed)`` returns ``chars`` characters starting at a seed-dependent offset, so
two seeds give different texts (a benchmark that repeats one text measures a warm cache, not
a count). Same Python version, same seed, same text.
"""

from __future__ import annotations

import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import orjson

Kind = Literal["prose", "code", "json"]
KINDS: tuple[Kind, ...] = ("prose", "code", "json")
_DOCSTRING = re.compile(r'"""(.*?)"""', re.S)
_WORD = re.compile(r"[A-Za-z]{3,12}")
_SKIP = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__"}


def _sources(limit_chars: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in _SKIP):
        files.extend(sorted(f for f in folder.rglob("*.py") if _SKIP.isdisjoint(f.parts)))
    out: list[str] = []
    total = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        out.append(text)
        total += len(text)
        if total >= limit_chars:
            break
    if not out:
        raise RuntimeError(
            f"no Python sources under {root}: the corpus needs the stdlib's .py files"
        )
    return out


def _is_prose(block: str) -> bool:
    return len(block) >= 300 and sum(c.isalpha() or c == " " for c in block) / len(block) > 0.8


@dataclass(frozen=True, slots=True)
class Corpus:
    prose: str
    code: str
    words: tuple[str, ...]

    @classmethod
    def load(cls, code_chars: int = 12_000_000) -> Corpus:
        sources = _sources(code_chars)
        blocks = [
            " ".join(line.strip() for line in m.group(1).splitlines()).strip()
            for text in sources
            for m in _DOCSTRING.finditer(text)
        ]
        prose = "\n\n".join(block for block in blocks if _is_prose(block))
        words = tuple(sorted(set(_WORD.findall(prose))))
        return cls(prose=prose, code="\n\n".join(sources), words=words)

    def take(self, kind: Kind, chars: int, seed: int) -> str:
        if kind == "json":
            return self._json(chars, seed)
        source = self.prose if kind == "prose" else self.code
        start = (seed * 104_729) % max(1, len(source) - 1)
        text = source[start : start + chars]
        while len(text) < chars:  # wrap around: the corpus is smaller than a huge request
            text += "\n\n" + source[: chars - len(text)]
        return text[:chars]

    def _json(self, chars: int, seed: int) -> str:
        rng = random.Random(seed)
        words = self.words
        records = []
        size = 0
        while size < chars:
            record = {
                "id": rng.randrange(10**9),
                "uuid": f"{rng.getrandbits(128):032x}",
                "name": f"{rng.choice(words).title()} {rng.choice(words).title()}",
                "email": f"{rng.choice(words).lower()}.{rng.randrange(100)}@example.com",
                "created_at": f"20{rng.randrange(10, 27)}-{rng.randrange(1, 13):02d}-"
                f"{rng.randrange(1, 29):02d}T{rng.randrange(24):02d}:"
                f"{rng.randrange(60):02d}:{rng.randrange(60):02d}Z",
                "score": round(rng.random() * 100, 3),
                "active": rng.random() < 0.5,
                "tags": [rng.choice(words).lower() for _ in range(rng.randrange(1, 5))],
                "address": {
                    "street": f"{rng.randrange(1, 999)} {rng.choice(words).title()} St",
                    "zip": f"{rng.randrange(10**5):05d}",
                },
                "note": " ".join(rng.choice(words) for _ in range(rng.randrange(3, 12))),
            }
            line = orjson.dumps(record).decode()
            records.append(line)
            size += len(line) + 2
        return ("[" + ",\n".join(records) + "]")[:chars]

    def mixed(self, chars: int, seed: int) -> str:
        """Half prose, a third code, the rest JSON: what a long agent prompt looks like."""
        prose = self.take("prose", chars // 2, seed)
        code = self.take("code", chars // 3, seed)
        data = self.take("json", chars - len(prose) - len(code), seed)
        return f"{prose}\n\n```python\n{code}\n```\n\n```json\n{data}\n```"
