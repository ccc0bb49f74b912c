"""``fd-serve plugins check``, run as a user runs it: a built-in passes (exit 0), a broken plugin fails
naming the invariant (exit 1), usage mistakes exit 2 with the choices."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import run_fd_serve


def _check(*args: str, site=None, timeout: float = 120):
    env = {}
    if site is not None:   # the broken plugins are visible to this subprocess only
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH", "")]))
    return run_fd_serve("plugins", "check", *args, env=env, timeout=timeout)


def _row(stdout: str, check: str) -> tuple[str, str]:
    """(result, invariant and reason) of the row of ``check``."""
    [row] = [line.split(None, 2) for line in stdout.splitlines() if line.split()[:1] == [check]]
    return row[1], row[2]


def test_a_built_in_passes_every_check():
    result = _check("scheduler/local")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("fd.schedulers/local (fd_plugins.schedulers.local:LocalScheduler, fd-engine ")
    assert lines[1].split() == ["CHECK", "RESULT", "INVARIANT"]
    assert _row(result.stdout, "exactly_once") == ("passed", "handed out exactly once or answered")
    status, text = _row(result.stdout, "peer_directory")
    assert status == "skipped" and text.endswith(" — not a PeerDirectory")
    assert lines[-1].startswith("10 checks: 9 passed, 0 failed, 1 skipped") and lines[-1].endswith("; all passed")


@pytest.mark.parametrize("name", ["fd.token_processors/default", "resource_manager/v1", "platform/cpu",
                                  "tool_parser/hermes", "fd.reasoning_parsers/think", "guided_decoding/xgrammar",
                                  "fd.proposers/ngram"])
def test_other_built_ins_pass(name):
    result = _check(name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith("all passed")


@pytest.mark.parametrize(("name", "check", "words"), [
    ("scheduler/drops-requests", "exactly_once",
     "handed out exactly once or answered — request 'r7' was never handed out nor answered (seed 0)"),
    ("fd.resource_managers/leaks-blocks", "tiny_pool", "no block leaks or double frees — LeaksBlocks (seed 0, step"),
    ("token_processor/misses-split-stops", "stop_strings",
     "stop strings match across tokens; the text ends at the match — case \"stop string 'azy d'"),
    ("platform/raising-detector", "detect",
     "detect() never raises — RaisingDetector.detect() raised RuntimeError: the device probe exploded"),
    ("connector/drops-blocks", "block_buffers",
     "block buffers arrive byte-identical and stay valid until the next receive — block message 0 never arrived"),
    ("fd.guided_decoding/ignores-stop-ids", "stop_ids", "the mask allows the matcher's stop ids, and no other special "
                                                        "token, just where the output is complete — IgnoresStopIds: "),
    ("proposer/ignores-budgets", "budgets", "one list per request, at most its budget long — IgnoresBudgets proposed "
                                            "4 tokens for request 'r4' with a budget of 2"),
])
def test_a_broken_plugin_fails_naming_the_invariant(broken_plugins_site, name, check, words):
    skip = ["--skip", "handoff,handoff_abort"] if name.startswith("connector/") else []
    result = _check(name, *skip, site=broken_plugins_site)
    assert result.returncode == 1, result.stdout + result.stderr
    status, text = _row(result.stdout, check)
    assert status == "FAILED" and text.startswith(words), result.stdout
    assert "; FAILED: " in result.stdout.splitlines()[-1]
    assert "Traceback" not in result.stderr


def test_options_come_from_the_config_file_and_dotted_flags(redis_server, tmp_path):
    deploy = tmp_path / "deploy.toml"
    deploy.write_text(f'[scheduler.options]\nurl = "{redis_server.url}"\nheartbeat_s = 0.1\nlease_s = 1.0\n')
    result = _check("scheduler/splitwise", "--config", str(deploy))
    assert result.returncode == 0, result.stdout + result.stderr
    assert _row(result.stdout, "peer_directory")[0] == "passed"
    options = json.dumps({"url": redis_server.url, "heartbeat_s": 0.1, "socket_timeout_s": 0.4, "lease_s": 1.0})
    result = _check("scheduler/global", "--scheduler.options", options, "--skip", "ttl_expiry")
    assert result.returncode == 0, result.stdout + result.stderr
    assert _row(result.stdout, "order_hook")[0] == "passed"
    assert _row(result.stdout, "ttl_expiry") == (
        "skipped", "expired requests are answered, never handed out — skipped on request")


@pytest.mark.parametrize(("args", "words"), [
    ([], "plugins check needs the plugin to check: GROUP/NAME or SEAM/NAME"),
    (["scheduler/nope"], "plugin fd.schedulers/nope: no such scheduler; available: "),
    (["schedulers-local"], "cannot tell the plugin from 'schedulers-local'; name it as one of: scheduler/NAME "
                           "(fd.schedulers/NAME)"),
    (["scheduler/local", "--skip", "exactly_twice"], "--skip: no scheduler check named exactly_twice; the checks "
                                                     "are: exactly_once, "),
    (["scheduler/local", "--scheduler.options", '{"ttl_s": 0}'], "scheduler.options.ttl_s: Input should be "
                                                                  "greater than 0"),
    (["scheduler/local", "--bogus"], "unknown flag --bogus"),
])
def test_usage_mistakes_exit_2_with_one_line(args, words):
    result = _check(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("WARNING ")]
    assert len(lines) == 1 and lines[0].startswith("fd-serve: error: ") and words in lines[0], lines
    assert result.stdout == ""


def test_help():
    result = _check("--help")
    assert result.returncode == 0 and result.stdout.startswith("usage: fd-serve plugins check GROUP/NAME")
    assert "plugins check GROUP/NAME" in run_fd_serve("--help").stdout
