"""What every seam plugin class declares: its name, hookspec version and settings model."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from pydantic import BaseModel


class SeamPlugin:
    """Class attributes the registry and the config read before instantiating a plugin.

    ``fd_hookspec_version`` is deliberately not given a default: each plugin states the
    version it was written for, so that a core upgrade refuses stale plugins by name.
    """

    #: The entry-point name a config selects it by.
    name: ClassVar[str]
    #: Hookspec major version the plugin was written against (see fd_core.hookspecs).
    fd_hookspec_version: ClassVar[int]
    #: Pydantic model of the plugin's ``<seam>.options``; ``None``: it takes no options.
    settings_model: ClassVar[type[BaseModel] | None] = None


class TemplateParser(SeamPlugin):
    """What the tool and reasoning parser contracts share: the family's literal tags, and how a
    model's chat template selects the parser under ``name = "auto"`` (``fd_core.parser_choice``)."""

    #: The family's literal tags and separators: what markup may hold besides whitespace.
    markers: ClassVar[tuple[str, ...]] = ()
    #: When several installed parsers accept a chat template, the highest wins (a family whose
    #: template also matches a more general parser sets it above 0).
    template_priority: ClassVar[int] = 0

    def __init__(self, settings: BaseModel | None = None) -> None:
        self.settings = settings

    @classmethod
    def matches_template(cls, template: str) -> bool:
        """Whether a model with this chat template writes its replies in this parser's format."""
        return False
