"""Every Redis round trip of the ``global`` scheduler: the key layout and its Lua scripts.

Keys of a pool (``P`` = ``fd:{topic}``)::

    P:alive:<instance>   string, expires after lease_s     the instance is alive while it exists; its value
                                                           is the member's token (one process: see rejoin)
    P:inst               zset instance -> last heartbeat   members of the pool (to find dead ones)
    P:load               zset instance -> queued requests  where peers look for work (as of its heartbeat)
    P:q:<instance>       list of request ids               the instance's own queue (it originated them)
    P:r:<request id>     hash req, origin, holder,         the request while it is queued or held; ``lease``
                         lease, reserves                   names the holder's lease ("" while queued)
    P:t:<request id>     list of token ids                 output tokens its origin's client has or will
                                                           have (those it came with, then those routed)
    P:leases             zset request id -> deadline (ms)  requests held by an instance that is not their origin
    P:out:<instance>     list of packed outputs            outputs on their way back to their origin

Every key but the pool-wide ``P:inst``, ``P:load`` and ``P:leases`` belongs to one member or one
request, and goes with it: ``alive`` expires; a member's queue and output list are dropped by the
reaper once its ``alive`` key is gone, and by the member itself when it rejoins; a request's ``r``
and ``t`` keys are deleted when it is answered through the pool, taken back by its origin,
withdrawn (abort, TTL, rejoin) or dropped with its dead origin.

A request is *taken* by LPOP from a queue inside a script that, in the same atomic step, writes
the taker into ``holder``, a new **lease id** into ``lease`` and a deadline into ``P:leases``
(the origin taking its own request drops the record instead: it holds it in memory). Lease ids
are unique (the member's token, a counter of its takes, the row), so a lease is fenced on its id,
never on the holder's name: a holder that took the same request again after losing it cannot
pass off the old run's outputs as the new one's. The holder renews its leases with each
heartbeat; its outputs go to the origin through a script that first checks the lease is still the
record's, so an instance that lost its lease can never add a duplicate.

The heartbeat script, one round trip per ``heartbeat_s``, also expires the member's own requests
queued past ``ttl_s`` and reaps: it queues requests whose lease ran out at the *front* of their
origin's queue (the tokens in ``P:t`` go with them: the next holder continues from there) and
drops the queues and records of instances whose ``alive`` key expired. It first checks that the
member's ``alive`` key still holds its token: when it does not (the member was paused or slow for
longer than ``lease_s``, and its peers may have reaped it) it changes nothing and says so, and the
member recovers (:meth:`PoolStore.rejoin`). Times in scripts come from Redis' own clock, so
instances on hosts whose clocks differ still agree on every deadline.

A standalone Redis (with replicas or Sentinel, through a redis-py URL) serves a pool; a Redis
Cluster is refused at start-up (:meth:`PoolStore.check`): the scripts take key names from ARGV,
which a cluster cannot route.
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field
from typing import Any, Final

import redis

from fd_core.redact import redacted_url

#: The oldest Redis the scripts run on (BLMPOP, LPOP with a count).
MIN_REDIS_VERSION: Final = (7, 0)

_NOW_MS = "local t = redis.call('TIME'); local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"

# Drop a request's record and progress (and its lease), if the record is origin's.
_DROP_IF_OWN = """
local function drop_if_own(p, rid, origin)
  local r = p .. ':r:' .. rid
  if redis.call('HGET', r, 'origin') == origin then
    redis.call('DEL', r, p .. ':t:' .. rid)
    redis.call('ZREM', p .. ':leases', rid)
  end
end
"""

_TAKE = _NOW_MS + """
local p, owner, me, lease_ms, count, min_queued, lease_prefix = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]),
    tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
if owner == '' then  -- steal: the busiest live peer with at least min_queued queued
  for _, peer in ipairs(redis.call('ZREVRANGEBYSCORE', p .. ':load', '+inf', min_queued, 'LIMIT', 0, 4)) do
    if peer ~= me and redis.call('EXISTS', p .. ':alive:' .. peer) == 1
        and redis.call('LLEN', p .. ':q:' .. peer) >= min_queued then
      owner = peer
      break
    end
  end
  if owner == '' then return {} end
