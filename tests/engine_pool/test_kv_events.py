"""engine_pool/kv_events.py: vLLM's KV event wire, the per-engine block set, gaps and restarts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from engine_pool.kv_events import (
    Batch,
    Cleared,
    EngineBlocks,
    KvEventsReader,
    Removed,
    Step,
    Stored,
    decode_payload,
)
from engine_pool.prefix_index import chained_hashes, token_bytes
from tests.support.vllm_kv import (
    BLOCK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Publisher,
    stored,
    wire,
)


def decoded(seq: int, *events: Any) -> Batch:
    return decode_payload(seq, msgspec.msgpack.decode(wire(seq, *events)[2]))


def digests(tokens: list[int]) -> list[int]:
    return chained_hashes(token_bytes(tokens), BLOCK * 4)


PROMPT = list(range(100, 112))  # three blocks of four


def test_decodes_vllms_structs() -> None:
    batch = decoded(
        3, stored([b"a", b"b"], None, PROMPT[:8]), BlockRemoved([b"a"], "GPU"), AllBlocksCleared()
    )
    assert batch == Batch(
        3,
        1.5,
        (Stored((b"a", b"b"), None, tuple(PROMPT[:8]), BLOCK), Removed((b"a",)), Cleared()),
    )


def test_stored_blocks_match_the_requests_own_hashes_across_events() -> None:
    blocks = EngineBlocks("e")
    assert blocks.apply(decoded(0, stored([b"a", b"b"], None, PROMPT[:8]))) is Step.OK
    assert blocks.match(digests(PROMPT)) == 2
    # The third block comes in its own event, chained on vLLM's hash of the second.
    blocks.apply(decoded(1, stored([b"c"], b"b", PROMPT[8:12])))
    assert blocks.match(digests(PROMPT)) == 3
    # Another prompt sharing the first block only.
    assert blocks.match(digests([*PROMPT[:4], 7, 7, 7, 7])) == 1
    blocks.apply(decoded(2, BlockRemoved([b"b"], "GPU")))
    assert blocks.match(digests(PROMPT)) == 1
    blocks.apply(decoded(3, AllBlocksCleared()))
    assert blocks.match(digests(PROMPT)) == 0 and blocks.blocks == 0


def test_a_block_whose_parent_was_never_seen_is_not_believed() -> None:
    blocks = EngineBlocks("e")
    blocks.apply(decoded(0, stored([b"c"], b"unknown", PROMPT[8:12])))
    assert blocks.blocks == 0 and blocks.orphans == 1


def test_blocks_of_a_lora_are_not_plain_token_blocks() -> None:
    blocks = EngineBlocks("e")
    event = BlockStored([b"a"], None, PROMPT[:4], BLOCK, 3, "GPU", "adapter", [("adapter",)])
    blocks.apply(decoded(0, event))
    assert blocks.match(digests(PROMPT)) == 0 and blocks.keyed == 1


def test_gap_old_and_restart_by_sequence() -> None:
    blocks = EngineBlocks("e")
    assert blocks.apply(decoded(2, stored([b"a"], None, PROMPT[:4]))) is Step.GAP
    assert blocks.apply(decoded(0, stored([b"a"], None, PROMPT[:4]))) is Step.OK
    assert blocks.apply(decoded(0, stored([b"a"], None, PROMPT[:4]))) is Step.OLD
    assert blocks.apply(decoded(1, stored([b"b"], b"a", PROMPT[4:8]))) is Step.OK
    assert blocks.apply(decoded(5, AllBlocksCleared())) is Step.GAP
    assert blocks.match(digests(PROMPT)) == 2
    # A new engine process counts from 0 again: everything before it is gone.
    assert blocks.apply(decoded(0, stored([b"x"], None, [9, 9, 9, 9]))) is Step.RESTART
    assert blocks.match(digests(PROMPT)) == 0 and blocks.rebuilds == 1


def test_an_engine_restart_told_from_outside_replays_from_sequence_0() -> None:
    """The monitor saw a new process start time: what was held is gone, and the next batch is
    read as a stream's first, so one past sequence 0 asks the replay socket from 0 (the new
    process's start), whatever sequence the old process had reached."""
    blocks = EngineBlocks("e")
    assert blocks.apply(decoded(0, stored([b"a"], None, PROMPT[:4]))) is Step.OK
    assert blocks.apply(decoded(1, stored([b"b"], b"a", PROMPT[4:8]))) is Step.OK
    blocks.restarted()
    assert blocks.match(digests(PROMPT)) == 0 and blocks.rebuilds == 1
    assert blocks.next_seq is None
    # The new process's batch 3 arrives first: 0-2 must be replayed before it.
    assert blocks.apply(decoded(3, stored([b"x"], None, PROMPT[:4]))) is Step.GAP
    assert blocks.apply(decoded(0, stored([b"a2"], None, PROMPT[:4]))) is Step.OK
    assert blocks.match(digests(PROMPT)) == 1 and blocks.next_seq == 1


