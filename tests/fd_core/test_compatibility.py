"""The compatibility promise, tried with a real package written against hookspec version 1
(tests/plugins/fd_november_plugin, pip-installed): what still works loads with a deprecation
warning naming the change and the fix; what broke is refused, naming the CHANGELOG section."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fd_core.compat import BREAKING, LOADS_UNTIL, FdDeprecationWarning, oldest_loadable
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_core.request import FinishReason, SamplingParams
from tests.conftest import PLUGIN_PACKAGES, _pip, run_fd_serve

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def november_plugin():
    _pip("install", "--no-deps", "--no-build-isolation", str(PLUGIN_PACKAGES / "fd_november_plugin"))
    yield
    _pip("uninstall", "-y", "fd-november-plugin")


def _row(table: str, group: str, name: str) -> str:
    return next(line for line in table.splitlines() if line.split()[:2] == [group, name])


def test_version_1_plugins_whose_seam_did_not_break_load_with_a_deprecation_note(november_plugin):
    listed = run_fd_serve("plugins", "list")
    assert listed.returncode == 0, listed.stderr
    for group, name in (("fd.plugins", "november-hooks"), ("fd.schedulers", "lifo-november")):
        row = _row(listed.stdout, group, name)
        assert f"loaded: deprecated: was written for hookspec version 1, which loads until fd-engine {LOADS_UNTIL}" \
            in row, row
        assert f"set fd_hookspec_version = {FD_HOOKSPEC_VERSION}" in row


def test_a_version_1_resource_manager_is_refused_naming_the_change_and_the_changelog(november_plugin):
    row = _row(run_fd_serve("plugins", "list").stdout, "fd.resource_managers", "november")
    assert "failed: was written for hookspec version 1; version 2 changed the resource manager contract: " \
           "ResourceManager.abort was removed" in row, row
    section = re.search(r"CHANGELOG\.md, '([^']+)'", row).group(1)
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {section}" in changelog or f"### {section}" in changelog, section


def test_check_accepts_the_old_scheduler_and_says_it_is_deprecated(november_plugin, tmp_path):
    deploy = tmp_path / "deploy.toml"
    deploy.write_text('[scheduler]\nname = "lifo-november"\n[plugins]\nhooks = ["november-hooks"]\n')
    result = run_fd_serve("--config", str(deploy), "--check")
    assert result.returncode == 0, result.stderr
    assert "overrides admission_order, which bypassed every fd_order_waiting hook" in result.stderr
    assert "rename the method to default_order" in result.stderr


def test_the_old_plugins_run_a_workload(november_plugin, tmp_path, monkeypatch):
    from fd_core.engine.llm import LLM
    from fd_core.testing.tiny_model import make_tiny_llama

    finished_log = tmp_path / "finished"
    monkeypatch.setenv("NOVEMBER_FINISHED_LOG", str(finished_log))
    model = make_tiny_llama(tmp_path / "tiny", layers=2, vocab=512, max_position_embeddings=256)
    with pytest.warns(FdDeprecationWarning):
        llm = LLM(model={"source": str(model)}, cache={"num_blocks": 64},
                  scheduler={"name": "lifo-november"}, plugins={"hooks": ["november-hooks"]})
    with llm:
        results = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [r.finish_reason for r in results] == [FinishReason.LENGTH] * 2
    assert sorted(finished_log.read_text().split("\n")[:-1]) == sorted(f"{r.request_id} length" for r in results)


def test_every_breaking_change_has_a_changelog_migration_note():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    for version, changes in BREAKING.items():
        heading = f"Hookspec version {version}"
        assert heading in changelog, heading
        section = changelog.split(heading, 1)[1].split("\n## ", 1)[0]
        for kind in changes:
            assert kind.replace("_", " ") in section.lower(), (heading, kind)
        assert "Migration" in section, heading


def test_the_oldest_loadable_version_follows_the_breaking_changes():
    assert oldest_loadable("scheduler") == 1 and oldest_loadable("general") == 1
    assert oldest_loadable("resource_manager") == 2 and oldest_loadable("token_processor") == 2
    assert oldest_loadable("connector") == 3
