"""The count cache: a bounded LRU from a digest of (tokenizer, text piece) to its token count.

Contract: ``key(tokenizer_id, piece)`` is a SHA-256 digest (a collision would let one text borrow
another's count, so not a fast non-cryptographic hash); ``get`` and ``put`` are thread-safe and
O(1); at most ``max_entries`` entries are kept, each a fixed ~200 bytes whatever the size of the
text, so memory is bounded by the entry count (8192 entries: about 2 MB). ``max_entries=0``
disables caching. ``IdsCache`` keeps pieces' token ids by the same key, bounded by the ids held.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict


def key(tokenizer_id: str, piece: bytes) -> bytes:
    digest = hashlib.sha256(tokenizer_id.encode())
    digest.update(b"\0")
    digest.update(piece)
    return digest.digest()


class CountCache:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: bytes) -> int | None:
        with self._lock:
            count = self._entries.get(digest)
            if count is not None:
                self._entries.move_to_end(digest)
            return count

    def put(self, digest: bytes, count: int) -> None:
        if self.max_entries <= 0:
            return
        with self._lock:
            self._entries[digest] = count
            self._entries.move_to_end(digest)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)


class IdsCache:
    """A bounded LRU from the same digest to a piece's token ids (4 bytes an id), for the prefix
    index's exact hashes (gateway/request/prefix.py, ``prefix_index.source: kv_events``): a
    system prompt or document repeated across requests is encoded once. At most ``max_ids``
    ids are held in all (4 bytes each); a piece larger than that is never kept."""

    def __init__(self, max_ids: int) -> None:
        self.max_ids = max_ids
        self.ids = 0
        self._entries: OrderedDict[bytes, array[int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: bytes) -> array[int] | None:
        with self._lock:
            found = self._entries.get(digest)
            if found is not None:
                self._entries.move_to_end(digest)
            return found

    def put(self, digest: bytes, ids: array[int]) -> None:
        if len(ids) > self.max_ids:
            return
        with self._lock:
            old = self._entries.pop(digest, None)
            self.ids += len(ids) - (len(old) if old is not None else 0)
            self._entries[digest] = ids
            while self.ids > self.max_ids:
                _, dropped = self._entries.popitem(last=False)
                self.ids -= len(dropped)
