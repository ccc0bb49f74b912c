"""Every Redis round trip of the ``global`` scheduler: the key layout and its Lua scripts.

Keys of a pool (``P`` = ``fd:{topic}``)::

    P:alive:<instance>   string, expires after lease_s     the instance is alive while it exists; its value
                                                           is the member's token (one process: see claim)
    P:inst               zset instance -> last heartbeat   members of the pool (to find dead ones)
    P:load               zset instance -> queued requests  where peers look for work (as of its heartbeat)
    P:q:<instance>       list of request ids               the instance's own queue (it originated them)
    P:r:<request id>     hash req, origin, holder, reserves   the request while it is queued or held
    P:t:<request id>     list of token ids                 output tokens already routed to the origin
    P:leases             zset request id -> deadline (ms)  requests held by an instance that is not their origin
    P:out:<instance>     list of packed outputs            outputs on their way back to their origin

A request is *taken* by LPOP from a queue inside a script that, in the same atomic step, writes
the taker into ``holder`` and a lease into ``P:leases`` (the origin taking its own request drops
the record instead: it holds it in memory). The holder renews its leases with each heartbeat;
its outputs go to the origin through a script that first checks it still is the holder, so an
instance that lost its lease can never add a duplicate. The reaper script, run by every instance
each heartbeat, queues requests whose lease ran out at the *front* of their origin's queue (the
tokens in ``P:t`` go with them: the next holder continues from there) and drops the queues and
records of instances whose ``alive`` key expired. Times in scripts come from Redis' own clock,
so instances on hosts whose clocks differ still agree on every deadline.

A standalone Redis (with replicas or Sentinel, through a redis-py URL) serves a pool; a Redis
Cluster is refused at start-up (:meth:`PoolStore.check`): the scripts take key names from ARGV,
which a cluster cannot route.
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass
from typing import Any, Final

import redis

from fd_core.redact import redacted_url

#: The oldest Redis the scripts run on (BLMPOP, LPOP with a count).
MIN_REDIS_VERSION: Final = (7, 0)

_NOW_MS = "local t = redis.call('TIME'); local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"

_TAKE = _NOW_MS + """
local p, owner, me, lease_ms, count, min_queued = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]),
    tonumber(ARGV[5]), tonumber(ARGV[6])
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
for _ = 1, count do
  local rid = redis.call('LPOP', q)
  if not rid then break end
  local r = p .. ':r:' .. rid
  local f = redis.call('HMGET', r, 'req', 'origin', 'reserves')
  if f[1] then
    if f[2] == me then
      redis.call('DEL', r, p .. ':t:' .. rid)
      redis.call('ZREM', p .. ':leases', rid)
      table.insert(taken, {rid, f[1], {}, tonumber(f[3] or '0'), f[2]})
    else
      redis.call('HSET', r, 'holder', me)
      redis.call('ZADD', p .. ':leases', now + lease_ms, rid)
      table.insert(taken, {rid, f[1], redis.call('LRANGE', p .. ':t:' .. rid, 0, -1), tonumber(f[3] or '0'), f[2]})
    end
  end
end
return taken
"""

_PUSH = """
local p, me = ARGV[1], ARGV[2]
local fenced = {}
local i = 3
while i <= #ARGV do
  local rid, origin, packed, finished, n = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], tonumber(ARGV[i + 4])
  local r = p .. ':r:' .. rid
  if redis.call('HGET', r, 'holder') == me and redis.call('EXISTS', p .. ':alive:' .. origin) == 1 then
    redis.call('RPUSH', p .. ':out:' .. origin, packed)
    if finished == '1' then
      redis.call('DEL', r, p .. ':t:' .. rid)
      redis.call('ZREM', p .. ':leases', rid)
    elseif n > 0 then
      redis.call('RPUSH', p .. ':t:' .. rid, unpack(ARGV, i + 5, i + 4 + n))
    end
  else
    table.insert(fenced, rid)
  end
  i = i + 5 + n
end
return fenced
"""

# Claim the instance id for this member (token): -1 when claimed (free, or already its own), else
# the milliseconds left on another member's claim.
_CLAIM = """
local key, token, lease_ms = ARGV[1] .. ':alive:' .. ARGV[2], ARGV[3], tonumber(ARGV[4])
local current = redis.call('GET', key)
if current and current ~= token then
  return redis.call('PTTL', key)
