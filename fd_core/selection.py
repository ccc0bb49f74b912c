"""Resolve a config's seam choices into loaded plugin classes with validated settings.

This is the start-up check shared by ``fd-serve --check``, the server and the offline LLM:
it imports only the selected plugins (all of them in strict mode), validates each one's
``<seam>.options`` against its ``settings_model``, picks the platform and instantiates it
(cheap: no model, no KV pool), then checks what would otherwise fail only after heavy work —
the model source, the dtype on that platform, the parallel sizes, prefix caching on the
resource manager. Every problem found is reported at once. It never touches a device beyond
the platforms' ``detect()`` probes and the chosen platform's ``supported_dtypes()``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from fd_core.config import config_errors, config_problems_from
from fd_core.errors import ConfigError, ModelLoadError, PluginError, PluginNotFoundError
from fd_core.paddle_import import import_paddle
from fd_core.parser_choice import AUTO, NONE, PARSER_SEAMS
from fd_core.precision import precision_problems
from fd_core.registry import SEAM_GROUPS, Registry

if TYPE_CHECKING:
    from fd_core.config import FdConfig
    from fd_core.contracts.platform import Platform
    from fd_core.model.architectures import ArchitecturePlugins

CONNECTOR, ARCHITECTURE, GUIDED_DECODING, PROPOSER = "connector", "architecture", "guided_decoding", "proposer"
#: ``guided_decoding.name`` values: off, and "the installed backend" (the built-in one first).
NO_GUIDED_DECODING, AUTO_GUIDED_DECODING, BUILT_IN_GUIDED_DECODING = "none", "auto", "xgrammar"
#: Connector name meaning "not a split deployment".
NO_CONNECTOR = "none"
#: Proposer name meaning "no speculative decoding".
NO_PROPOSER = "none"
#: Architecture name meaning "the plugin that declares the checkpoint's architecture".
AUTO_ARCHITECTURE = "auto"
#: Seams whose name may select no plugin: that name and what it means (a bad name's error lists it).
_OFF_NAMES = {CONNECTOR: (NO_CONNECTOR, "not a prefill/decode deployment"),
              PROPOSER: (NO_PROPOSER, "no speculative decoding")}
#: (seam, name) pairs that load no plugin here: no connector, no proposer, and the choices made once
#: the model is known (its architecture, its chat template's parsers: fd_core.parser_choice).
_NAMES_OF_NO_PLUGIN = (*((seam, off) for seam, (off, _) in _OFF_NAMES.items()), (ARCHITECTURE, AUTO_ARCHITECTURE),
                       (GUIDED_DECODING, NO_GUIDED_DECODING), (GUIDED_DECODING, AUTO_GUIDED_DECODING),
                       *((seam, name) for seam in PARSER_SEAMS for name in (AUTO, NONE)))
#: Parallel sizes this build runs (a larger one must fail here, not after loading the model).
RUNNABLE_PARALLEL_SIZE = 1

Problems = list[tuple[str, str]]


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
    platform: Platform | None = None    # the selected platform, instantiated with its settings
    enable_prefix_caching: bool = False  # cache.enable_prefix_caching, its default resolved

    def __getitem__(self, seam: str) -> SelectedPlugin:
        return self.plugins[seam]

    def architecture_plugins(self) -> ArchitecturePlugins:
        """The architecture plugins a model load may use: the named one, or every installed one."""
        from fd_core.model.architectures import ArchitecturePlugins

        named = self.plugins.get(ARCHITECTURE)
        return ArchitecturePlugins(self.registry, named.create() if named is not None else None)

    def summary(self) -> dict[str, str]:
        """Seam -> selected plugin name, for ``--check`` and logs."""
        return {seam: selected.name for seam, selected in self.plugins.items()}


def resolve(config: FdConfig, registry: Registry | None = None, *, apply_worker_env: bool = False) -> Selection:
    """Load and validate every seam plugin the config selects, then check the config against them.

    With ``apply_worker_env`` (engine start-up, not ``--check``), an explicitly named
    platform's ``worker_env()`` is put into ``os.environ`` *before* its ``detect()`` runs:
    visible-device variables only take effect before the device runtime starts, and a probe
    may start it. Under ``platform.name = "auto"`` the variables come after detection, so name
    the platform when you restrict devices. Raises one ConfigError listing every problem (key
    paths such as ``scheduler.options.ttl_s``, and the ``FD_*`` variable a bad value came
    from), or PluginError naming the plugin in strict mode, where every plugin must load.
    """
    with contextlib.suppress(ImportError):  # without Paddle, the platforms' detect() says so
        import_paddle()  # the platform probes import it: do it once, without its noise
    if registry is None:
        registry = Registry.discover(strict=config.plugins.strict, disabled=config.plugins.disabled,
                                     hooks=config.plugins.hooks)
    registry.check_strict()
    selection = Selection(registry)
    problems: Problems = _check_hooks_allowed(config, registry)
    for seam in SEAM_GROUPS:
        try:
            _select(config, selection, seam, apply_worker_env=apply_worker_env)
        except ConfigError as exc:
            problems.append((exc.key, str(exc).removeprefix(f"{exc.key}: ")))
        except _OptionsError as exc:
            problems.extend(exc.problems)
    problems += _check_model_source(config)
    problems += _check_parallel(config)
    if "platform" in selection.plugins:
        problems += _check_platform_answers(selection)
        problems += _check_dtype(config, selection)
    problems += precision_problems(config, selection.platform)
    problems += _check_splitwise(config, selection)
    if "resource_manager" in selection.plugins:
        problems += _resolve_prefix_caching(config, selection)
    if problems:
        raise config_errors(problems)
    return selection


class _OptionsError(Exception):
    """Several problems in one seam's options (internal: resolve collects them)."""

    def __init__(self, problems: Problems) -> None:
        super().__init__(problems)
        self.problems = problems


