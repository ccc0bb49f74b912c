"""Run the kit of a loaded plugin's seam with its config options: what ``fd-serve plugins check`` calls."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Final

from fd_core.testing.conformance._report import SeamReport

__all__ = ["check_names", "run_plugin_checks"]

#: The resource manager kit's rows (see run_resource_manager_checks).
_RESOURCE_MANAGER_ROWS: Final = ("tiny_pool", "no_prefix_caching", "strict_budget")


def check_names(seam: str) -> list[str]:
    """The names of the checks of ``seam``'s kit, in the order they run (what ``--skip`` takes)."""
    from fd_core.testing.conformance.connector import CONNECTOR_CHECKS
    from fd_core.testing.conformance.platform import PLATFORM_CHECKS
    from fd_core.testing.conformance.scheduler import SCHEDULER_CHECKS
    from fd_core.testing.conformance.token_processor import TOKEN_PROCESSOR_CHECKS

    checks = {"scheduler": SCHEDULER_CHECKS, "token_processor": TOKEN_PROCESSOR_CHECKS,
              "platform": PLATFORM_CHECKS, "connector": CONNECTOR_CHECKS}
    if seam == "resource_manager":
        return list(_RESOURCE_MANAGER_ROWS)
    return [check.name for check in checks[seam]]


def run_plugin_checks(seam: str, cls: type, options: Mapping[str, Any] | None = None, *,
                      skip: Collection[str] = (), plugin: str | None = None) -> SeamReport:
    """Every check of ``seam``'s kit against plugin class ``cls`` built with ``options``; never raises
    for a broken invariant. Bad options raise pydantic's ValidationError (or ValueError)."""
    from fd_core.testing.conformance import (
        connector,
        platform,
        resource_manager,
        scheduler,
        token_processor,
    )
    from fd_core.testing.conformance._factories import plugin_settings

    if seam == "scheduler":
        report = scheduler.run_scheduler_checks(cls, options=options, skip=skip)
    elif seam == "resource_manager":
        from fd_core.registry import Registry

        settings = plugin_settings(cls, options)
        hooks = Registry.from_plugins({}).hooks
        report = resource_manager.run_resource_manager_checks(
            lambda limits: cls(settings, limits=limits, hooks=hooks),
            supports_prefix_caching=cls.supports_prefix_caching, skip=skip, plugin=cls.__name__)
    elif seam == "token_processor":
        report = token_processor.run_token_processor_checks(cls, options=options, skip=skip)
    elif seam == "platform":
        report = platform.run_platform_checks(cls, options=options, skip=skip)
    elif seam == "connector":
        report = connector.run_connector_checks(cls, options=options, skip=skip)
    else:
        raise ValueError(f"no conformance kit for seam {seam!r}")
    return SeamReport(report.seam, plugin or report.plugin, report.results)