end
redis.call('SET', key, token, 'PX', lease_ms)
return -1
"""

# Withdraw the given own requests that are still queued (not taken): 1 for each one withdrawn.
_WITHDRAW_QUEUED = """
local p, me = ARGV[1], ARGV[2]
local out = {}
for i = 3, #ARGV do
  local rid = ARGV[i]
  if redis.call('LREM', p .. ':q:' .. me, 1, rid) == 1 then
    redis.call('DEL', p .. ':r:' .. rid, p .. ':t:' .. rid)
    redis.call('ZREM', p .. ':leases', rid)
    table.insert(out, 1)
  else
    table.insert(out, 0)
  end
end
return out
"""

_HEARTBEAT = _NOW_MS + """
local p, me, lease_ms, token = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
redis.call('SET', p .. ':alive:' .. me, token, 'PX', lease_ms)
redis.call('ZADD', p .. ':inst', now, me)
local queued = redis.call('LLEN', p .. ':q:' .. me)
redis.call('ZADD', p .. ':load', queued, me)
local lost = {}
for i = 5, #ARGV, 2 do
  local rid, origin = ARGV[i], ARGV[i + 1]
  local r = p .. ':r:' .. rid
  if redis.call('HGET', r, 'holder') == me and redis.call('EXISTS', p .. ':alive:' .. origin) == 1 then
    redis.call('ZADD', p .. ':leases', 'XX', now + lease_ms, rid)
  else
    if redis.call('HGET', r, 'holder') == me then
      redis.call('DEL', r, p .. ':t:' .. rid)
      redis.call('ZREM', p .. ':leases', rid)
    end
    table.insert(lost, rid)
  end
end
local peers = redis.call('ZCARD', p .. ':inst')
return {queued, peers, lost}
"""

_REAP = _NOW_MS + """
local p = ARGV[1]
local expired, dropped, dead = 0, 0, 0
for _, rid in ipairs(redis.call('ZRANGEBYSCORE', p .. ':leases', '-inf', now, 'LIMIT', 0, 256)) do
  redis.call('ZREM', p .. ':leases', rid)
  local r = p .. ':r:' .. rid
  local origin = redis.call('HGET', r, 'origin')
  if origin and redis.call('EXISTS', p .. ':alive:' .. origin) == 1 then
    redis.call('HSET', r, 'holder', '')
    redis.call('HINCRBY', r, 'reserves', 1)
    redis.call('LPUSH', p .. ':q:' .. origin, rid)
    expired = expired + 1
  else
    redis.call('DEL', r, p .. ':t:' .. rid)
    dropped = dropped + 1
  end
end
for _, inst in ipairs(redis.call('ZRANGE', p .. ':inst', 0, -1)) do
  if redis.call('EXISTS', p .. ':alive:' .. inst) == 0 then
    local q = p .. ':q:' .. inst
    for _, rid in ipairs(redis.call('LRANGE', q, 0, -1)) do
      redis.call('DEL', p .. ':r:' .. rid, p .. ':t:' .. rid)
    end
    redis.call('DEL', q, p .. ':out:' .. inst)
    redis.call('ZREM', p .. ':inst', inst)
    redis.call('ZREM', p .. ':load', inst)
    dead = dead + 1
  end
