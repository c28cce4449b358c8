"""The prompt prefix a request shares with earlier ones, as the endpoint chain scores it.

    prefixes = Prefixes(settings.prefix_index, metrics)
    seen = prefixes.look(prompt)        the prompt's chained block hashes and, per endpoint URL,
                                        the prefix tokens it is believed to hold (Seen.cached)
    prefixes.learn(views)               the endpoints' KV capacities, bounding their records
    prefixes.sent(seen, url)            the request went to ``url``: remember its blocks there
    prefixes.engine_down(url)           ``url`` went down: forget what was sent there
    prefixes.engine_restarted(url)      ``url``'s engine restarted: forget what it held, and
                                        read its KV events again from sequence 0
    prefixes.state()                    the index as ``/admin/state`` shows it (``prefix_index``)

The blocks are the prompt as the engine receives it, in order: a chat request's messages as
JSON (so two requests share blocks up to their first differing byte: the system prompt and the
earlier turns of a conversation), a completions prompt's first text, or its first token-id
list exactly (4 bytes an id, blocks of ``block_tokens`` ids). Text is cut in blocks of
``prefix_index.block_tokens`` x ``prefix_index.bytes_per_token`` bytes, so a block stands for
about one KV block of the engine. The index itself (bounded per endpoint by its KV cache and in
all, with TTLs) is engine_pool/prefix_index.py; its size and the age of its oldest entry are the
gauges ``shapegate_prefix_index_blocks`` and ``shapegate_prefix_index_oldest_seconds``.

With ``prefix_index.source: kv_events`` the blocks are the prompt's token ids as the engine gets
them (``tokens_of``: the model's chat template and tokenizer, gateway/count/), ``block_tokens``
ids a block, and an endpoint of a cluster with ``kv_events`` is believed to hold what its engine
reported (``engines``: engine_pool/kv_events.py, fed by ``readers``); other endpoints keep the
approximate record, each bounded by its engine's KV cache (``learn``, from the views the chain
ranks: ``EngineView.kv_capacity_tokens``, read from ``vllm:cache_config_info``). ``readers``
builds one reader per static endpoint of those clusters, or none (logged
``kv_events.unavailable``) when pyzmq or msgspec (the ``kv-events`` extra) is missing.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog

from engine_pool.cluster import EngineView
from engine_pool.kv_events import EngineBlocks, KvEventsReader, Step
from engine_pool.prefill_ledger import PrefillLedger
from engine_pool.prefix_index import Digest, PrefixIndex, chained_hashes, token_bytes
from gateway.observe.metrics import Metrics
from gateway.protocols.openai import ChatPrompt, Prompt
from gateway.settings import LaneSettings, PrefixIndexSettings, Settings

log = structlog.get_logger("shapegate.prefix")

# The prompt's token ids as the engine will see them, for a model.
TokensOf = Callable[[str, Prompt], Sequence[int]]


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
    def __init__(
        self, settings: PrefixIndexSettings, metrics: Metrics, tokens_of: TokensOf | None = None
    ) -> None:
        self.settings = settings
        self.index = PrefixIndex(
            settings.max_blocks,
            settings.ttl_s,
            block_tokens=settings.block_tokens,
            backstop_ttl_s=settings.backstop_ttl_s,
        )
        self._metrics = metrics
        self._tokens_of = tokens_of
        # Endpoint URL -> the blocks its engine reports holding (prefix_index.source kv_events).
        self.engines: dict[str, EngineBlocks] = {}
        # The prefill sent to each endpoint and not yet done (engine_pool/prefill_ledger.py).
        self.ledger = PrefillLedger()

    def look_for(self, prompt: Prompt, lane: LaneSettings, model: str = "") -> Seen:
        """``look``, for a lane that weighs prefix overlap or prefill work, or holds for a home;
        nothing for one that does none of these."""
        weighs = lane.weights.prefix or lane.weights.work or lane.prefix_hold_tokens is not None
        return self.look(prompt, model) if weighs else NOTHING

    def look(self, prompt: Prompt, model: str = "") -> Seen:
        if self.engines and self._tokens_of is not None:
            return self._look_tokens(self._tokens_of(model, prompt))
        data, ids = prompt_data(prompt)
        per_token = 4 if ids else self.settings.bytes_per_token
        block_tokens = self.settings.block_tokens
        hashes = tuple(chained_hashes(data, block_tokens * per_token))
        matched = self.index.match(hashes)
        cached = {url: blocks * block_tokens for url, blocks in matched.items()}
        return Seen(hashes, -(-len(data) // per_token), cached, self.index.held())

    def _look_tokens(self, token_ids: Sequence[int]) -> Seen:
        block_tokens = self.settings.block_tokens
        hashes = tuple(chained_hashes(token_bytes(token_ids), block_tokens * 4))
        matched = self.index.match(hashes)
        held = dict(self.index.held())
        for url, blocks in self.engines.items():
            matched[url] = blocks.match(hashes)
            held[url] = blocks.blocks
        cached = {url: n * block_tokens for url, n in matched.items() if n}
        return Seen(hashes, len(token_ids), cached, held)

    def learn(self, views: Sequence[EngineView]) -> None:
        """The endpoints' KV capacities as their views carry them: each endpoint's record is
        bounded by its own (engine_pool/prefix_index.py ``learn``). A smaller capacity may
        shrink the record at once, so the gauge is set again."""
        self.index.learn(views)
        self._metrics.prefix_index_blocks.set(self.index.blocks)

    def engine_down(self, url: str) -> None:
        """``url`` went down: its engine may restart with an empty cache, so the approximate
        record of what was sent there is dropped (an engine publishing KV events says itself
        what it holds after a restart). Forgetting costs one prefill a prefix at worst;
        believing a restarted engine still holds them sends follow-ups to a cold home."""
        blocks = self.index.held().get(url, 0)
        if not blocks:
            return
        self.index.forget(url)
        self._metrics.prefix_index_blocks.set(self.index.blocks)
        log.info("prefix_index.forgotten", endpoint=url, blocks=blocks, reason="engine_down")

    def state(self) -> dict[str, Any]:
        """The index as ``/admin/state`` shows it: ``entries`` (the approximate record's
        (block, endpoint) entries) against its ``bound`` (``prefix_index.max_blocks``), the
        age of its oldest entry, what it evicted, expired and cut to an engine's KV capacity;
        per endpoint its blocks (and KV capacity in blocks, when known) or, for an engine
        publishing KV events, the blocks it reports and how far its events lag (``lag_s``, the
        highest of those: null without any)."""
        index = self.index
        endpoints: dict[str, dict[str, Any]] = {
            url: {"source": "approximate", "blocks": n, "capacity_blocks": index.capacity(url)}
            for url, n in index.held().items()
        }
        for url, blocks in self.engines.items():
            endpoints[url] = {
                "source": "kv_events",
                "blocks": blocks.blocks,
                "lag_s": round(blocks.lag_s(), 3),
                "rebuilds": blocks.rebuilds,
            }
        lags = [e["lag_s"] for e in endpoints.values() if "lag_s" in e]
        return {
            "source": self.settings.source,
            "block_tokens": self.settings.block_tokens,
            "entries": index.blocks,
            "bound": index.max_blocks,
            "oldest_age_s": round(index.oldest_age_s(), 3),
            "evicted": index.evicted,
            "expired": index.expired,
            "overflowed": index.overflowed,
            "lag_s": max(lags) if lags else None,
            "endpoints": endpoints,
        }

    def engine_restarted(self, url: str) -> None:
        """``url``'s engine restarted (its ``process_start_time_seconds`` changed): its cache
        is empty, whether or not its probes ever failed. The approximate record of what was
        sent there is dropped; for an engine publishing KV events, its blocks are cleared and
        its reader goes back to the new process's sequence 0 (``EngineBlocks.restarted``:
        its next batch asks the replay socket from 0), so what the new process stored before
        the reader noticed is rebuilt rather than lost."""
        blocks = self.index.held().get(url, 0)
        engine = self.engines.get(url)
        if engine is not None:
            blocks += engine.blocks
            engine.restarted()
            # Its rebuild is counted by the reader's next step (``readers``' on_step counts
            # ``EngineBlocks.rebuilds`` as it grows): counting it here too would count it twice.
            self._metrics.kv_events_blocks.labels(url).set(0)
        self.index.forget(url)
        self._metrics.prefix_index_blocks.set(self.index.blocks)
        log.info(
            "prefix_index.forgotten",
            endpoint=url,
            blocks=blocks,
            reason="engine_restarted",
            kv_events=engine is not None,
        )

    def sending(self, seen: Seen, key: str, url: str) -> Callable[[], None]:
        """Request ``key`` goes to ``url``: its prompt less the prefix the endpoint is believed
        to hold is pending there until ``prefilled(key)`` (the call returned); then ``sent``."""
        self.ledger.add(key, url, seen.tokens - seen.cached.get(url, 0))
        self.sent(seen, url)
        return lambda: self.ledger.done(key)

    def prefilled(self, key: str) -> None:
        self.ledger.done(key)

    def sent(self, seen: Seen, url: str) -> None:
        if not seen.hashes or url in self.engines:
            # An engine publishing KV events says itself what it holds.
            return
        self.index.record(seen.hashes, url)
        self._metrics.prefix_index_blocks.set(self.index.blocks)
        self._metrics.prefix_index_oldest.set(round(self.index.oldest_age_s(), 3))


def readers(settings: Settings, prefixes: Prefixes, metrics: Metrics) -> list[KvEventsReader]:
    """One KV events reader per static endpoint of each cluster with ``kv_events`` (when the
    policy's ``prefix_index.source`` is ``kv_events``); none, said in the log, without the
    ``kv-events`` extra (pyzmq and msgspec): the approximate record serves every endpoint."""
    clusters = [c for c in settings.clusters if c.kv_events is not None]
    if settings.prefix_index.source != "kv_events" or not clusters:
        return []
    missing = [m for m in ("zmq", "msgspec") if importlib.util.find_spec(m) is None]
    if missing:
        log.error(
            "kv_events.unavailable",
            missing=missing,
            fix="pip install 'shapegate[kv-events]'",
            fallback="approximate prefix index for every endpoint",
        )
        return []
    block_tokens = settings.prefix_index.block_tokens
    counted: dict[str, int] = {}

    def on_step(blocks: EngineBlocks, step: Step) -> None:
        metrics.kv_events_blocks.labels(blocks.url).set(blocks.blocks)
        metrics.kv_events_lag.labels(blocks.url).set(round(blocks.lag_s(), 3))
        new = blocks.rebuilds - counted.get(blocks.url, 0)
        if new > 0:
            counted[blocks.url] = blocks.rebuilds
            metrics.kv_events_rebuilds.labels(blocks.url).inc(new)
        if blocks.block_size and blocks.block_size != block_tokens and not blocks.warned:
            blocks.warned = True
            log.error(
                "kv_events.block_size_mismatch",
                endpoint=blocks.url,
                engine_block=blocks.block_size,
                block_tokens=block_tokens,
            )

    out = []
    for cluster in clusters:
        assert cluster.kv_events is not None
        for url in cluster.endpoints:
            sockets = cluster.kv_events.sockets(url)
            if sockets is None:
                continue
            blocks = prefixes.engines.setdefault(url, EngineBlocks(url))
            out.append(KvEventsReader(blocks, sockets.publisher, sockets.replay, on_step))
    return out
