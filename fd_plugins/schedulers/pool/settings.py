"""``[scheduler.options]`` of the ``global`` scheduler."""

from __future__ import annotations

from typing import Final

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

#: Redis calls the heartbeat thread makes between two renewals of this member's liveness key and
#: leases: the renewal is one script (liveness, load, leases, the queue TTL and the reaper in one
#: round trip), so between the moments Redis runs two of them lie the rest of one call (its reply
#: may take up to ``socket_timeout_s``), the wait of ``heartbeat_s``, and the start of the next call
#: (its request may take up to ``socket_timeout_s``). A call slower than that raises, and the member
#: turns degraded instead of renewing late.
RENEWAL_ROUND_TRIPS: Final = 2


def longest_renewal_gap(heartbeat_s: float, socket_timeout_s: float) -> float:
    """The longest time between two renewals of a live, responsive member (see RENEWAL_ROUND_TRIPS)."""
    return heartbeat_s + RENEWAL_ROUND_TRIPS * socket_timeout_s


class GlobalSchedulerSettings(BaseModel):
    """Where the pool's Redis is, and the timing of heartbeats, leases and work stealing."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field("redis://127.0.0.1:6379/0", description="Redis server of the pool (redis-py URL).")
    topic: str = Field("default", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$",
                       description="Instances naming the same URL and topic form one pool.")
    instance_id: str | None = Field(None, description="This instance's name in the pool; unset: host:pid:random.")
    heartbeat_s: float = Field(0.5, gt=0, description="How often liveness, load and leases are renewed.")
    socket_timeout_s: float = Field(1.0, gt=0, description="A Redis call slower than this counts as Redis lost.")
    lease_s: float = Field(3.0, gt=0, description=(
        "A request taken by an instance (and the instance itself) counts as lost when not renewed for this "
        "long; its request is then queued again at its origin and continues from the tokens already sent. "
        "At least heartbeat_s + 2 x socket_timeout_s (the longest gap between two renewals) and 2 x heartbeat_s."))
    steal_min_queued: int = Field(2, ge=1, description=(
        "Take work from a peer only when at least this many of its requests are queued."))
    steal_batch: int = Field(4, ge=1, description="Most requests taken from a peer at once.")
    poll_s: float = Field(0.1, gt=0, description="While idle, how often peers' queues are looked at.")
    ttl_s: float = Field(600.0, gt=0, description="Requests still queued after this long expire.")

    @field_validator("lease_s")
    @classmethod
    def _lease_outlives_renewals(cls, lease_s: float, info: ValidationInfo) -> float:
        heartbeat_s, socket_timeout_s = info.data.get("heartbeat_s"), info.data.get("socket_timeout_s")
        if heartbeat_s is None or socket_timeout_s is None:
            return lease_s   # those failed on their own: their errors say why
        gap = longest_renewal_gap(heartbeat_s, socket_timeout_s)
        if lease_s < gap:
            raise ValueError(
                f"lease_s ({lease_s:g}) must outlast the longest gap between two renewals of a live member: "
                f"heartbeat_s ({heartbeat_s:g}) + {RENEWAL_ROUND_TRIPS} x socket_timeout_s ({socket_timeout_s:g}) "
                f"= {gap:g} s; with less, a member that is merely slow has its queue and leases reaped by its "
                "peers. Raise lease_s, or lower heartbeat_s or socket_timeout_s")
        if lease_s < 2 * heartbeat_s:
            raise ValueError(f"lease_s ({lease_s:g}) must be at least twice heartbeat_s ({heartbeat_s:g}), "
                             "or a live instance loses its leases between two heartbeats")
        return lease_s
