"""Which prompt prefixes the gateway believes each endpoint holds cached: approximate mode.

    hashes = chained_hashes(data, block_bytes)     one 64-bit hash a full block, each covering
                                                   the whole prefix up to its block's end
    index = PrefixIndex(max_blocks, ttl_s)
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

Bounded, never grown without limit: at most ``max_blocks`` (block, endpoint) entries, the least
recently sent evicted first, and an entry older than ``ttl_s`` (the engine has likely evicted it
by then) is neither matched nor kept. Its size (``blocks``) and the age of its oldest entry
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

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

Digest = int


def token_bytes(ids: Sequence[int]) -> bytes:
    """Token ids as the bytes the index hashes (4 bytes an id, so a block is block_size ids)."""
    return array("I", ids).tobytes()


def chained_hashes(data: bytes, block_bytes: int) -> list[Digest]:
    """One digest per full block of ``data``; digest i covers ``data[: (i + 1) * block_bytes]``."""
    h = 0
    out: list[Digest] = []
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        h = hash((h, data[start : start + block_bytes]))
        out.append(h)
    return out


class PrefixIndex:
    def __init__(
        self, max_blocks: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self._clock = clock
        # block -> {url: when sent}; the order of (block, url) from least to most recently sent.
        self._where: dict[Digest, dict[str, float]] = {}
        self._order: OrderedDict[tuple[Digest, str], float] = OrderedDict()
        self._per_url: dict[str, int] = {}
        self.evicted = 0
        self.expired = 0

    @property
    def blocks(self) -> int:
        """(block, endpoint) entries held."""
        return len(self._order)

    def held_by(self, url: str) -> int:
        """Blocks recorded for ``url``."""
        return self._per_url.get(url, 0)

    def held(self) -> Mapping[str, int]:
        """Blocks recorded per endpoint URL (a read-only view)."""
        return MappingProxyType(self._per_url)

    def oldest_age_s(self) -> float:
        if not self._order:
            return 0.0
        first = next(iter(self._order.values()))
        return max(0.0, self._clock() - first)

    def match(self, hashes: Sequence[Digest]) -> dict[str, int]:
        """Per endpoint, how many leading blocks of ``hashes`` it is believed to hold."""
        if not hashes:
            return {}
        first = self._where.get(hashes[0])
        if not first:
            return {}
        oldest_kept = self._clock() - self.ttl_s
        where = self._where
        matched: dict[str, int] = {}
        for url, at in first.items():
            if at < oldest_kept:
                continue
            # Held blocks are a prefix: the largest i whose block is held and fresh.
            lo, hi = 1, len(hashes)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                holders = where.get(hashes[mid - 1])
                if holders is not None and holders.get(url, -1.0) >= oldest_kept:
                    lo = mid
                else:
                    hi = mid - 1
            matched[url] = lo
        return matched

    def record(self, hashes: Sequence[Digest], url: str) -> None:
        """``url`` was sent these blocks now (it will hold them once it prefilled them)."""
        now = self._clock()
        order = self._order
        # Last block first: the first blocks are the most recent, so eviction cuts the end.
        for digest in reversed(hashes):
            self._where.setdefault(digest, {})[url] = now
            key = (digest, url)
            if key in order:
                order.move_to_end(key)
            else:
                self._per_url[url] = self._per_url.get(url, 0) + 1
            order[key] = now
        self._trim(now)

    def forget(self, url: str) -> None:
        """Drop everything believed of ``url`` (it restarted, left, or cleared its cache)."""
        for key in [k for k in self._order if k[1] == url]:
            self._drop(key)

    def _trim(self, now: float) -> None:
        order = self._order
        while len(order) > self.max_blocks:
            self._drop(next(iter(order)))
            self.evicted += 1
        oldest_kept = now - self.ttl_s
        while order:
            key, at = next(iter(order.items()))
            if at >= oldest_kept:
                break
            self._drop(key)
            self.expired += 1

    def _drop(self, key: tuple[Digest, str]) -> None:
        del self._order[key]
        digest, url = key
        self._per_url[url] -= 1
        if not self._per_url[url]:
            del self._per_url[url]
        holders = self._where.get(digest)
        if holders is not None:
            holders.pop(url, None)
            if not holders:
                del self._where[digest]