def _select(config: FdConfig, selection: Selection, seam: str, *, apply_worker_env: bool) -> None:
    section = config.seam_section(seam)
    if (seam, section.name) in _NAMES_OF_NO_PLUGIN:
        if section.options:
            raise ConfigError(f"{seam}.options", f"given, but {seam}.name is {section.name!r}; "
                              f"name the {seam} plugin they are for, or remove them")
        auto_backend = seam == GUIDED_DECODING and section.name == AUTO_GUIDED_DECODING
        if not auto_backend or not (name := _auto_guided_decoding(selection.registry)):
            return
    elif seam == "platform" and section.name == "auto":
        name, selection.platform_reason = _auto_platform(selection.registry)
    else:
        name = section.name
    cls = _load(selection.registry, seam, name)
    settings = _validate_options(config, seam, cls, section.options)
    plugin = SelectedPlugin(seam, name, cls, settings)
    if seam == "platform":
        if apply_worker_env and not selection.platform_reason:
            selection.platform = plugin.create()
            os.environ.update(selection.platform.worker_env())
        if not selection.platform_reason:
            selection.platform_reason = _explicit_platform_reason(cls)
        selection.platform = selection.platform or plugin.create()
    selection.plugins[seam] = plugin


def _auto_guided_decoding(registry: Registry) -> str | None:
    """The guided-decoding backend ``auto`` picks: the built-in one where it is registered, else the
    first other by name, else none (guided decoding off)."""
    names = sorted(registry.names(GUIDED_DECODING))
    return BUILT_IN_GUIDED_DECODING if BUILT_IN_GUIDED_DECODING in names else next(iter(names), None)


def _load(registry: Registry, seam: str, name: str) -> type:
    try:
        return registry.load(seam, name)
    except PluginNotFoundError as exc:
        if seam in PARSER_SEAMS:
            available = ", ".join([AUTO, NONE, *registry.names(seam)])
            raise ConfigError(f"{seam}.name", f"plugin {exc.plugin}: no such {seam.replace('_', ' ')}; available: "
                              f"{available} ({AUTO!r}: chosen by the chat template)") from exc
        if seam not in _OFF_NAMES:
            raise ConfigError(f"{seam}.name", str(exc)) from exc
        off, meaning = _OFF_NAMES[seam]
        available = ", ".join([off, *registry.names(seam)])
        raise ConfigError(f"{seam}.name", f"plugin {exc.plugin}: no such {seam.replace('_', ' ')}; available: "
                          f"{available} ({off!r}: {meaning})") from exc
    except PluginError as exc:
        raise ConfigError(f"{seam}.name", str(exc)) from exc


def _validate_options(config: FdConfig, seam: str, cls: type, options: dict[str, Any]) -> BaseModel | None:
    model: type[BaseModel] | None = cls.settings_model
    if model is None:
        if options:
            raise ConfigError(f"{seam}.options", f"plugin {cls.name!r} takes no options, got {sorted(options)}")
        return None
    try:
        return model.model_validate(options)
    except ValidationError as exc:
        raise _OptionsError(config_problems_from(exc, prefix=f"{seam}.options", env_var=config.env_var_of)) from exc


def _from_env(config: FdConfig, key: str) -> str:
    var = config.env_var_of(key)
    return f" (from {var})" if var else ""


def _check_hooks_allowed(config: FdConfig, registry: Registry) -> Problems:
    """Every name in ``plugins.hooks`` is an installed hook plugin (a typo would enable nothing)."""
    if config.plugins.hooks is None:
        return []
    installed = {record.name for record in registry.records("general")}
    unknown = sorted({name.removeprefix("fd.plugins/") for name in config.plugins.hooks} - installed)
    if not unknown:
        return []
    return [("plugins.hooks", "no installed hook plugin (fd.plugins entry point) is named "
                              f"{', '.join(map(repr, unknown))}; installed: {', '.join(sorted(installed)) or 'none'}"
                              f"{_from_env(config, 'plugins.hooks')}")]