end
local q = p .. ':q:' .. owner
if redis.call('LLEN', q) < min_queued then return {} end
local taken = {}
for i = 1, count do
  local rid = redis.call('LPOP', q)
  if not rid then break end
  local r = p .. ':r:' .. rid
  local f = redis.call('HMGET', r, 'req', 'origin', 'reserves')
  if f[1] then
    if f[2] == me then  -- the origin takes its own: it has the request and what its client got in memory
      redis.call('DEL', r, p .. ':t:' .. rid)
      redis.call('ZREM', p .. ':leases', rid)
      table.insert(taken, {rid, '', {}, tonumber(f[3] or '0'), f[2], ''})
    else
      local lease = lease_prefix .. ':' .. i
      redis.call('HSET', r, 'holder', me, 'lease', lease)
      redis.call('ZADD', p .. ':leases', now + lease_ms, rid)
      table.insert(taken, {rid, f[1], redis.call('LRANGE', p .. ':t:' .. rid, 0, -1), tonumber(f[3] or '0'), f[2],
                           lease})
    end
  end
end
return taken
"""

# Outputs of held requests, each (request id, lease, packed output, finished, n, n token ids): routed
# to the origin when the lease is still the record's and the origin alive. Returns the 1-based
# positions of the fenced ones.
_PUSH = """
local p = ARGV[1]
local fenced = {}
local i, position = 2, 0
while i <= #ARGV do
  local rid, lease, packed, finished, n = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], tonumber(ARGV[i + 4])
  position = position + 1
  local r = p .. ':r:' .. rid
  local f = redis.call('HMGET', r, 'lease', 'origin')
  local mine = f[1] == lease
  if mine and redis.call('EXISTS', p .. ':alive:' .. f[2]) == 1 then
    redis.call('RPUSH', p .. ':out:' .. f[2], packed)
    if finished == '1' then
      redis.call('DEL', r, p .. ':t:' .. rid)
      redis.call('ZREM', p .. ':leases', rid)
    elseif n > 0 then
      redis.call('RPUSH', p .. ':t:' .. rid, unpack(ARGV, i + 5, i + 4 + n))
    end
  else
    if mine then  -- its origin is gone: nobody reads it any more
      redis.call('DEL', r, p .. ':t:' .. rid)
      redis.call('ZREM', p .. ':leases', rid)
    end
    table.insert(fenced, position)
  end
  i = i + 5 + n
end
return fenced
"""

# Claim the instance id for this member (token) and start clean: -1 when done, else the
# milliseconds left on another live member's claim (nothing is changed then). Drops what an earlier
# life of this id left (its queue, its output list) and withdraws the given request ids.
_REJOIN = _NOW_MS + _DROP_IF_OWN + """
local p, me, token, lease_ms = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local alive = p .. ':alive:' .. me
local current = redis.call('GET', alive)
if current and current ~= token then
  return redis.call('PTTL', alive)
end
redis.call('SET', alive, token, 'PX', lease_ms)
redis.call('ZADD', p .. ':inst', now, me)
local q = p .. ':q:' .. me
for _, rid in ipairs(redis.call('LRANGE', q, 0, -1)) do
  drop_if_own(p, rid, me)
end
redis.call('DEL', q, p .. ':out:' .. me)
redis.call('ZADD', p .. ':load', 0, me)
for i = 5, #ARGV do
  drop_if_own(p, ARGV[i], me)
end
return -1
"""

# Leave the pool at shutdown: give the held requests (id, lease pairs) back to their origins at once
# (queued again at the front, like after a lapsed lease, without waiting lease_s), then drop this
# member's queue, output list and liveness, unless another member claimed the id since.
_LEAVE = _DROP_IF_OWN + """
local p, me, token = ARGV[1], ARGV[2], ARGV[3]
for i = 4, #ARGV, 2 do
  local rid, lease = ARGV[i], ARGV[i + 1]
  local r = p .. ':r:' .. rid
  local f = redis.call('HMGET', r, 'lease', 'origin')
  if f[1] == lease then
    redis.call('ZREM', p .. ':leases', rid)
    if redis.call('EXISTS', p .. ':alive:' .. f[2]) == 1 then
      redis.call('HSET', r, 'holder', '', 'lease', '')
      redis.call('HINCRBY', r, 'reserves', 1)
      redis.call('LPUSH', p .. ':q:' .. f[2], rid)
    else
      redis.call('DEL', r, p .. ':t:' .. rid)
    end
  end
