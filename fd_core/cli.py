"""The ``fd-serve`` command: serve, check a config, list or check plugins, or run the router.

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
    UsageError,
    check_config_flags,
    check_router_flags,
    help_text,
    own_flags_parser,
    plugins_check_help_text,
    plugins_check_parser,
    router_flags_parser,
    router_help_text,
)
from fd_core.errors import FdError
from fd_core.exit_codes import ExitCode

if TYPE_CHECKING:
    from fd_core.config import FdConfig
    from fd_core.registry import PluginRecord, Registry
    from fd_core.router.config import RouterConfig
    from fd_core.testing.conformance import SeamReport


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fd-serve``; returns the process exit code."""
    try:
        return _run(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:  # ``fd-serve --help | head``: the reader left; that is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.OK


def _run(argv: list[str]) -> int:
    if argv[:1] == ["router"]:
        return _router(argv[1:])
    if argv[:2] == ["plugins", "check"]:
        return _plugins_check(argv[2:])
    command = "serve"
    if argv[:2] == ["plugins", "list"]:
        command, argv = "plugins-list", argv[2:]
    try:
        args, rest = own_flags_parser().parse_known_args(argv)
        if args.help:
            print(help_text())
            return ExitCode.OK
        if args.version:
            print(f"fd-serve (fd-engine) {_version()}")
            return ExitCode.OK
        check_config_flags(rest)
    except UsageError as exc:
        print(f"fd-serve: error: {exc} (see fd-serve --help)", file=sys.stderr)
        return ExitCode.USAGE
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
        return ExitCode.USAGE


def _router(argv: list[str]) -> int:
    """``fd-serve router ...``: validate the router's config, then forward requests until stopped."""
    try:
        args, rest = router_flags_parser().parse_known_args(argv)
        if args.help:
            print(router_help_text())
            return ExitCode.OK
        check_router_flags(rest)
    except UsageError as exc:
        print(f"fd-serve: error: {exc} (see fd-serve router --help)", file=sys.stderr)
        return ExitCode.USAGE
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = _load_router(args, rest)
    except FdError as exc:
        for line in str(exc).splitlines():
            print(f"fd-serve: error: {line}", file=sys.stderr)
        return ExitCode.USAGE
    if args.check:
        print(json.dumps(config.model_dump(mode="json"), indent=2))
        print("config OK", file=sys.stderr)
        return ExitCode.OK
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
    from fd_core.precision import mode_of
    from fd_core.selection import resolve

    selection = resolve(config)
    resolved = config.public_dict()
    resolved["cache"]["enable_prefix_caching"] = selection.enable_prefix_caching
    resolved["model"]["precision"] = mode_of(config.model)
    resolved["selected"] = selection.summary()
    resolved["selected"]["platform_reason"] = selection.platform_reason
    for seam, plugin in selection.plugins.items():
        if plugin.settings is not None:
            resolved[seam]["options"] = plugin.settings.model_dump(mode="json")
    print(json.dumps(resolved, indent=2))
    print("config OK", file=sys.stderr)
    return ExitCode.OK


def _plugins_list(config: FdConfig) -> int:
    from fd_core.paddle_import import import_paddle
    from fd_core.registry import Registry

    with contextlib.suppress(ImportError):  # without Paddle, the platforms' detect() says so
        import_paddle()  # the platforms' detect() imports it: do it once, without its noise
    logging.getLogger("fd_core.registry").setLevel(logging.ERROR)  # the table shows failures
    registry = Registry.discover(disabled=config.plugins.disabled, hooks=config.plugins.hooks)
    failures = registry.load_all()
    print(format_plugin_table(registry, detections=detect_platforms(registry)))
    if failures and config.plugins.strict:
        names = ", ".join(record.label for record in failures)
        print(f"fd-serve: error: strict mode: plugins failed to load: {names}", file=sys.stderr)
        return ExitCode.FAILED
    return ExitCode.OK


def _plugins_check(argv: list[str]) -> int:
    """``fd-serve plugins check GROUP/NAME``: run the plugin's seam kit, print a row per check.

    Exit status 0 when no check failed, 1 when one did (or the plugin does not load), 2 for a
    usage error: a bad command line, an unknown seam or plugin (the choices are listed), options
    the plugin's settings model refuses.
    """
    try:
        args, rest = plugins_check_parser().parse_known_args(argv)
        if args.help:
            print(plugins_check_help_text())
            return ExitCode.OK
        if args.name is None:
            raise UsageError("plugins check needs the plugin to check: GROUP/NAME or SEAM/NAME, "
                             "e.g. fd.schedulers/local or scheduler/local")
        check_config_flags(rest)
        seam, name = parse_plugin_name(args.name)
        skip = [part for item in args.skip for part in item.split(",") if part]
    except UsageError as exc:
        print(f"fd-serve: error: {exc} (see fd-serve plugins check --help)", file=sys.stderr)
        return ExitCode.USAGE
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    from fd_core.errors import PluginLoadError, PluginVersionError

    try:
        config = _load(argparse.Namespace(config=args.config, strict=False), rest)
        record, cls = _load_plugin(config, seam, name)
        options = config.seam_section(seam).options
        report = _run_kit(seam, cls, options, skip, record)
    except (PluginLoadError, PluginVersionError) as exc:
        print(f"fd-serve: error: {exc}", file=sys.stderr)
        return ExitCode.FAILED
    except (FdError, UsageError) as exc:
        for line in str(exc).splitlines():
            print(f"fd-serve: error: {line}", file=sys.stderr)
        return ExitCode.USAGE
    print(format_check_table(report, title=record.label))
    return ExitCode.OK if report.ok else ExitCode.FAILED


def parse_plugin_name(text: str) -> tuple[str, str]:
    """``fd.schedulers/local`` or ``scheduler/local`` (``resource-manager/v1`` too) -> (seam, name)."""
    from fd_core.registry import SEAM_GROUPS

    prefix, slash, name = text.partition("/")
    by_group = {group: seam for seam, group in SEAM_GROUPS.items()}
    seam = by_group.get(prefix) or prefix.replace("-", "_")
    if not slash or not name or seam not in SEAM_GROUPS:
        choices = ", ".join(f"{seam}/NAME ({group}/NAME)" for seam, group in SEAM_GROUPS.items())
        raise UsageError(f"cannot tell the plugin from {text!r}; name it as one of: {choices}")
    return seam, name


def _load_plugin(config: FdConfig, seam: str, name: str) -> tuple[PluginRecord, type]:
    """The winning record of ``seam``/``name`` and its loaded class; a name nobody registers is a
    usage error listing the choices (PluginNotFoundError is an FdError)."""
    from fd_core.registry import Registry

    if seam == "platform":
        from fd_core.paddle_import import import_paddle

        with contextlib.suppress(ImportError):  # the platforms' detect() imports it: once, without its noise
            import_paddle()
    registry = Registry.discover(disabled=config.plugins.disabled, hooks=config.plugins.hooks)
    cls = registry.load(seam, name)
    record = next(r for r in registry.records(seam) if r.name == name and r.obj is cls)
    return record, cls


def _run_kit(seam: str, cls: type, options: dict[str, object], skip: list[str],
             record: PluginRecord) -> SeamReport:
    from pydantic import ValidationError

    from fd_core.config import config_error_from
    from fd_core.errors import ConfigError
    from fd_core.testing.conformance import check_names, run_plugin_checks

    unknown = sorted(set(skip) - set(check_names(seam)))
    if unknown:
        raise UsageError(f"--skip: no {seam.replace('_', ' ')} check named {', '.join(unknown)}; "
                         f"the checks are: {', '.join(check_names(seam))}")
    try:
        return run_plugin_checks(seam, cls, options, skip=skip, plugin=record.label)
    except ValidationError as exc:
        raise config_error_from(exc, prefix=f"{seam}.options") from exc
    except ValueError as exc:   # options given to a plugin that takes none
        raise ConfigError(f"{seam}.options", str(exc)) from exc


def format_check_table(report: SeamReport, *, title: str) -> str:
    """The ``plugins check`` table: a row per check (name, result, invariant; why, when it did not
    pass), then a summary line."""
    rows = [("CHECK", "RESULT", "INVARIANT")]
    for result in report.results:
        invariant = result.invariant
        if result.status != "passed":
            invariant = f"{invariant} — {result.detail or result.reason}"
        rows.append((result.check, result.status.upper() if result.status == "failed" else result.status,
                     invariant))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = [f"{title}: {report.seam.replace('_', ' ')} conformance kit"]
    lines += ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:2])) + "  " + row[2] for row in rows]
    counts = {status: sum(r.status == status for r in report.results) for status in ("passed", "failed", "skipped")}
    seconds = sum(r.seconds for r in report.results)
    summary = f"{len(report.results)} checks: {counts['passed']} passed, {counts['failed']} failed, " \
              f"{counts['skipped']} skipped ({seconds:.1f} s)"
    failed = [r.check for r in report.failures]
    lines.append(summary + (f"; FAILED: {', '.join(failed)}" if failed else "; all passed"))
    return "\n".join(lines)


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
