"""Which prompt prefixes the gateway believes each endpoint holds cached: approximate mode.

    hashes = chained_hashes(data, block_bytes)     one 64-bit hash a full block, each covering
                                                   the whole prefix up to its block's end
    index = PrefixIndex(max_blocks, ttl_s, block_tokens=, backstop_ttl_s=)
    index.learn(views)                             each endpoint's KV capacity, from its view
    index.match(hashes) -> {url: blocks}           the longest cached prefix per endpoint
    index.record(hashes, url)                      the gateway sent this prefix to ``url``
    index.forget(url)                              the endpoint restarted or left

The gateway's own record of which prefix blocks it sent where, for engines that publish no KV
events. A block is the request's own prompt cut in the engine's block size and hashed chained,
as vLLM hashes its KV blocks (each block's hash covers its parent's), so two prompts share the
leading blocks of their common prefix and nothing after the first difference; only full blocks
count, as in vLLM. ``data`` is the prompt's token ids as 4-byte integers when the request
carries them (``token_bytes``), else its text as UTF-8 cut at ``bytes_per_token`` bytes a token:
a block then stands for about ``block_tokens`` tokens (``prefix_index.bytes_per_token``).

Forgotten as the engine forgets: an endpoint whose KV cache size is known (``learn``: the
``kv_capacity_tokens`` of its view, read from vLLM's ``vllm:cache_config_info``) keeps at most
that many blocks recorded, the least recently sent evicted first, as vLLM's prefix cache evicts
its least recently used free blocks; its entries also expire after ``backstop_ttl_s`` (traffic
the gateway does not see, another replica's, may have evicted them sooner). An endpoint whose
size is unknown (SGLang, a metric not read yet) has no such bound: its entries expire after
``ttl_s``, the engine having likely evicted them by then. Over all endpoints at most
``max_blocks`` (block, endpoint) entries (about 150 bytes each), the least recently sent
evicted first. Never grown without limit. Its size (``blocks``) and the age of its oldest entry
(``oldest_age_s``, how far back it remembers) are exported as metrics by the gateway.

The hash is the process's own (``hash`` of the parent hash and the block's bytes: SipHash with
the interpreter's per-process seed, 64 bits): the index lives in one process and is never
shared, so a per-process seed costs nothing and keeps block hashes unguessable to clients.

Cost: one hash a block, then a binary search per endpoint holding the first block (an
endpoint that holds block i holds every block before it: a record refreshes a prompt's blocks
together, its first block last, so eviction takes a prefix from its end). ``shapegate bench
prefix`` prints the lookup time for a 200k-token prompt.
"""

from __future__ import annotations

import math
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence

from engine_pool.cluster import EngineView

Digest = int
# Never sent: older than any TTL allows, whatever the clock reads.
_NEVER = -math.inf


def token_bytes(ids: Sequence[int]) -> bytes:
    """Token ids as the bytes the index hashes (4 bytes an id, so a block is block_size ids)."""
    return array("I", ids).tobytes()


def chained_hashes(data: bytes, block_bytes: int, parent: Digest = 0) -> list[Digest]:
    """One digest per full block of ``data``; digest i covers ``data[: (i + 1) * block_bytes]``
    (and the blocks before ``data``, whose last digest is ``parent``: 0 for none)."""
    h = parent
    out: list[Digest] = []
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        h = hash((h, data[start : start + block_bytes]))
        out.append(h)
    return out


