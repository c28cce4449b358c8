"""The Redis client from the settings: a URL, or a Sentinel-managed primary whose passwords
come from the environment variables the policy names (real failovers:
tests/integration/test_redis_sentinel.py)."""

from __future__ import annotations

import pytest
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.settings import StateSettings
from gateway.slots.connect import redis_client

SENTINEL = {
    "hosts": ["10.0.0.1:26379", "sentinel-1.redis:26380"],
    "master_name": "main",
    "password_env": "T_REDIS_PASSWORD",
    "sentinel_password_env": "T_SENTINEL_PASSWORD",
    "db": 2,
}


async def test_a_sentinel_client_asks_the_named_sentinels_with_their_own_password() -> None:
    state = StateSettings.model_validate({"backend": "redis", "sentinel": SENTINEL})
    env = {"T_REDIS_PASSWORD": "server-secret", "T_SENTINEL_PASSWORD": "sentinel-secret"}
    client = redis_client(state, env)
    try:
        pool = client.connection_pool
        assert isinstance(pool, SentinelConnectionPool)
        assert pool.service_name == "main"
        assert pool.connection_kwargs["password"] == "server-secret"
        assert pool.connection_kwargs["db"] == 2
        assert pool.connection_kwargs["socket_timeout"] == state.redis_timeout_s
        sentinels = pool.sentinel_manager.sentinels
        addresses = [
            (
                s.connection_pool.connection_kwargs["host"],
                s.connection_pool.connection_kwargs["port"],
            )
            for s in sentinels
        ]
        assert addresses == [("10.0.0.1", 26379), ("sentinel-1.redis", 26380)]
        assert {s.connection_pool.connection_kwargs["password"] for s in sentinels} == {
            "sentinel-secret"
        }
    finally:
        await client.aclose()


async def test_an_unset_password_variable_is_a_start_up_error() -> None:
    state = StateSettings.model_validate({"backend": "redis", "sentinel": SENTINEL})
    with pytest.raises(ValueError, match="T_REDIS_PASSWORD is not set"):
        redis_client(state, {"T_SENTINEL_PASSWORD": "x"})


async def test_without_sentinel_the_url_is_used() -> None:
    state = StateSettings.model_validate({"backend": "redis", "redis_url": "redis://h:7000/3"})
    client = redis_client(state)
    try:
        kwargs = client.connection_pool.connection_kwargs
        assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("h", 7000, 3)
    finally:
        await client.aclose()


async def test_a_sentinel_client_whose_close_fails_still_closes_its_sentinel_clients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """redis-py raises a disconnect's timeout from the primary's pool: the clients to the
    sentinels (the manager's) are closed all the same, and the error still reaches the caller."""
    state = StateSettings.model_validate({"backend": "redis", "sentinel": SENTINEL})
    env = {"T_REDIS_PASSWORD": "server-secret", "T_SENTINEL_PASSWORD": "sentinel-secret"}
    client = redis_client(state, env)
    manager = client.connection_pool.sentinel_manager
    closed: list[str] = []
    manager_close = manager.aclose

    async def disconnect_times_out(inuse_connections: bool = True) -> None:
        raise RedisTimeoutError("Timed out closing connection after 0.5")

    async def manager_closes() -> None:
        closed.append("sentinels")
        await manager_close()

    monkeypatch.setattr(client.connection_pool, "disconnect", disconnect_times_out)
    monkeypatch.setattr(manager, "aclose", manager_closes)
    with pytest.raises(RedisTimeoutError, match="Timed out closing"):
        await client.aclose()
    assert closed == ["sentinels"]
