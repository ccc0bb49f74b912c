"""The ``fd-serve`` command: serve, check a config, or list plugins.

Every mistake a user can make on the command line (an unknown flag, a bad value, a config that
cannot run) ends in one ``fd-serve: error: ...`` line per problem on stderr and exit code 2,
never a traceback; unknown flags get the closest known flag as a hint.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import logging
import sys
from typing import TYPE_CHECKING, Final, NoReturn

from fd_core.errors import FdError

if TYPE_CHECKING:
    from fd_core.config import FdConfig
    from fd_core.registry import Registry

#: Exit code of every user mistake (the argparse convention).
USAGE_EXIT: Final = 2
LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR")
USAGE: Final = """\
usage: fd-serve [--config FILE] [--check] [--strict] [--log-level LEVEL] [--SECTION.KEY VALUE ...]
       fd-serve plugins list [--config FILE] [--strict]
       fd-serve --version | --help"""

#: fd-serve's own flags: (flag, metavar, help). Config keys are listed from the config models.
_OWN_FLAGS: Final = (
    ("--config", "FILE", "TOML config file (an annotated example: docs/deploy.toml)"),
    ("--check", "", "validate the config and the plugins it selects, print the resolved config, exit"),
    ("--strict", "", "any plugin that fails to load (or misnames a hook) stops start-up"),
    ("--log-level", "LEVEL", f"{', '.join(LOG_LEVELS)}; DEBUG shows plugin tracebacks (default: INFO)"),
    ("--version", "", "print the fd-engine version and exit"),
    ("-h, --help", "", "show this text and exit"),
)


class UsageError(Exception):
    """A command line fd-serve cannot parse; the message is one line."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing its own usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _parser() -> _Parser:
    parser = _Parser(prog="fd-serve", add_help=False, allow_abbrev=False)
    parser.add_argument("--config")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--strict", action="store_true")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    parser.add_argument("--version", action="store_true")
    parser.add_argument("-h", "--help", action="store_true")
    return parser


def help_text() -> str:
    """``fd-serve --help``: usage, fd-serve's flags, then every config key with its default."""
    from fd_core.config_reference import config_keys

    lines = [USAGE, "", "Serve an OpenAI-compatible HTTP API for one model (the default), validate a config",
             "(--check), or list the installed plugins (plugins list).", "", "options:"]
    lines += [f"  {(flag + ' ' + metavar).strip():<24}{text}" for flag, metavar, text in _OWN_FLAGS]
    lines += ["", "config keys (CLI flag > FD_SECTION__KEY environment variable > --config file > default;",
              "reference: docs/config.md):"]
    for item in config_keys():
        description = item.description.replace("`", "")
        lines.append(f"  {item.flag} {_metavar(item.type)}")
        lines.append(f"      {description}{' ' if description else ''}(default: {item.default})")
    return "\n".join(lines)


def _metavar(type_text: str) -> str:
    """``Literal['a', 'b'] | None`` -> ``{a,b}``; ``int | None`` -> ``INT``; ``dict[...]`` -> ``JSON``."""
    text = type_text.removesuffix(" | None")
    if text.startswith("Literal["):
        return "{" + ",".join(part.strip(" '") for part in text[8:-1].split(",")) + "}"
    if text.startswith(("dict", "list")):
        return "JSON"
    return "SECRET" if text == "pydantic.types.SecretStr" else text.upper()


def _known_flags() -> dict[str, str]:
    """Every accepted flag, keyed by its spelling with ``_`` for ``-`` (after the leading dashes)."""
    from fd_core.config_reference import config_keys

    flags = [flag for entry in _OWN_FLAGS for flag in entry[0].split(", ")]
    flags += [item.flag for item in config_keys()]
    return {_normal(flag): flag for flag in flags}


def _normal(flag: str) -> str:
    return "--" + flag.lstrip("-").replace("-", "_")


def suggest_flag(flag: str) -> str | None:
    """The flag a user most likely meant by the unknown ``flag``, or None.

    A section name points at its first key (``--model`` -> ``--model.source``); a key without
    its section at the sections holding it (``--port`` -> ``--server.port``); anything else at
    the closest spelling (``--chek`` -> ``--check``).
    """
    from fd_core.config_reference import config_keys

    bare = flag.lstrip("-").replace("-", "_")
    keys = list(config_keys())
    section_keys = [item.flag for item in keys if item.section == bare]
    if section_keys:
        return section_keys[0]
    owners = [item.flag for item in keys if item.key == bare]
    if owners:
        return " or ".join(owners)
    known = _known_flags()
    close = difflib.get_close_matches(_normal(flag), list(known), n=1, cutoff=0.6)
    if close:
        return known[close[0]]
    by_key = difflib.get_close_matches(bare, [item.key for item in keys], n=1, cutoff=0.75)
    return next((item.flag for item in keys if by_key and item.key == by_key[0]), None)


def check_config_flags(args: list[str]) -> None:
    """Raise UsageError for the first argument that is no config flag (``--section.key VALUE``)."""
    known = _known_flags()
    i = 0
    while i < len(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        if not arg.startswith("-"):
            hint = " (did you mean: fd-serve plugins list?)" if arg.startswith("plugin") else ""
            raise UsageError(f"unexpected argument {arg!r}{hint}")
        if _normal(name) not in known or not name.startswith("--"):
            hint = suggest_flag(name)
            raise UsageError(f"unknown flag {name}" + (f"; did you mean {hint}?" if hint else ""))
        if "=" not in arg:
            if i + 1 == len(args):
                raise UsageError(f"flag {name} needs a value")
            i += 1  # its value, whatever it looks like (-1 is a value)
        i += 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fd-serve``; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = "serve"
    if argv[:2] == ["plugins", "list"]:
        command, argv = "plugins-list", argv[2:]
    try:
        args, rest = _parser().parse_known_args(argv)
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
