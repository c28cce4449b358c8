"""The Lua scripts behind ``RedisSlotStore`` and the one way they are run (``ScriptRunner``).

Each script is atomic and reads the clock from Redis.

A limit is a sorted set: member = request token, score = lease deadline in milliseconds of
Redis server time (``TIME``), so replicas with skewed clocks agree on who has expired. A lease
is live while its score is above now. A lane's waiting list is two sorted sets: the place
(score = the class band plus a ticket from ``INCR``, i.e. class, then arrival, across
replicas; member ``replica|token``) and the waiter's own liveness deadline, so a waiter whose
replica died stops holding up the queue after one TTL.

Every key a script touches is passed in KEYS and shares one ``{hash tag}``, so the scripts run
on Redis Cluster. Keys expire (3 x TTL, only ever extended) so abandoned limits disappear, but a
key always outlives the leases in it.

Data loss (a restart without persistence, a failover to an empty replica) is told apart from
reaping by an epoch: a key that never expires, created by the first acquire with a random value
that every acquire returns and every lease remembers. The epoch names the server that wrote it
(its ``run_id``), so a failover to a replica that carries the old epoch, or a restart that
reloaded it from disk, also counts as data loss: replication is asynchronous, the last grants
and renewals may be missing, and leases may have lapsed while no primary answered. A renewal
that finds its lease gone *and* the epoch changed or missing knows Redis lost its data, not that
the lease expired: the owner is alive and its request in flight on an engine, so the lease is
re-established (``RENEW`` answers 2). Whoever notices the loss first (a renewal, or an acquire
from a replica that knew the old epoch) sets a recovery marker for half a TTL, during which
acquires take nothing: every live holder renews within a third of a TTL, so their leases are
back before anyone new is admitted, and the count never exceeds the limit.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from redis.asyncio import Redis
from redis.exceptions import NoScriptError, RedisError

from gateway.observe.log import Logger, get_logger, swallowed
from gateway.observe.metrics import Metrics

PROBE_INTERVAL_S = 1.0
# What a failed call means for the request, when it is not the on_redis_down policy itself.
_DECISIONS = {
    "release": "left_to_lease_ttl",
    "move": "no_failover",
    "leave": "left_to_queue_ttl",
    "renew": "retry_next_renewal",
    "refresh": "retry_next_refresh",
    "reserve": "borrowers_not_held_off",
}


class Down(enum.Enum):
    DOWN = "down"


DOWN = Down.DOWN


@dataclass(frozen=True, slots=True)
class Script:
    text: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.text.encode()).hexdigest())  # noqa: S324

    async def __call__(self, client: Redis, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        """EVALSHA, and on NOSCRIPT (first use, or Redis restarted) one EVAL, which also caches
        the script: two round trips at worst, where redis-py's Script takes three."""
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await client.eval(self.text, len(keys), *keys, *args)