end
local alive = p .. ':alive:' .. me
local current = redis.call('GET', alive)
if current == token or not current then  -- (not when another member claimed the id since)
  local q = p .. ':q:' .. me
  for _, rid in ipairs(redis.call('LRANGE', q, 0, -1)) do
    drop_if_own(p, rid, me)
  end
  redis.call('DEL', q, p .. ':out:' .. me, alive)
  redis.call('ZREM', p .. ':inst', me)
  redis.call('ZREM', p .. ':load', me)
end
return 0
"""

# Withdraw own requests: 1 for each one still queued (now removed), else 0.
_WITHDRAW = _DROP_IF_OWN + """
local p, me = ARGV[1], ARGV[2]
local out = {}
for i = 3, #ARGV do
  table.insert(out, redis.call('LREM', p .. ':q:' .. me, 1, ARGV[i]))
  drop_if_own(p, ARGV[i], me)
end
return out
"""

# ARGV: p, me, lease_ms, token, n_held, n_held x (request id, lease), then own request ids past ttl_s.
# {-1} when this member's alive key is not its own any more (nothing changed); else
# {queued, members, lost (id, lease pairs), expired ids, requeued, dropped, dead}.
_HEARTBEAT = _NOW_MS + _DROP_IF_OWN + """
local p, me, lease_ms, token, n_held = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5])
local alive = p .. ':alive:' .. me
if redis.call('GET', alive) ~= token then
  return {-1}
end
redis.call('SET', alive, token, 'PX', lease_ms)
redis.call('ZADD', p .. ':inst', now, me)
local lost = {}
for i = 6, 5 + 2 * n_held, 2 do
  local rid, lease = ARGV[i], ARGV[i + 1]
  local r = p .. ':r:' .. rid
  local f = redis.call('HMGET', r, 'lease', 'origin')
  if f[1] == lease and redis.call('EXISTS', p .. ':alive:' .. f[2]) == 1 then
    redis.call('ZADD', p .. ':leases', 'XX', now + lease_ms, rid)
  else
    if f[1] == lease then  -- its origin is gone
      redis.call('DEL', r, p .. ':t:' .. rid)
      redis.call('ZREM', p .. ':leases', rid)
    end
    table.insert(lost, rid)
    table.insert(lost, lease)
  end
end
local q = p .. ':q:' .. me
local expired = {}
for i = 6 + 2 * n_held, #ARGV do
  local rid = ARGV[i]
  if redis.call('LREM', q, 1, rid) == 1 then
    redis.call('DEL', p .. ':r:' .. rid, p .. ':t:' .. rid)
    redis.call('ZREM', p .. ':leases', rid)
    table.insert(expired, rid)
  end
end
local queued = redis.call('LLEN', q)
redis.call('ZADD', p .. ':load', queued, me)
-- the reaper: leases that ran out, then members whose alive key expired
local requeued, dropped, dead = 0, 0, 0
for _, rid in ipairs(redis.call('ZRANGEBYSCORE', p .. ':leases', '-inf', now, 'LIMIT', 0, 256)) do
  redis.call('ZREM', p .. ':leases', rid)
  local r = p .. ':r:' .. rid
  local origin = redis.call('HGET', r, 'origin')
  if origin and redis.call('EXISTS', p .. ':alive:' .. origin) == 1 then
    redis.call('HSET', r, 'holder', '', 'lease', '')
    redis.call('HINCRBY', r, 'reserves', 1)
    redis.call('LPUSH', p .. ':q:' .. origin, rid)
    requeued = requeued + 1
  else
    redis.call('DEL', r, p .. ':t:' .. rid)
    dropped = dropped + 1
  end
end
for _, inst in ipairs(redis.call('ZRANGE', p .. ':inst', 0, -1)) do
  if redis.call('EXISTS', p .. ':alive:' .. inst) == 0 then
    local dq = p .. ':q:' .. inst
    for _, rid in ipairs(redis.call('LRANGE', dq, 0, -1)) do
      drop_if_own(p, rid, inst)  -- (a request id another member queued since is left alone)
    end
    redis.call('DEL', dq, p .. ':out:' .. inst)
    redis.call('ZREM', p .. ':inst', inst)
    redis.call('ZREM', p .. ':load', inst)
    dead = dead + 1
  end
