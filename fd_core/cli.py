"""The ``fd-serve`` command: serve, check a config, list plugins, or run the router.

Every mistake a user can make on the command line (an unknown flag, a bad value, a config that
cannot run) ends in one ``fd-serve: error: ...`` line per problem on stderr and exit code 2,
never a traceback; unknown flags get the closest known flag as a hint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from typing import TYPE_CHECKING

from fd_core.cli_usage import (
    USAGE_EXIT,
    UsageError,
    check_config_flags,
    check_router_flags,
    help_text,
    own_flags_parser,
    router_flags_parser,
    router_help_text,
)
from fd_core.errors import FdError

if TYPE_CHECKING:
    from fd_core.config import FdConfig
    from fd_core.registry import Registry
    from fd_core.router.config import RouterConfig

def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fd-serve``; returns the process exit code."""
    try:
        return _run(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:  # ``fd-serve --help | head``: the reader left; that is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _run(argv: list[str]) -> int:
    if argv[:1] == ["router"]:
        return _router(argv[1:])
    command = "serve"
    if argv[:2] == ["plugins", "list"]:
        command, argv = "plugins-list", argv[2:]
    try:
        args, rest = own_flags_parser().parse_known_args(argv)
        if args.help:
            print(help_text())
            return 0
        if args.version:
            print(f"fd-serve (fd-engine) {_version()}")
            return 0
        check_config_flags(rest)
    except UsageError as exc:
        print(f"fd-serve: error: {exc} (see fd-serve --help)", file=sys.stderr)
        return USAGE_EXIT
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = _load(args, rest)
        if command == "plugins-list":
            return _plugins_list(config)
        if args.check:
            return _check(config)
        return _serve(config)
    except FdError as exc:
        for line in str(exc).splitlines():
            print(f"fd-serve: error: {line}", file=sys.stderr)
        return USAGE_EXIT


def _router(argv: list[str]) -> int:
    """``fd-serve router ...``: validate the router's config, then forward requests until stopped."""
    try:
        args, rest = router_flags_parser().parse_known_args(argv)
        if args.help:
            print(router_help_text())
            return 0
        check_router_flags(rest)
    except UsageError as exc:
        print(f"fd-serve: error: {exc} (see fd-serve router --help)", file=sys.stderr)
        return USAGE_EXIT
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = _load_router(args, rest)
    except FdError as exc:
        for line in str(exc).splitlines():
            print(f"fd-serve: error: {line}", file=sys.stderr)
        return USAGE_EXIT
    if args.check:
        print(json.dumps(config.model_dump(mode="json"), indent=2))
        print("config OK", file=sys.stderr)
        return 0
    from fd_core.router.main import serve_router

    return serve_router(config)


def _load_router(args: argparse.Namespace, rest: list[str]) -> RouterConfig:
    from fd_core.router.config import load_router_config

    return load_router_config(args.config, cli_args=rest)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fd-engine")
    except PackageNotFoundError:
        return "unknown (not installed; run pip install -e .)"


def _load(args: argparse.Namespace, rest: list[str]) -> FdConfig:
    from fd_core.config import load_config

    config = load_config(args.config, cli_args=rest)
    if args.strict:
        config.plugins.strict = True
    return config


def _check(config: FdConfig) -> int:
    from fd_core.selection import resolve

    selection = resolve(config)
    resolved = config.public_dict()
    resolved["cache"]["enable_prefix_caching"] = selection.enable_prefix_caching
    resolved["selected"] = selection.summary()
    resolved["selected"]["platform_reason"] = selection.platform_reason
    for seam, plugin in selection.plugins.items():
        if plugin.settings is not None:
            resolved[seam]["options"] = plugin.settings.model_dump(mode="json")
    print(json.dumps(resolved, indent=2))
    print("config OK", file=sys.stderr)
    return 0


def _plugins_list(config: FdConfig) -> int:
    from fd_core.registry import Registry
    from fd_core.paddle_import import import_paddle

    with contextlib.suppress(ImportError):  # without Paddle, the platforms' detect() says so
        import_paddle()  # the platforms' detect() imports it: do it once, without its noise
    logging.getLogger("fd_core.registry").setLevel(logging.ERROR)  # the table shows failures
    registry = Registry.discover(disabled=config.plugins.disabled)
    failures = registry.load_all()
    print(format_plugin_table(registry, detections=detect_platforms(registry)))
    if failures and config.plugins.strict:
        names = ", ".join(record.label for record in failures)
        print(f"fd-serve: error: strict mode: plugins failed to load: {names}", file=sys.stderr)
        return 1
    return 0


def detect_platforms(registry: Registry) -> dict[str, str]:
    """Platform name -> ``available: <reason>`` or ``unavailable: <reason>``, for each loaded platform."""
    from fd_core.registry import LOADED

    found = {}
    for record in registry.records("platform"):
        if record.status == LOADED:
            result = record.obj.detect()
            found[record.name] = f"{'available' if result.available else 'unavailable'}: {result.reason}"
    return found


def format_plugin_table(registry: Registry, *, detections: dict[str, str] | None = None) -> str:
    """The ``plugins list`` table: one row per plugin, grouped by seam; platforms show ``detections``."""
    rows = [("GROUP", "NAME", "DISTRIBUTION", "VERSION", "STATUS")]
    for record in registry.records():
        status = record.status if record.reason is None else f"{record.status}: {record.reason}"
        if record.seam == "platform" and detections and record.name in detections:
            status = f"{status} — {detections[record.name]}"
        rows.append((record.group, record.name, record.dist, record.version, status))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4]
        for row in rows)


def _serve(config: FdConfig) -> int:
    from fd_core.selection import resolve
    from fd_core.server.main import serve

    resolve(config)  # every config problem stops start-up here, before the engine is spawned
    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
