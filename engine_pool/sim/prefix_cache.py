"""A simulated engine's prefix cache: a block LRU of the profile's KV size. Pure.

    cache = BlockCache(capacity_blocks)
    cache.hit(blocks) -> int       leading blocks of the prompt already held (touched: most
                                   recent now); the engine skips their prefill
    cache.store(blocks)            the prompt's blocks, held once prefilled (least recently
                                   used evicted past the capacity)
    cache.peek(blocks) -> int      the same count as ``hit`` without touching (an oracle's look)

A block is a key for one full KV block of a prompt, chained as vLLM's block hashes are (a key
stands for the whole prefix up to its block's end), so only a prompt's leading run of held
blocks is a hit. Like vLLM's automatic prefix caching, a fully cached prompt still computes its
last token (the caller caps the skipped tokens below the prompt length).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


class BlockCache:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = max(1, capacity_blocks)
        self._blocks: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def peek(self, blocks: Sequence[Hashable]) -> int:
        held = 0
        for block in blocks:
            if block not in self._blocks:
                break
            held += 1
        return held

    def hit(self, blocks: Sequence[Hashable]) -> int:
        held = self.peek(blocks)
        for block in reversed(blocks[:held]):  # first blocks most recent: evicted last
            self._blocks.move_to_end(block)
        return held

    def store(self, blocks: Sequence[Hashable]) -> None:
        for block in reversed(blocks):
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
