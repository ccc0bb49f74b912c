"""A last-in-first-out scheduler, written the way version 1's docs showed (this file is kept as
it was written: fd-engine's tests check that it still loads, with a deprecation warning)."""

from typing import ClassVar

from fd_plugins.schedulers.local import LocalScheduler


class LifoScheduler(LocalScheduler):
    name: ClassVar[str] = "lifo-november"
    fd_hookspec_version: ClassVar[int] = 1

    def admission_order(self, waiting, now):
        return sorted(waiting, key=lambda r: r.arrival_time, reverse=True)
