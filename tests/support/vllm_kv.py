"""vLLM's KV event wire for tests: its own msgspec structs (vllm/distributed/kv_events.py,
0.32) and a publisher with ZmqEventPublisher's sockets (PUB of 3 frames, a replaying ROUTER)."""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

BLOCK = 4


# vLLM 0.32's own structs (vllm/distributed/kv_events.py), so the test encodes what it sends.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


def stored(
    hashes: list[bytes | int], parent: bytes | None, tokens: list[int], block: int = BLOCK
) -> BlockStored:
    return BlockStored(hashes, parent, tokens, block, None, "GPU", None, [None] * len(hashes))


def wire(seq: int, *events: Any) -> list[bytes]:
    payload = msgspec.msgpack.encode(EventBatch(1.5, list(events)))
    return [b"", seq.to_bytes(8, "big"), payload]


class Publisher:
    """vLLM's ZmqEventPublisher's wire: PUB of 3 frames, ROUTER replaying its buffer."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[list[bytes]] = []

    def publish(self, frames: list[bytes], send: bool = True) -> None:
        self.buffer.append(frames)
        if send:
            self.pub.send_multipart(frames)

    def serve_replay(self) -> None:
        while self.router.poll(0):
            client, _, start = self.router.recv_multipart()
            for frames in self.buffer:
                if int.from_bytes(frames[1], "big") >= int.from_bytes(start, "big"):
                    self.router.send_multipart([client, b"", *frames])
            self.router.send_multipart(
                [client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
            )

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()