def _check_model_source(config: FdConfig) -> Problems:
    from fd_core.model.loader import model_source_kind

    try:
        model_source_kind(config.model.source)
    except ModelLoadError as exc:
        return [("model.source", f"{exc}{_from_env(config, 'model.source')}")]
    return []


def _check_parallel(config: FdConfig) -> Problems:
    """Tensor parallelism does not run yet; data parallelism is fd-serve's (one engine per rank)."""
    size = config.parallel.tensor_parallel_size
    if size == RUNNABLE_PARALLEL_SIZE:
        return []
    return [("parallel.tensor_parallel_size", f"{size} is not supported yet: only {RUNNABLE_PARALLEL_SIZE} runs "
                                              f"in this version{_from_env(config, 'parallel.tensor_parallel_size')}")]


def _check_platform_answers(selection: Selection) -> Problems:
    """The platform answers what start-up asks of it (``--check`` would otherwise pass a platform
    that fails only once the engine starts)."""
    platform = selection.platform
    assert platform is not None, "a selected platform is instantiated in _select"
    for method in ("num_threads", "worker_env", "supported_dtypes", "device_string"):
        try:
            getattr(platform, method)()
        except Exception as exc:
            label = f"{selection['platform'].name} ({type(platform).__module__}:{type(platform).__qualname__})"
            return [("platform.name", f"plugin {label}: {method}() raised {type(exc).__name__}: {exc}")]
    return []


def _check_dtype(config: FdConfig, selection: Selection) -> Problems:
    assert selection.platform is not None, "a selected platform is instantiated in _select"
    supported = selection.platform.supported_dtypes()
    if config.model.dtype in supported:
        return []
    return [("model.dtype", f"{config.model.dtype!r} is not supported by platform {selection['platform'].name!r}; "
                            f"it supports {list(supported)}{_from_env(config, 'model.dtype')}")]


def _check_splitwise(config: FdConfig, selection: Selection) -> Problems:
    """A prefill or decode instance needs a connector, a scheduler with a peer directory and
    one engine; a decode instance a resource manager that reserves; a mixed one no connector."""
    from fd_core.contracts.scheduler import PeerDirectory

    role = config.splitwise.role
    origin = _from_env(config, "splitwise.role")
    connector = config.connector.name
    if role == "mixed":
        if "connector" not in selection.plugins:   # none, or one that failed to load (reported already)
            return []
        return [("connector.name", f"{connector!r} is selected, but splitwise.role is 'mixed'{origin}: only prefill "
                                   f"and decode instances use a connector; set splitwise.role or connector.name = "
                                   f"{NO_CONNECTOR!r}")]
    problems: Problems = []
    if connector == NO_CONNECTOR:
        available = ", ".join(selection.registry.names("connector")) or "none installed"
        problems.append(("connector.name", f"splitwise.role is {role!r}{origin}, which needs a connector to reach "
                                           f"its peers; choose one of: {available}"))
    scheduler = selection.plugins.get("scheduler")
    if scheduler is not None and not issubclass(scheduler.cls, PeerDirectory):
        problems.append(("scheduler.name", f"{scheduler.name!r} cannot pair prefill and decode instances (it is not a "
                                           f"PeerDirectory); splitwise.role {role!r} needs scheduler 'splitwise'"))
    manager = selection.plugins.get("resource_manager")
    if role == "decode" and manager is not None and not manager.cls.supports_reserve:
        problems.append(("resource_manager.name", f"{manager.name!r} cannot reserve blocks for KV computed elsewhere, "
                                                  "which a decode instance needs; use v1 or v0"))
    if config.parallel.data_parallel_size not in (1, "auto"):   # "auto" is 1 here
        problems.append(("parallel.data_parallel_size", f"a {role} instance runs one engine; start one fd-serve per "
                                                        "instance instead"))
    return problems


def _resolve_prefix_caching(config: FdConfig, selection: Selection) -> Problems:
    """Set ``selection.enable_prefix_caching``: the key's value, or when unset what the manager
    supports (never on a decode instance)."""
    selected = selection["resource_manager"]
    supported = selected.cls.supports_prefix_caching and config.splitwise.role != "decode"
    wanted = config.cache.enable_prefix_caching
    if wanted and not supported:
        origin = _from_env(config, "cache.enable_prefix_caching")
        why = ("a decode instance cannot cache prefixes (prefill instances fill its prompt blocks)"
               if config.splitwise.role == "decode" else f"resource manager {selected.name!r} has no prefix cache")
        return [("cache.enable_prefix_caching", f"{why}; set it to false or leave it unset{origin}")]
    selection.enable_prefix_caching = supported if wanted is None else wanted
    return []


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
