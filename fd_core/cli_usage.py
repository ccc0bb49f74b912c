"""The ``fd-serve`` command line's vocabulary: its own flags, the ``--help`` texts, and hints.

Config keys are flags too (``--cache.block_size 32``); they are listed from the config models
(``fd_core.config_reference``), so help and hints never drift from the real keys. A flag that
is neither gets the closest known one as a hint (``--port`` -> ``--server.port``). The same
holds for ``fd-serve router``, whose keys are the ``[router]`` section's
(``fd_core.router.config``; ``--port`` -> ``--router.port``).
"""

from __future__ import annotations

import argparse
import difflib
import textwrap
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Final, NoReturn

from fd_core.seams import SEAMS

if TYPE_CHECKING:
    from fd_core.config_reference import KeyDoc

LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR")
USAGE: Final = """\
usage: fd-serve [--config FILE] [--check] [--strict] [--log-level LEVEL] [--SECTION.KEY VALUE ...]
       fd-serve plugins list [--config FILE] [--strict]
       fd-serve plugins check GROUP/NAME [--config FILE] [--skip CHECK ...] [--SECTION.KEY VALUE ...]
       fd-serve router [--config FILE] [--check] [--log-level LEVEL] [--router.KEY VALUE ...]
       fd-serve --version | --help"""
ROUTER_USAGE: Final = "usage: fd-serve router [--config FILE] [--check] [--log-level LEVEL] [--router.KEY VALUE ...]"
PLUGINS_CHECK_USAGE: Final = ("usage: fd-serve plugins check GROUP/NAME [--config FILE] [--skip CHECK ...] "
                              "[--log-level LEVEL] [--SECTION.KEY VALUE ...]")

#: fd-serve's own flags: (flag, metavar, help). Config keys are listed from the config models.
_OWN_FLAGS: Final = (
    ("--config", "FILE", "TOML config file (an annotated example: docs/deploy.toml)"),
    ("--check", "", "validate the config and the plugins it selects, print the resolved config, exit"),
    ("--strict", "", "any plugin that fails to load (or misnames a hook) stops start-up"),
    ("--log-level", "LEVEL", f"{', '.join(LOG_LEVELS)}; DEBUG shows plugin tracebacks (default: INFO)"),
    ("--version", "", "print the fd-engine version and exit"),
    ("-h, --help", "", "show this text and exit"),
)

#: fd-serve router's own flags: (flag, metavar, help). Its config keys come from the [router] section.
_ROUTER_FLAGS: Final = (
    ("--config", "FILE", "TOML config file with a [router] section"),
    ("--check", "", "validate the config, print the resolved config, exit"),
    ("--log-level", "LEVEL", f"{', '.join(LOG_LEVELS)} (default: INFO)"),
    ("-h, --help", "", "show this text and exit"),
)


#: fd-serve plugins check's own flags: (flag, metavar, help). Plugin options are config flags.
_PLUGINS_CHECK_FLAGS: Final = (
    ("--config", "FILE", "TOML config file; the checked seam's [<seam>.options] configure the plugin"),
    ("--skip", "CHECK", "do not run this check (repeatable, or comma-separated); listed as skipped"),
    ("--log-level", "LEVEL", f"{', '.join(LOG_LEVELS)} (default: WARNING)"),
    ("-h, --help", "", "show this text and exit"),
)


class UsageError(Exception):
    """A command line fd-serve cannot parse; the message is one line."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing its own usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def own_flags_parser() -> _Parser:
    """The parser of fd-serve's own flags; config flags are left over for :func:`check_config_flags`."""
    parser = _Parser(prog="fd-serve", add_help=False, allow_abbrev=False)
    parser.add_argument("--config")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--strict", action="store_true")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    parser.add_argument("--version", action="store_true")
    parser.add_argument("-h", "--help", action="store_true")
    return parser


def router_flags_parser() -> _Parser:
    """The parser of ``fd-serve router``'s own flags; ``--router.*`` flags are left over."""
    parser = _Parser(prog="fd-serve router", add_help=False, allow_abbrev=False)
    parser.add_argument("--config")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    parser.add_argument("-h", "--help", action="store_true")
    return parser


def plugins_check_parser() -> _Parser:
    """The parser of ``fd-serve plugins check``'s own flags; config flags (plugin options) are left over."""
    parser = _Parser(prog="fd-serve plugins check", add_help=False, allow_abbrev=False)
    parser.add_argument("name", nargs="?")
    parser.add_argument("--config")
    parser.add_argument("--skip", action="append", default=[])
    parser.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS)
    parser.add_argument("-h", "--help", action="store_true")
    return parser