@contextlib.asynccontextmanager
async def reading(publisher: Publisher, blocks: EngineBlocks) -> AsyncIterator[KvEventsReader]:
    """A reader of ``publisher`` into ``blocks``, running for the body; both closed after."""
    reader = KvEventsReader(
        blocks,
        f"tcp://127.0.0.1:{publisher.port}",
        f"tcp://127.0.0.1:{publisher.replay_port}",
    )
    task = asyncio.create_task(reader.run())
    try:
        yield reader
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        publisher.close()


def test_the_reader_resubscribes_from_0_after_a_restart_told_from_outside() -> None:
    async def main() -> None:
        publisher = Publisher()
        blocks = EngineBlocks("e")
        async with reading(publisher, blocks):
            for seq, (name, parent, part) in enumerate(
                [(b"a", None, PROMPT[:4]), (b"b", b"a", PROMPT[4:8]), (b"c", b"b", PROMPT[8:12])]
            ):
                # Before the reader subscribed: its start's replay gives them.
                publisher.publish(wire(seq, stored([name], parent, part)), send=False)
            await until(lambda: blocks.match(digests(PROMPT)) == 3, publisher)
            # The engine restarted: its new process publishes from 0 again, and the reader
            # (told by the monitor) missed its first batches on the PUB socket.
            publisher.buffer.clear()
            blocks.restarted()
            publisher.publish(wire(0, stored([b"n"], None, PROMPT[:4])), send=False)
            await asyncio.sleep(0.3)  # the SUB socket's subscription reaches the PUB
            publisher.publish(wire(1, stored([b"m"], b"n", PROMPT[4:8])))
            await until(lambda: blocks.match(digests(PROMPT)) == 2, publisher)
            assert blocks.next_seq == 2 and blocks.rebuilds == 1

    asyncio.run(main())


async def until(check: Any, publisher: Publisher, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        publisher.serve_replay()
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("not reached")


def test_reader_replays_what_it_missed_before_it_started_and_in_a_gap() -> None:
    async def main() -> None:
        publisher = Publisher()
        blocks = EngineBlocks("e")
        # Published before the reader subscribed: only the replay socket has it.
        publisher.publish(wire(0, stored([b"a"], None, PROMPT[:4])), send=False)
        async with reading(publisher, blocks) as reader:
            await until(lambda: blocks.match(digests(PROMPT)) == 1, publisher)
            await asyncio.sleep(0.3)  # the SUB socket's subscription reaches the PUB
            # Sequence 1 is lost on the PUB socket; 2 arrives and makes the reader replay 1.
            publisher.publish(wire(1, stored([b"b"], b"a", PROMPT[4:8])), send=False)
            publisher.publish(wire(2, stored([b"c"], b"b", PROMPT[8:12])))
            await until(lambda: blocks.match(digests(PROMPT)) == 3, publisher)
            assert blocks.next_seq == 3 and reader.errors == 0

    asyncio.run(main())
