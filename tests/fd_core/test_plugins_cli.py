"""fd-serve plugins list / --check against real pip-installed third-party plugin packages."""

from __future__ import annotations

import json

import pytest

from fd_core.compat import oldest_loadable
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from tests.conftest import run_fd_serve

pytestmark = pytest.mark.usefixtures("demo_plugins")

DEMO_DEPLOY = """
[scheduler]
name = "demo"
[scheduler.options]
greeting = "hi there"
ttl_s = 30

[platform]
name = "demo"
[platform.options]
lanes = 4
"""


def _row(table: str, group: str, name: str, dist: str) -> str:
    rows = [line for line in table.splitlines()
            if line.split()[:3] == [group, name, dist]]
    assert len(rows) == 1, f"{group}/{name} from {dist} not listed once:\n{table}"
    return rows[0]


def test_plugins_list_shows_third_party_plugins_with_distribution_and_version():
    result = run_fd_serve("plugins", "list")
    assert result.returncode == 0, result.stderr
    assert "loaded" in _row(result.stdout, "fd.schedulers", "demo", "fd-demo-plugin")
    assert " 1.2.3 " in _row(result.stdout, "fd.platforms", "demo", "fd-demo-plugin")
    assert "loaded" in _row(result.stdout, "fd.plugins", "priority-order", "fd-demo-plugin")
    assert "loaded" in _row(result.stdout, "fd.schedulers", "local", "fd-engine")


def test_platforms_show_their_detection_reason():
    table = run_fd_serve("plugins", "list").stdout
    cpu = _row(table, "fd.platforms", "cpu", "fd-engine")
    assert "loaded — available: host CPU " in cpu and "usable cores" in cpu
    assert "loaded — unavailable: paddle was built without CUDA" in _row(table, "fd.platforms", "cuda", "fd-engine")
    demo = _row(table, "fd.platforms", "demo", "fd-demo-plugin")   # written for hookspec version 2: deprecated
    assert "loaded: deprecated: was written for hookspec version 2" in demo
    assert demo.endswith("— unavailable: FD_DEMO_DEVICE is not 1")


def test_broken_plugin_is_listed_as_failed_with_its_error():
    result = run_fd_serve("plugins", "list")
    row = _row(result.stdout, "fd.schedulers", "broken", "fd-other-plugins")
    assert "failed: ImportError: fd_other_plugins needs the package 'frobnicate'" in row


def test_name_clash_is_shadowed_with_a_deterministic_winner():
    table = run_fd_serve("plugins", "list").stdout
    # the built-in distribution always wins its own names
    assert "shadowed by fd.schedulers/local (fd_plugins.schedulers.local:LocalScheduler, fd-engine" in \
        _row(table, "fd.schedulers", "local", "fd-other-plugins")
    # between third parties the first distribution name wins (fd-demo-plugin < fd-other-plugins)
    assert "shadowed by fd.schedulers/demo (fd_demo_plugin.scheduler:LifoScheduler, fd-demo-plugin 1.2.3)" in \
        _row(table, "fd.schedulers", "demo", "fd-other-plugins")


def test_hookspec_version_mismatch_is_refused_naming_the_plugin(tmp_path):
    table = run_fd_serve("plugins", "list").stdout
    oldest = oldest_loadable("scheduler")
    assert (f"failed: was written for hookspec version 0; this core speaks versions {oldest} to "
            f"{FD_HOOKSPEC_VERSION} for scheduler plugins") in \
        _row(table, "fd.schedulers", "old", "fd-other-plugins")
    deploy = tmp_path / "deploy.toml"
    deploy.write_text('[scheduler]\nname = "old"\n')
    result = run_fd_serve("--config", str(deploy), "--check")
    assert result.returncode != 0
    assert "fd.schedulers/old (fd_other_plugins.old:OldScheduler, fd-other-plugins 0.0.1)" in result.stderr
    assert "hookspec version 0" in result.stderr


def test_deploy_toml_selects_third_party_plugins_and_validates_their_settings(tmp_path):
    deploy = tmp_path / "deploy.toml"
    deploy.write_text(DEMO_DEPLOY)
    result = run_fd_serve("--config", str(deploy), "--check", env={"FD_DEMO_DEVICE": "1"})
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert resolved["selected"]["scheduler"] == "demo"
    assert resolved["selected"]["platform"] == "demo"
    assert resolved["scheduler"]["options"] == {"ttl_s": 30.0, "greeting": "hi there"}
    assert resolved["platform"]["options"] == {"lanes": 4}


