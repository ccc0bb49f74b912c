"""The ``fd-serve`` command: serve, check a config, or list plugins.

    fd-serve [--config deploy.toml] [--strict] [--check] [--<section>.<key> VALUE ...]
    fd-serve plugins list [--config deploy.toml] [--strict]

Dotted flags (``--cache.block_size 32``) beat ``FD_*`` environment variables, which beat the
TOML file, which beats the defaults.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TYPE_CHECKING

from fd_core.errors import FdError

if TYPE_CHECKING:
    from fd_core.config import FdConfig
    from fd_core.registry import Registry


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fd-serve", description=__doc__.split("\n\n")[0],
                                     add_help=False)
    parser.add_argument("--config", help="TOML config file (see docs/deploy.toml)")
    parser.add_argument("--check", action="store_true", help="validate, print the resolved config, exit")
    parser.add_argument("--strict", action="store_true", help="any plugin that fails to load is fatal")
    parser.add_argument("--log-level", default="INFO", help="DEBUG shows plugin tracebacks")
    parser.add_argument("-h", "--help", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fd-serve``; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = "serve"
    if argv[:2] == ["plugins", "list"]:
        command, argv = "plugins-list", argv[2:]
    args, rest = _parser().parse_known_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.help:
        _parser().print_help()
        print("\n  plugins list          show every discovered plugin and its status\n"
              "  --<section>.<key> V   any config key, e.g. --cache.block_size 32")
        return 0
    try:
        config = _load(args, rest)
        if command == "plugins-list":
            return _plugins_list(config)
        if args.check:
            return _check(config)
        return _serve(config)
    except FdError as exc:
        print(f"fd-serve: error: {exc}", file=sys.stderr)
        return 2


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
    from fd_core.server.main import serve

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
