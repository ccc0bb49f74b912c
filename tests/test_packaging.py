"""Packaging facts that are easy to break: package list, cheap core import, README vs CI."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def test_every_top_level_package_is_named_for_its_folder():
    """Import names are folder names (kernels/ once installed as fd_kernels and shadowed Hugging Face's
    ``kernels`` package on the test path); setuptools finds each of them."""
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    tops = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    assert tops == ["fd_core", "fd_kernels", "fd_plugins"]
    assert sorted(pattern.removesuffix("*") for pattern in include) == tops


def test_importing_fd_core_pulls_in_no_heavy_dependency():
    code = ("import sys, fd_core; heavy = [m for m in ('paddle', 'fastapi', 'zmq', 'fd_plugins', 'torch') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _readme_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.*?)\n```", readme, re.S)


def test_ci_runs_the_readme_test_command():
    test_command = next(b for b in _readme_commands() if "pytest" in b)
    assert test_command.strip() in (ROOT / ".ci" / "run").read_text()


def test_both_readme_commands_install_with_the_lock():
    installs = [b for b in _readme_commands() if "pip install" in b]
    assert len(installs) >= 2, "the serve command and the test command"
    for command in installs:
        assert "pip install -c constraints.txt " in command, command


def _locked() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


def test_the_lock_pins_every_dependency_ci_installs_within_pyproject_bounds():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [Requirement(r) for r in project["dependencies"] + extras["cpu"] + extras["test"] + extras["hf"]]
    pins = _locked()
    for requirement in wanted:
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is not in constraints.txt: run bash .ci/lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {requirement.name}=={pins[name]}, outside pyproject's {requirement}: "
            "run bash .ci/lock")