def plugins_check_help_text() -> str:
    """``fd-serve plugins check --help``."""
    lines = [PLUGINS_CHECK_USAGE, "",
             "Run the conformance kit of an installed plugin's seam (fd_core.testing.conformance) and print",
             "one row per check. GROUP/NAME is an entry-point group or a seam, then the plugin's name:",
             "fd.schedulers/local or scheduler/local. The plugin is built with the seam's options from the",
             "config (e.g. --config deploy.toml, or --scheduler.options '{\"url\": \"redis://...\"}').",
             *textwrap.wrap("Seams: " + ", ".join(seam.name for seam in SEAMS) + ".", width=96),
             "Exit status: 0 when every check passed (or was skipped), 1 when one failed, 2 for a usage",
             "error. Reference: docs/conformance.md.", "", "options:"]
    lines += [f"  {(flag + ' ' + metavar).strip():<24}{text}" for flag, metavar, text in _PLUGINS_CHECK_FLAGS]
    return "\n".join(lines)


def help_text() -> str:
    """``fd-serve --help``: usage, fd-serve's flags, then every config key with its default."""
    from fd_core.config_reference import config_keys

    lines = [USAGE, "", "Serve an OpenAI-compatible HTTP API for one model (the default), validate a config",
             "(--check), list the installed plugins (plugins list), run a plugin's conformance kit (plugins",
             "check; fd-serve plugins check --help), or front several fd-serve instances (router; fd-serve",
             "router --help lists its keys).", "", "options:"]
    lines += [f"  {(flag + ' ' + metavar).strip():<24}{text}" for flag, metavar, text in _OWN_FLAGS]
    lines += ["", "config keys (CLI flag > FD_SECTION__KEY environment variable > --config file > default;",
              "reference: docs/config.md):"]
    lines += _key_lines(config_keys())
    return "\n".join(lines)


def router_help_text() -> str:
    """``fd-serve router --help``: usage, the router's flags, then every ``[router]`` key with its default."""
    from fd_core.router.config import router_keys

    lines = [ROUTER_USAGE, "",
             "An OpenAI-compatible front with no model of its own: forwards each request to the least",
             "loaded healthy fd-serve backend (role mixed or decode) and streams its answer back.",
             "", "options:"]
    lines += [f"  {(flag + ' ' + metavar).strip():<24}{text}" for flag, metavar, text in _ROUTER_FLAGS]
    lines += ["", "config keys (CLI flag > FD_ROUTER__KEY environment variable > [router] in --config file > default;",
              "reference: docs/router.md):"]
    lines += _key_lines(router_keys())
    return "\n".join(lines)


def _key_lines(keys: Iterable[KeyDoc]) -> list[str]:
    lines = []
    for item in keys:
        description = item.description.replace("`", "")
        lines.append(f"  {item.flag} {_metavar(item.type)}")
        lines.append(f"      {description}{' ' if description else ''}(default: {item.default})")
    return lines


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
    _check_flags(args, _known_flags(), suggest_flag, command="fd-serve")


def check_router_flags(args: list[str]) -> None:
    """Raise UsageError for the first argument that is no ``--router.KEY VALUE`` flag."""
    from fd_core.router.config import router_keys

    keys = list(router_keys())
    known = {_normal(flag): flag for entry in _ROUTER_FLAGS for flag in entry[0].split(", ")}
    known.update((_normal(item.flag), item.flag) for item in keys)

    def suggest(flag: str) -> str | None:
        bare = flag.lstrip("-").replace("-", "_")
        if bare == "router":
            return keys[0].flag
        owner = next((item.flag for item in keys if item.key == bare or f"server.{item.key}" == bare), None)
        if owner is not None:
            return owner
        close = difflib.get_close_matches(_normal(flag), list(known), n=1, cutoff=0.6)
        if close:
            return known[close[0]]
        by_key = difflib.get_close_matches(bare, [item.key for item in keys], n=1, cutoff=0.75)
        return next((item.flag for item in keys if by_key and item.key == by_key[0]), None)

    _check_flags(args, known, suggest, command="fd-serve router")


def _check_flags(args: list[str], known: dict[str, str], suggest: Callable[[str], str | None], *,
                 command: str) -> None:
    i = 0
    while i < len(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        if not arg.startswith("-"):
            hint = ""
            if command == "fd-serve" and arg.startswith("plugin"):
                hint = " (did you mean: fd-serve plugins list, or fd-serve plugins check GROUP/NAME?)"
            elif command == "fd-serve" and difflib.get_close_matches(arg, ["router"], n=1, cutoff=0.7):
                hint = " (did you mean: fd-serve router?)"
            raise UsageError(f"unexpected argument {arg!r}{hint}")
        if _normal(name) not in known or not name.startswith("--"):
            hint = suggest(name)
            raise UsageError(f"unknown flag {name}" + (f"; did you mean {hint}?" if hint else ""))
        if "=" not in arg:
            if i + 1 == len(args):
                raise UsageError(f"flag {name} needs a value")
            i += 1  # its value, whatever it looks like (-1 is a value)
        i += 1
