"""One ``Encoder`` protocol over three BPE implementations: gigatoken, tiktoken, Hugging Face.

Contract, the same for every backend:
- ``encode(text)`` returns the token ids as a ``list`` of Python ints (gigatoken's numpy uint32
  array never leaks out); ``count(text)`` and ``count_many(texts)`` return Python ints.
- Special-token strings inside the text (``<|im_start|>`` in a user message) are matched as the
  special token, which is what Hugging Face tokenizers and vLLM's chat path do with a rendered
  prompt. Nothing is added around the text (no BOS): the caller accounts for that.
- ``count_many`` is the call made from a worker thread: where the backend can, long texts are
  encoded without the GIL (gigatoken's batch call; its plain ``encode`` holds the GIL for the
  whole text, which stalls the event loop as badly as running inline).
- Calls on one encoder are serialised by its ``lock``: gigatoken's tokenizer is not re-entrant
  (a second thread gets ``RuntimeError: Already borrowed``). ``try_count_many`` never waits for
  the lock, so the event loop can count small texts inline and hand the rest to a worker.

Known limit: gigatoken keeps every distinct pre-token it has encoded in a cache inside the
tokenizer, with no bound and no way to clear it short of loading the tokenizer again (1.3 s,
GIL held). Prose and code saturate it (~+40 MB); text made of ever-new pieces does not: measured
+3 MB RSS per MB of random CJK text, +6 MB per MB of base64. So the gateway runs
``GigatokenEncoder`` in a child process replaced past a memory bound (``worker.py``).
"""

from __future__ import annotations

import threading
import unicodedata
from collections.abc import Sequence
from typing import Any, Literal, Protocol

Backend = Literal["gigatoken", "tiktoken", "hf"]


class Encoder(Protocol):
    backend: Backend
    lock: threading.Lock
    # Counts run in another process: waiting for one holds no GIL, so the event loop should
    # never wait inline (worker.py); in-process backends hold the GIL either way.
    out_of_process: bool

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids, special tokens included (the simulator's ``/detokenize``);
        ``ValueError`` for an id outside the vocabulary."""
        ...

    def count_many(self, texts: Sequence[str]) -> list[int]: ...

    def try_count_many(self, texts: Sequence[str]) -> list[int] | None: ...

    def close(self) -> None: ...


class _Locked:
    """``try_count_many`` for every backend: count now if nobody else is, else say so."""

    lock: threading.Lock
    out_of_process = False

    def _count_unlocked(self, texts: Sequence[str]) -> list[int]:
        raise NotImplementedError

    def count_many(self, texts: Sequence[str]) -> list[int]:
        with self.lock:
            return self._count_unlocked(texts)

    def try_count_many(self, texts: Sequence[str]) -> list[int] | None:
        if not self.lock.acquire(blocking=False):
            return None
        try:
            return self._count_unlocked(texts)
        finally:
            self.lock.release()

    def close(self) -> None:
        """Nothing to release: the tokenizer lives in this process."""


class GigatokenEncoder(_Locked):
    """gigatoken's Rust BPE (``BPETokenizer`` or ``SentencePieceTokenizer`` backend object)."""

    backend: Backend = "gigatoken"

    def __init__(self, rust_tokenizer: Any, *, nfc: bool) -> None:
        # nfc: normalise here, for vocabularies loaded from a .tiktoken file (a tokenizer.json
        # carries its normaliser and gigatoken applies it).
        from gigatoken.gigatoken_rs import PadTruncate

        self._tok = rust_tokenizer
        self._nfc = nfc
        self._one_row = PadTruncate(0)
        self.lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        if self._nfc:
            text = unicodedata.normalize("NFC", text)
        with self.lock:
            ids: list[int] = self._tok.encode(text).tolist()
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        # Checked first: gigatoken panics (a Rust index out of bounds) on an unknown id.
        size = int(self._tok.vocab_size)
        bad = [i for i in ids if not 0 <= i < size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary of {size}")
        with self.lock:
            raw: bytes = self._tok.decode(list(ids))
        return raw.decode("utf-8", errors="replace")

    def _count_unlocked(self, texts: Sequence[str]) -> list[int]:
        counts = []
        for raw in texts:
            text = unicodedata.normalize("NFC", raw) if self._nfc else raw
            if len(text) < GIL_FREE_ABOVE_CHARS:
                counts.append(len(self._tok.encode(text)))
            else:
                # The batch entry point releases the GIL (encode holds it throughout); one row
                # so nothing is padded, parallel=False so it stays on this thread and core.
                # The padded variant answers with a lengths array, without awkward's overhead.
                _, lengths = self._tok.encode_batch_padded([text], self._one_row, parallel=False)
                counts.append(int(lengths[0]))
        return counts


# Texts up to this size encode with the GIL held (under ~2 ms: the batch call costs ~0.5 ms
# more); longer ones through the GIL-free batch call, so a worker thread leaves the loop free.
GIL_FREE_ABOVE_CHARS = 262_144


class TiktokenEncoder(_Locked):
    """A ``tiktoken.Encoding``; ``nfc`` for vocabularies whose tokenizer normalises first."""

    backend: Backend = "tiktoken"

    def __init__(self, encoding: Any, *, nfc: bool) -> None:
        self._enc = encoding
        self._nfc = nfc
        self.lock = threading.Lock()

    def _ids(self, text: str) -> list[int]:
        if self._nfc:
            text = unicodedata.normalize("NFC", text)
        ids: list[int] = self._enc.encode(text, allowed_special="all")
        return ids

    def encode(self, text: str) -> list[int]:
        with self.lock:
            return self._ids(text)

    def decode(self, ids: Sequence[int]) -> str:
        try:
            with self.lock:
                text: str = self._enc.decode(list(ids), errors="replace")
        except KeyError as exc:
            raise ValueError(f"token id {exc} is outside the vocabulary") from exc
        return text

    def _count_unlocked(self, texts: Sequence[str]) -> list[int]:
        return [len(self._ids(text)) for text in texts]


class HFEncoder(_Locked):
    """A Hugging Face ``tokenizers.Tokenizer`` (the reference implementation, and a fallback)."""

    backend: Backend = "hf"

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        with self.lock:
            ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        with self.lock:
            text: str | None = self._tok.decode(list(ids), skip_special_tokens=False)
        if text is None:
            raise ValueError("token ids outside the vocabulary")
        return text

    def _count_unlocked(self, texts: Sequence[str]) -> list[int]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [len(e.ids) for e in encodings]
