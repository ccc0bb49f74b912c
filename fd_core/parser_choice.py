"""Which tool parser and reasoning parser read a model's replies: the two parser seams' selection.

``<seam>.name`` is one of:

* ``"none"`` — no parser: replies are not parsed for tool calls / all text is the answer;
* a plugin's name — that parser, with its ``[<seam>.options]`` (``fd_core.selection.resolve``
  loaded it and validated them at start-up);
* ``"auto"`` (the default) — the installed parser whose ``matches_template`` accepts the model's
  chat template; among several, the highest ``template_priority`` wins, and at the same priority a
  third-party parser goes before the built-in one (so a package can replace how a family is read);
  two third-party parsers tied are an error naming both (pick one with ``<seam>.name``). No chat
  template, or none that a parser recognises: no parser.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final

from fd_core.errors import ConfigError, PluginError

if TYPE_CHECKING:
    from fd_core.config import FdConfig
    from fd_core.contracts.reasoning_parser import ReasoningParser
    from fd_core.contracts.tool_parser import ToolParser
    from fd_core.registry import PluginRecord, Registry

log = logging.getLogger(__name__)

#: The seams selected here.
PARSER_SEAMS: Final = ("tool_parser", "reasoning_parser")
#: ``<seam>.name`` values that name no plugin.
AUTO: Final = "auto"
NONE: Final = "none"


def choose_parser(config: FdConfig, registry: Registry, seam: str,
                  chat_template: str | None) -> ToolParser | ReasoningParser | None:
    """The parser of ``seam`` (one of :data:`PARSER_SEAMS`) for a model with ``chat_template``, built
    with its settings; None when there is none. Raises ConfigError (``<seam>.name``) when ``auto``
    finds two third-party parsers equally fit, or a named one does not load. The server's front end
    calls it once the tokenizer is loaded (start-up already checked a named parser's options)."""
    assert seam in PARSER_SEAMS, seam
    section = config.seam_section(seam)
    if section.name == NONE:
        return None
    if section.name != AUTO:
        try:
            cls = registry.load(seam, section.name)
        except PluginError as exc:
            raise ConfigError(f"{seam}.name", str(exc)) from exc
        return cls(cls.settings_model.model_validate(section.options) if cls.settings_model else None)
    cls = parser_for_template(registry, seam, chat_template or "")
    if cls is None:
        return None
    return cls(cls.settings_model.model_validate({}) if cls.settings_model else None)


def parser_for_template(registry: Registry, seam: str, chat_template: str) -> type | None:
    """The class ``auto`` picks for ``chat_template`` among ``seam``'s installed parsers (module docstring)."""
    from fd_core.registry import BUILTIN_DIST

    fit = [(record, cls) for record, cls in _loaded(registry, seam) if cls.matches_template(chat_template)]
    if not chat_template or not fit:
        return None
    top = max(cls.template_priority for _, cls in fit)
    fit = [(record, cls) for record, cls in fit if cls.template_priority == top]
    third_party = [(record, cls) for record, cls in fit if record.dist != BUILTIN_DIST]
    if len(third_party) > 1:
        names = ", ".join(record.label for record, _ in third_party)
        raise ConfigError(f"{seam}.name", f"the chat template is claimed by several plugins ({names}); "
                                          f"choose one with {seam}.name")
    record, cls = (third_party or sorted(fit, key=lambda pair: pair[0].name))[0]
    log.info("%s %r reads this model's replies (chosen by its chat template)", seam.replace("_", " "), record.name)
    return cls


def _loaded(registry: Registry, seam: str) -> list[tuple[PluginRecord, type]]:
    """Every parser of ``seam`` that loads (one that fails is listed by ``fd-serve plugins list``)."""
    loaded = []
    for name in registry.names(seam):
        try:
            cls = registry.load(seam, name)
        except PluginError:
            continue   # lenient mode: a broken parser is skipped (strict mode stopped start-up already)
        record = next(r for r in registry.records(seam) if r.name == name and r.obj is cls)
        loaded.append((record, cls))
    return loaded
