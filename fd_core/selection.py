"""Resolve a config's seam choices into loaded plugin classes with validated settings.

This is the start-up check shared by ``fd-serve --check``, the server and the offline LLM:
it imports only the selected plugins (all of them in strict mode), validates each one's
``<seam>.options`` against its ``settings_model`` and picks the platform. It never touches a
device beyond the platforms' ``detect()`` probes, which never raise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from fd_core.config import config_error_from
from fd_core.errors import ConfigError, PluginError
from fd_core.registry import SEAM_GROUPS, Registry

if TYPE_CHECKING:
    from fd_core.config import FdConfig

#: Connector name meaning "not a split deployment".
NO_CONNECTOR = "none"


@dataclass(slots=True)
class SelectedPlugin:
    """One seam's choice: the class and its validated settings."""

    seam: str
    name: str
    cls: type
    settings: BaseModel | None

    def create(self, **kwargs: Any) -> Any:
        """Instantiate the plugin with its settings and seam-specific keyword arguments."""
        return self.cls(self.settings, **kwargs)


@dataclass(slots=True)
class Selection:
    """Everything start-up needs from the plugin layer."""

    registry: Registry
    plugins: dict[str, SelectedPlugin] = field(default_factory=dict)
    platform_reason: str = ""   # why this platform was picked

    def __getitem__(self, seam: str) -> SelectedPlugin:
        return self.plugins[seam]

    def summary(self) -> dict[str, str]:
        """Seam -> selected plugin name, for ``--check`` and logs."""
        return {seam: selected.name for seam, selected in self.plugins.items()}


def resolve(config: FdConfig, registry: Registry | None = None, *, apply_worker_env: bool = False) -> Selection:
    """Load and validate every seam plugin the config selects.

    With ``apply_worker_env`` (engine start-up, not ``--check``), an explicitly named
    platform's ``worker_env()`` is put into ``os.environ`` *before* its ``detect()`` runs:
    visible-device variables only take effect before the device runtime starts, and a probe
    may start it. Under ``platform.name = "auto"`` the variables come after detection, so name
    the platform when you restrict devices. Raises ConfigError (key path such as ``scheduler.options.ttl_s``) or PluginError
    (naming the plugin). In strict mode every discovered plugin must load.
    """
    if registry is None:
        registry = Registry.discover(strict=config.plugins.strict, disabled=config.plugins.disabled)
    registry.check_strict()
    selection = Selection(registry)
    for seam in SEAM_GROUPS:
        section = config.seam_section(seam)
        if seam == "connector" and section.name == NO_CONNECTOR:
            continue
        if seam == "platform" and section.name == "auto":
            name, selection.platform_reason = _auto_platform(registry)
        else:
            name = section.name
        cls = _load(registry, seam, name)
        settings = _validate_options(seam, cls, section.options)
        if seam == "platform" and apply_worker_env and not selection.platform_reason:
            os.environ.update(cls(settings).worker_env())
        selection.plugins[seam] = SelectedPlugin(seam, name, cls, settings)
    if "platform" in selection.plugins and not selection.platform_reason:
        selection.platform_reason = _explicit_platform_reason(selection["platform"].cls)
    return selection


def _load(registry: Registry, seam: str, name: str) -> type:
    try:
        return registry.load(seam, name)
    except PluginError as exc:
        raise ConfigError(f"{seam}.name", str(exc)) from exc


def _validate_options(seam: str, cls: type, options: dict[str, Any]) -> BaseModel | None:
    model: type[BaseModel] | None = cls.settings_model
    if model is None:
        if options:
            raise ConfigError(f"{seam}.options", f"plugin {cls.name!r} takes no options, got {sorted(options)}")
        return None
    try:
        return model.model_validate(options)
    except ValidationError as exc:
        raise config_error_from(exc, prefix=f"{seam}.options") from exc


def _auto_platform(registry: Registry) -> tuple[str, str]:
    """The available platform with the highest priority (ties: by name)."""
    found: list[tuple[int, str, str]] = []
    for name in registry.names("platform"):
        try:
            cls = registry.load("platform", name)
        except PluginError:
            continue  # lenient mode: a broken platform plugin is skipped (and listed as failed)
        result = cls.detect()
        if result.available:
            found.append((-cls.priority, name, result.reason))
    if not found:
        raise ConfigError("platform.name", "no platform is available (not even cpu); see `fd-serve plugins list`")
    _, name, reason = min(found)
    return name, f"auto: {reason}"


def _explicit_platform_reason(cls: type) -> str:
    result = cls.detect()
    if not result.available:
        raise ConfigError("platform.name", f"platform {cls.name!r} was requested but is not available: {result.reason}")
    return f"explicit: {result.reason}"
