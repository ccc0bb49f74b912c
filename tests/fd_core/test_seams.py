"""Every table of seams derives from ``fd_core.seams.SEAMS``; what cannot derive (pyproject.toml, the
README, the hookspecs pluggy needs as functions, the config sections) is checked against it here."""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

from fd_core import hookspecs
from fd_core.config import FdConfig
from fd_core.contracts._base import SeamPlugin
from fd_core.seams import GENERAL_GROUP, SEAMS

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_declares_an_entry_point_group_per_seam_and_no_other():
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert set(groups) == {seam.group for seam in SEAMS}


def test_the_readme_plugin_table_lists_every_seam_in_order():
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| ([^|]+) \| `(fd\.\w+)` \| [^|]+ \| `([^`]+)` \|$", readme, re.M)
    expected = [(seam.title, seam.group, f"fd_core/contracts/{seam.name}.py") for seam in SEAMS]
    assert rows == expected + [("hook implementations", GENERAL_GROUP, "fd_core/hookspecs.py")]


def test_each_seam_has_its_registration_hookspec_and_no_other_exists():
    registration = {name for name in vars(hookspecs) if name.startswith("fd_register_")}
    assert registration == {seam.registration_hook for seam in SEAMS}


def test_each_seam_has_a_contract_and_a_config_section():
    for seam in SEAMS:
        module, name = seam.contract_path.split(":")
        assert issubclass(getattr(importlib.import_module(module), name), SeamPlugin)
        section = FdConfig.model_fields[seam.name].annotation
        assert {"name", "options"} <= set(section.model_fields), seam.name