class ScriptRunner:
    """Runs scripts on one Redis, each call bounded by ``timeout_s``, and tracks whether Redis
    can be reached: the first failure logs ``state.degraded`` and sets
    ``shapegate_state_degraded``; the first success after it logs ``state.recovered``."""

    def __init__(
        self,
        client: Redis,
        timeout_s: float,
        policy: str,
        log: Logger | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.policy = policy
        self.log = log or get_logger("slots")
        self.metrics = metrics
        self.degraded_since: float | None = None
        self._next_probe = 0.0

    async def call(
        self,
        op: str,
        script: Script,
        keys: Sequence[str],
        args: Sequence[str | int],
        *,
        gated: bool = False,
    ) -> Any:
        """The script's reply, or DOWN when Redis cannot answer in time.

        ``gated`` calls (new work) skip Redis while degraded until the next probe is due
        (every ``PROBE_INTERVAL_S``), so a down Redis costs new requests nothing; releases and
        renewals always try.
        """
        if gated and self.skipping():
            return DOWN
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        try:
            with anyio.fail_after(self.timeout_s):
                result = await script(self.client, keys, args)
        except (RedisError, OSError, TimeoutError) as exc:
            _redeliver_cancellation(task, cancels)
            self._down(op, exc)
            return DOWN
        _redeliver_cancellation(task, cancels)
        if self.degraded_since is not None:
            degraded_s = round(time.monotonic() - self.degraded_since, 3)
            self.log.info("state.recovered", op=op, degraded_s=degraded_s)
            self.degraded_since = None
            if self.metrics is not None:
                self.metrics.state_degraded.set(0)
        return result

    def skipping(self) -> bool:
        """True while degraded and no probe is due: gated calls return DOWN unsent."""
        return self.degraded_since is not None and time.monotonic() < self._next_probe

    def _down(self, op: str, exc: BaseException) -> None:
        decision = _DECISIONS.get(op, self.policy)
        swallowed(self.log, self.metrics, f"slots_redis.{op}", exc, decision=decision)
        self._next_probe = time.monotonic() + PROBE_INTERVAL_S
        if self.degraded_since is None:
            self.degraded_since = time.monotonic()
            error_type = type(exc).__name__
            self.log.warning("state.degraded", op=op, policy=self.policy, error_type=error_type)
            if self.metrics is not None:
                self.metrics.state_degraded.set(1)

    async def aclose(self) -> None:
        await self.client.aclose()


def _redeliver_cancellation(task: asyncio.Task[Any] | None, cancels: int) -> None:
    """Raise the cancellation the call swallowed, if it did.

    On Python 3.11, ``asyncio.wait_for`` (redis-py opens connections with it) drops a
    cancellation that lands just as the connection completes (CPython gh-86296): the caller
    would then go on, e.g. take a slot for a client that already left.
    """
    if task is not None and task.cancelling() > cancels:
        raise asyncio.CancelledError


# A waiting list's score is band + ticket: the class band (``band``) orders before arrival.
BAND = 10**12


def band(rank: int, starved: bool = False) -> int:
    """The score band of a waiter of class ``rank`` (0 the highest); a starved waiter (past
    ``classes.starvation_s``) goes before every class: band 0."""
    return 0 if starved else (rank + 1) * BAND


_PRELUDE = (
    f"""
local BAND = {BAND}
"""
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function extend(key, keep)
  if redis.call('PTTL', key) < keep then redis.call('PEXPIRE', key, keep) end
end
-- The store's epoch (see the module docstring); ``known`` is the caller's, '' if none yet. The
-- epoch is "<random>@<run_id of the server that made it>": a server that finds another's run_id
-- in it took over data it did not write itself (a promoted replica, a restart from disk), and
-- the last writes before the switch may be missing, so it starts a new epoch as after data loss.
local function epoch_of(ekey, rkey, known, proposal, grace)
  local server = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
  local epoch = redis.call('GET', ekey)
  if epoch and not string.find(epoch, '@', 1, true) then
    -- Written before epochs named their server: adopt it, nothing was lost.
    epoch = epoch .. '@' .. server
    redis.call('SET', ekey, epoch)
  end
  if epoch and string.sub(epoch, -#server - 1) ~= '@' .. server then
    epoch = nil
    known = 'switched'
  end
  if not epoch then
    epoch = proposal .. '@' .. server
    redis.call('SET', ekey, epoch)
    if known ~= '' then redis.call('SET', rkey, '1', 'PX', grace) end
    return epoch
  end
  if known ~= '' and epoch ~= known then redis.call('SET', rkey, '1', 'PX', grace, 'NX') end
  return epoch
end
"""
)

# KEYS: lane, queue, queue liveness, ticket counter, epoch, recovery marker, candidate endpoints
#       (n of them), then the guard keys the candidates name.
# ARGV: token, ttl_ms, lane limit, the token's waiting-list member ("replica|token"),
#       "<1 when it is a waiter, else 0>|<its class band>" (``band``; "0|0" for a newcomer), the
#       replica's known epoch ('' if none), a new epoch should none exist, the
#       recovery grace in ms, candidate limits... (ARGV[i + 2] is the limit of KEYS[i], i >= 7),
#       then one guard list per candidate (ARGV[n + i + 2] for KEYS[i]): '' or KEYS indices
#       "a,b" of keys where no other token may hold a live lease for KEYS[i] to be taken.
# Returns {index, epoch}: the 0-based index of the candidate taken, or -1: nothing taken.
ACQUIRE = Script(
    _PRELUDE
    + """
local token, ttl, me = ARGV[1], tonumber(ARGV[2]), ARGV[4]
local waiter, base = string.match(ARGV[5], '^(%d)|(%d+)$')
base = tonumber(base)
local lane, queue, live, tickets = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local n = (#ARGV - 8) / 2
local last = 6 + n
local epoch = epoch_of(KEYS[5], KEYS[6], ARGV[6], ARGV[7], tonumber(ARGV[8]))
redis.call('ZREMRANGEBYSCORE', lane, '-inf', now)
for i = 7, #KEYS do redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now) end
local dead = redis.call('ZRANGEBYSCORE', live, '-inf', now)
for _, w in ipairs(dead) do redis.call('ZREM', queue, w) end
redis.call('ZREMRANGEBYSCORE', live, '-inf', now)

local function refuse()
  if waiter == '1' and not redis.call('ZSCORE', queue, me) then
    -- A waiter whose place lapsed (its replica stalled past a TTL) joins again at the back
    -- of its class.
    redis.call('ZADD', queue, string.format('%d', base + redis.call('INCR', tickets)), me)
    redis.call('ZADD', live, now + ttl, me)
    for i = 2, 4 do extend(KEYS[i], 3 * ttl) end
  end
  return -1
end

local function decide()
if redis.call('ZSCORE', lane, token) then
  -- A retried acquire: report what this token already holds, never take a second slot.
  for i = 7, last do
    if redis.call('ZSCORE', KEYS[i], token) then return i - 7 end
  end
  return -1
end
-- Redis lost its data a moment ago: the leases still in flight come back at their next renewal.
if redis.call('EXISTS', KEYS[6]) == 1 then return refuse() end
local free = tonumber(ARGV[3]) - redis.call('ZCARD', lane)
if free <= 0 then return refuse() end
-- Class, then arrival, across replicas (the score: class band + ticket): a waiter goes only
-- while fewer other replicas' waiters stand ahead of it than there are free slots; a newcomer
-- stands behind every live waiter (once queued, its class puts it in place). Its own replica's
-- waiters are skipped: its local queue already put them behind it (their joins may have
-- reached Redis in another order), and only its local head ever asks.
local rank = redis.call('ZRANK', queue, me)
local span = rank or redis.call('ZCARD', queue)
if span >= free then
  local mine = string.match(me, '^[^|]*|')
  local ahead = 0
  for _, waiter in ipairs(redis.call('ZRANGE', queue, 0, span - 1)) do
    if string.sub(waiter, 1, #mine) ~= mine then
      ahead = ahead + 1
      if ahead >= free then return refuse() end
    end
  end
end

local function unguarded(i)
  for index in string.gmatch(ARGV[n + i + 2], '[^,]+') do
    local key = KEYS[tonumber(index)]
    local others = redis.call('ZCARD', key)
    if redis.call('ZSCORE', key, token) then others = others - 1 end
    if others > 0 then return false end
  end
  return true
end

local chosen = nil
for i = 7, last do
  if redis.call('ZCARD', KEYS[i]) < tonumber(ARGV[i + 2]) and unguarded(i) then
    chosen = i
    break
  end
end
if not chosen then return refuse() end
local deadline = now + ttl
redis.call('ZADD', lane, deadline, token)
redis.call('ZADD', KEYS[chosen], deadline, token)
extend(lane, 3 * ttl)
extend(KEYS[chosen], 3 * ttl)
redis.call('ZREM', queue, me)
redis.call('ZREM', live, me)
return chosen - 7
end

return {decide(), epoch}
"""
)

# KEYS: epoch, recovery marker, lane, the endpoint to give up, candidate endpoints...
# ARGV: token, ttl_ms, the epoch the lease was granted in ('' if unknown), a new epoch should none
#       exist, the recovery grace in ms, candidate limits... (ARGV[i + 1] limits KEYS[i], i >= 5)
# Returns {index, epoch}: the 0-based index of the candidate now held, -1 when none has room (the
# token keeps its lane slot only), -2 when the token's lane lease was reaped (nothing taken). A
# lane lease gone with Redis's data (the epoch changed) is re-established, as RENEW does.
MOVE = Script(
    _PRELUDE
    + """
local token, ttl, granted, lane = ARGV[1], tonumber(ARGV[2]), ARGV[3], KEYS[3]
local epoch = epoch_of(KEYS[1], KEYS[2], granted, ARGV[4], tonumber(ARGV[5]))
redis.call('ZREM', KEYS[4], token)
if granted ~= '' and epoch ~= granted then
  redis.call('ZADD', lane, now + ttl, token)
  extend(lane, 3 * ttl)
end
local score = redis.call('ZSCORE', lane, token)
if not score or tonumber(score) <= now then return {-2, epoch} end
for i = 5, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
  if redis.call('ZSCORE', KEYS[i], token) then return {i - 5, epoch} end
  if redis.call('ZCARD', KEYS[i]) < tonumber(ARGV[i + 1]) then
    local deadline = now + ttl
    redis.call('ZADD', KEYS[i], deadline, token)
    redis.call('ZADD', lane, 'XX', deadline, token)
    extend(KEYS[i], 3 * ttl)
    extend(lane, 3 * ttl)
    return {i - 5, epoch}
  end
end
return {-1, epoch}
"""
)

# KEYS: epoch, recovery marker, the keys the token holds.
# ARGV: token, ttl_ms, the epoch the lease was granted in ('' if unknown), a new epoch should none
#       exist, the recovery grace in ms.
# Returns {status, epoch}. status 1: every lease was live and now runs to now + ttl. 2: Redis
# lost its data since the grant (the epoch changed): the leases are re-established. 0: reaped,
# and the token is removed everywhere: a reaped lease is never resurrected, and a half-held one
# is not kept.
RENEW = Script(
    _PRELUDE
    + """
local token, ttl, granted = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local epoch = epoch_of(KEYS[1], KEYS[2], granted, ARGV[4], tonumber(ARGV[5]))
if granted ~= '' and epoch ~= granted then
  for i = 3, #KEYS do
    redis.call('ZADD', KEYS[i], now + ttl, token)
    extend(KEYS[i], 3 * ttl)
  end
  return {2, epoch}
end
local alive = true
for i = 3, #KEYS do
  local score = redis.call('ZSCORE', KEYS[i], token)
  if not score or tonumber(score) <= now then alive = false end
end
if not alive then
  for i = 3, #KEYS do redis.call('ZREM', KEYS[i], token) end
  return {0, epoch}
end
for i = 3, #KEYS do
  redis.call('ZADD', KEYS[i], 'XX', now + ttl, token)
  extend(KEYS[i], 3 * ttl)
end
return {1, epoch}
"""
)

# KEYS: the reserved key. ARGV: token, ttl_ms. A lease on the key for the token, taken or
# renewed (a waiter reserving an endpoint; guards naming the key keep others out meanwhile).
RESERVE = Script(
    _PRELUDE
    + """
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
extend(KEYS[1], 3 * ttl)
return 1
"""
)

# KEYS: the keys the token may hold. ARGV: token. Exact and idempotent.
RELEASE = Script(
    """
local removed = 0
for i = 1, #KEYS do removed = removed + redis.call('ZREM', KEYS[i], ARGV[1]) end
return removed
"""
)

# KEYS: limits. Returns the live lease count of each, in order.
IN_USE = Script(
    _PRELUDE
    + """
local counts = {}
for i = 1, #KEYS do counts[i] = redis.call('ZCOUNT', KEYS[i], '(' .. now, '+inf') end
return counts
"""
)

# KEYS: queue, queue liveness, ticket counter. ARGV: member ("replica|token"), ttl_ms, mode,
# the waiter's class band (``band``).
# mode "join": join the lane's waiting list at the back of its class, or keep a live place;
# returns 1 when the member (re)joined at the back, 0 when it kept its place. mode "refresh":
# extend a live place only (returns 1), moving it to the band given with its ticket kept (a
# waiter that starved goes before every class), never re-add one (returns 0): a refresh that
# lands after the acquire that granted the waiter, or after its leave, must not put it back.
ENQUEUE = Script(
    _PRELUDE
    + """
local member, ttl, mode, base = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local queue, live, tickets = KEYS[1], KEYS[2], KEYS[3]
local until_ = redis.call('ZSCORE', live, member)
local placed = until_ and tonumber(until_) > now and redis.call('ZSCORE', queue, member)
local joined = 0
if mode == 'refresh' then
  if not placed then return 0 end
  local ticket = tonumber(placed) % BAND
  if tonumber(placed) - ticket ~= base then
    redis.call('ZADD', queue, string.format('%d', base + ticket), member)
  end
elseif not placed then
  redis.call('ZREM', queue, member)
  redis.call('ZADD', queue, string.format('%d', base + redis.call('INCR', tickets)), member)
  joined = 1
end
redis.call('ZADD', live, now + ttl, member)
for i = 1, 3 do extend(KEYS[i], 3 * ttl) end
if mode == 'refresh' then return 1 end
return joined
"""
)

# KEYS: queue, queue liveness. ARGV: member ("replica|token"). Idempotent.
LEAVE = Script(
    """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 0
"""
)
