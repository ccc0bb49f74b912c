"""A last-in-first-out request scheduler built on the local one."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

import fd_core
from fd_plugins.schedulers.local import LocalScheduler


class LifoSettings(BaseModel):
    """Options of the demo scheduler (``[scheduler.options]``)."""

    model_config = ConfigDict(extra="forbid")

    ttl_s: float = Field(600.0, gt=0)
    greeting: str = "hello"


class LifoScheduler(LocalScheduler):
    """Hands out the newest request first."""

    name: ClassVar[str] = "demo"
    fd_hookspec_version: ClassVar[int] = fd_core.FD_HOOKSPEC_VERSION
    settings_model: ClassVar[type[BaseModel]] = LifoSettings

    def admission_order(self, waiting, now):
        return sorted(waiting, key=lambda r: r.arrival_time, reverse=True)
