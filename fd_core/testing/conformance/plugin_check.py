"""Run the kit of a loaded plugin's seam with its config options: what ``fd-serve plugins check`` calls."""

from __future__ import annotations

import importlib
from collections.abc import Collection, Mapping
from typing import Any, Final

from fd_core.testing.conformance._report import SeamReport

__all__ = ["check_names", "run_plugin_checks"]

#: The resource manager kit's rows (see run_resource_manager_checks).
_RESOURCE_MANAGER_ROWS: Final = ("tiny_pool", "no_prefix_caching", "strict_budget", "prompt_logprobs")


def check_names(seam: str) -> list[str]:
    """The names of the checks of ``seam``'s kit, in the order they run (what ``--skip`` takes)."""
    if seam == "resource_manager":
        return list(_RESOURCE_MANAGER_ROWS)
    kit = importlib.import_module(f"fd_core.testing.conformance.{seam}")   # one kit module per seam, named for it
    return [check.name for check in getattr(kit, f"{seam.upper()}_CHECKS")]


def run_plugin_checks(seam: str, cls: type, options: Mapping[str, Any] | None = None, *,
                      skip: Collection[str] = (), plugin: str | None = None) -> SeamReport:
    """Every check of ``seam``'s kit against plugin class ``cls`` built with ``options``; never raises
    for a broken invariant. Bad options raise pydantic's ValidationError (or ValueError)."""
    from fd_core.seams import BY_NAME
    from fd_core.testing.conformance._factories import plugin_settings

    if seam not in BY_NAME:
        raise ValueError(f"no conformance kit for seam {seam!r}")
    kit = importlib.import_module(f"fd_core.testing.conformance.{seam}")
    run = getattr(kit, f"run_{seam}_checks")
    if seam == "resource_manager":   # its kit takes a factory of managers over given limits
        from fd_core.registry import Registry

        settings = plugin_settings(cls, options)
        hooks = Registry.from_plugins({}).hooks
        report = run(lambda limits: cls(settings, limits=limits, hooks=hooks),
                     supports_prefix_caching=cls.supports_prefix_caching, skip=skip, plugin=cls.__name__)
    else:
        report = run(cls, options=options, skip=skip)
    return SeamReport(report.seam, plugin or report.plugin, report.results)
