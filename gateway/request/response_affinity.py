"""Stateful Responses: which engine produced a response, so a follow-up reaches the same one.

vLLM keeps a stored response (and the conversation behind it) in the memory of the engine that
produced it; a request whose ``previous_response_id`` reaches any other engine is answered 404.
So the gateway remembers ``response id -> (cluster, endpoint)`` for every ``/v1/responses``
answer, and routes a request carrying ``previous_response_id`` to that endpoint.

Contract:
- ``ResponseAffinity.remember(response_id, cluster, url)`` and ``lookup(response_id)``; both
  async, both bounded: ``MemoryAffinity`` is an LRU of ``routes.response_affinity_entries``
  entries, each kept ``routes.response_affinity_ttl_s``; ``RedisAffinity`` (when
  ``state.backend`` is redis) shares the map between replicas as one key per response with that
  TTL, every call bounded by ``state.redis_timeout_s``.
- A Redis failure never fails the request: it is logged and counted (``swallowed``) and the
  request is routed by its count alone (the engine answers 404 if it lacks the response).
- ``pin(affinity, previous_response_id, decision, lanes)``: the decision pinned to the
  endpoint that stored the previous response, with that endpoint (the pipeline's step 4).
- ``response_id_of(payload)`` reads the id from a Responses JSON body or from the first SSE
  event (``response.created``) of a stream.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.core.decision import Decision
from gateway.observe.log import Logger, swallowed
from gateway.observe.metrics import Metrics
from gateway.request.lanes import pin_to_cluster
from gateway.settings import LaneSettings, Settings


class ResponseAffinity(Protocol):
    async def remember(self, response_id: str, cluster: str, url: str) -> None: ...
    async def lookup(self, response_id: str) -> tuple[str, str] | None: ...
    async def aclose(self) -> None: ...


class MemoryAffinity:
    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, tuple[float, str, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def remember(self, response_id: str, cluster: str, url: str) -> None:
        if self.max_entries <= 0:
            return
        self._entries[response_id] = (time.monotonic() + self.ttl_s, cluster, url)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    async def lookup(self, response_id: str) -> tuple[str, str] | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        expires, cluster, url = entry
        if expires < time.monotonic():
            del self._entries[response_id]
            return None
        return cluster, url

    async def aclose(self) -> None:
        self._entries.clear()


class RedisAffinity:
    def __init__(
        self, client: Redis, prefix: str, ttl_s: float, log: Logger, metrics: Metrics
    ) -> None:
        self._redis = client
        self._prefix = prefix
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._log = log
        self._metrics = metrics

    def _key(self, response_id: str) -> str:
        return f"{self._prefix}:response:{response_id}"

    async def remember(self, response_id: str, cluster: str, url: str) -> None:
        value = orjson.dumps([cluster, url])
        try:
            await self._redis.set(self._key(response_id), value, px=self._ttl_ms)
        except (RedisError, OSError, TimeoutError) as exc:
            swallowed(
                self._log,
                self._metrics,
                "response_affinity.remember",
                exc,
                decision="response_not_remembered",
            )

    async def lookup(self, response_id: str) -> tuple[str, str] | None:
        try:
            raw = await self._redis.get(self._key(response_id))
        except (RedisError, OSError, TimeoutError) as exc:
            swallowed(
                self._log,
                self._metrics,
                "response_affinity.lookup",
                exc,
                decision="routed_by_count_only",
            )
            return None
        if raw is None:
            return None
        cluster, url = orjson.loads(raw)
        return str(cluster), str(url)

    async def aclose(self) -> None:
        await self._redis.aclose()


def build_affinity(settings: Settings, log: Logger, metrics: Metrics) -> ResponseAffinity:
    routes = settings.routes
    if settings.state.backend == "redis":
        from gateway.slots.redis_store import redis_client

        return RedisAffinity(
            redis_client(settings.state),
            settings.state.key_prefix,
            routes.response_affinity_ttl_s,
            log,
            metrics,
        )
    return MemoryAffinity(routes.response_affinity_entries, routes.response_affinity_ttl_s)


def response_id_of(payload: bytes) -> str | None:
    """The ``id`` of a Responses body, or of the response in a stream's first event."""
    if payload.startswith(b"event:"):
        start = payload.find(b"data: ")
        end = payload.find(b"\n", start)
        if start < 0 or end < 0:
            return None
        payload = payload[start + 6 : end]
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None  # not a Responses body (an error page, a cut stream): nothing to remember
    if isinstance(data, dict) and isinstance(data.get("response"), dict):
        data = data["response"]
    found = data.get("id") if isinstance(data, dict) else None
    return found if isinstance(found, str) and found else None


async def pin(
    affinity: ResponseAffinity,
    previous: str | None,
    decision: Decision,
    lanes: Sequence[LaneSettings],
) -> tuple[Decision, str | None]:
    """A Responses follow-up goes to the endpoint that stored its previous response, when
    the gateway knows it; otherwise the count alone decides (the engine answers 404 for a
    response it does not hold)."""
    if previous is None:
        return decision, None
    found = await affinity.lookup(previous)
    if found is None:
        return decision, None
    pinned = pin_to_cluster(decision, found[0], lanes)
    return pinned, found[1] if pinned.reason == "response_affinity" else None