end
return {expired, dropped, dead}
"""


class RedisUnsupported(Exception):
    """The Redis answers but cannot hold a pool (a Redis Cluster node); the message says why."""


class RedisLost(Exception):
    """Redis could not be reached (or answered too slowly); the message says how."""


@dataclass(frozen=True, slots=True)
class Taken:
    """A request taken from a queue: its packed form, the output tokens already routed to its
    origin (a continuation when not empty), how often its lease expired before, and its origin."""

    request_id: str
    payload: bytes
    delivered: list[int]
    reserves: int
    origin: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    queued: int            # this instance's own queue in Redis
    num_instances: int     # members of the pool, this one included
    lost: list[str]        # held request ids that are no longer this instance's (origin gone, aborted, re-leased)


@dataclass(frozen=True, slots=True)
class Reaped:
    expired: int           # leases that ran out: requests queued again at their live origin
    dropped: int           # requests of dead origins dropped
    dead_instances: int    # instances found dead and removed


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One output of a request held for a peer, on its way to the origin."""

    request_id: str
    origin: str
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
        self._take = self._redis.register_script(_TAKE)
        self._push = self._redis.register_script(_PUSH)
        self._heartbeat = self._redis.register_script(_HEARTBEAT)
        self._claim = self._redis.register_script(_CLAIM)
        self._withdraw_queued = self._redis.register_script(_WITHDRAW_QUEUED)
        self.token = secrets.token_hex(8)   # this member's, whatever its instance id
        self._reap = self._redis.register_script(_REAP)

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

    def put(self, request_id: str, payload: bytes) -> None:
        """Queue a request this instance originated at the tail of its own queue."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(self._key("r", request_id), mapping={"req": payload, "origin": self.instance_id, "holder": ""})
        pipe.rpush(self._key("q", self.instance_id), request_id)
        self._call(pipe.execute)

    def take(self, owner: str, count: int, *, min_queued: int, lease_s: float) -> list[Taken]:
        """Take up to ``count`` requests from ``owner``'s queue if it holds at least ``min_queued``;
        ``owner=""``: from the busiest live peer's (a steal), in the same round trip."""
        rows = self._call(self._take, args=[self.prefix, owner, self.instance_id, int(lease_s * 1000), count,
                                            min_queued])
        return [Taken(rid.decode(), payload, [int(t) for t in tokens], int(reserves), origin.decode())
                for rid, payload, tokens, reserves, origin in rows]

    def push(self, outgoing: list[Outgoing]) -> list[str]:
        """Route outputs to their origins; returns the ids this instance no longer holds (fenced)."""
        args: list[Any] = [self.prefix, self.instance_id]
        for o in outgoing:
            args += [o.request_id, o.origin, o.packed, "1" if o.finished else "0", len(o.new_token_ids),
                     *o.new_token_ids]
        return [rid.decode() for rid in self._call(self._push, args=args)]

    def claim(self, *, lease_s: float) -> int | None:
        """Take the instance id for this member: None when done, else the milliseconds left on
        another member's claim of it (a live one renews it; a dead one's runs out)."""
        left = int(self._call(self._claim, args=[self.prefix, self.instance_id, self.token, int(lease_s * 1000)]))
        return None if left < 0 else left

    def heartbeat(self, *, lease_s: float, held: dict[str, str]) -> Heartbeat:
        """Stay alive, publish the own queue's length, renew the leases of ``held`` (id -> origin)."""
        args: list[Any] = [self.prefix, self.instance_id, int(lease_s * 1000), self.token]
        for request_id, origin in held.items():
            args += [request_id, origin]
        queued, num_instances, lost = self._call(self._heartbeat, args=args)
        return Heartbeat(int(queued), int(num_instances), [rid.decode() for rid in lost])

    def reap(self) -> Reaped:
        """Queue again the requests whose lease ran out; drop what dead instances left."""
        expired, dropped, dead = self._call(self._reap, args=[self.prefix])
        return Reaped(int(expired), int(dropped), int(dead))

    def withdraw(self, request_ids: list[str]) -> list[bool]:
        """Remove requests this instance originated from the pool; True for each one still queued.

        A holder of one finds its record gone at its next push or heartbeat and drops it.
        """
        pipe = self._redis.pipeline(transaction=True)
        for request_id in request_ids:
            pipe.lrem(self._key("q", self.instance_id), 1, request_id)
            pipe.delete(self._key("r", request_id), self._key("t", request_id))
            pipe.zrem(self._key("leases"), request_id)
        replies = self._call(pipe.execute)
        return [bool(replies[3 * i]) for i in range(len(request_ids))]

    def withdraw_queued(self, request_ids: list[str]) -> list[bool]:
        """Remove those of ``request_ids`` (this instance's) that are still queued, each atomically
        with the check; True for each one removed. A taken one stays with its holder."""
        if not request_ids:
            return []
        return [bool(n) for n in self._call(self._withdraw_queued, args=[self.prefix, self.instance_id, *request_ids])]

    def rejoin(self) -> None:
        """Empty this instance's queue and result list (after Redis was lost, it serves those itself)."""
        self._call(self._redis.delete, self._key("q", self.instance_id), self._key("out", self.instance_id))

    def leave(self) -> None:
        """Leave the pool at shutdown (peers stop sending here at once, not after lease_s)."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self._key("alive", self.instance_id))
        pipe.zrem(self._key("load"), self.instance_id)
        self._call(pipe.execute)

    def pop_results(self) -> list[bytes]:
        """Outputs routed to this instance, oldest first; blocks up to result_block_s for the first."""
        reply = self._call(self._reader.blmpop, self._result_block_s, 1, self._key("out", self.instance_id),
                           direction="LEFT", count=256)
        return [] if reply is None else list(reply[1])

    def close(self) -> None:
        self._redis.close()
        self._reader.close()
