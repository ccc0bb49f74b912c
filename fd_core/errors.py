"""The fd-engine exception tree; every error the engine raises on purpose derives from FdError.

    FdError
    ├── ConfigError              bad configuration; ``.key`` is the dotted path (cache.block_size)
    ├── PluginError              a plugin could not be used; ``.plugin`` is "group/name (dist ver)"
    │   ├── PluginLoadError      importing the entry point raised
    │   ├── PluginNotFoundError  no plugin of that name in the group; lists the candidates
    │   └── PluginVersionError   the plugin was written for another hookspec version
    ├── ModelLoadError           weights, tokenizer or default model could not be loaded
    ├── RequestError             a request is invalid; ``.field`` names the field (-> HTTP 400)
    ├── QueueFullError           the scheduler queue or concurrency limit is full (-> HTTP 429)
    └── EngineDeadError          the engine process is gone (-> HTTP 503)
"""

from __future__ import annotations


class FdError(Exception):
    """Base class of every error fd-engine raises on purpose."""


class ConfigError(FdError):
    """Raised when configuration is invalid; ``key`` is the dotted path of the bad key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key


class PluginError(FdError):
    """Raised when a plugin cannot be used; ``plugin`` names it as group/name (dist version)."""

    def __init__(self, plugin: str, message: str) -> None:
        super().__init__(f"plugin {plugin}: {message}")
        self.plugin = plugin
        self.reason = message


class PluginLoadError(PluginError):
    """Importing or validating the plugin's entry point raised."""


class PluginNotFoundError(PluginError):
    """No plugin of the wanted name is registered in the group."""


class PluginVersionError(PluginError):
    """The plugin declares a hookspec version this core does not speak."""


class ModelLoadError(FdError):
    """Weights, tokenizer or the default model could not be loaded; the message names the cause."""


class RequestError(FdError):
    """A request is invalid; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class QueueFullError(FdError):
    """The request queue or the concurrency limit is full; retry later."""


class EngineDeadError(FdError):
    """The engine process stopped; requests in flight cannot complete."""
