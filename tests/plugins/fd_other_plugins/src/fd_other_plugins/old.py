"""A scheduler written for a hookspec version this core does not speak, and a name thief."""

from fd_plugins.schedulers.local import LocalScheduler


class OldScheduler(LocalScheduler):
    name = "old"
    fd_hookspec_version = 0


class ShadowScheduler(LocalScheduler):
    name = "shadow"
