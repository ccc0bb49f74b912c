"""A last-in-first-out request scheduler built on the local one."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel

import fd_core
from fd_plugins.schedulers.local import LocalScheduler, LocalSchedulerSettings


class LifoSettings(LocalSchedulerSettings):
    """Options of the demo scheduler (``[scheduler.options]``): the local queue's, and one more."""

    greeting: str = "hello"


class LifoScheduler(LocalScheduler):
    """Hands out the newest request first."""

    name: ClassVar[str] = "demo"
    fd_hookspec_version: ClassVar[int] = fd_core.FD_HOOKSPEC_VERSION
    settings_model: ClassVar[type[BaseModel]] = LifoSettings

    def default_order(self, waiting, now):
        return sorted(waiting, key=lambda r: r.arrival_time, reverse=True)
