"""The seams, described once: every table of seams in fd-engine is derived from :data:`SEAMS`.

The registry's entry-point groups and contract classes, the registration hooks, hook tracing,
``fd-serve plugins check``, the config's seam sections and the compatibility policy read it;
tests check that pyproject.toml's entry-point groups and the README's plugin table agree with it.
Importing this module imports nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True, slots=True)
class Seam:
    """One seam: its name (the config section, e.g. ``scheduler``) and what derives from it."""

    name: str     # config section and registry key: "scheduler"
    title: str    # how docs name it: "request scheduler"
    plural: str   # "schedulers": names the entry-point group and the registration hook
    contract: str  # the contract class in fd_core.contracts.<name>

    @property
    def group(self) -> str:
        """The entry-point group of its plugins: ``fd.schedulers``."""
        return f"fd.{self.plural}"

    @property
    def registration_hook(self) -> str:
        """The hook a general plugin contributes classes of this seam with: ``fd_register_schedulers``."""
        return f"fd_register_{self.plural}"

    @property
    def contract_path(self) -> str:
        """``fd_core.contracts.scheduler:Scheduler``."""
        return f"fd_core.contracts.{self.name}:{self.contract}"


SEAMS: Final = (
    Seam("scheduler", "request scheduler", "schedulers", "Scheduler"),
    Seam("resource_manager", "KV resource manager", "resource_managers", "ResourceManager"),
    Seam("token_processor", "token processor", "token_processors", "TokenProcessor"),
    Seam("connector", "splitwise connector", "connectors", "Connector"),
    Seam("platform", "platform", "platforms", "Platform"),
    Seam("architecture", "model architecture", "models", "ModelArchitecture"),
    Seam("guided_decoding", "guided decoding backend", "guided_decoding", "GuidedDecodingBackend"),
    Seam("tool_parser", "tool parser", "tool_parsers", "ToolParser"),
    Seam("reasoning_parser", "reasoning parser", "reasoning_parsers", "ReasoningParser"),
    Seam("proposer", "speculative proposer", "proposers", "Proposer"),
)
#: Seam name -> its descriptor.
BY_NAME: Final = {seam.name: seam for seam in SEAMS}
#: The entry-point group of general plugins (hook implementations; no seam).
GENERAL_GROUP: Final = "fd.plugins"