def test_third_party_settings_errors_name_the_key_path(tmp_path):
    deploy = tmp_path / "deploy.toml"
    deploy.write_text(DEMO_DEPLOY.replace("ttl_s = 30", "ttl_s = -1"))
    result = run_fd_serve("--config", str(deploy), "--check", env={"FD_DEMO_DEVICE": "1"})
    assert result.returncode != 0
    assert "scheduler.options.ttl_s: Input should be greater than 0" in result.stderr
    deploy.write_text(DEMO_DEPLOY.replace("lanes = 4", "lanes = 4\nturbo = true"))
    result = run_fd_serve("--config", str(deploy), "--check", env={"FD_DEMO_DEVICE": "1"})
    assert "platform.options.turbo: Extra inputs are not permitted" in result.stderr


def test_requested_platform_that_is_not_available_is_refused(tmp_path):
    deploy = tmp_path / "deploy.toml"
    deploy.write_text(DEMO_DEPLOY)
    result = run_fd_serve("--config", str(deploy), "--check")
    assert result.returncode != 0
    assert "platform.name: platform 'demo' was requested but is not available: FD_DEMO_DEVICE is not 1" in result.stderr


def test_strict_mode_turns_a_broken_plugin_into_a_startup_error(tmp_path):
    lenient = run_fd_serve("--check")
    assert lenient.returncode == 0, lenient.stderr
    strict = run_fd_serve("--check", "--strict", "--plugins.disabled", '["fd.plugins/typo"]')
    assert strict.returncode != 0
    assert "plugin fd.schedulers/broken (fd_other_plugins.broken:Scheduler, fd-other-plugins 0.0.1)" in strict.stderr
    deploy = tmp_path / "deploy.toml"
    deploy.write_text('[plugins]\nstrict = true\ndisabled = ["fd.plugins/typo"]\n')
    by_config = run_fd_serve("--config", str(deploy), "--check")
    assert by_config.returncode != 0 and "fd.schedulers/broken" in by_config.stderr


def test_a_misspelt_hook_is_reported_naming_the_plugin(tmp_path):
    """fd-other-plugins' ``typo`` implements ``fd_order_wating``: pluggy's check_pending() finds it."""
    row = _row(run_fd_serve("plugins", "list").stdout, "fd.plugins", "typo", "fd-other-plugins")
    assert "failed: implements fd_order_wating (did you mean fd_order_waiting?)" in row
    lenient = run_fd_serve("--check")
    assert lenient.returncode == 0, lenient.stderr
    assert "plugin fd.plugins/typo (fd_other_plugins.typo, fd-other-plugins 0.0.1) failed to load" in lenient.stderr
    deploy = tmp_path / "deploy.toml"
    deploy.write_text('[plugins]\nstrict = true\ndisabled = ["fd.schedulers/broken", "fd.schedulers/old"]\n')
    strict = run_fd_serve("--config", str(deploy), "--check")
    assert strict.returncode == 2
    assert "plugin fd.plugins/typo (fd_other_plugins.typo, fd-other-plugins 0.0.1): implements fd_order_wating" \
        in strict.stderr
    assert "Traceback" not in strict.stderr


def test_a_named_connector_that_is_not_installed_lists_the_choices():
    result = run_fd_serve("--check", "--connector.name", "nccl")
    assert result.returncode == 2
    assert "connector.name: plugin fd.connectors/nccl: no such connector; available: none, shm, zmq" in result.stderr


def test_disabled_plugin_is_not_imported(tmp_path):
    deploy = tmp_path / "deploy.toml"
    deploy.write_text('[plugins]\nstrict = true\n'
                      'disabled = ["fd.schedulers/broken", "fd.schedulers/old", "fd.plugins/typo"]\n')
    result = run_fd_serve("--config", str(deploy), "--check")
    assert result.returncode == 0, result.stderr


def test_loading_a_name_imports_only_the_winner():
    import subprocess
    import sys

    code = ("import sys; from fd_core.registry import Registry; r = Registry.discover(); "
            "r.load('scheduler', 'local'); print('fd_other_plugins.old' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
