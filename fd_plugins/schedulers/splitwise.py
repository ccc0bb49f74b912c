"""The ``splitwise`` scheduler: a local queue plus a peer directory in Redis for prefill/decode pairs.

Requests reach a decode instance from its own front end and queue as with ``local`` (FIFO,
order hook, TTL, size limit). What it adds is the directory (:class:`PeerDirectory`): every
prefill and decode instance publishes itself (role, connector address and name, host, KV layout,
load) as ``fd:{topic}:sw:peer:{instance_id}``, renewed every ``heartbeat_s`` with a lifetime of
``lease_s``, and listed in the set ``fd:{topic}:sw:peers``; an instance whose entry expired (it
died) is no longer listed and is dropped from the set by whoever notices.

All Redis I/O after start-up runs on the directory's own thread: once per ``heartbeat_s`` it
renews this instance's entry and reads every entry into a cached listing. :meth:`peers`,
:meth:`report_load` and :meth:`stats` only touch memory, so a slow or black-holed Redis never
holds up a hand-off or the engine loop. While Redis answers, the listing is at most
``heartbeat_s`` plus one round of Redis calls old; while it does not (each call gives up after
``socket_timeout_s``), the last listing is kept (a peer that died meanwhile is found out by the
hand-off's own timeouts) and /health says ``degraded`` until Redis answers again.

Redis unreachable at start-up is a config error naming ``scheduler.options.url``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from typing import Any, ClassVar

import redis
from pydantic import BaseModel, Field, model_validator

from fd_core.contracts.scheduler import PeerDirectory, PeerInfo
from fd_core.errors import ConfigError
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_plugins.schedulers.local import LocalScheduler, LocalSchedulerSettings

log = logging.getLogger(__name__)


class SplitwiseSchedulerSettings(LocalSchedulerSettings):
    """``[scheduler.options]`` of the ``splitwise`` scheduler (and the local queue's ``ttl_s``)."""

    url: str = Field("redis://127.0.0.1:6379/0", description="Redis server of the peer directory (redis-py URL).")
    topic: str = Field("default", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$",
                       description="Prefill and decode instances naming the same URL and topic pair up.")
    heartbeat_s: float = Field(0.5, gt=0, description="How often this instance's entry and load are renewed.")
    lease_s: float = Field(3.0, gt=0, description="An entry not renewed for this long is gone (its instance died).")
    socket_timeout_s: float = Field(2.0, gt=0, description="A Redis call slower than this counts as Redis lost.")

    @model_validator(mode="after")
    def _lease_outlives_heartbeats(self) -> SplitwiseSchedulerSettings:
        if self.lease_s < 2 * self.heartbeat_s:
            raise ValueError(f"lease_s ({self.lease_s}) must be at least twice heartbeat_s ({self.heartbeat_s})")
        return self


class SplitwiseScheduler(LocalScheduler, PeerDirectory):
    """The local queue, and the Redis peer directory prefill and decode instances pair through."""

    name: ClassVar[str] = "splitwise"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    settings_model: ClassVar[type[BaseModel]] = SplitwiseSchedulerSettings

    def __init__(self, settings: SplitwiseSchedulerSettings | None, *, hooks: Any, max_queue_size: int) -> None:
        settings = settings or SplitwiseSchedulerSettings()
        super().__init__(settings, hooks=hooks, max_queue_size=max_queue_size)
        self._redis = redis.Redis.from_url(settings.url, socket_timeout=settings.socket_timeout_s,
                                           socket_connect_timeout=settings.socket_timeout_s)
        try:
            self._redis.ping()
        except redis.RedisError as exc:
            self._redis.close()
            raise ConfigError("scheduler.options.url", f"Redis at {settings.url} is unreachable ({exc})") from None
        self._prefix = f"fd:{settings.topic}:sw"
        self._me: PeerInfo | None = None
        self._load = 0
        self._listing: list[PeerInfo] = []   # replaced whole by the directory thread
        self._unreadable: set[tuple[str, bytes]] = set()   # directory entries said to be unreadable
        self._degraded: str | None = None
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="fd-splitwise-heartbeat", daemon=True)

    # --- PeerDirectory -------------------------------------------------------------------------

    def join(self, me: PeerInfo) -> None:
        """Publish ``me`` and read the directory once (at start-up, in the caller's thread); from
        then on both run on the directory thread."""
        self._me = me
        self._renew()
        self._heartbeat.start()
        log.info("joined the prefill/decode directory %r as %s (%s at %s)", self.settings.topic,
                 me.instance_id, me.role, me.address)

    def report_load(self, load: int) -> None:
        self._load = load

    def peers(self, role: str) -> list[PeerInfo]:
        """From the cached listing (see the module docstring for how old it may be); no Redis I/O."""
        listing = self._listing
        return sorted((p for p in listing if p.role == role), key=lambda p: (p.load, p.instance_id))

    # --- Scheduler -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        listing = self._listing
        figures: dict[str, Any] = {"peers_prefill": sum(p.role == "prefill" for p in listing),
                                   "peers_decode": sum(p.role == "decode" for p in listing),
                                   "redis_up": int(self._degraded is None)}
        if self._degraded is not None:
            figures["degraded_reason"] = self._degraded
        return figures

    def close(self) -> None:
        self._stop.set()
        if self._heartbeat.is_alive():
            self._heartbeat.join(timeout=5)
        if self._me is not None:
            try:
                self._redis.delete(self._key(self._me.instance_id))
                self._redis.srem(f"{self._prefix}:peers", self._me.instance_id)
            except redis.RedisError:
                pass   # the entry expires on its own
        self._redis.close()
        super().close()

    # --- internals -----------------------------------------------------------------------------

    def _key(self, instance_id: str) -> str:
        return f"{self._prefix}:peer:{instance_id}"

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_s):
            try:
                self._renew()
            except Exception:   # one bad round must not end the directory's thread
                log.exception("the prefill/decode directory failed to renew; it tries again next heartbeat")

    def _renew(self) -> None:
        """Renew this instance's entry, then read the listing (the directory thread, after join)."""
        self._publish()
        self._refresh_listing()

    def _publish(self) -> None:
        assert self._me is not None
        entry = json.dumps(dataclasses.asdict(dataclasses.replace(self._me, load=self._load)))
        try:
            pipe = self._redis.pipeline()
            pipe.set(self._key(self._me.instance_id), entry, px=int(self.settings.lease_s * 1000))
            pipe.sadd(f"{self._prefix}:peers", self._me.instance_id)
            pipe.execute()
        except redis.RedisError as exc:
            self._lose_redis(exc)
        else:
            self._regain_redis()

    def _refresh_listing(self) -> None:
        """Read every live entry into the cached listing; without Redis, keep the last one."""
        me = self._me.instance_id if self._me is not None else None
        try:
            members = sorted(self._readable_members(self._redis.smembers(f"{self._prefix}:peers")))
            entries = self._redis.mget([self._key(m) for m in members]) if members else []
        except redis.RedisError as exc:
            self._lose_redis(exc)
            return
        listing, gone = [], []
        for member, entry in zip(members, entries, strict=True):
            if entry is None:
                gone.append(member)
            elif member != me and (peer := self._peer_info(member, entry)) is not None:
                listing.append(peer)
        if gone:
            try:
                self._redis.srem(f"{self._prefix}:peers", *gone)
            except redis.RedisError:
                pass
        self._listing = listing

    def _readable_members(self, members: set[bytes]) -> list[str]:
        """The set's instance ids; one that is not UTF-8 (no instance wrote it) is left out, said once."""
        readable = []
        for member in members:
            try:
                readable.append(member.decode())
            except UnicodeDecodeError:
                self._say_unreadable(member.decode(errors="replace"), member, "it is not UTF-8")
        return readable

    def _say_unreadable(self, member: str, entry: bytes, why: str) -> None:
        if (member, entry) not in self._unreadable:
            self._unreadable.add((member, entry))
            log.warning("peer directory entry of %r is not one this version reads (%s); not pairing with it",
                        member, why)

    def _peer_info(self, member: str, entry: bytes) -> PeerInfo | None:
        """A directory entry as a peer, or None for one that does not decode (damaged, or written by
        another fd-engine version with other fields): never paired with, said once per entry."""
        try:
            data = json.loads(entry)
            return PeerInfo(**data)
        except (ValueError, TypeError) as exc:
            self._say_unreadable(member, entry, f"{type(exc).__name__}: {exc}")
            return None

    def _lose_redis(self, exc: Exception) -> None:
        if self._degraded is None:
            log.warning("the prefill/decode directory lost Redis at %s: %s", self.settings.url, exc)
        self._degraded = f"Redis at {self.settings.url} is unreachable ({exc}); pairing from the last listing"

    def _regain_redis(self) -> None:
        if self._degraded is not None:
            log.info("the prefill/decode directory reached Redis again")
        self._degraded = None
