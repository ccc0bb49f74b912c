"""The exit codes of ``fd-serve`` (and ``fd-serve router``), one table for every command.

A supervisor (systemd, Kubernetes) can act on them: ``USAGE`` will not fix itself (fix the
command line or the config); ``CANNOT_LISTEN`` may (the port frees up); ``ENGINE_DIED`` asks for a
restart.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """What ended the process."""

    OK = 0              # done, or a graceful shutdown
    FAILED = 1          # could not start the engine; a plugin failed to load in strict mode; a plugin check failed
    USAGE = 2           # a mistake on the command line or in the config (one error line per problem)
    ENGINE_DIED = 3     # the engine process died while serving
    CANNOT_LISTEN = 4   # the listening socket could not be bound (port taken, no such address)
