"""The prompt prefix a request shares with earlier ones, as the endpoint chain scores it.

    prefixes = Prefixes(settings.prefix_index, metrics)
    seen = prefixes.look(prompt)        the prompt's chained block hashes and, per endpoint URL,
                                        the prefix tokens it is believed to hold (Seen.cached)
    prefixes.sent(seen, url)            the request went to ``url``: remember its blocks there

The blocks are the prompt as the engine receives it, in order: a chat request's messages as
JSON (so two requests share blocks up to their first differing byte: the system prompt and the
earlier turns of a conversation), a completions prompt's first text, or its first token-id
list exactly (4 bytes an id, blocks of ``block_tokens`` ids). Text is cut in blocks of
``prefix_index.block_tokens`` x ``prefix_index.bytes_per_token`` bytes, so a block stands for
about one KV block of the engine. The index itself (bounded, TTL) is
engine_pool/prefix_index.py; its size and the age of its oldest entry are the gauges
``shapegate_prefix_index_blocks`` and ``shapegate_prefix_index_oldest_seconds``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import orjson

from engine_pool.prefix_index import Digest, PrefixIndex, chained_hashes, token_bytes
from gateway.observe.metrics import Metrics
from gateway.protocols.openai import ChatPrompt, Prompt
from gateway.settings import LaneSettings, PrefixIndexSettings


@dataclass(frozen=True, slots=True)
class Seen:
    hashes: tuple[Digest, ...] = ()
    # The prompt's size in the index's tokens (whole and partial blocks).
    tokens: int = 0
    # Endpoint URL -> prefix tokens it is believed to hold.
    cached: dict[str, int] = field(default_factory=dict)
    # Endpoint URL -> blocks the index holds for it (a new prefix's home: the least held).
    held: Mapping[str, int] = field(default_factory=dict)


NOTHING = Seen()


def prompt_data(prompt: Prompt) -> tuple[bytes, bool]:
    """The bytes the blocks are cut from, and whether they are token ids (4 bytes an id)."""
    if isinstance(prompt, ChatPrompt):
        return orjson.dumps(prompt.messages), False
    if prompt.token_ids:
        return token_bytes(prompt.token_ids[0]), True
    return (prompt.texts[0].encode() if prompt.texts else b""), False


class Prefixes:
    def __init__(self, settings: PrefixIndexSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.index = PrefixIndex(settings.max_blocks, settings.ttl_s)
        self._metrics = metrics

    def look_for(self, prompt: Prompt, lane: LaneSettings) -> Seen:
        """``look``, for a lane that weighs prefix overlap; nothing for one that does not."""
        return self.look(prompt) if lane.weights.prefix else NOTHING

    def look(self, prompt: Prompt) -> Seen:
        data, ids = prompt_data(prompt)
        per_token = 4 if ids else self.settings.bytes_per_token
        block_tokens = self.settings.block_tokens
        hashes = tuple(chained_hashes(data, block_tokens * per_token))
        matched = self.index.match(hashes)
        cached = {url: blocks * block_tokens for url, blocks in matched.items()}
        return Seen(hashes, -(-len(data) // per_token), cached, self.index.held())

    def sent(self, seen: Seen, url: str) -> None:
        if not seen.hashes:
            return
        self.index.record(seen.hashes, url)
        self._metrics.prefix_index_blocks.set(self.index.blocks)
        self._metrics.prefix_index_oldest.set(round(self.index.oldest_age_s(), 3))
