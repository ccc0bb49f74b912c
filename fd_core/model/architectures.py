"""Which model-architecture plugin runs a checkpoint (the ``architecture`` seam's selection).

``architecture.name = "auto"``: the installed plugin that declares the checkpoint's Hugging Face
architecture (or GGUF ``general.architecture``); a third-party plugin goes before the built-in
one, so a package can replace how an architecture runs, and two third-party plugins claiming
the same architecture are an error naming both (pick one with ``architecture.name``). A named
plugin runs every checkpoint it is given. A registry without architecture plugins (one built by
``Registry.from_plugins`` from other seams' classes) uses the installed ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fd_core.errors import ModelLoadError, PluginError

if TYPE_CHECKING:
    from fd_core.contracts.architecture import ModelArchitecture
    from fd_core.registry import PluginRecord, Registry

log = logging.getLogger(__name__)

SEAM = "architecture"


@dataclass(slots=True)
class ArchitecturePlugins:
    """The plugins a load may use: ``named`` when the config names one, else the installed ones."""

    registry: Registry | None = None
    named: ModelArchitecture | None = None
    chosen: dict[tuple[str, str], ModelArchitecture] = field(default_factory=dict)   # (attribute, name) -> plugin

    def for_hf(self, architectures: list[str], source: str) -> ModelArchitecture:
        """The plugin for a ``config.json`` declaring ``architectures``."""
        if self.named is not None:
            return self.named
        declared = architectures[0] if architectures else "<none declared>"
        return self._claimant(declared, "hf_architectures", f"{source}: architecture {declared!r}")

    def for_gguf(self, architecture: str, source: str) -> ModelArchitecture:
        """The plugin for a GGUF file whose ``general.architecture`` is ``architecture``."""
        if self.named is not None:
            return self.named
        return self._claimant(architecture, "gguf_architectures", f"{source}: GGUF architecture {architecture!r}")

    def _claimant(self, architecture: str, attribute: str, what: str) -> ModelArchitecture:
        """The plugin for ``architecture`` (asked once per load: the GGUF reader and the loader share it)."""
        if (attribute, architecture) not in self.chosen:
            self.chosen[attribute, architecture] = self._claim(architecture, attribute, what)
        return self.chosen[attribute, architecture]

    def _claim(self, architecture: str, attribute: str, what: str) -> ModelArchitecture:
        from fd_core.registry import BUILTIN_DIST, Registry

        registry = self.registry
        if registry is None or not registry.records(SEAM):   # e.g. Registry.from_plugins without model plugins
            registry = self.registry = Registry.discover()
        loaded = _loaded_plugins(registry)
        claims = [(record, cls) for record, cls in loaded if architecture in getattr(cls, attribute)]
        if not claims:
            supported = sorted({name for _, cls in loaded for name in getattr(cls, attribute)})
            raise ModelLoadError(f"{what} is not supported; supported: {', '.join(supported) or 'none'} "
                                 "(a model-architecture plugin in the fd.models group adds more)")
        third_party = [(record, cls) for record, cls in claims if record.dist != BUILTIN_DIST]
        if len(third_party) > 1:
            names = ", ".join(record.label for record, _ in third_party)
            raise ModelLoadError(f"{what} is claimed by several plugins ({names}); choose one with architecture.name")
        record, cls = (third_party or claims)[0]
        if third_party and len(claims) > 1:
            log.info("%s runs with plugin %s, which replaces the built-in one", what, record.label)
        return cls(cls.settings_model.model_validate({}) if cls.settings_model else None)


def _loaded_plugins(registry: Registry) -> list[tuple[PluginRecord, type]]:
    """Every architecture plugin that loads (one that fails is listed by ``plugins list``)."""
    from fd_core.registry import DISABLED, SHADOWED

    plugins = []
    for record in registry.records(SEAM):
        if record.status in (SHADOWED, DISABLED):
            continue
        try:
            plugins.append((record, registry.load(SEAM, record.name)))
        except PluginError as exc:
            log.warning("%s", exc)
    return plugins
