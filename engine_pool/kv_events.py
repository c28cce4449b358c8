"""Which token blocks a vLLM engine holds, read from its KV events (``--kv-events-config``).

    batch = decode(frames)                  one ZMQ message (topic, 8-byte sequence, msgpack)
    blocks = EngineBlocks(url)
    step = blocks.apply(batch)              OK, GAP (ask the replay socket from blocks.next_seq)
                                            or RESTART (the engine started over: rebuilt)
    blocks.restarted()                      the engine restarted (told from outside, e.g. its
                                            process start time): forget all, and read the new
                                            process's events from sequence 0
    blocks.match(hashes) -> blocks          leading blocks of a prompt's chained hashes it holds
    reader = KvEventsReader(blocks, endpoint, replay_endpoint)
    await reader.run()                      the I/O: SUB socket, DEALER to the replay ROUTER

The wire, as vLLM 0.32 publishes it (vllm/distributed/kv_events.py, ``ZmqEventPublisher``):
three frames, the topic, the batch's sequence number (8 bytes big-endian, counting from 0 at
the engine's start) and a msgpack ``KVEventBatch``: a msgspec struct with ``array_like=True``,
so ``[ts, [event, ...]]`` (a third element, the data-parallel rank, when set). Each event is a
msgspec tagged struct (``tag=True``, not array-like): a map whose ``type`` is ``BlockStored``
(``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ...),
``BlockRemoved`` (``block_hashes``) or ``AllBlocksCleared``. Block hashes are bytes (sha256)
or 64-bit integers (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``). The replay socket is a ROUTER:
a DEALER sends ``[b"", start_seq (8 bytes big-endian)]`` and receives
``[b"", topic, seq, payload]`` for every buffered batch from ``start_seq`` on, then
``[b"", b"", -1 (8 bytes, signed), b""]``.

The index keys are the gateway's own hashes (engine_pool/prefix_index.py ``chained_hashes`` of
the blocks' token ids, 4 bytes an id), never vLLM's: a ``BlockStored`` event carries the token
ids of its blocks, so the gateway rebuilds the chain from the parent it already knows and
compares the request's own token ids hashed the same way, whatever ``--prefix-caching-hash-algo``
and seed the engine uses. vLLM's hash is kept only to map a later ``BlockRemoved`` (and a
child's ``parent_block_hash``) to the gateway's. A block whose parent is unknown (its parent's
event was lost) is skipped and counted: nothing is believed that was not seen.

Bounded: an engine holds at most its KV cache's blocks, and the map holds one entry a block it
reported stored and not yet removed; ``max_blocks`` caps it anyway (a forgotten removal never
grows it without limit: past the cap the engine's state is unknown, so it is rebuilt).
Imports pyzmq and msgspec only inside the reader (the ``kv-events`` extra): decoding of an
already-parsed payload and the per-endpoint state are plain Python.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from engine_pool.prefix_index import Digest, chained_hashes, token_bytes

log = structlog.get_logger("shapegate.kv_events")

EngineHash = bytes | int
END_SEQ = -1


class BadMessage(ValueError):
    """A message that is not a vLLM KV event batch."""


@dataclass(frozen=True, slots=True)
class Stored:
    hashes: tuple[EngineHash, ...]
    parent: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    # Blocks of a LoRA, multimodal input or cache salt: their tokens alone do not name them.
    keyed: bool = False


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[EngineHash, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    seq: int
    ts: float
    events: tuple[Event, ...]


def _hash(value: Any) -> EngineHash:
    if isinstance(value, bytes | int) and not isinstance(value, bool):
        return value
    raise BadMessage(f"block hash is {type(value).__name__}")


def decode_event(raw: Any) -> Event | None:
    """One event of a batch (a tagged map; a tagged list ``[tag, ...fields]`` is read too).

    None for an event type this reader does not know (a newer vLLM's)."""
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        names = {
            "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
            "BlockRemoved": ("block_hashes",),
        }
        raw = {"type": raw[0], **dict(zip(names.get(raw[0], ()), raw[1:], strict=False))}
    if not isinstance(raw, dict):
        raise BadMessage(f"event is {type(raw).__name__}")
    kind = raw.get("type")
    try:
        if kind == "BlockStored":
            parent = raw.get("parent_block_hash")
            keyed = bool(raw.get("lora_id") or raw.get("lora_name") or raw.get("extra_keys"))
            if raw.get("extra_keys") and all(k is None for k in raw["extra_keys"]):
                keyed = bool(raw.get("lora_id") or raw.get("lora_name"))
            return Stored(
                tuple(_hash(h) for h in raw["block_hashes"]),
                None if parent is None else _hash(parent),
                tuple(int(t) for t in raw["token_ids"]),
                int(raw["block_size"]),
                keyed,
            )
        if kind == "BlockRemoved":
            return Removed(tuple(_hash(h) for h in raw["block_hashes"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise BadMessage(f"{kind}: {exc}") from exc
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


def decode_payload(seq: int, payload: Any) -> Batch:
    """A batch from its sequence number and its msgpack payload, already parsed."""
    if not isinstance(payload, list | tuple) or len(payload) < 2:
        raise BadMessage("batch is not [ts, events, ...]")
    ts, raw_events = payload[0], payload[1]
    if not isinstance(raw_events, list | tuple) or not isinstance(ts, int | float):
        raise BadMessage("batch is not [ts, events, ...]")
    events = tuple(e for e in (decode_event(r) for r in raw_events) if e is not None)
    return Batch(seq, float(ts), events)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise BadMessage(f"sequence frame of {len(frame)} bytes")
    return int.from_bytes(frame, "big", signed=True)


class Step(enum.Enum):
    OK = "ok"
    # Batches were missed: ask the replay socket from ``next_seq``.
    GAP = "gap"
    # The engine started over (its sequence went back, or it cleared its cache): rebuilt.
    RESTART = "restart"
    # Already applied (a replayed batch seen live too).
    OLD = "old"


class EngineBlocks:
    """One engine's cached blocks, as its events tell them, keyed by the gateway's hashes."""

    def __init__(self, url: str, max_blocks: int = 1_000_000) -> None:
        self.url = url
        self.max_blocks = max_blocks
        # vLLM's block hash -> the gateway's digest of the same block.
        self._own: dict[EngineHash, Digest] = {}
        self._held: dict[Digest, int] = {}
        self.next_seq: int | None = None
        self.last_ts = 0.0
        self.applied_at = 0.0
        self.orphans = 0
        self.keyed = 0
        self.rebuilds = 0
        self.block_size = 0
        # Told once that the engine's block is not the index's.
        self.warned = False

    @property
    def blocks(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        self._own.clear()
        self._held.clear()

    def holds(self, digest: Digest) -> bool:
        return digest in self._held

    def match(self, hashes: Sequence[Digest]) -> int:
        """How many leading blocks of ``hashes`` the engine holds."""
        n = 0
        for digest in hashes:
            if digest not in self._held:
                break
            n += 1
        return n

    def lag_s(self) -> float:
        """Seconds between the newest batch's engine timestamp and when it was applied."""
        return max(0.0, self.applied_at - self.last_ts) if self.last_ts else 0.0

    def apply(self, batch: Batch, clock: Callable[[], float] = time.time) -> Step:
        step = Step.OK
        if self.next_seq is not None:
            if batch.seq < self.next_seq - 1 or (batch.seq == 0 and self.next_seq > 1):
                # The sequence went back: a new engine process (its counter starts at 0).
                self.clear()
                self.rebuilds += 1
                step = Step.RESTART
            elif batch.seq < self.next_seq:
                return Step.OLD
            elif batch.seq > self.next_seq:
                return Step.GAP
        elif batch.seq > 0:
            # First batch seen mid-stream: what came before it must be replayed first.
            return Step.GAP
        self._apply_events(batch.events)
        self.next_seq = batch.seq + 1
        self.last_ts = batch.ts
        self.applied_at = clock()
        return step

    def restarted(self) -> None:
        """The engine's process restarted (the monitor saw a new start time): everything is
        forgotten and the next batch is read as a stream's first, so any batch after sequence
        0 is a GAP and the reader asks the replay socket from 0 (the new process's start,
        sequences counting from 0 again): blocks the new process stored before this was told
        are read again, not lost."""
        self.clear()
        self.rebuilds += 1
        self.next_seq = None

    def restart_from(self, seq: int) -> None:
        """The replay cannot give what was missed: forget everything, go on from ``seq``."""
        self.clear()
        self.rebuilds += 1
        self.next_seq = seq

    def _apply_events(self, events: Iterable[Event]) -> None:
        for event in events:
            if isinstance(event, Stored):
                self._store(event)
            elif isinstance(event, Removed):
                for engine_hash in event.hashes:
                    digest = self._own.pop(engine_hash, None)
                    if digest is not None:
                        count = self._held.get(digest, 0) - 1
                        if count > 0:
                            self._held[digest] = count
                        else:
                            self._held.pop(digest, None)
            else:
                self.clear()
        if len(self._own) > self.max_blocks:
            log.warning("kv_events.too_many_blocks", endpoint=self.url, blocks=len(self._own))
            self.clear()
            self.rebuilds += 1

    def _store(self, event: Stored) -> None:
        if event.keyed:
            # Its hash mixes in more than tokens: a plain-token request never shares it.
            self.keyed += len(event.hashes)
            return
        parent: Digest = 0
        if event.parent is not None:
            known = self._own.get(event.parent)
            if known is None:
                self.orphans += len(event.hashes)
                return
            parent = known
        size = event.block_size
        self.block_size = size
        data = token_bytes(event.token_ids[: size * len(event.hashes)])
        digests = chained_hashes(data, size * 4, parent)
        for engine_hash, digest in zip(event.hashes, digests, strict=False):
            if engine_hash in self._own:
                continue
            self._own[engine_hash] = digest
            self._held[digest] = self._held.get(digest, 0) + 1


class KvEventsReader:
    """Keeps ``blocks`` up to date from an engine's publisher (needs pyzmq and msgspec).

    ``endpoint`` is the engine's PUB address (``tcp://host:port``), ``replay_endpoint`` its
    ROUTER (None: a gap rebuilds from the next batch on). On start, and on every gap, it asks
    the replay socket for what it missed."""

    def __init__(
        self,
        blocks: EngineBlocks,
        endpoint: str,
        replay_endpoint: str | None,
        on_step: Callable[[EngineBlocks, Step], None] | None = None,
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.blocks = blocks
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.on_step = on_step
        self.replay_timeout_s = replay_timeout_s
        self.errors = 0
        self.batches = 0
        self._decode_error: type[Exception] = BadMessage

    async def run(self) -> None:
        import msgspec
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)
        decoder = msgspec.msgpack.Decoder()
        self._decode_error = msgspec.DecodeError
        log.info(
            "kv_events.subscribed",
            endpoint=self.blocks.url,
            publisher=self.endpoint,
            replay=self.replay_endpoint,
        )
        try:
            await self._replay(ctx, decoder, 0)
            while True:
                frames = await sub.recv_multipart()
                batch = self._decode(frames, decoder)
                if batch is None:
                    continue
                step = self._apply(batch)
                if step is Step.GAP:
                    want = self.blocks.next_seq or 0
                    await self._replay(ctx, decoder, want)
                    if self.blocks.next_seq is None or self.blocks.next_seq <= batch.seq:
                        # The replay did not reach this batch: what came before is lost.
                        self.blocks.restart_from(batch.seq)
                        log.warning(
                            "kv_events.rebuilt", endpoint=self.blocks.url, reason="gap", seq=want
                        )
                    self._apply(batch)
        finally:
            sub.close(linger=0)

    def _decode(self, frames: list[bytes], decoder: Any) -> Batch | None:
        try:
            if len(frames) != 3:
                raise BadMessage(f"{len(frames)} frames")
            return decode_payload(decode_seq(frames[1]), decoder.decode(frames[2]))
        except (BadMessage, self._decode_error) as exc:  # skipped, logged and counted
            self.errors += 1
            log.warning("kv_events.bad_message", endpoint=self.blocks.url, error=str(exc))
            return None

    def _apply(self, batch: Batch) -> Step:
        step = self.blocks.apply(batch)
        self.batches += 1
        if step is Step.RESTART:
            log.info("kv_events.rebuilt", endpoint=self.blocks.url, reason="restart", seq=batch.seq)
        if self.on_step is not None:
            self.on_step(self.blocks, step)
        return step

    async def _replay(self, ctx: Any, decoder: Any, start: int) -> None:
        """Apply the publisher's buffered batches from ``start`` on (nothing without a socket)."""
        if self.replay_endpoint is None:
            return
        import zmq

        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(self.replay_timeout_s * 1000):
                    log.warning("kv_events.replay_timeout", endpoint=self.blocks.url, seq=start)
                    return
                frames = await dealer.recv_multipart()
                if len(frames) == 4 and decode_seq(frames[2]) == END_SEQ:
                    return
                batch = self._decode(frames[1:], decoder)
                if batch is None:
                    continue
                if self.blocks.next_seq is None and batch.seq > start:
                    # The buffer no longer reaches back to ``start``: go on from what it has.
                    self.blocks.restart_from(batch.seq)
                step = self._apply(batch)
                if step is Step.GAP and self.blocks.next_seq is not None:
                    self.blocks.restart_from(batch.seq)
                    self._apply(batch)
        finally:
            dealer.close(linger=0)