end
return {queued, redis.call('ZCARD', p .. ':inst'), lost, expired, requeued, dropped, dead}
"""


class RedisUnsupported(Exception):
    """The Redis answers but cannot hold a pool (a Redis Cluster node); the message says why."""


class RedisLost(Exception):
    """Redis could not be reached (or answered too slowly); the message says how."""


@dataclass(frozen=True, slots=True)
class Taken:
    """A request taken from a queue: its packed form (empty for an own request: its origin has it),
    the output tokens its origin's client has (a continuation when not empty), how often its lease
    expired before, its origin, and the lease it is held under ("" for an own request)."""

    request_id: str
    payload: bytes
    delivered: list[int]
    reserves: int
    origin: str
    lease: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    lapsed: bool                # this member's alive key had lapsed or was another's: nothing was changed
    queued: int = 0             # this instance's own queue
    num_instances: int = 0      # members of the pool, this one included
    lost: list[tuple[str, str]] = field(default_factory=list)   # (request id, lease) held no longer
    expired: list[str] = field(default_factory=list)   # own requests past ttl_s removed from the queue
    requeued: int = 0           # leases that ran out: requests queued again at their live origin
    dropped: int = 0            # requests of dead origins dropped
    dead_instances: int = 0     # instances found dead and removed


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One output of a request held for a peer, on its way to the origin under ``lease``."""

    request_id: str
    lease: str
    packed: bytes
    finished: bool
    new_token_ids: list[int]


