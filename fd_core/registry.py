"""Plugin discovery and loading: entry-point groups per seam plus one general pluggy group.

Discovery reads entry-point metadata only (no imports). A seam plugin is imported when it is
selected (``Registry.load``) or when every plugin is checked (``Registry.load_all``: strict mode
and ``fd-serve plugins list``). General plugins (group ``fd.plugins``) carry hook
implementations and are imported and registered with pluggy at discovery.

Two entry points with the same name in one group: exactly one wins, the others are reported as
*shadowed by* the winner. The winner is the built-in distribution (``fd-engine``) if it is one
of them, otherwise the first by (distribution name, ``module:attr``) — deterministic whatever
the install order. Pick a shadowed plugin by giving it another name in its own package.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as metadata
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

import pluggy

from fd_core import compat, hookspecs
from fd_core.errors import PluginError, PluginLoadError, PluginNotFoundError, PluginVersionError
from fd_core.seams import BY_NAME, GENERAL_GROUP, SEAMS

log = logging.getLogger(__name__)

#: Seam name -> entry-point group (from ``fd_core.seams``).
SEAM_GROUPS: Final = {seam.name: seam.group for seam in SEAMS}
#: Distribution of the built-in plugins; it wins name clashes.
BUILTIN_DIST: Final = "fd-engine"

LOADED: Final = "loaded"
NOT_LOADED: Final = "not loaded"
FAILED: Final = "failed"
SHADOWED: Final = "shadowed"
DISABLED: Final = "disabled"


@dataclass(slots=True)
class PluginRecord:
    """What the registry knows of one plugin; one row of ``fd-serve plugins list``."""

    seam: str                 # a key of SEAM_GROUPS, or "general"
    name: str                 # entry-point name (the name a config uses)
    target: str               # "module:attr"
    dist: str                 # distribution name, "?" when unknown
    version: str              # distribution version, "?" when unknown
    status: str = NOT_LOADED  # LOADED / NOT_LOADED / FAILED / SHADOWED / DISABLED
    reason: str | None = None           # why it failed or who shadows it
    obj: Any = None                     # the loaded class or module

    @property
    def group(self) -> str:
        return SEAM_GROUPS.get(self.seam, GENERAL_GROUP)

    @property
    def label(self) -> str:
        """``group/name (module:attr, dist version)``: how errors name a plugin."""
        return f"{self.group}/{self.name} ({self.target}, {self.dist} {self.version})"


def _winner_key(record: PluginRecord) -> tuple[int, str, str]:
    return (record.dist != BUILTIN_DIST, record.dist, record.target)


def _check_version(record: PluginRecord, obj: Any) -> None:
    """Refuse a plugin whose declared hookspec version its seam no longer loads; warn (once per
    plugin) when it declares an older one that still loads (see ``fd_core.compat``)."""
    declared = getattr(obj, "fd_hookspec_version", None)
    loadable = (isinstance(declared, int) and not isinstance(declared, bool)
                and compat.oldest_loadable(record.seam) <= declared <= hookspecs.FD_HOOKSPEC_VERSION)
    if not loadable:
        raise PluginVersionError(record.label, compat.refusal(record.seam, declared))
    note = compat.deprecation(record.seam, declared)
    if note is not None:
        record.reason = f"deprecated: {note}"
        compat.warn_deprecated(f"plugin {record.label}", note)


def _check_contract(record: PluginRecord, obj: Any) -> None:
    module_name, cls_name = BY_NAME[record.seam].contract_path.split(":")
    contract = getattr(importlib.import_module(module_name), cls_name)
    if not (isinstance(obj, type) and issubclass(obj, contract)):
        raise PluginLoadError(record.label, f"is not a subclass of {contract.__module__}.{cls_name}")


class Registry:
    """Every discovered plugin, the pluggy manager holding hook implementations, and policy."""

    def __init__(self, records: Iterable[PluginRecord], *, strict: bool = False,
                 plugin_manager: pluggy.PluginManager | None = None) -> None:
        self.strict = strict
        self.plugin_manager = plugin_manager or _new_plugin_manager()
        self._records: list[PluginRecord] = sorted(records, key=lambda r: (r.seam, r.name, _winner_key(r)))
        self._mark_shadowed()

    # --- construction ------------------------------------------------------------------------

    @classmethod
    def discover(cls, *, strict: bool = False, disabled: Iterable[str] = (),
                 hooks: Iterable[str] | None = None) -> Registry:
        """Read entry points of every group; import and register the general plugins only.

        ``disabled`` holds ``group/name`` strings; such plugins are listed but never imported.
        ``hooks`` (``plugins.hooks``), when given, names the general plugins to register; the
        other installed ones are listed as disabled and never imported.
        """
        blocked = set(disabled)
        records: list[PluginRecord] = []
        for seam, group in SEAM_GROUPS.items():
            records.extend(_records_for(seam, group, blocked))
        registry = cls(records, strict=strict)
        allowed = None if hooks is None else {name.removeprefix(f"{GENERAL_GROUP}/") for name in hooks}
        for record in _records_for("general", GENERAL_GROUP, blocked):
            if allowed is not None and record.status != DISABLED and record.name not in allowed:
                record.status, record.reason = DISABLED, "not in plugins.hooks"
            registry._add_general(record)
        registry._check_pending()
        registry._collect_registered_classes()
        return registry

    @classmethod
    def from_plugins(cls, seam_plugins: dict[str, list[type]], *, general: Iterable[Any] = (),
                     strict: bool = False) -> Registry:
        """Build a registry from ready-made classes and hook objects (for tests and embedding)."""
        records = [
            PluginRecord(seam, plugin.name, f"{plugin.__module__}:{plugin.__qualname__}", "<local>", "-",
                         status=LOADED, obj=plugin)
            for seam, plugins in seam_plugins.items() for plugin in plugins
        ]
        registry = cls(records, strict=strict)
        for obj in general:
            name = getattr(obj, "__name__", type(obj).__name__)
            registry._add_general(PluginRecord("general", name, name, "<local>", "-", status=LOADED, obj=obj))
        registry._check_pending()
        return registry

    # --- queries -----------------------------------------------------------------------------

    @property
    def hooks(self) -> Any:
        """The pluggy hook relay: ``registry.hooks.fd_order_waiting(...)``."""
        return self.plugin_manager.hook

    def records(self, seam: str | None = None) -> list[PluginRecord]:
        """Records in (seam, name, winner first) order, optionally of one seam."""
        return [r for r in self._records if seam is None or r.seam == seam]

    def names(self, seam: str) -> list[str]:
        """Names a config may select for ``seam`` (winners only, not disabled)."""
        return sorted({r.name for r in self._records
                       if r.seam == seam and r.status not in (SHADOWED, DISABLED)})

    # --- loading -----------------------------------------------------------------------------

    def load(self, seam: str, name: str) -> type:
        """Import (once) and return the class registered as ``name`` for ``seam``.

        Raises PluginNotFoundError listing the candidates, or PluginLoadError /
        PluginVersionError naming the plugin.
        """
        record = self._winner(seam, name)
        if record.status == LOADED:
            return record.obj
        if record.status == FAILED:
            raise PluginLoadError(record.label, record.reason or "failed to load")
        self._load_record(record, raise_errors=True)
        return record.obj

    def load_all(self) -> list[PluginRecord]:
        """Try to import every seam plugin (not shadowed or disabled); return the failures.

        In strict mode the first failure is raised instead.
        """
        failures = []
        for record in self._records:
            if record.status == NOT_LOADED:
                self._load_record(record, raise_errors=self.strict)
            if record.status == FAILED:
                failures.append(record)
        return failures

    def check_strict(self) -> None:
        """In strict mode, load every plugin so that any broken one stops start-up."""
        if self.strict:
            self.load_all()
            for record in self._records:
                if record.status == FAILED:
                    raise PluginLoadError(record.label, record.reason or "failed to load")

    # --- internals ---------------------------------------------------------------------------

    def _winner(self, seam: str, name: str) -> PluginRecord:
        for record in self._records:
            if record.seam == seam and record.name == name and record.status not in (SHADOWED, DISABLED):
                return record
        candidates = ", ".join(self.names(seam)) or "none installed"
        raise PluginNotFoundError(
            f"{SEAM_GROUPS.get(seam, seam)}/{name}",
            f"no such {seam.replace('_', ' ')}; available: {candidates}",
        )

    def _load_record(self, record: PluginRecord, *, raise_errors: bool) -> None:
        try:
            obj = _load_entry_point(record)
            _check_version(record, obj)
            _check_contract(record, obj)
        except (KeyboardInterrupt, SystemExit):
            raise
        except PluginError as exc:
            self._fail(record, exc.reason, exc, raise_errors)
        except Exception as exc:  # any import-time error of third-party code
            self._fail(record, f"{type(exc).__name__}: {exc}", exc, raise_errors)
        else:
            record.status, record.obj = LOADED, obj

    def _fail(self, record: PluginRecord, reason: str, exc: BaseException, raise_errors: bool) -> None:
        record.status, record.reason = FAILED, reason
        log.warning("plugin %s failed to load: %s", record.label, reason)
        log.debug("traceback of %s", record.label, exc_info=exc)
        if raise_errors:
            if isinstance(exc, PluginError):
                raise exc
            raise PluginLoadError(record.label, reason) from exc

    def _add_general(self, record: PluginRecord) -> None:
        if record.status == DISABLED:
            self._records.append(record)
            return
        if record.obj is None:
            self._load_general(record)
        else:
            self._register_general(record)
        self._records.append(record)

    def _load_general(self, record: PluginRecord) -> None:
        try:
            obj = _load_entry_point(record)
            _check_version(record, obj)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:
            reason = exc.reason if isinstance(exc, PluginError) else f"{type(exc).__name__}: {exc}"
            self._fail(record, reason, exc, raise_errors=self.strict)
            return
        record.obj = obj
        self._register_general(record)

    def _register_general(self, record: PluginRecord) -> None:
        try:
            self.plugin_manager.register(record.obj, name=f"{record.group}/{record.name}")
        except ValueError as exc:  # pluggy: duplicate name or already registered
            self._fail(record, str(exc), exc, raise_errors=self.strict)
        except pluggy.PluginValidationError as exc:
            self._fail(record, str(exc), PluginLoadError(record.label, str(exc)), raise_errors=True)
        else:
            record.status = LOADED

    def _check_pending(self) -> None:
        """Refuse each general plugin with a hook implementation no hookspec declares.

        pluggy accepts an implementation of an unknown hook (``fd_order_wating``) and never calls
        it; ``check_pending()`` finds them. Such a plugin is unregistered and marked failed (it
        would silently not do its job): fatal in strict mode, a warning and a ``plugins list``
        row otherwise.
        """
        while True:
            try:
                self.plugin_manager.check_pending()
                return
            except pluggy.PluginValidationError as exc:
                record = next(r for r in self._records if r.seam == "general" and r.obj is exc.plugin)
                unknown = sorted(caller.name for caller in self.plugin_manager.get_hookcallers(exc.plugin) or ()
                                 if not caller.has_spec())
                self.plugin_manager.unregister(exc.plugin)
                reason = _unknown_hooks_reason(unknown)
                self._fail(record, reason, PluginLoadError(record.label, reason), raise_errors=self.strict)

    def _collect_registered_classes(self) -> None:
        """Add seam classes contributed through ``fd_register_*`` hooks."""
        by_plugin = {r.obj: r for r in self._records if r.seam == "general" and r.status == LOADED}
        for seam in SEAMS:
            hook_name = seam.registration_hook
            hook = getattr(self.plugin_manager.hook, hook_name)
            for impl in hook.get_hookimpls():
                source = by_plugin.get(impl.plugin)
                try:
                    contributed = list(impl.function() or ())
                except Exception as exc:  # a broken plugin fails to load, like one whose import raises
                    if source is not None:
                        reason = f"{hook_name} raised {type(exc).__name__}: {exc}"
                        self._fail(source, reason, PluginLoadError(source.label, reason), raise_errors=self.strict)
                    continue
                for cls in contributed:
                    record = PluginRecord(
                        seam.name, cls.name, f"{cls.__module__}:{cls.__qualname__}",
                        source.dist if source else "?", source.version if source else "?")
                    self._records.append(record)
                    try:
                        _check_version(record, cls)
                        _check_contract(record, cls)
                    except PluginError as exc:
                        self._fail(record, exc.reason, exc, raise_errors=self.strict)
                    else:
                        record.status, record.obj = LOADED, cls
        self._records.sort(key=lambda r: (r.seam, r.name, _winner_key(r)))
        self._mark_shadowed()

    def _mark_shadowed(self) -> None:
        winners: dict[tuple[str, str], PluginRecord] = {}
        for record in self._records:
            if record.status == DISABLED:
                continue
            key = (record.seam, record.name)
            if key in winners and winners[key] is not record:
                record.status, record.reason = SHADOWED, f"shadowed by {winners[key].label}"
            else:
                winners[key] = record


def _unknown_hooks_reason(names: list[str]) -> str:
    known = [name for name in vars(hookspecs) if name.startswith("fd_") and callable(getattr(hookspecs, name))]
    parts = []
    for name in names:
        close = difflib.get_close_matches(name, known, n=1)
        parts.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return (f"implements {', '.join(parts)}, which no hookspec of this core declares; "
            "the plugin is not used (fix the hook name)")


def _new_plugin_manager() -> pluggy.PluginManager:
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    return manager


def _records_for(seam: str, group: str, blocked: set[str]) -> list[PluginRecord]:
    records = []
    for ep in metadata.entry_points(group=group):
        dist = ep.dist
        record = PluginRecord(seam, ep.name, ep.value,
                              dist.metadata["Name"] if dist else "?", dist.version if dist else "?")
        if f"{group}/{ep.name}" in blocked:
            record.status, record.reason = DISABLED, "disabled by plugins.disabled"
        records.append(record)
    return records


def _load_entry_point(record: PluginRecord) -> Any:
    """Import exactly one plugin: the entry point the record names (never the other candidates
    of a clashing name).

    Read from ``importlib.metadata`` at each call: stevedore, used here before, keeps each
    group's entry points for the life of the process, so a plugin installed after the first
    look-up was never found in that process.
    """
    for entry_point in metadata.entry_points(group=record.group):
        if entry_point.name == record.name and entry_point.value == record.target:
            return entry_point.load()
    raise LookupError(f"entry point {record.target} is no longer installed")