class PrefixIndex:
    def __init__(
        self,
        max_blocks: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        block_tokens: int = 1,
        backstop_ttl_s: float | None = None,
    ) -> None:
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        # The TTL of an endpoint whose capacity is known (its own bound forgets first).
        self.backstop_ttl_s = ttl_s if backstop_ttl_s is None else backstop_ttl_s
        # Tokens a block stands for: a capacity in tokens is so many blocks.
        self.block_tokens = block_tokens
        self._clock = clock
        # Per endpoint: its blocks -> when last sent, least recently sent first. One entry a
        # (block, endpoint): about 150 bytes (a record's stamp is one float object, shared).
        self._urls: dict[str, OrderedDict[Digest, float]] = {}
        # Per endpoint whose KV cache size is known: the blocks it holds at most.
        self._capacity: dict[str, int] = {}
        self._size = 0
        self.evicted = 0
        self.expired = 0
        # Entries evicted because their endpoint's record outgrew its KV capacity.
        self.overflowed = 0

    @property
    def blocks(self) -> int:
        """(block, endpoint) entries held."""
        return self._size

    def held_by(self, url: str) -> int:
        """Blocks recorded for ``url``."""
        held = self._urls.get(url)
        return len(held) if held is not None else 0

    def held(self) -> Mapping[str, int]:
        """Blocks recorded per endpoint URL."""
        return {url: len(held) for url, held in self._urls.items()}

    def capacity(self, url: str) -> int | None:
        """Blocks ``url``'s engine holds at most, when known."""
        return self._capacity.get(url)

    def learn(self, views: Iterable[EngineView]) -> None:
        """Each endpoint's KV capacity from its view (``kv_capacity_tokens``, in blocks of
        ``block_tokens``); a view without one makes its endpoint's size unknown again."""
        for view in views:
            tokens = view.kv_capacity_tokens
            if tokens is None:
                self._capacity.pop(view.url, None)
                continue
            blocks = max(1, tokens // self.block_tokens)
            if self._capacity.get(view.url) != blocks:
                self._capacity[view.url] = blocks
                self._fit(view.url)

    def _ttl(self, url: str) -> float:
        return self.backstop_ttl_s if url in self._capacity else self.ttl_s

    def oldest_age_s(self) -> float:
        firsts = [next(iter(held.values())) for held in self._urls.values() if held]
        return max(0.0, self._clock() - min(firsts)) if firsts else 0.0

    def match(self, hashes: Sequence[Digest]) -> dict[str, int]:
        """Per endpoint, how many leading blocks of ``hashes`` it is believed to hold."""
        if not hashes:
            return {}
        now = self._clock()
        matched: dict[str, int] = {}
        for url, held in self._urls.items():
            oldest_kept = now - self._ttl(url)
            if held.get(hashes[0], _NEVER) < oldest_kept:
                continue
            # Held blocks are a prefix: the largest i whose block is held and fresh.
            lo, hi = 1, len(hashes)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if held.get(hashes[mid - 1], _NEVER) >= oldest_kept:
                    lo = mid
                else:
                    hi = mid - 1
            matched[url] = lo
        return matched

    def record(self, hashes: Sequence[Digest], url: str) -> None:
        """``url`` was sent these blocks now (it will hold them once it prefilled them)."""
        now = self._clock()
        held = self._urls.setdefault(url, OrderedDict())
        before = len(held)
        # Last block first: the first blocks are the most recent, so eviction cuts the end.
        for digest in reversed(hashes):
            if digest in held:
                held.move_to_end(digest)
            held[digest] = now
        self._size += len(held) - before
        self._fit(url)
        self._trim(now)

    def forget(self, url: str) -> None:
        """Drop everything believed of ``url`` (it restarted, left, or cleared its cache)."""
        held = self._urls.pop(url, None)
        if held is not None:
            self._size -= len(held)

    def _fit(self, url: str) -> None:
        """Keep ``url``'s record within its KV capacity: least recently sent blocks go first,
        as the engine's own prefix cache evicts (a prompt's first blocks are its most recent,
        so a prefix is cut from its end)."""
        held, capacity = self._urls.get(url), self._capacity.get(url)
        if held is None or capacity is None:
            return
        while len(held) > capacity:
            held.popitem(last=False)
            self._size -= 1
            self.overflowed += 1

    def _trim(self, now: float) -> None:
        for url, held in self._urls.items():
            oldest_kept = now - self._ttl(url)
            while held and next(iter(held.values())) < oldest_kept:
                held.popitem(last=False)
                self._size -= 1
                self.expired += 1
        while self._size > self.max_blocks:
            # The endpoint whose least recent block is the oldest gives it up.
            held = min((h for h in self._urls.values() if h), key=lambda h: next(iter(h.values())))
            held.popitem(last=False)
            self._size -= 1
            self.evicted += 1