class PoolStore:
    """The pool's Redis state as seen by one instance; every method is one round trip.

    Methods raise :class:`RedisLost` instead of redis-py's errors. Thread-safe (redis-py's
    connection pool); the blocking read of results uses a connection of its own.
    """

    def __init__(self, url: str, topic: str, instance_id: str, *, socket_timeout_s: float,
                 result_block_s: float) -> None:
        self.url = url
        self.shown_url = redacted_url(url)   # in errors and logs: no password
        self.instance_id = instance_id
        self.prefix = f"fd:{{{topic}}}"
        self._result_block_s = result_block_s
        kwargs = {"socket_connect_timeout": socket_timeout_s, "health_check_interval": 0}
        self._redis = redis.Redis.from_url(url, socket_timeout=socket_timeout_s, **kwargs)
        self._reader = redis.Redis.from_url(url, socket_timeout=result_block_s + socket_timeout_s, **kwargs)
        self._round_trips = itertools.count()
        self.round_trips = 0
        self._takes = itertools.count()   # numbers this member's takes: lease ids are token:take:row
        self._take = self._redis.register_script(_TAKE)
        self._push = self._redis.register_script(_PUSH)
        self._heartbeat = self._redis.register_script(_HEARTBEAT)
        self._rejoin = self._redis.register_script(_REJOIN)
        self._withdraw = self._redis.register_script(_WITHDRAW)
        self._leave = self._redis.register_script(_LEAVE)
        self.token = secrets.token_hex(8)   # this member's, whatever its instance id

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.round_trips = next(self._round_trips) + 1
        try:
            return fn(*args, **kwargs)
        except redis.RedisError as exc:
            raise RedisLost(f"Redis at {self.shown_url} is unreachable ({type(exc).__name__}: {exc})") from exc

    def check(self) -> None:
        """Fail unless Redis answers, is new enough and is a standalone server (RedisUnsupported
        for a Redis Cluster node: the scripts name keys the cluster cannot route)."""
        if int(self._call(self._redis.info, "cluster").get("cluster_enabled", 0)):
            raise RedisUnsupported(f"Redis at {self.shown_url} runs in cluster mode; the global scheduler needs a "
                                   "standalone Redis (or a primary with replicas), not a Redis Cluster")
        info = self._call(self._redis.info, "server")
        version = tuple(int(part) for part in str(info.get("redis_version", "0")).split(".")[:2])
        if version < MIN_REDIS_VERSION:
            raise RedisLost(f"Redis at {self.shown_url} is version {info.get('redis_version')}; the global scheduler "
                            f"needs {'.'.join(map(str, MIN_REDIS_VERSION))} or newer")

    def put(self, request_id: str, payload: bytes, delivered: list[int]) -> None:
        """Queue a request this instance originated at the tail of its own queue, as a new record
        (whatever an earlier request of this id left goes); ``delivered``: the output tokens its
        client already has (a continuation of a request begun elsewhere), which a taker continues from."""
        record, progress = self._key("r", request_id), self._key("t", request_id)
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(record, progress)
        pipe.zrem(self._key("leases"), request_id)
        pipe.hset(record, mapping={"req": payload, "origin": self.instance_id, "holder": "", "lease": ""})
        if delivered:
            pipe.rpush(progress, *delivered)
        pipe.rpush(self._key("q", self.instance_id), request_id)
        self._call(pipe.execute)

    def take(self, owner: str, count: int, *, min_queued: int, lease_s: float) -> list[Taken]:
        """Take up to ``count`` requests from ``owner``'s queue if it holds at least ``min_queued``;
        ``owner=""``: from the busiest live peer's (a steal), in the same round trip."""
        lease_prefix = f"{self.token}:{next(self._takes)}"
        rows = self._call(self._take, args=[self.prefix, owner, self.instance_id, int(lease_s * 1000), count,
                                            min_queued, lease_prefix])
        return [Taken(rid.decode(), payload, [int(t) for t in tokens], int(reserves), origin.decode(), lease.decode())
                for rid, payload, tokens, reserves, origin, lease in rows]

    def push(self, outgoing: list[Outgoing]) -> list[Outgoing]:
        """Route outputs to their origins; returns those fenced (their lease is not the record's any
        more, or the origin is gone): the holder ends those requests."""
        args: list[Any] = [self.prefix]
        for o in outgoing:
            args += [o.request_id, o.lease, o.packed, "1" if o.finished else "0", len(o.new_token_ids),
                     *o.new_token_ids]
        return [outgoing[int(position) - 1] for position in self._call(self._push, args=args)]

    def rejoin(self, *, lease_s: float, withdraw: list[str]) -> int | None:
        """Claim the instance id for this member and start clean (drop the queue and output list an
        earlier life of it left, withdraw the ``withdraw`` requests): None when done, else the
        milliseconds left on another live member's claim of the id (nothing changed)."""
        left = int(self._call(self._rejoin, args=[self.prefix, self.instance_id, self.token, int(lease_s * 1000),
                                                  *withdraw]))
        return None if left < 0 else left

    def heartbeat(self, *, lease_s: float, held: list[tuple[str, str]], expired: list[str]) -> Heartbeat:
        """Stay alive, renew the leases of ``held`` ((request id, lease) pairs), withdraw the own
        requests of ``expired`` still queued, publish the own queue's length, and reap."""
        args: list[Any] = [self.prefix, self.instance_id, int(lease_s * 1000), self.token, len(held)]
        for request_id, lease in held:
            args += [request_id, lease]
        reply = self._call(self._heartbeat, args=[*args, *expired])
        if int(reply[0]) < 0:
            return Heartbeat(lapsed=True)
        queued, num_instances, lost, gone, requeued, dropped, dead = reply
        return Heartbeat(False, int(queued), int(num_instances),
                         [(lost[i].decode(), lost[i + 1].decode()) for i in range(0, len(lost), 2)],
                         [rid.decode() for rid in gone], int(requeued), int(dropped), int(dead))

    def withdraw(self, request_ids: list[str]) -> list[bool]:
        """Remove requests this instance originated from the pool; True for each one still queued.

        A holder of one finds its record gone at its next push or heartbeat and drops it.
        """
        if not request_ids:
            return []
        return [bool(n) for n in self._call(self._withdraw, args=[self.prefix, self.instance_id, *request_ids])]

    def leave(self, held: list[tuple[str, str]]) -> None:
        """Leave the pool at shutdown: the ``held`` requests ((request id, lease) pairs) go back to
        their origins' queues at once, and this member's keys go (peers stop sending here at once,
        not after lease_s; what is still queued here has no client any more)."""
        args: list[Any] = [self.prefix, self.instance_id, self.token]
        for request_id, lease in held:
            args += [request_id, lease]
        self._call(self._leave, args=args)

    def pop_results(self) -> list[bytes]:
        """Outputs routed to this instance, oldest first; blocks up to result_block_s for the first."""
        reply = self._call(self._reader.blmpop, self._result_block_s, 1, self._key("out", self.instance_id),
                           direction="LEFT", count=256)
        return [] if reply is None else list(reply[1])

    def close(self) -> None:
        self._redis.close()
        self._reader.close()
