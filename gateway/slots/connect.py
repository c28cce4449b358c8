"""The Redis client behind the shared state: one URL, or the primary found through Sentinel.

``redis_client(state)`` returns a client whose every call fits ``state.redis_timeout_s``. With
``state.sentinel`` set, the client asks the sentinels for the primary of ``master_name`` each
time it opens a connection, and drops a connection whose server answers READONLY (a demoted
primary): after a failover the next call (or its one retry) reaches the promoted replica, with
no restart. While no sentinel names a healthy primary (the primary is down and not yet replaced,
or the sentinels lost their quorum) calls fail as with an unreachable Redis, and the store's
``on_redis_down`` policy applies. Telling the failover's possible loss of the last writes from
an intact store is the Lua scripts' business (the epoch names its server, gateway/slots/lua.py).

Passwords are read from the environment variables the settings name; an unset one is a start-up
error (config_check reports it first).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.driver_info import DriverInfo

from gateway.settings import SentinelSettings, StateSettings


def _fast(timeout_s: float) -> dict[str, Any]:
    return {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        # One immediate retry on a fresh connection heals a pool left stale by a Redis restart
        # or a failover; redis-py's default (10 retries, exponential backoff) would outlast 2 s.
        "retry": Retry(NoBackoff(), 1),
        # A new connection's first call must fit the timeout too: RESP2 and no driver info
        # skip the HELLO, CLIENT MAINT_NOTIFICATIONS and SETINFO round trips redis-py 8 makes.
        "protocol": 2,
        "driver_info": DriverInfo(name=None, lib_version=None),
    }


def redis_client(state: StateSettings, environ: Mapping[str, str] | None = None) -> Redis:
    """A client for slots and response affinity, every call bounded by ``redis_timeout_s``."""
    if state.sentinel is not None:
        return sentinel_client(state.sentinel, state.redis_timeout_s, environ)
    return Redis.from_url(state.redis_url, **_fast(state.redis_timeout_s))


class _SentinelRedis(Redis):
    """A primary's client that also closes the sentinel clients it looks the primary up with."""

    manager: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:  # a primary's close that failed (a disconnect's timeout) still closes these
            if self.manager is not None:
                await self.manager.aclose()


def sentinel_client(
    sentinel: SentinelSettings, timeout_s: float, environ: Mapping[str, str] | None = None
) -> Redis:
    env = os.environ if environ is None else environ
    sentinel_kwargs = _fast(timeout_s)
    if sentinel.sentinel_password_env:
        sentinel_kwargs["password"] = _secret(env, sentinel.sentinel_password_env)
    server_kwargs = _fast(timeout_s)
    server_kwargs["db"] = sentinel.db
    if sentinel.password_env:
        server_kwargs["password"] = _secret(env, sentinel.password_env)
    if sentinel.username:
        server_kwargs["username"] = sentinel.username
    manager = Sentinel(  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis 8.2
        sentinel.addresses(), sentinel_kwargs=sentinel_kwargs, **server_kwargs
    )
    client = manager.master_for(sentinel.master_name, redis_class=_SentinelRedis)
    assert isinstance(client, _SentinelRedis)  # master_for builds the class it is given
    client.manager = manager
    return client


def _secret(env: Mapping[str, str], name: str) -> str:
    value = env.get(name)
    if not value:
        raise ValueError(f"state.sentinel: environment variable {name} is not set (or empty)")
    return value
