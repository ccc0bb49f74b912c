"""``[scheduler.options]`` of the ``global`` scheduler."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class GlobalSchedulerSettings(BaseModel):
    """Where the pool's Redis is, and the timing of heartbeats, leases and work stealing."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field("redis://127.0.0.1:6379/0", description="Redis server of the pool (redis-py URL).")
    topic: str = Field("default", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$",
                       description="Instances naming the same URL and topic form one pool.")
    instance_id: str | None = Field(None, description="This instance's name in the pool; unset: host:pid:random.")
    heartbeat_s: float = Field(0.5, gt=0, description="How often liveness, load and leases are renewed.")
    lease_s: float = Field(3.0, gt=0, description=(
        "A request taken by an instance (and the instance itself) counts as lost when not renewed for this "
        "long; its request is then queued again at its origin and continues from the tokens already sent."))
    steal_min_queued: int = Field(2, ge=1, description=(
        "Take work from a peer only when at least this many of its requests are queued."))
    steal_batch: int = Field(4, ge=1, description="Most requests taken from a peer at once.")
    poll_s: float = Field(0.1, gt=0, description="While idle, how often peers' queues are looked at.")
    ttl_s: float = Field(600.0, gt=0, description="Requests still queued after this long expire.")
    socket_timeout_s: float = Field(2.0, gt=0, description="A Redis call slower than this counts as Redis lost.")

    @model_validator(mode="after")
    def _lease_outlives_heartbeats(self) -> GlobalSchedulerSettings:
        if self.lease_s < 2 * self.heartbeat_s:
            raise ValueError(f"lease_s ({self.lease_s}) must be at least twice heartbeat_s ({self.heartbeat_s}), "
                             "or a live instance loses its leases between two heartbeats")
        return self
